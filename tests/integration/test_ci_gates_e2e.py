"""miles' CI gates through the whole loop (local Ray, the embedded engine, the torch trainer, a tiny
model): a run records its gradient norms and model hashes, a second run on the same seed matches them,
and a tampered record, or an eval metric short of its threshold, fails the run (exit 1) with the gate's
error in the trace and every actor torn down."""

from __future__ import annotations

import json

import pytest

from miles.checkpoint.store import CheckpointStore
from miles.cli.train import main as train_main
from miles.metrics.ci_gates import MODEL_HASH_FILE
from miles.runtime import read_trace
from tests.conftest import base_flags, miles_actors
from tests.integration.test_main_job import run

pytestmark = pytest.mark.ray

FLAGS = dict(num_rollout=2, ci_test=True)


def _failed_with(tmp_path, run_dir: str, flags: list[str], message: str, capsys) -> None:
    """The run fails (exit 1) with `message` in the trace's error, after draining and the teardown."""
    assert train_main(flags) == 1
    assert message in capsys.readouterr().err
    trace = read_trace(tmp_path / run_dir)
    error = trace.of("error")[0].get("error")
    assert error["type"] == "CICheckFailed" and message in error["message"], error
    assert trace.events[-1].get("outcome") == "failed"
    assert miles_actors() == []


@pytest.mark.extended   # out of the default run (CI budget): five runs; the gates' checks in tests/unit/test_ci_gates.py, a gate failing a run in the test below
def test_recorded_norms_and_hash_match_a_second_run_and_a_tampered_record_fails(ray_cluster, tiny_task,
                                                                               tmp_path, capsys):
    norms, ck = tmp_path / "norms.json", tmp_path / "ck"
    first = run(base_flags(tiny_task, tmp_path / "first", save=ck, ci_save_grad_norm=norms, ci_save_model_hash=True,
                           eval_prompt_data=["arith", tiny_task["eval"]], ci_metric_checker_key="eval/arith",
                           ci_metric_checker_threshold=0.0, **FLAGS))
    assert first.final_state == "shutdown"
    assert read_trace(first.run_dir).of("ci_metric_passed")[0].get("key") == "eval/arith/reward_mean"
    recorded = json.loads(norms.read_text())
    assert sorted(recorded) == ["actor/0/0", "actor/1/0"] and all(v > 0 for v in recorded.values())
    rows = [r for r in first.metrics if r.get("kind") == "train"]
    assert [r["grad_norm"] for r in rows] == [recorded["actor/0/0"], recorded["actor/1/0"]]   # one step each
    assert all("step_grad_norms" not in r for r in first.metrics)
    _, saved = CheckpointStore(ck).latest()
    assert json.loads((saved / MODEL_HASH_FILE).read_text())["trainer_float32_sha256"]

    # the same flags and seed: every step's norm matches; the resumed weights hash as saved
    second = run(base_flags(tiny_task, tmp_path / "second", ci_load_grad_norm=norms, **FLAGS))
    trace = read_trace(second.run_dir)
    assert [(e.rollout_id, e.get("action")) for e in trace.of("ci_grad_norms")] == [(0, "matched"), (1, "matched")]
    resumed = run(base_flags(tiny_task, tmp_path / "resumed", load=ck, ci_check_model_hash=True, **{**FLAGS,
                                                                                                   "num_rollout": 3}))
    assert len(read_trace(resumed.run_dir).of("ci_model_hash_matched")) == 1

    # a record off by more than the tolerance at rollout 1, and a hash of other weights
    norms.write_text(json.dumps({**recorded, "actor/1/0": recorded["actor/1/0"] * 1.5 + 0.1}))
    _failed_with(tmp_path, "tampered_norms", base_flags(tiny_task, tmp_path / "tampered_norms",
                                                        ci_load_grad_norm=norms, **FLAGS),
                 "gradient norm at rollout 1 step 0", capsys)
    (saved / MODEL_HASH_FILE).write_text(json.dumps({"trainer_float32_sha256": "0" * 64}))
    _failed_with(tmp_path, "tampered_hash", base_flags(tiny_task, tmp_path / "tampered_hash", load=ck,
                                                       ci_check_model_hash=True, **{**FLAGS, "num_rollout": 3}),
                 "the checkpoint round trip changed them", capsys)


def test_an_eval_metric_short_of_its_threshold_fails_the_run_at_its_end(ray_cluster, tiny_task, tmp_path, capsys):
    flags = base_flags(tiny_task, tmp_path / "run", eval_prompt_data=["arith", tiny_task["eval"]],
                       ci_metric_checker_key="eval/arith", ci_metric_checker_threshold=1.5, **FLAGS)
    _failed_with(tmp_path, "run", flags, "no eval reached --ci-metric-checker-threshold 1.5", capsys)
    trace = read_trace(tmp_path / "run")
    checked = trace.of("ci_metric_checked")
    assert [e.get("step") for e in checked] == [0, 2] and not any(e.get("reached") for e in checked)
    assert trace.of("error")[0].state == "draining"        # the verdict waits for the last eval
