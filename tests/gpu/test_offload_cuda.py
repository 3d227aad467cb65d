"""Optimizer/weights offload on CUDA: the GPU memory really goes (the weights come back), the streamed
steps hold one chunk of the optimizer state at a time, values unchanged."""

import copy

import pytest
import torch

from miles.training.offload import HostOffload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def step(model, opt, seed, off=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    opt.zero_grad(set_to_none=True)
    model(torch.randn(64, 1024, generator=gen, device="cuda")).square().mean().backward()
    off.step() if off is not None else opt.step()


@pytest.mark.parametrize("weights", [False, True])
def test_offload_frees_gpu_memory_and_onload_restores_it_exactly(weights):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(model, opt, 0)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    param_bytes = sum(p.numel() * 4 for p in model.parameters())

    off = HostOffload(opt, model, weights=weights, chunk_bytes=(1024 * 1024 + 1024) * 4)   # one layer a chunk
    before = torch.cuda.memory_allocated()
    off.offload()
    freed = before - torch.cuda.memory_allocated()
    # state (2x) + grads (1x) + weights (1x when asked)
    assert freed >= (3 + weights) * param_bytes * 0.99, (freed, param_bytes)
    assert all(v.device.type == "cpu" and v.is_pinned() for s in opt.state.values() for v in s.values() if v.numel() > 1)
    off.onload()
    for seed in (1, 2):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(model, opt, seed, off)
        # over the baseline: activations, the gradients (param_bytes) and one layer's moments with the
        # update's temporaries, never the whole state's 2 x param_bytes on top of the gradients
        assert torch.cuda.max_memory_allocated() - base < 2 * param_bytes, (torch.cuda.max_memory_allocated() - base)
        assert all(v.device.type == "cpu" for s in opt.state.values() for k, v in s.items() if k != "step")
        step(twin, twin_opt, seed)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    off.dispose()
