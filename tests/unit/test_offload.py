"""Optimizer state (and weights) to host memory, the streamed step: bit-for-bit, and training goes on as before."""

import copy

import pytest
import torch

from miles.training.torch.offload import HostOffload
from miles.training.torch.shards import local

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


def streamed(model, opt, seed, off):
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad(set_to_none=True)
    model(torch.randn(16, 4, generator=gen)).square().mean().backward()
    off.step()


@pytest.mark.parametrize("weights", [False, True])
def test_offload_keeps_the_state_on_the_host_and_the_streamed_steps_equal_the_optimizers(weights):
    model, opt = model_and_optimizer()
    step(model, opt, 0)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.1)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))   # else both share the state tensors
    before = {k: v.clone() for k, v in state_tensors(opt).items()}
    params = list(model.parameters())

    off = HostOffload(opt, model, weights=weights, chunk_bytes=40)   # every parameter in a chunk of its own
    moved = off.offload()
    # exp_avg and exp_avg_sq of every parameter (the scalar step stays), the parameters
    n_bytes = sum(p.numel() * 4 for p in params)
    assert moved == 2 * n_bytes + (n_bytes if weights else 0)
    assert all(p.grad is None for p in params)
    held = state_tensors(opt)
    assert all(held[k].data_ptr() != before[k].data_ptr() for k in held if k[1] != "step")
    assert off.offload() == 0                                         # idempotent
    assert off.onload() == (n_bytes if weights else 0) and off.onload() == 0   # the state stays on the host
    assert list(model.parameters()) == params                         # the same Parameter objects
    for k, v in state_tensors(opt).items():
        assert torch.equal(v, before[k])
    for seed in (1, 2):
        streamed(model, opt, seed, off)
        step(twin, twin_opt, seed)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    after = state_tensors(opt)
    assert all(after[k] is held[k] for k in held if k[1] != "step")   # updated in its host buffers
    assert all(torch.equal(v, twin_opt.state_dict()["state"][k[0]][k[1]]) for k, v in after.items())


def test_a_first_step_streams_the_state_it_makes_and_chunks_split_by_bytes():
    model, opt = model_and_optimizer()
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.1)
    off = HostOffload(opt, model, chunk_bytes=1)          # one parameter per chunk
    assert off.offload() == 0                              # no state before the first step
    assert [len(c) for c in off._chunks(list(model.parameters()))] == [1, 1, 1, 1]
    streamed(model, opt, 0, off)
    step(twin, twin_opt, 0)
    assert len(opt.state) == 4 and opt.param_groups[0]["params"] == list(model.parameters())
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    keys = {(id(p), n) for p in model.parameters() for n in ("exp_avg", "exp_avg_sq")}
    assert set(off._host) == keys                          # the new state went into host buffers


def on_the_host(opt, off) -> bool:
    """Every moment of `opt` is (a DTensor around) its host buffer: nothing of the state elsewhere."""
    held = {k: v.data_ptr() for k, v in off._host.items()}
    return all(local(v).data_ptr() == held.get((id(p), k)) for p, s in opt.state.items() for k, v in s.items()
               if k != "step")


def test_a_state_loaded_while_offloaded_goes_to_the_host_buffers_and_one_loaded_while_not_is_streamed_there():
    model, opt = model_and_optimizer()
    off = HostOffload(opt, model)
    step(model, opt, 0)
    off.offload()
    saved = copy.deepcopy(opt.state_dict())
    for p in opt.state:
        opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].clone()    # a load leaves the buffers behind
    assert not on_the_host(opt, off)
    opt.load_state_dict(saved)                  # torch puts the loaded state on the parameters' device
    assert on_the_host(opt, off)                # offloaded: rehosted at once
    off.onload()
    opt.load_state_dict(saved)                  # not handed off: left where torch put it ...
    loaded = state_tensors(opt)
    assert not on_the_host(opt, off)
    streamed(model, opt, 1, off)                # ... and the next streamed step puts it back
    assert all(state_tensors(opt)[k] is not loaded[k] for k in loaded if k[1] != "step")
    assert on_the_host(opt, off)


def test_buffers_are_reused_and_dispose_keeps_only_what_the_state_holds():
    model, opt = model_and_optimizer()
    step(model, opt, 0)
    off = HostOffload(opt, model, weights=True)
    off.offload()
    first = {k: v.data_ptr() for k, v in state_tensors(opt).items() if k[1] != "step"}
    off.onload()
    streamed(model, opt, 1, off)
    off.offload()
    assert {k: v.data_ptr() for k, v in state_tensors(opt).items() if k[1] != "step"} == first
    off.onload()
    off.dispose()
    assert len(off._host) == 2 * len(list(model.parameters()))     # the weights' buffers went


def test_weights_need_the_model_and_chunks_a_size():
    _, opt = model_and_optimizer()
    with pytest.raises(ValueError, match="needs the model"):
        HostOffload(opt, weights=True)
    with pytest.raises(ValueError, match="chunk_bytes must be positive"):
        HostOffload(opt, chunk_bytes=0)


def test_a_saved_state_loads_into_the_host_buffers_and_steps_as_torchs_load():
    model, opt = model_and_optimizer()
    step(model, opt, 0)
    saved = copy.deepcopy(opt.state_dict())
    twin, twin_opt = copy.deepcopy(model), None
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.5)     # the saved lr wins, as in torch's load
    twin_opt.load_state_dict(saved)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
    off = HostOffload(fresh, model)
    off.offload()
    off.load_state_dict(saved)
    assert fresh.param_groups[0]["lr"] == 0.1
    # the slabs sized once for the loaded moments (8 buffers of 512 bytes), not grown from a 64 MiB first slab
    arena = off._arenas[(False, False)]
    assert (arena.used_bytes, arena.allocated_bytes, len(arena._slabs)) == (8 * 512, 4096, 1)
    for p in model.parameters():
        assert fresh.state[p]["exp_avg"].data_ptr() == off._host[(id(p), "exp_avg")].data_ptr()
    streamed(model, fresh, 1, off)
    step(twin, twin_opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    other = HostOffload(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
    with pytest.raises(ValueError, match="4 parameters in 1 groups, this optimizer 2 in 1: not this model's"):
        other.load_state_dict(saved)


def _sharded_rank(rank: int, world: int, port: int, out) -> None:
    """One gloo rank: a model sharded with FSDP2 and its twin; the offloaded one steps streamed."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        models = []
        for _ in range(2):
            model, _ = model_and_optimizer()
            fully_shard(model[0])
            fully_shard(model)
            models.append((model, torch.optim.AdamW(model.parameters(), lr=0.1)))
        (model, opt), (twin, twin_opt) = models
        step(model, opt, 0)
        step(twin, twin_opt, 0)
        off = HostOffload(opt, model, chunk_bytes=64)
        local = sum(p._local_tensor.numel() * 4 for p in model.parameters())
        assert off.offload() == 2 * local                    # this rank's shards of the two moments
        for seed in (1, 2):
            streamed(model, opt, seed + rank, off)
            step(twin, twin_opt, seed + rank)
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(a.full_tensor(), b.full_tensor())
        for p in model.parameters():
            value = opt.state[p]["exp_avg"]
            assert type(value).__name__ == "DTensor" and value.shape == p.shape
            assert value._local_tensor.data_ptr() == off._host[(id(p), "exp_avg")].data_ptr()
        assert off.onload() == 0 and off.offload() == 2 * local    # held there, not moved again
        with pytest.raises(ValueError, match="sharded .* weights"):
            HostOffload(opt, model, weights=True)
        out.put((rank, "ok"))
    except BaseException as exc:            # the parent reports it
        import traceback
        out.put((rank, traceback.format_exc()[-600:]))
    finally:
        dist.destroy_process_group()


def test_sharded_state_moves_shard_by_shard_and_the_streamed_steps_equal_the_optimizers():
    """FSDP2 on 2 gloo ranks: each rank's optimizer state shards go to its host buffers inside
    DTensors of the same mesh and shape, and streamed steps equal the optimizer's own."""
    from tests.unit.test_fsdp_ranks import spawn_gloo_ranks

    assert spawn_gloo_ranks(_sharded_rank) == {0: "ok", 1: "ok"}


def _sharded_resume_rank(folder: str, rank: int, world: int, port: int, out) -> None:
    """One gloo rank: an FSDP2 model saved in the sharded checkpoint after a step, stepped on (the
    straight run); a fresh one offloaded (as miles.phases.init does), then loaded from the sharded
    checkpoint (FSDPRank's `load_sharded`) or from the one-process optimizer file (`load_full`, what
    FSDPRank._load_whole calls): the state in the host buffers, the streamed step the straight one's."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from miles.training.torch.fsdp.checkpoint import load_full, load_sharded, save_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        def sharded():
            model, _ = model_and_optimizer()
            fully_shard(model[0])
            fully_shard(model)
            return model, torch.optim.AdamW(model.parameters(), lr=0.1)

        straight, straight_opt = sharded()
        whole, whole_opt = model_and_optimizer()            # the one-process trainer on the same batch
        step(straight, straight_opt, 0)
        step(whole, whole_opt, 0)
        save_sharded(straight, straight_opt, folder)
        step(straight, straight_opt, 1)
        for load in ("sharded", "whole"):
            model, opt = sharded()
            off = HostOffload(opt, model)
            assert off.offload() == 0                       # a fresh optimizer: nothing to move
            if load == "sharded":
                load_sharded(model, opt, folder)
            else:
                load_full(model, whole.state_dict(), opt, copy.deepcopy(whole_opt.state_dict()))
            assert len(opt.state) == 4 and on_the_host(opt, off), load
            assert all(type(v).__name__ == "DTensor" for s in opt.state.values() for k, v in s.items() if k != "step")
            assert off.onload() == 0
            streamed(model, opt, 1, off)
            for a, b in zip(model.parameters(), straight.parameters()):
                assert torch.equal(a.full_tensor(), b.full_tensor()), load
            assert on_the_host(opt, off)
            off.dispose()
        out.put((rank, "ok"))
    except BaseException:                   # the parent reports it
        import traceback
        out.put((rank, traceback.format_exc()[-600:]))
    finally:
        dist.destroy_process_group()


def test_a_sharded_resume_while_offloaded_puts_the_state_in_the_host_buffers(tmp_path):
    """FSDP2 on 2 gloo ranks resumed with --offload-train: the load leaves no moment on the device
    (the next offload would find the trainer offloaded already), and the streamed step after it is
    the straight run's, bit for bit."""
    import functools

    from tests.unit.test_fsdp_ranks import spawn_gloo_ranks

    assert spawn_gloo_ranks(functools.partial(_sharded_resume_rank, str(tmp_path / "ck"))) == {0: "ok", 1: "ok"}


def test_offload_sizes_the_slabs_once_and_keeps_the_weights_in_slabs_of_their_own():
    import weakref

    model, opt = model_and_optimizer()
    step(model, opt, 0)
    off = HostOffload(opt, model, weights=True)
    off.offload()
    state, weights = off._arenas[(False, False)], off._arenas[(True, False)]
    # every buffer is under 512 bytes (Linear(4, 8), Linear(8, 2)): 8 moments and 4 weights of 512
    assert (state.used_bytes, state.allocated_bytes, len(state._slabs)) == (8 * 512, 4096, 1)
    assert (weights.used_bytes, weights.allocated_bytes, len(weights._slabs)) == (4 * 512, 2048, 1)
    def inside(t, arena):           # in the memory of the arena's one slab
        return 0 <= t.data_ptr() - arena._slabs[0].data_ptr() < arena._slabs[0].numel()
    assert all(inside(v, state) for k, v in state_tensors(opt).items() if k[1] != "step")
    assert all(inside(p, weights) for p in model.parameters())
    # the storages' Python objects live as long as the storages (torch keeps them while a tensor holds one)
    gone = weakref.ref(weights._slabs[0].untyped_storage()), weakref.ref(state._slabs[0].untyped_storage())
    del state, weights
    off.onload()
    off.dispose()
    assert gone[0]() is None and gone[1]() is not None      # the weights' slab freed, the state's held by the state
    opt.state.clear()               # the trainer drops its optimizer and its HostOffload together
    del off
    assert gone[1]() is None
