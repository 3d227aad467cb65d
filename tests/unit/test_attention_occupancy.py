"""scripts/bench/attention_occupancy.py: an sm_90 SM's occupancy arithmetic and the launch's integer arguments as
the JIT specialises them; the offline compile itself where a Triton with its NVIDIA backend imports (not in CI)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.unit.test_fp8_profile_benches import load


@pytest.fixture(scope="module")
def occ():
    return load("attention_occupancy")


def test_registers_are_given_per_warp_in_units_of_256(occ):
    # 128 registers x 32 threads = 4,096 a warp: 16 warps, 4 programs of 4 warps
    assert occ.resident(128, 38912, 4) == dict(programs=4, limited_by=["registers"],
                                               limits=dict(registers=4, shared=5, warps=16, blocks=32))
    # 91 registers round up to 96 a thread (3,072 a warp): 21 warps, 5 programs of 4
    assert occ.resident(91, 0, 4)["limits"]["registers"] == 5


def test_shared_memory_counts_the_block_reserved_kilobyte_and_the_per_block_cap(occ):
    # bf16 at 64 keys, default stages: 70 KiB + 1 KiB reserved, three in 228 KiB
    assert occ.resident(91, 71680, 4)["limits"]["shared"] == 3
    assert occ.resident(91, 71680, 4)["limited_by"] == ["shared"]
    # above a block's 227 KiB the launch cannot run at all
    assert occ.resident(91, 232449, 4)["programs"] == 0


def test_the_integer_arguments_are_the_engine_calls(occ):
    args = SimpleNamespace(kv_heads=8, group=4, head_dim=128, max_len=4160)
    slot = occ.call_values(args, page=0)
    assert (slot["sqb"], slot["sqh"], slot["sqg"]) == (8 * 4 * 128, 4 * 128, 128)
    assert (slot["skb"], slot["skh"], slot["skn"]) == (8 * 4160 * 128, 4160 * 128, 128)
    assert slot["stb"] == 0
    paged = occ.call_values(args, page=64)
    assert (paged["skb"], paged["skh"], paged["skn"]) == (8 * 64 * 128, 64 * 128, 128)
    assert paged["stb"] == 65            # pages per sequence: the one stride the JIT does not mark divisible by 16


def test_an_e4m3_launch_compiles_for_hopper_pipelined(occ):
    triton = pytest.importorskip("triton")
    nvidia = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not nvidia.exists():
        pytest.skip("this Triton has no NVIDIA backend")
    args = SimpleNamespace(cache_dtypes=["fp8"], blocks=[64], warps=[4], stages=[None], kv_heads=8, group=4,
                           head_dim=128, max_len=4160, page_size=0, v_as_a=[False, True])
    row, v_a = occ.analyse(args)["launches"]
    assert "error" not in row and "error" not in v_a, (row, v_a)
    assert row["pipelined"] and row["tensor_core_ops"] > 0 and row["programs"] >= 1
    assert row["kv_bytes_per_iteration"] == 2 * 64 * 128
    # an e4m3 V as the product's B operand is read from shared memory a byte at a time; as its A operand, not
    assert row["byte_shared_loads"] > 0 and v_a["byte_shared_loads"] == 0
