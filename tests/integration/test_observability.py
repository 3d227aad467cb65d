"""Observability on real parts: the CLI's plain progress, the sinks (JSONL, TensorBoard, W&B offline)
as disposer resources, the actors' logs in the run dir with the run's context, and `miles plot`."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
from pathlib import Path

import pytest

from miles.cli import main as miles_main
from miles.runtime import read_trace
from miles.cli.train import main as train_main
from tests.conftest import assert_cpu_threads, base_flags

pytestmark = pytest.mark.ray

HAS_TB = importlib.util.find_spec("tensorboard") is not None
HAS_WANDB = importlib.util.find_spec("wandb") is not None
DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def observed_run(ray_cluster, tiny_task, tmp_path_factory):
    """One CLI run with every sink on (those installed) and plain progress; its dir and its stderr."""
    run_dir = tmp_path_factory.mktemp("observed") / "run"
    extra = {"use_tensorboard": HAS_TB, "use_wandb": HAS_WANDB, "wandb_mode": "offline" if HAS_WANDB else None}
    argv = base_flags(tiny_task, run_dir, num_rollout=2, eval_prompt_data=["arith", tiny_task["eval"]],
                      eval_interval=2, progress="plain", save_debug_rollout_data=run_dir.parent / "rollouts", **extra)
    err = io.StringIO()
    os.environ.setdefault("WANDB_SILENT", "true")
    with contextlib.redirect_stderr(err):
        code = train_main(argv)
    assert code == 0, err.getvalue()[-3000:]
    return run_dir, err.getvalue()


def test_a_run_shows_progress_fills_every_sink_and_logs_into_its_dir(observed_run):
    run_dir, err = observed_run

    # progress: plain lines (not a terminal), one per trained rollout and eval, with an ETA
    lines = [line for line in err.splitlines() if line.startswith("miles: ")]
    assert lines[0].startswith("miles: run ") and lines[0].endswith(" started")
    rollout_lines = [line for line in lines if line.startswith("miles: rollout ")]
    assert [line.split()[1:4] for line in rollout_lines] == [["rollout", "0", "(1/2)"], ["rollout", "1", "(2/2)"]]
    assert "reward=" in rollout_lines[0] and "tok/s=" in rollout_lines[0] and "eta=0:00:00" in rollout_lines[1]
    assert sum(line.startswith("miles: eval after") for line in lines) == 2     # before training, after the last
    # each eval says why it runs: the first by miles' rule, though --eval-interval 2 is the last rollout
    assert [line for line in lines if line.startswith("miles: evaluating")] == [
        "miles: evaluating after 0 rollouts: before the first rollout, the baseline (miles runs it whatever "
        "--eval-interval is; --skip-eval-before-train skips it)",
        "miles: evaluating after 2 rollouts: every --eval-interval 2 rollouts"]
    assert lines[-1].startswith("miles: run ") and " ended: ok after " in lines[-1]

    # sinks: registered in init as each opened, torn down in reverse, flushed by draining first
    trace = read_trace(run_dir)
    assert_cpu_threads(run_dir, trace, overlapped=False)   # the sync machine: the trainer steps alone, on every core
    registered = [e.get("resource") for e in trace.of("registered")]
    sinks = ["metrics_writer"] + ["tensorboard"] * HAS_TB + ["wandb"] * HAS_WANDB
    locks = [f"lock --run-dir {run_dir}"]          # the run's folders: registered first, so released last
    assert registered[:len(locks) + len(sinks) + 1] == locks + sinks + ["ray_cluster"]
    disposed = [e.get("resource") for e in trace.of("disposed")]
    assert disposed[-len(sinks) - len(locks):] == list(reversed(sinks)) + locks
    assert all(e.get("outcome") == "ok" for e in trace.of("disposed"))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"]) for r in rows] == [(0, "eval"), (0, "train"), (1, "train"), (2, "eval")]
    if HAS_TB:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        acc = EventAccumulator(str(run_dir / "tensorboard"))
        acc.Reload()
        assert [s.step for s in acc.Scalars("train/reward_mean")] == [0, 1]
        assert [s.step for s in acc.Scalars("eval/arith/pass@1")] == [0, 2]
    if HAS_WANDB:
        assert len(list((run_dir / "wandb" / "wandb").glob(f"offline-run-*-{trace.events[0].run_id}"))) == 1

    # logs: one file per actor and the driver, each line with the run's context
    run_id = trace.events[0].run_id
    files = sorted(p.name for p in (run_dir / "logs").iterdir())
    assert files == ["driver-0.jsonl", "engine-0.jsonl", "rollout-executor-0.jsonl", "trainer-0.jsonl"]
    trainer = [json.loads(x) for x in (run_dir / "logs" / "trainer-0.jsonl").read_text().splitlines()]
    assert all(e["run_id"] == run_id and e["role"] == "trainer" and e["rank"] == 0 for e in trainer)
    assert [e["rollout_id"] for e in trainer if e["event"] == "train_done"] == [0, 1]
    engine = [json.loads(x) for x in (run_dir / "logs" / "engine-0.jsonl").read_text().splitlines()]
    assert [e["event"] for e in engine][:2] == ["engine_ready", "actor_ready"] and engine[0]["role"] == "engine"
    assert "train_done" not in err                       # info lines went to the files, not the console
    config = (run_dir / "config.yaml").read_text()
    assert f"run_dir: {run_dir}" in config and "progress: plain" in config

    # the plot of that run
    assert miles_main(["plot", str(run_dir)]) == 0
    assert (run_dir / "plots" / "metrics.png").stat().st_size > 10_000


def docs_commands(page: Path) -> list[str]:
    """The `miles` commands of a page's ```bash blocks that run in seconds (not a training)."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
    commands = []
    lines = (x.split("#")[0].strip() for block in blocks for x in block.replace("\\\n", " ").splitlines())
    for line in lines:
        words = shlex.split(line) if line else []
        if words and words[0].endswith("miles") and (words[1] != "train" or "--help" in words):
            commands.append(line)
    return commands


def test_the_commands_of_docs_running_md_work_on_a_real_run(observed_run, capsys):
    run_dir, _ = observed_run
    commands = docs_commands(DOCS / "running.md")
    assert len(commands) >= 5                # --help, plot, trace show/check/plot
    for line in commands:
        argv = shlex.split(line.replace("runs/demo", str(run_dir)))[1:]
        try:
            code = miles_main(argv)
        except SystemExit as exc:             # argparse's --help
            code = exc.code
        assert code == 0, (line, capsys.readouterr())
    assert (run_dir / "plots" / "gantt.png").exists()


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_saved_rollouts_replay_without_engines_to_the_same_losses(observed_run, tiny_task, tmp_path):
    run_dir, _ = observed_run
    saved = run_dir.parent / "rollouts"
    assert sorted(p.name for p in saved.iterdir()) == ["rollout_0.pt", "rollout_1.pt"]
    replay_dir = tmp_path / "replay"
    assert train_main(base_flags(tiny_task, replay_dir, num_rollout=2, load_debug_rollout_data=saved,
                                 progress="off")) == 0
    trace = read_trace(replay_dir)
    assert trace.events[0].machine == "train_only"            # picked by the flag
    registered = {e.get("resource") for e in trace.of("registered")}
    assert "trainer" in registered and not any(r.startswith("engine") for r in registered)
    assert [e.get("loaded_from") for e in trace.of("rollout_done")] == [str(saved / "rollout_0.pt"),
                                                                      str(saved / "rollout_1.pt")]
    # the same samples from the same initial weights: the same steps, loss for loss
    trained = {r["step"]: r for r in rows_of(run_dir) if r["kind"] == "train"}
    replayed = {r["step"]: r for r in rows_of(replay_dir) if r["kind"] == "train"}
    assert sorted(replayed) == [0, 1]
    for step in (0, 1):
        for key in ("loss", "grad_norm", "entropy", "reward_mean"):
            assert replayed[step][key] == trained[step][key], (step, key)


def test_rollout_only_generates_and_logs_without_a_trainer(ray_cluster, tiny_task, tmp_path):
    run_dir = tmp_path / "ro"
    assert train_main(base_flags(tiny_task, run_dir, num_rollout=1, debug_rollout_only=True,
                                 save_debug_rollout_data=tmp_path / "d" / "{rollout_id}.pt", progress="off")) == 0
    trace = read_trace(run_dir)
    assert trace.events[0].machine == "rollout_only"
    registered = {e.get("resource") for e in trace.of("registered")}
    assert "engine-0" in registered and "trainer" not in registered
    assert [(r["step"], r["kind"]) for r in rows_of(run_dir)] == [(0, "rollout")]
    assert (tmp_path / "d" / "0.pt").is_file() and trace.of("rollout_data_saved")[0].rollout_id == 0
