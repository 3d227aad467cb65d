"""The megatron trainer's parallel layout arithmetic (pure), and its rank order against megatron-core's
own generator when megatron-core is installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from miles.training.megatron.layout import ParallelLayout, RankCoords, batch_problems, layout_problems

SHAPES = [(8, 2, 2, 1), (8, 2, 1, 2), (16, 2, 2, 2), (4, 1, 4, 1), (6, 3, 1, 1), (12, 2, 3, 1)]  # world, tp, pp, cp


def test_rank_order_is_tp_fastest_then_cp_dp_pp():
    layout = ParallelLayout(16, tp=2, pp=2, cp=2)           # dp = 2
    assert layout.dp == 2
    # rank 13 = 1 + 2 * (0 + 2 * (1 + 2 * 1)): tp 1, cp 0, dp 1, pp 1
    assert layout.coords(13) == RankCoords(tp=1, cp=0, dp=1, pp=1)
    assert all(layout.rank(layout.coords(r)) == r for r in range(16))


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
@pytest.mark.parametrize("world,tp,pp,cp", SHAPES)
def test_rank_order_matches_megatron_core(world, tp, pp, cp):
    from megatron.core.parallel_state import RankGenerator

    layout = ParallelLayout(world, tp=tp, pp=pp, cp=cp)
    gen = RankGenerator(tp=tp, ep=1, dp=layout.dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    for axis in ("tp", "cp", "dp", "pp"):
        for group in gen.get_ranks(axis):
            coords = [layout.coords(r) for r in group]
            # a group varies along its axis only, through every index of it in rank order
            assert [getattr(c, axis) for c in coords] == list(range(len(group))), (axis, group)
            others = {tuple(v for k, v in vars(c).items() if k != axis) for c in coords}
            assert len(others) == 1, (axis, group)


def test_stages_split_layers_evenly_and_dp_rows_cover_the_batch():
    layout = ParallelLayout(8, tp=2, pp=2)
    assert [layout.stage_layers(s, 24) for s in range(2)] == [range(0, 12), range(12, 24)]
    dp3 = ParallelLayout(3)
    rows = [dp3.dp_rows(r, 8) for r in range(3)]
    assert rows == [range(0, 3), range(3, 6), range(6, 8)]     # sizes differ by at most one, in order


def test_sequence_padding_multiple():
    assert ParallelLayout(4, tp=4).seq_multiple == 1
    assert ParallelLayout(4, tp=4, sequence_parallel=True).seq_multiple == 4
    assert ParallelLayout(8, tp=2, cp=2, sequence_parallel=True).seq_multiple == 4   # lcm(2, 2 * 2)
    assert ParallelLayout(12, tp=3, cp=2, sequence_parallel=True).seq_multiple == 12


def test_cp_positions_are_the_load_balanced_chunks_and_cover_the_sequence():
    layout = ParallelLayout(2, cp=2)
    # 8 positions in 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert layout.cp_positions(0, 8).tolist() == [0, 1, 6, 7]
    assert layout.cp_positions(1, 8).tolist() == [2, 3, 4, 5]
    held = torch.cat([layout.cp_positions(r, 8) for r in range(2)]).sort().values
    assert held.tolist() == list(range(8))
    with pytest.raises(ValueError, match="multiple of 2 \\* CP"):
        layout.cp_positions(0, 6)


def test_layout_problems_name_the_flags():
    assert layout_problems(8, 2, 2, 1, False, 24) == []
    assert "not a multiple of TP 2 x PP 2 x CP 1" in layout_problems(6, 2, 2, 1, False)[0]
    assert "--sequence-parallel needs" in layout_problems(2, 1, 1, 1, True)[0]
    assert "does not divide the model's 5 layers" in layout_problems(2, 1, 2, 1, False, 5)[0]
    assert layout_problems(2, 0, 1, 1, False) == ["--tensor-model-parallel-size 0: must be >= 1"]


def test_batch_problems():
    dp2 = ParallelLayout(4, tp=2)
    assert batch_problems(dp2, 16, 16, 4) == []
    assert "does not split over the 2 data-parallel ranks" in batch_problems(dp2, 15, 15, 1)[0]
    assert "does not split over the 2 data-parallel ranks" in batch_problems(dp2, 16, 5, 1)[0]
    pp2 = ParallelLayout(4, pp=2)                               # dp 2: 8 samples per rank per step
    assert batch_problems(pp2, 16, 16, 4) == []
    assert "multiple of --micro-batch-size 3" in batch_problems(pp2, 16, 16, 3)[0]
