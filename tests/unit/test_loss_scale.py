"""Megatron-LM's loss-scale rule (miles.training.torch.loss_scale), step by step."""

from __future__ import annotations

import json

import torch

from miles.config import TrainConfig
from miles.training.torch.loss_scale import NO_SCALING, LossScaler, loss_scaler


def run(scaler: LossScaler, overflows: str) -> list[float]:
    """The scale after each step of `overflows` ('x': an overflow, '.': a clean step)."""
    out = []
    for c in overflows:
        scaler.update(c == "x")
        out.append(scaler.scale)
    return out


def test_the_scale_doubles_after_a_window_of_clean_steps():
    # window 3: steps 3 and 6 double it; the tracker restarts at each growth
    assert run(LossScaler(scale=8.0, window=3), "......") == [8, 8, 16, 16, 16, 32]


def test_an_overflow_restarts_the_growth_window():
    # an overflow at step 2 (hysteresis 2: not cut yet) restarts the count: growth at step 5, not 3
    assert run(LossScaler(scale=8.0, window=3, hysteresis=2), "..x...") == [8, 8, 8, 8, 8, 16]


def test_hysteresis_cuts_the_scale_from_its_nth_overflow_on():
    # hysteresis 3: overflows 1 and 2 keep 1024; the 3rd halves it; the tracker stays spent, so the 4th halves again
    s = LossScaler(scale=1024.0, window=100, hysteresis=3)
    assert run(s, "xxxx") == [1024, 1024, 512, 256]
    assert s.hysteresis_tracker == -1 and s.growth_tracker == 0


def test_the_hysteresis_tracker_refills_only_at_a_growth():
    # Megatron-LM's rule: clean steps between overflows do not refill it; a growth does
    s = LossScaler(scale=64.0, window=2, hysteresis=2)
    assert run(s, "x.x") == [64, 64, 32]            # 1st overflow spends one, the 2nd (after one clean step) cuts
    assert run(s, "..x") == [32, 64, 64]            # growth at 2 clean steps refills the tracker: the overflow waits
    assert s.hysteresis_tracker == 1


def test_the_scale_never_falls_below_the_minimum():
    assert run(LossScaler(scale=4.0, min_scale=1.0, hysteresis=1), "xxxx") == [2, 1, 1, 1]


def test_a_fixed_scale_never_moves():
    s = LossScaler(scale=128.0, dynamic=False, window=1, hysteresis=1)
    assert run(s, "x..x.") == [128] * 5


def test_megatrons_defaults_but_torchs_start_and_who_scales():
    t = TrainConfig()
    s = loss_scaler(t, torch.float16)
    assert (s.scale, s.min_scale, s.window, s.hysteresis, s.dynamic) == (2.0 ** 16, 1.0, 1000, 2, True)
    assert loss_scaler(TrainConfig(loss_scale=4096.0), torch.float16) == LossScaler(scale=4096.0, dynamic=False)
    assert loss_scaler(t, torch.bfloat16) is NO_SCALING and loss_scaler(t, torch.float32) is NO_SCALING


def test_state_survives_json_bit_for_bit():
    s = LossScaler(scale=2.0 ** 32, window=7, hysteresis=3)
    run(s, "x.x.....x..")
    back = LossScaler(scale=1.0, window=7, hysteresis=3)
    back.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert back == s


def test_unscale_divides_by_the_scale():
    g = [torch.full((3,), 96.0), torch.full((2,), -32.0)]
    LossScaler(scale=32.0).unscale(g)
    assert g[0].tolist() == [3.0] * 3 and g[1].tolist() == [-1.0] * 2
    loss = torch.tensor(1.5)
    assert LossScaler(scale=4.0).scaled(loss).item() == 6.0 and NO_SCALING.scaled(loss) is loss


def test_the_floor_is_where_the_dynamic_scale_can_fall_no_further():
    s = LossScaler(scale=4.0, min_scale=2.0, hysteresis=1)
    assert not s.at_floor
    s.update(True)
    assert s.scale == 2.0 and s.at_floor
    assert not LossScaler(scale=1.0, dynamic=False).at_floor and not NO_SCALING.at_floor   # a fixed scale has none
