"""Optimizer/weights offload on CUDA: the GPU memory really goes (the weights come back), the streamed
steps hold one chunk of the optimizer state at a time, values unchanged."""

import copy

import pytest
import torch

from miles.training.torch.offload import HostOffload

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
    # state (2x) + grads (1x, dropped) + weights (1x when asked)
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


def test_a_checkpoints_state_loaded_to_the_cpu_lands_in_pinned_buffers_and_steps_as_torchs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(2)]).cuda()   # step() feeds 1024 wide
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(model, opt, 0)
    saved = torch.utils._pytree.tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v,
                                         copy.deepcopy(opt.state_dict()))      # as a checkpoint loads it
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    twin_opt.load_state_dict(saved)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    off = HostOffload(fresh, model)
    off.offload()
    off.load_state_dict(saved)
    moments = [v for s in fresh.state.values() for k, v in s.items() if k != "step"]
    # pinned: the parameters are on CUDA, whatever device the loaded values came from
    assert moments and all(v.device.type == "cpu" and v.is_pinned() for v in moments)
    assert list(off._arenas) == [(False, True)]
    off.onload()
    step(model, fresh, 1, off)
    step(twin, twin_opt, 1)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    off.dispose()


def test_sharded_state_goes_to_pinned_host_shards_and_streamed_steps_equal_the_optimizers():
    """FSDP2 on one NCCL rank (the torch trainer's ranks): the optimizer state's DTensors keep their
    mesh and shape around pinned host shards, the GPU gives the memory back, and the streamed steps
    equal the optimizer's own step on a twin."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from tests.unit.test_fsdp_ranks import free_port

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        pairs = []
        for _ in range(2):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            pairs.append((model, torch.optim.AdamW(model.parameters(), lr=1e-3)))
        (model, opt), (twin, twin_opt) = pairs
        step(model, opt, 0)
        step(twin, twin_opt, 0)
        param_bytes = sum(p.numel() * 4 for p in model.parameters())
        off = HostOffload(opt, model, chunk_bytes=(1024 * 1024 + 1024) * 4)
        before = torch.cuda.memory_allocated()
        assert off.offload() == 2 * param_bytes            # the moments' shards, now in host memory
        assert before - torch.cuda.memory_allocated() >= 3 * param_bytes * 0.99   # and the gradients dropped
        for p in model.parameters():
            value = opt.state[p]["exp_avg"]
            assert type(value).__name__ == "DTensor" and value.shape == p.shape
            assert value._local_tensor.device.type == "cpu" and value._local_tensor.is_pinned()
        off.onload()
        for seed in (1, 2):
            step(model, opt, seed, off)
            step(twin, twin_opt, seed)
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(a.full_tensor(), b.full_tensor())
        off.dispose()
    finally:
        dist.destroy_process_group()


def test_the_overlapped_streamed_steps_equal_adamw_and_hold_at_most_two_chunks_on_the_device():
    """Eight chunks (a layer each), four steps, the first making the state: after every step the
    weights and the moments equal torch's AdamW on a twin, bit for bit, and while `step` runs its
    copies on the side streams the device never holds more than the documented bound."""
    torch.manual_seed(0)
    layer_bytes = (1024 * 1024 + 1024) * 4
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    twin = copy.deepcopy(model)
    opt, twin_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (model, twin))
    off = HostOffload(opt, model, chunk_bytes=layer_bytes)
    off.offload()
    for seed in range(4):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        opt.zero_grad(set_to_none=True)
        model(torch.randn(64, 1024, generator=gen, device="cuda")).square().mean().backward()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        off.step()
        # two chunks' moments (2 chunks x 2 moments x layer_bytes) and one chunk's update temporaries
        # (exp_avg_sq's square root: layer_bytes), of the 16 x layer_bytes the whole state would take
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= 5 * layer_bytes + (1 << 20), (seed, peak / layer_bytes)
        assert off._streams is not None                    # the overlapped path ran
        step(twin, twin_opt, seed)
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q), seed
            for name in ("exp_avg", "exp_avg_sq"):
                held = opt.state[p][name]
                assert held.device.type == "cpu" and held.is_pinned()
                assert torch.equal(held, twin_opt.state[q][name].cpu()), (seed, name)
    off.dispose()
