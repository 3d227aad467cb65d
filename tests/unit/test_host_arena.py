"""HostArena: exact-size host tensors in power-of-two slabs, laid out without overlap, and the slabs
it makes for Qwen3-30B-A3B's shapes cut to 12 layers (the numbers in its docstring)."""

import math
import random

import pytest
import torch

from miles.training.torch import offload
from miles.training.torch.offload import ALIGN_BYTES, HostArena

GiB, MiB = 1 << 30, 1 << 20
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool,
          torch.complex64]


def slabs(arena: HostArena) -> list[tuple[int, int]]:
    """(size, free tail) of each slab."""
    return [(s.numel(), s.numel() - end) for s, end in zip(arena._slabs, arena._ends)]


def moe_moments() -> list[int]:
    """Bytes of AdamW's two float32 moments of each parameter of the 12-layer MoE, in the order
    `model.parameters()` gives them (the order offload hosts them)."""
    layer = [(4096, 2048), (512, 2048), (512, 2048), (2048, 4096), (128,), (128,),   # q k v o, q_norm k_norm
             (128, 2048), (128, 1536, 2048), (128, 2048, 768),                        # router, experts
             (2048,), (2048,)]                                                        # the two RMSNorms
    shapes = [(151936, 2048)] + layer * 12 + [(2048,), (151936, 2048)]                # embedding, final norm, lm_head
    return [math.prod(s) * 4 for s in shapes for _ in ("exp_avg", "exp_avg_sq")]


def test_views_hold_their_own_values_in_mixed_dtypes_and_shapes(monkeypatch):
    # small slabs so that the requests spread over several, one of them larger than the largest slab
    monkeypatch.setattr(offload, "FIRST_SLAB_BYTES", 4096)
    monkeypatch.setattr(offload, "MAX_SLAB_BYTES", 32 << 10)
    arena, rng = HostArena(pin=False), random.Random(0)
    views = []
    for i in range(300):
        dtype = DTYPES[i % len(DTYPES)]
        shape = [(), (rng.randint(1, 40),), (rng.randint(1, 9), rng.randint(1, 9))][i % 3]
        views.append(arena.empty(shape, dtype) if i != 150 else arena.empty((5000, 3), torch.float64))  # 120 KB
    for i, v in enumerate(views):
        v.fill_(i % 2 if v.dtype == torch.bool else i % 100 + 1)
    for i, v in enumerate(views):
        expected = i % 2 if v.dtype == torch.bool else i % 100 + 1
        assert torch.equal(v, torch.full_like(v, expected)), i
    spans = sorted((v.data_ptr(), v.data_ptr() + v.nbytes) for v in views)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))     # no two overlap
    for v in views:
        slab = next(s for s in arena._slabs if s.data_ptr() <= v.data_ptr() < s.data_ptr() + s.numel())
        assert v.data_ptr() + v.nbytes <= slab.data_ptr() + slab.numel()      # inside one slab's memory
        assert (v.data_ptr() - slab.data_ptr()) % ALIGN_BYTES == 0
    sizes = [size for size, _ in slabs(arena)]
    assert len(sizes) > 3 and all(size & (size - 1) == 0 for size in sizes)
    assert 128 << 10 in sizes                     # the 120 KB request's own slab: its power of two
    assert arena.allocated_bytes == sum(sizes)
    assert arena.used_bytes == sum(-(-v.nbytes // ALIGN_BYTES) * ALIGN_BYTES for v in views)


def test_slabs_double_up_to_4_gib_and_a_larger_request_gets_its_power_of_two():
    arena = HostArena(pin=False, device="meta")
    for nbytes in (40 * MiB, 40 * MiB, 80 * MiB, 200 * MiB, 3 * GiB, 3 * GiB, 5 * GiB, 2 * GiB):
        arena.empty((nbytes,), torch.uint8)
    # 40 fits the first 64 MiB, the next 40 does not: 128; 80 fits its tail; 200: 256; 3 GiB: 4 GiB
    # (not 512 MiB: its own power of two); 3 GiB again: 4 GiB (the largest); 5 GiB: 8 GiB, whose tail
    # takes the last 2 GiB
    assert [size >> 20 for size, _ in slabs(arena)] == [64, 128, 256, 4096, 4096, 8192]
    assert slabs(arena)[-1][1] == GiB
    assert arena.empty((0, 3), torch.float32).shape == (0, 3) and len(arena._slabs) == 6   # no bytes, no slab


def test_reserve_makes_the_slabs_once_and_pins_a_fraction_of_torchs_rounding_for_the_moe():
    moments = moe_moments()
    pow2 = sum(1 << (n - 1).bit_length() for n in moments)           # torch's pinned allocator, one buffer each
    assert sum(moments) == 64_798_236_672 and pow2 == 87_736_885_248

    arena = HostArena(pin=False, device="meta")
    arena.reserve(moments)
    planned = slabs(arena)
    assert planned == [(4 * GiB, 4 * GiB)] * 16 and arena.allocated_bytes == 68_719_476_736
    for n in moments:
        arena.empty((n // 4,), torch.float32)
    assert [size for size, _ in slabs(arena)] == [size for size, _ in planned]     # no further slab
    assert arena.used_bytes == sum(moments)                            # every moment a multiple of 512 bytes
    assert arena.allocated_bytes < 1.1 * sum(moments)                   # 6% over

    # slabs sized from the total alone (15 of 4 GiB, one of 512 MiB for the other 356 MiB): first fit
    # leaves two requests over, two more slabs
    by_total = HostArena(pin=False, device="meta")
    rest = sum(moments) % (4 * GiB)
    for size in [4 * GiB] * (sum(moments) // (4 * GiB)) + [1 << (rest - 1).bit_length()]:
        by_total._add_slab(size)
    for n in moments:
        by_total.empty((n // 4,), torch.float32)
    assert len(by_total._slabs) == 18 and by_total.allocated_bytes == 71_403_831_296

    grown = HostArena(pin=False, device="meta")                         # the first streamed step's way
    for n in moments:
        grown.empty((n // 4,), torch.float32)
    assert grown.allocated_bytes == 70_866_960_384 and len(grown._slabs) == 17


def test_reserve_counts_the_free_tails_there_already_and_plans_the_last_slab_to_its_power_of_two():
    arena = HostArena(pin=False, device="meta")
    arena.empty((10 * MiB,), torch.uint8)                 # a 64 MiB slab, 54 MiB free
    arena.reserve([50 * MiB, 3 * GiB, 1 * GiB, 300 * MiB])
    # 50 MiB into the tail; 3 GiB and 1 GiB fill a 4 GiB slab; 300 MiB: a slab of 512 MiB
    assert [size >> 20 for size, _ in slabs(arena)] == [64, 4096, 512]
    for nbytes in (50 * MiB, 3 * GiB, 1 * GiB, 300 * MiB):
        arena.empty((nbytes,), torch.uint8)
    assert [free >> 20 for _, free in slabs(arena)] == [4, 0, 212]


@pytest.mark.parametrize("planned", [False, True])
def test_waste_stays_within_the_bound(planned):
    """Every slab but the newest kept less free tail than the largest request; planned, the newest
    slab's free tail is under its used bytes; grown, the total stays under twice the used bytes plus
    the newest slab."""
    rng = random.Random(1)
    for trial in range(200):
        sizes = [int(2 ** rng.uniform(0, 33)) for _ in range(rng.randint(1, 60))]    # 1 B .. 8 GiB
        arena = HostArena(pin=False, device="meta")
        if planned:
            arena.reserve(sizes)
        for n in sizes:
            arena.empty((n,), torch.uint8)
        *older, (newest, newest_free) = slabs(arena)
        largest = max(-(-n // ALIGN_BYTES) * ALIGN_BYTES for n in sizes)
        assert all(free < largest for _, free in older), trial
        if planned:
            assert newest_free < newest - newest_free, trial
        assert arena.allocated_bytes < 2 * arena.used_bytes + newest, trial


def test_a_saved_buffer_holds_its_own_bytes_not_its_slabs(tmp_path):
    """torch.save writes a tensor's whole storage: each buffer has a storage of exactly its bytes, over the
    slab's memory (a checkpoint of the offloaded state must not hold whole slabs)."""
    arena = HostArena(pin=False)
    a, b = arena.empty((1000,), torch.float32), arena.empty((10, 10), torch.bfloat16)
    assert a.untyped_storage().nbytes() == 4000 and b.untyped_storage().nbytes() == 200
    slab = arena._slabs[0]
    a.fill_(3.0)
    assert slab[:4000].view(torch.float32).eq(3.0).all()        # the slab's own memory, not a copy
    torch.save({"a": a, "b": b}, tmp_path / "state.pt")
    assert (tmp_path / "state.pt").stat().st_size < 16 << 10     # the 64 MiB slab would be the whole file
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert loaded["a"].equal(a) and loaded["b"].shape == (10, 10)
    del arena, slab
    import gc
    gc.collect()
    a.add_(1.0)                                                 # the buffers keep the slab's memory alive
    assert a.eq(4.0).all()
