"""Optimizer state (and weights) to host memory and back: bit-for-bit, and training goes on as before."""

import copy

import pytest
import torch

from miles.training.offload import HostOffload

torch.set_num_threads(1)


def model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def step(model, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad(set_to_none=True)
    model(torch.randn(16, 4, generator=gen)).square().mean().backward()
    opt.step()


def state_tensors(opt):
    return {(i, k): v for i, s in enumerate(opt.state.values()) for k, v in s.items()}


@pytest.mark.parametrize("weights", [False, True])
def test_round_trip_is_exact_and_the_next_steps_are_unchanged(weights):
    model, opt = model_and_optimizer()
    step(model, opt, 0)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.1)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))   # else both share the state tensors
    before = {k: v.clone() for k, v in state_tensors(opt).items()}
    params = list(model.parameters())

    off = HostOffload(opt, model, weights=weights)
    moved = off.offload()
    # exp_avg and exp_avg_sq of every parameter (the scalar step stays), plus the parameters
    n_bytes = sum(p.numel() * 4 for p in params)
    assert moved == 2 * n_bytes + (n_bytes if weights else 0)
    assert all(p.grad is None for p in params)
    held = state_tensors(opt)
    assert all(held[k].data_ptr() != before[k].data_ptr() or before[k].numel() == 1 for k in held)
    assert off.offload() == 0                                         # idempotent
    assert off.onload() == moved and off.onload() == 0
    assert list(model.parameters()) == params                         # the same Parameter objects
    for k, v in state_tensors(opt).items():
        assert torch.equal(v, before[k])
    for seed in (1, 2):
        step(model, opt, seed)
        step(twin, twin_opt, seed)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_buffers_are_reused_and_dispose_drops_them():
    model, opt = model_and_optimizer()
    step(model, opt, 0)
    off = HostOffload(opt)
    off.offload()
    first = {k: v.data_ptr() for k, v in state_tensors(opt).items() if v.numel() > 1}
    off.onload()
    step(model, opt, 1)
    off.offload()
    assert {k: v.data_ptr() for k, v in state_tensors(opt).items() if v.numel() > 1} == first
    off.onload()
    off.dispose()
    assert off._host == {}


def test_weights_need_the_model():
    _, opt = model_and_optimizer()
    with pytest.raises(ValueError, match="needs the model"):
        HostOffload(opt, weights=True)
