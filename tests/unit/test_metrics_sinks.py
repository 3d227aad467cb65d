"""Metrics sinks: the Tracker's fan-out, tags, missing extras, TensorBoard and W&B (offline)."""

from __future__ import annotations

import importlib.util
import sys
import time
import types

import pytest

from miles.config import ConfigError, TrackingConfig
from miles.metrics.jsonl import MetricsWriter, read_metrics, untimed
from miles.metrics.sinks import Tracker, WandbSink, open_sinks, scalars, tracking_problems


class Recorder:
    resource_name = "recorder"

    def __init__(self):
        self.rows, self.flushes = [], 0

    def log(self, step, row):
        self.rows.append((step, dict(row)))

    def flush(self):
        self.flushes += 1

    def dispose(self):
        pass


def test_tracker_gives_every_row_to_every_sink_in_order():
    a, b = Recorder(), Recorder()
    t = Tracker([a])
    t.add(b)
    t.log(0, {"reward_mean": 0.5})
    t.log(1, {"reward_mean": 0.7, "kind": "train"})
    t.flush()
    assert a.rows == b.rows == [(0, {"reward_mean": 0.5}), (1, {"reward_mean": 0.7, "kind": "train"})]
    assert a.flushes == b.flushes == 1


def test_scalars_tag_by_kind_keep_sections_and_drop_non_numbers():
    row = {"step": 3, "kind": "train", "reward_mean": 0.25, "epoch": 1, "actor_trained": True, "note": "x",
           "kl": float("nan"), "eval/arith/pass@1": 0.5}
    assert scalars(3, row) == {"train/reward_mean": 0.25, "train/epoch": 1.0, "eval/arith/pass@1": 0.5}
    assert scalars(4, {"kind": "eval", "weight_version": 4}) == {"eval/weight_version": 4.0}


def test_metrics_writer_is_silent_and_flushes(tmp_path, capsys):
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    w.log(0, {"reward_mean": 0.5, "kl": float("inf")})
    w.flush()
    assert read_metrics(tmp_path) == [{"step": 0, "reward_mean": 0.5, "kl": None}]
    w.dispose()
    assert capsys.readouterr().err == ""          # library code prints no progress


def test_read_metrics_skips_a_line_cut_off_by_a_kill(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward_mean": 0.5}\n{"step": 1, "rew')
    assert read_metrics(tmp_path) == [{"step": 0, "reward_mean": 0.5}]


def test_a_missing_extra_is_a_config_problem_naming_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    problems = tracking_problems(TrackingConfig(use_wandb=True))
    assert problems == ["--use-wandb needs the 'wandb' package (module 'wandb'), which is not installed in this "
                        f"Python ({sys.prefix}): pip install -e '.[wandb]' in a miles checkout (pip install "
                        "'miles[wandb]' otherwise) (or drop --use-wandb)"]
    assert tracking_problems(TrackingConfig()) == []
    with pytest.raises(ConfigError, match=r"miles\[wandb\]"):
        next(open_sinks(TrackingConfig(use_wandb=True), run_dir=None, run_id="r", run_config={}))


def test_flags_reject_use_wandb_without_wandb_together_with_other_problems(monkeypatch):
    from miles.config.flags import parse_flags

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as info:
        parse_flags(["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--rollout-batch-size", "2",
                     "--use-wandb", "--lr", "-1"])
    assert any("miles[wandb]" in p for p in info.value.problems)
    assert any(p.startswith("--lr -1") for p in info.value.problems)


def test_open_sinks_opens_the_file_first_then_only_what_was_asked(tmp_path):
    sinks = list(open_sinks(TrackingConfig(), run_dir=tmp_path, run_id="r", run_config={}))
    assert [s.resource_name for s in sinks] == ["metrics_writer"]
    sinks[0].dispose()


def test_tensorboard_sink_writes_scalars_tensorboard_reads_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = list(open_sinks(TrackingConfig(use_tensorboard=True), run_dir=tmp_path, run_id="r", run_config={}))
    assert [s.resource_name for s in sinks] == ["metrics_writer", "tensorboard"]
    t = Tracker(sinks)
    t.log(0, {"reward_mean": 0.25, "kind": "train"})
    t.log(1, {"reward_mean": 0.75, "kind": "train"})
    t.log(2, {"eval/arith/pass@1": 0.5, "kind": "eval"})
    t.flush()
    for s in sinks:
        s.dispose()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/reward_mean")] == [(0, 0.25), (1, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/arith/pass@1")] == [(2, 0.5)]


def test_wandb_sink_logs_against_the_rollout_axis_and_finishes(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def define_metric(self, name, **kw):
            calls.append(("define_metric", name, kw))

        def log(self, data):
            calls.append(("log", data))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(Settings=lambda **kw: kw,
                                 init=lambda **kw: calls.append(("init", kw)) or FakeRun())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    sink = WandbSink(TrackingConfig(use_wandb=True, wandb_project="p", wandb_group="g"), run_dir=tmp_path,
                     run_id="run-1", run_config={"lr": 1e-3})
    sink.log(1, {"reward_mean": 0.5, "kind": "train"})
    sink.log(0, {"eval/a/pass@1": 0.25, "kind": "eval"})     # an async eval arriving late is still plotted
    sink.dispose()
    init = calls[0][1]
    assert (init["project"], init["group"], init["id"], init["mode"]) == ("p", "g", "run-1", "online")
    assert init["dir"] == str(tmp_path / "wandb") and init["config"] == {"lr": 1e-3}
    assert init["settings"]["console"] == "off"
    assert ("define_metric", "*", {"step_metric": "rollout"}) in calls
    assert [c[1] for c in calls if c[0] == "log"] == [{"rollout": 1, "train/reward_mean": 0.5},
                                                      {"rollout": 0, "eval/a/pass@1": 0.25}]
    assert calls[-1] == ("finish",)


def test_wandb_offline_mode_needs_no_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(TrackingConfig(use_wandb=True), run_dir=tmp_path, run_id="offline-test", run_config={"a": 1})
    assert sink.mode == "offline"
    sink.log(0, {"reward_mean": 0.5, "kind": "train"})
    sink.dispose()
    files = list((tmp_path / "wandb").glob("wandb/offline-run-*-offline-test/run-offline-test.wandb"))
    assert len(files) == 1
    # W&B's service process writes the file behind finish(); give it a moment on a loaded machine
    deadline = time.monotonic() + 20
    while b"train/reward_mean" not in files[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"train/reward_mean" in files[0].read_bytes()


def test_use_mlflow_without_mlflow_is_a_config_problem_naming_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert tracking_problems(TrackingConfig(use_mlflow=True)) == [
        f"--use-mlflow needs the 'mlflow' package (module 'mlflow'), which is not installed in this Python "
        f"({sys.prefix}): pip install mlflow (or drop --use-mlflow)"]


def test_mlflow_sink_logs_one_run_with_params_and_metrics_and_ends_it(tmp_path, monkeypatch):
    from miles.metrics.sinks import MlflowSink

    calls = []

    class FakeClient:
        def __init__(self, tracking_uri):
            calls.append(("client", tracking_uri))

        def get_experiment_by_name(self, name):
            calls.append(("get_experiment", name))
            return None

        def create_experiment(self, name):
            return "exp-7"

        def create_run(self, experiment_id, run_name, tags):
            calls.append(("create_run", experiment_id, run_name, tags))
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id="mlrun-1"))

        def log_batch(self, run_id, metrics=(), params=()):
            calls.append(("log_batch", run_id, list(metrics), list(params)))

        def set_terminated(self, run_id):
            calls.append(("terminated", run_id))

    entities = types.SimpleNamespace(Metric=lambda key, value, timestamp, step: (key, value, step),
                                     Param=lambda key, value: (key, value))
    monkeypatch.setitem(sys.modules, "mlflow", types.SimpleNamespace(MlflowClient=FakeClient, entities=entities))
    monkeypatch.setitem(sys.modules, "mlflow.entities", entities)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    sink = MlflowSink(run_dir=tmp_path, run_id="run-1", run_config={"train": {"lr": 0.001}, "num_rollout": 3})
    sink.log(2, {"reward_mean": 0.5, "kind": "train", "note": "x"})
    sink.log(2, {"eval/arith/pass@4": 0.75, "kind": "eval"})
    sink.dispose()
    assert calls[0] == ("client", (tmp_path / "mlruns").resolve().as_uri())
    assert calls[2] == ("create_run", "exp-7", "run-1", {"miles.run_id": "run-1"})
    assert calls[3] == ("log_batch", "mlrun-1", [], [("train.lr", "0.001"), ("num_rollout", "3")])
    assert calls[4] == ("log_batch", "mlrun-1", [("train/reward_mean", 0.5, 2)], [])
    assert calls[5] == ("log_batch", "mlrun-1", [("eval/arith/pass_at_4", 0.75, 2)], [])   # MLflow keys have no @
    assert calls[-1] == ("terminated", "mlrun-1")


def test_untimed_drops_the_clocks_numbers_only():
    row = {"step_time_s": 1.2, "gen_tokens_per_s": 9.0, "tflops": 0.1, "critic/mfu": 0.2,
           "num_steps": 2, "num_samples": 8, "reward_std": 0.5, "reward_timeouts": 0, "loss": 0.1}
    assert untimed(row) == {"num_steps": 2, "num_samples": 8, "reward_std": 0.5, "reward_timeouts": 0, "loss": 0.1}
