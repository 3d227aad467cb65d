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


@pytest.mark.parametrize("pp,first,last", [(2, 1, None), (2, None, 3), (3, 1, 1), (4, 2, None), (3, None, None)])
def test_uneven_stages_match_megatron_cores_layer_counts(pp, first, last):
    layout = ParallelLayout(pp, pp=pp, first_stage_layers=first, last_stage_layers=last)
    num_layers = 6 if (first, last) == (None, None) else 5 if pp < 4 else 8    # splits that come out whole
    stages = [layout.stage_layers(s, num_layers) for s in range(pp)]
    assert stages[0].start == 0 and all(a.stop == b.start for a, b in zip(stages, stages[1:]))
    assert (first is None or len(stages[0]) == first) and (last is None or len(stages[-1]) == last)
    if importlib.util.find_spec("megatron") is None:
        return
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    assert stages[-1].stop == num_layers
    config = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=2,
                               pipeline_model_parallel_size=pp, num_layers_in_first_pipeline_stage=first,
                               num_layers_in_last_pipeline_stage=last, pipeline_dtype=torch.float32)
    for s, layers in enumerate(stages):
        assert (get_num_layers_to_build(config, pp_rank=s), get_transformer_layer_offset(config, pp_rank=s)) \
            == (len(layers), layers.start), s


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
    assert layout_problems(2, 1, 2, 1, False, 5, first=1) == []            # 1 + 4
    assert layout_problems(3, 1, 3, 1, False, 5, first=1, last=2) == []    # 1 + 2 + 2
    assert "must share the other 3 evenly" in layout_problems(3, 1, 3, 1, False, 5, first=2)[0]
    assert "need --pipeline-model-parallel-size > 1" in layout_problems(1, 1, 1, 1, False, 4, first=1)[0]


def test_batch_problems():
    dp2 = ParallelLayout(4, tp=2)
    assert batch_problems(dp2, 16, 16, 4) == []
    assert "does not split over the 2 data-parallel ranks" in batch_problems(dp2, 15, 15, 1)[0]
    assert "does not split over the 2 data-parallel ranks" in batch_problems(dp2, 16, 5, 1)[0]
    pp2 = ParallelLayout(4, pp=2)                               # dp 2: 8 samples per rank per step
    assert batch_problems(pp2, 16, 16, 4) == []
    assert "multiple of --micro-batch-size 3" in batch_problems(pp2, 16, 16, 3)[0]
