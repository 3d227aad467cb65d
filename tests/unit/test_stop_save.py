"""Why a stop does or does not save the last trained rollout (`draining`'s `why_not_save_on_stop`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from miles.config import CheckpointConfig
from miles.phases.drain import why_not_save_on_stop


def ctx(**kw):
    base = dict(cfg=SimpleNamespace(checkpoint=CheckpointConfig(save="ckpt")), start_rollout=0,
                saved_rollout=None, training=None, save_duration_s=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_a_trained_unsaved_rollout_is_saved():
    assert why_not_save_on_stop(ctx(saved_rollout=2), 3, budget=10.0) is None
    assert why_not_save_on_stop(ctx(save_duration_s=4.0), 3, budget=5.0) is None   # fits


@pytest.mark.parametrize("kw, rid, budget, reason", [
    ({"cfg": SimpleNamespace(checkpoint=CheckpointConfig())}, 3, None, "--save is not set"),
    ({"start_rollout": 4}, 3, None, "no rollout was trained since the run started"),
    ({"saved_rollout": 3}, 3, None, "rollout 3 is saved already"),
    ({"training": 4}, 3, None, "train was cut short while the trainer stepped on rollout 4"),
    ({"save_duration_s": 6.0}, 3, 2.5, "the last save took 6.0 s and 2.5 s are left"),
])
def test_each_reason_not_to_save_is_named(kw, rid, budget, reason):
    assert reason in why_not_save_on_stop(ctx(**kw), rid, budget)
