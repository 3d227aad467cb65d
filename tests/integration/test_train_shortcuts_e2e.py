"""miles' training shortcuts through the real loop (local Ray, embedded engine, torch trainer, tiny model):
--debug-skip-weight-update leaves the engines on the initial weights while the trainer moves on, and
--skip-actor-forward-only trains without the old-logprob pass, on the engine's logprobs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.api.launch import train
from miles.config.flags import parse_flags
from miles.runtime import load_machine, read_trace, with_disposer
from miles.traceview.check import check_trace
from tests.conftest import base_flags

pytestmark = pytest.mark.ray


def run(argv):
    cfg, machine = parse_flags(argv)
    return asyncio.run(with_disposer(train, cfg, machine=machine or "sync"))


def train_rows(result) -> list[dict]:
    return [r for r in result.metrics if r.get("kind") not in ("eval", "rollout")]


def test_debug_skip_weight_update_keeps_the_engines_on_the_initial_weights(ray_cluster, tiny_task, tmp_path):
    result = run(base_flags(tiny_task, tmp_path / "run", num_rollout=2, debug_skip_weight_update=True,
                            eval_prompt_data=["arith", tiny_task["eval"]], eval_interval=1))
    trace = read_trace(result.run_dir)
    skipped = trace.of("weights_sync_skipped")
    # every visit of weight_sync: before rollout 0, after each of the 2 trainings; the engines stay at v0
    assert [(e.get("version"), e.get("engines_hold"), e.get("reason")) for e in skipped] == \
        [(v, 0, "--debug-skip-weight-update") for v in (0, 1, 2)]
    assert not trace.of("weights_synced")
    # the evals keep their schedule (before training, after each rollout), all on the engines' v0
    evals = [r for r in result.metrics if r.get("kind") == "eval"]
    assert [(r["step"], r["weight_version"]) for r in evals] == [(0, 0), (1, 0), (2, 0)]
    first, second = (r["logprob_diff_rollout"] for r in train_rows(result))
    # rollout 0: engine and trainer hold the same (initial) weights; rollout 1 came from those same
    # engine weights while the trainer had taken a step (a synced run keeps this ~0: --ci-test checks it)
    assert first < 1e-4
    assert second > 10 * max(first, 1e-5)
    assert check_trace(trace, load_machine("sync")).ok


def test_skip_actor_forward_only_trains_on_the_engines_logprobs_without_the_pass(ray_cluster, tiny_task, tmp_path):
    # two optimizer steps per rollout: without the flag the trainer would run the pass (logprob_passes 1)
    result = run(base_flags(tiny_task, tmp_path / "run", num_rollout=1, num_steps_per_rollout=2,
                            use_rollout_logprobs=True, skip_actor_forward_only=True,
                            save_debug_train_data=str(tmp_path / "train")))
    (row,) = train_rows(result)
    assert row["logprob_passes"] == 0.0 and row["num_steps"] == 2
    assert "logprob_diff_rollout" in row                       # the mismatch, from the steps' own logprobs
    saved = torch.load(tmp_path / "train" / "train_0.pt")
    assert torch.equal(saved["old_logprobs"], saved["rollout_logprobs"])
    assert saved["loss_mask"].any()
