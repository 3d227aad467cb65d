"""The optimizer step and gradient clipping on local shards (`miles.training.torch.shards`): the same
result as torch's calls on whole tensors, on a plain model and on an FSDP2 model over 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from miles.training.torch.shards import clip_grad_norm, step_shards


def model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def backward(model: nn.Module, seed: int) -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).sum().backward()


def test_without_dtensors_they_are_torchs_own_calls_bit_for_bit():
    (model, opt), (twin, twin_opt) = model_and_optimizer(), model_and_optimizer()
    for seed in range(3):
        backward(model, seed)
        backward(twin, seed)
        norm = clip_grad_norm(model.parameters(), 0.5)
        assert norm == float(torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5))
        step_shards(opt)
        twin_opt.step()
        opt.zero_grad()
        twin_opt.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert clip_grad_norm(model.parameters(), 1.0) == 0.0      # no gradients: nothing to clip


def test_a_subset_steps_only_those_parameters_with_their_groups_settings():
    model, _ = model_and_optimizer()
    first, last = model[0], model[2]
    opt = torch.optim.AdamW([{"params": first.parameters(), "lr": 0.0}, {"params": last.parameters()}], lr=0.05)
    twin, _ = model_and_optimizer()
    twin_opt = torch.optim.AdamW([{"params": twin[2].parameters()}], lr=0.05)
    backward(model, 0)
    backward(twin, 0)
    before = [p.detach().clone() for p in first.parameters()]
    step_shards(opt, list(last.parameters()))
    twin_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), before))     # not chosen: untouched
    assert not any(p in opt.state for p in first.parameters())
    assert all(torch.equal(a, b) for a, b in zip(last.parameters(), twin[2].parameters()))
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]                  # the groups as they were


def _rank(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        (model, _), (twin, twin_opt) = model_and_optimizer(), model_and_optimizer()
        fully_shard(model[0])
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)     # over the sharded parameters
        for seed, max_norm in ((0, 1e9), (1, 1e9), (2, 0.3)):       # the last one clips
            backward(model, seed)     # every rank the same batch: the mean over ranks is the twin's gradient
            backward(twin, seed)
            norm = clip_grad_norm(model.parameters(), max_norm)
            twin_norm = float(torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm))
            assert norm == pytest.approx(twin_norm, rel=1e-6), (norm, twin_norm)
            step_shards(opt)
            twin_opt.step()
            for p in model.parameters():
                assert p._local_tensor.grad is None     # no second hold on the gradient's shard
            opt.zero_grad(set_to_none=True)
            twin_opt.zero_grad()
            for (name, a), b in zip(model.named_parameters(), twin.parameters()):
                torch.testing.assert_close(a.full_tensor(), b.detach(), rtol=0, atol=0 if seed < 2 else 1e-6,
                                           msg=f"{name} after step {seed}")
        for p in model.parameters():
            state = opt.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                assert isinstance(state[key], DTensor) and state[key].shape == p.shape
                assert state[key].placements == p.placements
            assert int(state["step"]) == 3
        assert set(opt.state_dict()["state"]) == set(range(4))
        out.put((rank, "ok"))
    except BaseException:                   # the parent reports it
        import traceback
        out.put((rank, traceback.format_exc()[-1500:]))
    finally:
        dist.destroy_process_group()


def test_on_two_fsdp_ranks_the_norm_and_the_step_equal_the_whole_models():
    """FSDP2 over 2 gloo ranks against an unsharded twin: the global gradient norm (one all-reduce of
    the local squares), the clipped step and AdamW's update on the shards equal the twin's; the
    moments a first step makes are DTensors placed like their parameters."""
    from tests.unit.test_fsdp_ranks import spawn_gloo_ranks

    assert spawn_gloo_ranks(_rank) == {0: "ok", 1: "ok"}
