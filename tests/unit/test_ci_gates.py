"""miles' CI gates (miles/metrics/ci_gates.py): the eval metric gate, the gradient-norm record and check,
the model hash, and their start-up checks."""

from __future__ import annotations

import json
import math

import pytest

from miles.config import ConfigError
from miles.config.flags import parse_flags
from miles.metrics.ci_gates import (MODEL_HASH_FILE, CICheckFailed, CIGates, GradNormRecord, MetricGate,
                                   check_model_hash, metric_name, write_model_hash)
from miles.training.protocol import STEP_GRAD_NORMS
from tests.unit.test_tracking_flags import base


# --- the metric gate --------------------------------------------------------------------------------
def test_miles_eval_set_key_is_its_mean_reward():
    assert metric_name("eval/gsm8k") == "eval/gsm8k/reward_mean"
    assert metric_name("eval/gsm8k/pass@1") == "eval/gsm8k/pass@1"


def test_one_eval_reaching_the_threshold_passes_the_gate():
    gate = MetricGate("eval/arith", 0.4)
    assert gate.on_eval(0, {"eval/arith/reward_mean": 0.3}) is False
    assert gate.on_eval(2, {"eval/arith/reward_mean": 0.4}) is True     # >= : the threshold itself passes
    assert gate.on_eval(4, {"eval/arith/reward_mean": 0.35}) is False
    gate.finish()


def test_no_eval_reaching_the_threshold_fails_at_the_end():
    gate = MetricGate("eval/arith/pass@1", 0.5)
    gate.on_eval(0, {"eval/arith/pass@1": 0.25})
    gate.on_eval(2, {"eval/arith/pass@1": 0.4999})
    with pytest.raises(CICheckFailed, match=r"no eval reached --ci-metric-checker-threshold 0.5 .*0.25, 0.4999"):
        gate.finish()


def test_a_key_the_eval_does_not_log_fails_at_that_eval():
    gate = MetricGate("eval/arith/accuracy", 0.1)
    with pytest.raises(CICheckFailed, match=r"eval at step 3 logged no eval/arith/accuracy .*eval/arith/pass@1"):
        gate.on_eval(3, {"eval/arith/pass@1": 1.0, "eval/arith/reward_mean": 1.0})


def test_a_run_without_an_eval_fails_the_gate():
    with pytest.raises(CICheckFailed, match="no eval ran"):
        MetricGate("eval/arith", 0.0).finish()


# --- gradient norms ---------------------------------------------------------------------------------
def test_recorded_norms_match_a_run_within_miles_tolerance(tmp_path):
    path = str(tmp_path / "norms.json")
    saver = GradNormRecord(path, save=True)
    saver.take("actor", 0, [1.0, 2.0])
    saver.take("actor", 1, [3.0])
    saver.take("critic", 1, [0.5])
    assert json.loads((tmp_path / "norms.json").read_text()) == {
        "actor/0/0": 1.0, "actor/0/1": 2.0, "actor/1/0": 3.0, "critic/1/0": 0.5}
    loader = GradNormRecord(path, save=False)
    loader.take("actor", 0, [1.009, 2.02])        # |diff| 0.009 <= abs 0.01; 0.02 <= rel 0.01 * 2.02
    loader.take("actor", 1, [3.0])
    loader.take("critic", 1, [0.505])


def test_a_norm_off_the_record_fails_naming_the_step(tmp_path):
    path = str(tmp_path / "norms.json")
    GradNormRecord(path, save=True).take("actor", 0, [1.0, 2.0])
    with pytest.raises(CICheckFailed, match=r"rollout 0 step 1 is 2.05, the recorded one 2 "):
        GradNormRecord(path, save=False).take("actor", 0, [1.0, 2.05])   # 0.05 > max(0.01, 0.01 * 2.05)


def test_a_step_the_record_lacks_fails(tmp_path):
    path = str(tmp_path / "norms.json")
    GradNormRecord(path, save=True).take("actor", 0, [1.0])
    loader = GradNormRecord(path, save=False)
    with pytest.raises(CICheckFailed, match="no gradient norm recorded for actor/0/1"):
        loader.take("actor", 0, [1.0, 1.0])
    with pytest.raises(CICheckFailed, match="no gradient norm recorded for critic/0/0"):
        loader.take("critic", 0, [1.0])


def test_a_missing_file_fails(tmp_path):
    with pytest.raises(CICheckFailed, match="--ci-load-grad-norm .*gone.json: no such file"):
        GradNormRecord(str(tmp_path / "gone.json"), save=False).take("actor", 0, [1.0])


def test_miles_template_fields_spread_the_record_over_files(tmp_path):
    template = str(tmp_path / "{role}" / "r{rollout_id}_s{step_id}.json")
    GradNormRecord(template, save=True).take("actor", 2, [1.5, 2.5])
    assert json.loads((tmp_path / "actor" / "r2_s1.json").read_text()) == {"actor/2/1": 2.5}
    GradNormRecord(template, save=False).take("actor", 2, [1.5, 2.5])


def test_skipped_float16_steps_match_only_each_other(tmp_path):
    path = str(tmp_path / "norms.json")
    GradNormRecord(path, save=True).take("actor", 0, [math.nan, 1.0])
    GradNormRecord(path, save=False).take("actor", 0, [math.nan, 1.0])
    with pytest.raises(CICheckFailed, match="step 0"):
        GradNormRecord(path, save=False).take("actor", 0, [1.0, 1.0])


def test_the_step_norms_leave_the_metrics_row_with_or_without_the_gates(tmp_path):
    metrics = {"grad_norm": 1.5, STEP_GRAD_NORMS: [1.0, 2.0], f"critic/{STEP_GRAD_NORMS}": [0.5]}
    assert CIGates().after_train(0, metrics) == {}
    assert metrics == {"grad_norm": 1.5}
    gates = CIGates(grad_norms=GradNormRecord(str(tmp_path / "n.json"), save=True))
    assert gates.after_train(4, {STEP_GRAD_NORMS: [1.0, 2.0], f"critic/{STEP_GRAD_NORMS}": [0.5]}) == \
        {"actor": 2, "critic": 1}
    assert set(json.loads((tmp_path / "n.json").read_text())) == {"actor/4/0", "actor/4/1", "critic/4/0"}


# --- the model hash -----------------------------------------------------------------------------------
def test_the_model_hash_round_trip(tmp_path):
    write_model_hash(tmp_path, "ab" * 32)
    check_model_hash(tmp_path, "ab" * 32)
    with pytest.raises(CICheckFailed, match="hash to " + "cd" * 32 + ", not to " + "ab" * 32):
        check_model_hash(tmp_path, "cd" * 32)
    (tmp_path / MODEL_HASH_FILE).unlink()
    with pytest.raises(CICheckFailed, match="model_hash.json does not exist"):
        check_model_hash(tmp_path, "ab" * 32)


# --- start-up checks ----------------------------------------------------------------------------------
def _parse(tmp_path, *extra: str):
    (tmp_path / "e.jsonl").write_text('{"input": "1+1="}\n')
    return parse_flags(base(tmp_path) + ["--eval-prompt-data", "arith", str(tmp_path / "e.jsonl"), *extra])[0]


def test_the_gates_build_from_the_flags(tmp_path):
    cfg = _parse(tmp_path, "--ci-test", "--ci-metric-checker-key", "eval/arith", "--ci-metric-checker-threshold",
                 "0.7", "--ci-load-grad-norm", "n.json", "--save", str(tmp_path / "ck"), "--ci-save-model-hash")
    gates = CIGates.of(cfg)
    assert (gates.metric.metric, gates.metric.threshold) == ("eval/arith/reward_mean", 0.7)
    assert (gates.grad_norms.template, gates.grad_norms.save) == ("n.json", False)
    assert (gates.model_hash_saved, gates.model_hash_checked) == (True, False)
    assert CIGates.of(_parse(tmp_path)) == CIGates()


@pytest.mark.parametrize("extra, message", [
    (["--ci-metric-checker-key", "eval/arith", "--ci-metric-checker-threshold", "1"], "work under --ci-test"),
    (["--ci-test", "--ci-metric-checker-key", "eval/arith"], "go together: give both"),
    (["--ci-test", "--ci-metric-checker-key", "eval/gsm8k", "--ci-metric-checker-threshold", "1"],
     "eval/gsm8k: not an eval metric of this run.*arith"),
    (["--ci-test", "--ci-metric-checker-key", "reward_mean", "--ci-metric-checker-threshold", "1"],
     "not an eval metric"),
    (["--ci-save-grad-norm", "a.json", "--ci-load-grad-norm", "a.json"], "records the norms or checks them"),
    (["--ci-save-grad-norm", "n_{rank}.json"], r"fields are among role, rollout_id, step_id"),
    (["--ci-load-grad-norm", "n_{.json"], r"fields are among"),
    (["--ci-test", "--ci-save-model-hash"], "add --save DIR"),
    (["--ci-test", "--ci-check-model-hash"], "add --load DIR"),
    (["--ci-check-model-hash"], "--ci-check-model-hash work under --ci-test"),
])
def test_bad_gate_flags_are_refused_at_start_up(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        _parse(tmp_path, *extra)
