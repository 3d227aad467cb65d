"""The fault matrix: every state of `sync` crossed with every fault, on real parts.

Each case asserts: the trace ends in `shutdown` and conforms to the machine (`trace check`);
teardown ran in exact reverse registration order and every registered resource was disposed; no
actor of the run is alive and no worker process of its actors is left; the outcome / exit code;
the primary error is the one the fault causes; the newest complete checkpoint loads.

Every case attaches to the session's Ray cluster. Faults that end a run (an exception, the trainer
SIGKILLed, a signal) get one run per state; faults a run survives or meets only at teardown (the
engine SIGKILLed, a teardown that raises or hangs) are injected in every state of one run. Signal
cases drive the CLI's signal path in this process; two more check a real `scripts/train.py`
process's exit codes, and one a second SIGINT.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pytest
import ray

from miles.checkpoint.checkpointer import read_data_position
from miles.checkpoint.store import CheckpointStore
from miles.config.flags import parse_flags
from miles.api.launch import train
from miles.runtime import load_machine, read_trace, with_disposer
from miles.runtime.procs import pid_running
from miles.traceview.check import check_trace
from miles.metrics.jsonl import read_metrics, untimed
from miles.cli.train import run_with_signals
from tests.conftest import base_flags, miles_actors

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STATES = ["init", "weight_sync", "eval", "rollout", "train", "save", "draining"]
ROOT = Path(__file__).resolve().parents[2]

# what the run ends as, and which error is primary, for each fault (one fault in one state)
EXPECTED = {
    "raise": ("failed", "InjectedFault"),
    "kill_engine": ("ok", None),                      # restarted within the budget
    "kill_trainer": ("failed", "ActorDiedError"),     # not restartable
    "teardown_raise": ("failed", "InjectedFault"),
    "teardown_hang": ("failed", "TeardownTimeout"),
}
FATAL = ("raise", "kill_trainer")     # faults that end the run: one run per state
# how the phase hangs in each state's SIGTERM case: a cancellable await, a thread that never returns,
# a Ray call that never returns (the executor blocked in it: its teardown is forced)
HANG_IN = {"init": "hang_thread", "weight_sync": "hang_ray", "eval": "hang", "rollout": "hang_ray",
           "train": "hang_thread", "save": "hang", "draining": "hang"}
STOP_TIMEOUT_S = 6.0
N_ROLLOUT = 2
# which visit of its state a fault fires on: the second where the state comes again, so that rollout 0
# is trained (and, but in the stop cases, saved) when it fires and the resume has a checkpoint to start
# from; init and draining come once
VISIT = {"init": 1, "weight_sync": 2, "eval": 2, "rollout": 2, "train": 2, "save": 2, "draining": 1}
# a stop case saves only after the last rollout: a stop before then saves the last trained rollout
# itself (the stop's save), and the resume starts from that save's data position. Its `save` comes
# once; a stop in train 0 lets the step finish (SIGINT) and saves it, with rollout 1 generating ahead
# (async), which draining cancels
STOP_SAVES = ["--save-interval", "2"]
STOP_VISIT = {**VISIT, "train": 1, "save": 1}

# CI (scripts/test.sh's default run) takes one fault of each cross product per state; the rest of the
# product is marked `extended` (`bash scripts/test.sh -m extended` runs it). Chosen so that CI still
# meets every state and every kind: an exception where the phase raises it (a save cut half-way among
# them) and the trainer's death met in the phase itself or a later one; SIGTERM against each way a
# phase hangs (a thread, a Ray call, an await) and in draining itself, SIGINT in the other states.
FATAL_IN_CI = {"init": "raise", "weight_sync": "kill_trainer", "eval": "raise", "rollout": "kill_trainer",
               "train": "kill_trainer", "save": "raise", "draining": "raise"}
SIGNAL_IN_CI = {"init": "sigterm", "weight_sync": "sigterm", "eval": "sigint", "rollout": "sigint",
                "train": "sigint", "save": "sigterm", "draining": "sigterm"}
# Every case checks that its newest checkpoint holds the uninterrupted run's data position for that
# rollout; every extended case also resumes from it and compares what the resume trains, step by step,
# with the uninterrupted run; CI resumes one way out per state, where the resume has a rollout left to
# train (a stop in rollout is the one that lost its prompts before, issue 59). In init nothing is
# trained (no checkpoint: a rerun is a fresh start); in draining everything is trained and saved, and
# the checkpoint's data position is the check (CI runs no resume there that would train nothing)
RESUME_IN_CI = {"init": "signal", "weight_sync": "signal", "eval": "signal", "rollout": "signal",
                "train": "fatal", "save": "fatal", "draining": None}


def matrix_params(kinds, in_ci: dict[str, str]) -> list:
    """(state, kind) pytest params for every state x kind; those not `in_ci` are marked extended."""
    return [pytest.param(state, kind, id=f"{state}-{kind}", marks=() if in_ci.get(state) == kind else pytest.mark.extended)
            for state in STATES for kind in kinds]


def matrix_flags(task, tmp_path, fault: str | list[str] | None, *, run: str = "run"):
    # 2 rollouts, saving and evaluating after each: every state of sync is visited
    return base_flags(task, tmp_path / run, num_rollout=N_ROLLOUT, rollout_batch_size=2, n_samples_per_prompt=2,
                      rollout_max_response_len=3, save=tmp_path / "ckpt", save_interval=1,
                      eval_prompt_data=["arith", task["eval"]], eval_interval=1, teardown_timeout=20,
                      inject_fault=[fault] if isinstance(fault, str) else fault or None)


def at_visit(state: str, kind: str, *, stop: bool = False) -> str:
    """The --inject-fault of `kind` in `state`, on the visit VISIT (a stop case: STOP_VISIT) names."""
    return f"{state}:{kind}:{(STOP_VISIT if stop else VISIT)[state]}"


# -- exactly-once training data: each case's resume trains what the uninterrupted run trained ------------

@dataclass
class Uninterrupted:
    """An uninterrupted run of the matrix's flags: its checkpoints (one per rollout) and, per step, the
    prompts trained (the dataset rows, from the trace's `rollout_done`) and the untimed metrics."""

    ckpt: Path
    steps: dict[int, tuple[list[int], dict]]


def trained_steps(run_dir: Path) -> dict[int, tuple[list[int], dict]]:
    """Each step a run trained: (its prompts, its untimed metrics row)."""
    prompts = {e.rollout_id: e.get("prompts") for e in read_trace(run_dir).of("rollout_done")}
    rows = {r["step"]: untimed(r) for r in read_metrics(run_dir) if r.get("kind") == "train"}
    return {step: (prompts[step], row) for step, row in rows.items()}


def uninterrupted(run_dir: Path, ckpt: Path) -> Uninterrupted:
    steps = trained_steps(run_dir)
    assert sorted(steps) == list(range(N_ROLLOUT)), steps
    assert [r for r, _ in CheckpointStore(ckpt).list()] == list(range(N_ROLLOUT))
    assert all(len(p) == 2 for p, _ in steps.values())       # --rollout-batch-size prompts a step
    return Uninterrupted(ckpt, steps)


def assert_resume_trains_as_uninterrupted(task, tmp_path, reference: Uninterrupted, *, resume: bool,
                                          machine: str = "sync", extra=(), same_metrics: bool = True) -> None:
    """After the case's run (tmp_path / "run"), whatever way it ended: its newest checkpoint holds the
    data position the uninterrupted run had after the same rollout, and (`resume`) a run with --load
    from it trains exactly the rollouts after it, each on the prompts the uninterrupted run trained
    at that step (and, `same_metrics`, with the same untimed metrics). So each prompt is trained as
    often as in the uninterrupted run. Without a checkpoint, a rerun is a fresh start: the
    uninterrupted run itself."""
    first = trained_steps(tmp_path / "run")
    for step, (prompts, _) in first.items():          # what the case's run trained, it trained on the right prompts
        assert prompts == reference.steps[step][0], (step, prompts, reference.steps[step][0])
    latest = CheckpointStore(tmp_path / "ckpt").latest()
    if latest is None:
        return
    rid, path = latest
    assert rid in first, (rid, sorted(first))           # a checkpoint is of a rollout this run trained
    assert read_data_position(path) == read_data_position(CheckpointStore(reference.ckpt).path_for(rid)), rid
    if not resume:
        return
    cfg, _ = parse_flags([*matrix_flags(task, tmp_path, None, run="resumed"), "--load", str(tmp_path / "ckpt"),
                          *extra])
    asyncio.run(with_disposer(train, cfg, machine=machine))
    resumed = read_trace(tmp_path / "resumed")
    assert resumed.of("resumed")[0].rollout_id == rid
    got = trained_steps(tmp_path / "resumed")
    assert sorted(got) == list(range(rid + 1, N_ROLLOUT)), sorted(got)
    for step, (prompts, row) in got.items():
        assert prompts == reference.steps[step][0], (step, prompts, reference.steps[step][0])
        if same_metrics:
            assert row == reference.steps[step][1], step


def leftover_actor_processes(trace) -> list[str]:
    """The run's actor worker processes (pids from the trace) that are still running."""
    pids = {}
    for e in trace.of("components_ready", "engine_restarted"):
        pids.update(e.get("pids") or {})
    assert pids, "the trace names no actor processes"
    deadline = time.monotonic() + 10          # ray.kill is asynchronous: give the raylet a moment
    while True:
        alive = [f"{name} pid {pid}" for name, pid in pids.items() if pid_running(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def signal_to_end_s(trace) -> float:
    """Seconds from the injected signal to the run's end (the trace's own clock)."""
    signalled = next(e for e in trace.of("fault_injected") if e.get("kind") in ("sigint", "sigterm"))
    return trace.of("run_end")[0].mono - signalled.mono


def _report(run_dir: Path, trace, outcome: str) -> None:
    """With MILES_FAULT_REPORT=path, append this case's numbers (docs/reliability.md's table)."""
    if not os.environ.get("MILES_FAULT_REPORT"):
        return
    unwind = trace.of("unwind_end")
    fault = trace.of("fault_injected")
    row = {"case": run_dir.parent.name, "state": fault[0].get("state") if fault else None,
           "fault": fault[0].get("kind") if fault else None, "outcome": outcome,
           "teardown_s": unwind[0].duration_s if unwind else None,
           "disposed": len(trace.of("disposed")), "restarts": len(trace.of("engine_restart")),
           "escalations": [e.get("resource") for e in trace.of("disposed") if e.get("outcome") != "ok"],
           "hang": next((e.get("kind") for e in fault if e.get("kind", "").startswith("hang")), None),
           "signal_to_end_s": (round(signal_to_end_s(trace), 2)
                               if any(e.get("kind") in ("sigint", "sigterm") for e in fault) else None),
           "stop_save": [(e.get("saved"), e.get("reason")) for e in trace.of("stop_save")]}
    _report_row(row)


def _report_row(row: dict) -> None:
    if path := os.environ.get("MILES_FAULT_REPORT"):
        import json
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def assert_clean_end(run_dir: Path, *, outcome: str, error_type: str | None, ckpt: Path, machine: str = "sync"):
    trace = read_trace(run_dir)
    end = trace.events[-1]
    assert end.event == "run_end" and end.state == "shutdown", end
    assert end.get("outcome") == outcome, (end.get("outcome"), end.error)
    if error_type:
        assert error_type in end.error["type"] or error_type in end.error["message"], end.error
    report = check_trace(trace, load_machine(machine))
    assert report.ok, [v.message for v in report.violations]
    registered = [e.get("position") for e in trace.of("registered")]
    disposed = [e.get("position") for e in trace.of("disposed")]
    assert disposed == sorted(registered, reverse=True)
    cluster = trace.of("cluster_ready")
    if cluster:
        assert miles_actors(cluster[0].get("namespace")) == []
    if trace.of("components_ready"):
        assert leftover_actor_processes(trace) == []
    _report(run_dir, trace, outcome)
    latest = CheckpointStore(ckpt).latest()
    if latest is not None:                            # the newest complete checkpoint loads
        from transformers import AutoModelForCausalLM
        AutoModelForCausalLM.from_pretrained(latest[1] / "hf")
    return trace


def run_in_process(task, tmp_path, faults, *, machine="sync", extra=()):
    """One run on the session cluster with these faults injected; returns (trace-dir, raised)."""
    cfg, _ = parse_flags([*matrix_flags(task, tmp_path, faults), *extra])
    try:
        asyncio.run(with_disposer(train, cfg, machine=machine))
        return None
    except BaseException as exc:  # noqa: BLE001
        return exc


def resumes(state: str, case: str, kind: str, in_ci: dict[str, str], resume_in_ci: dict[str, str | None]) -> bool:
    """Whether this case runs its resume: every extended case does; in CI, the one way out per state
    `resume_in_ci` names ("fatal" or "signal"; None: none)."""
    return in_ci.get(state) != kind or resume_in_ci[state] == case


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_task, tmp_path_factory):
    """The uninterrupted run the resumes are held to, and CI's teardown case: both failing teardowns
    registered in every state, met only after the last rollout was trained and saved (the teardown
    test asserts on this same run). Returns (its folder, what it raised, its Uninterrupted)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    raised = run_in_process(tiny_task, root, teardown_faults_flags(TEARDOWN_IN_CI))
    return root, raised, uninterrupted(root / "run", root / "ckpt")


@pytest.mark.parametrize("state,fault", matrix_params(FATAL, FATAL_IN_CI))
def test_fatal_fault_in_each_state(ray_cluster, tiny_task, tmp_path, reference, state, fault):
    outcome, error_type = EXPECTED[fault]
    if fault == "kill_trainer" and state == "draining":
        outcome, error_type = "ok", None              # nothing uses the trainer after draining starts
    raised = run_in_process(tiny_task, tmp_path, [at_visit(state, fault)])
    trace = assert_clean_end(tmp_path / "run", outcome=outcome, error_type=error_type, ckpt=tmp_path / "ckpt")
    assert trace.of("fault_injected")[0].get("state") == state
    if outcome == "ok":
        assert raised is None
    else:
        assert error_type in type(raised).__name__ or error_type in str(raised)
    if fault == "raise":
        assert trace.of("error")[0].state == state
    assert_resume_trains_as_uninterrupted(tiny_task, tmp_path, reference[2],
                                          resume=resumes(state, "fatal", fault, FATAL_IN_CI, RESUME_IN_CI))


def test_engine_killed_in_every_state_is_restarted_each_time(ray_cluster, tiny_task, tmp_path):
    # the faults that do not end a run share one: the engine is SIGKILLed in each state in turn
    raised = run_in_process(tiny_task, tmp_path, [f"{s}:kill_engine" for s in STATES],
                            extra=["--engine-max-restarts", "10"])
    assert raised is None, raised
    trace = assert_clean_end(tmp_path / "run", outcome="ok", error_type=None, ckpt=tmp_path / "ckpt")
    killed = [e.get("state") for e in trace.of("fault_injected") if e.get("kind") == "kill_engine"]
    assert killed == STATES
    # each kill is met by the next phase that uses the engine (train and save use none: the kill in
    # train is met by weight_sync before save's kill); draining's kill is met by nobody
    assert 4 <= len(trace.of("engine_restart")) <= 6
    assert all(e.get("engine") == 0 for e in trace.of("engine_restart"))


# the error each failing teardown adds to the run's ExceptionGroup
TEARDOWN_ERROR = {"teardown_raise": "InjectedFault", "teardown_hang": "TeardownTimeout"}
# CI registers both failing teardowns in every state of one run (the disposer meets a raise and a hang
# interleaved, 14 failures); each kind alone is the same path and extended
TEARDOWN_IN_CI = ("teardown_raise", "teardown_hang")
TEARDOWN_FAULTS = [pytest.param(TEARDOWN_IN_CI, id="teardown_raise+teardown_hang"),
                   *(pytest.param((k,), id=k, marks=pytest.mark.extended) for k in TEARDOWN_ERROR)]


def teardown_faults_flags(faults: tuple[str, ...]) -> list[str]:
    return [f"{s}:{f}" for s in STATES for f in faults]


def assert_failed_teardowns(raised, trace, faults: tuple[str, ...]) -> None:
    """Each injected teardown failed once per state, with its error in the group; every other teardown ok."""
    assert isinstance(raised, ExceptionGroup)
    assert Counter(type(e).__name__ for e in raised.exceptions) == Counter(
        {TEARDOWN_ERROR[f]: len(STATES) for f in faults})
    bad = [e for e in trace.of("disposed") if e.get("outcome") != "ok"]
    assert Counter(e.get("resource") for e in bad) == Counter({f"injected_{f}": len(STATES) for f in faults})
    injected = {f"injected_{f}" for f in faults}
    assert all(e.get("outcome") == "ok" for e in trace.of("disposed") if e.get("resource") not in injected)


@pytest.mark.parametrize("faults", TEARDOWN_FAULTS)
def test_teardowns_registered_in_every_state_that_fail(ray_cluster, tiny_task, tmp_path, request, faults):
    if faults == TEARDOWN_IN_CI:                      # the run the resumes are held to (`reference`)
        tmp_path, raised, _ = request.getfixturevalue("reference")
    else:
        raised = run_in_process(tiny_task, tmp_path, teardown_faults_flags(faults))
    trace = assert_clean_end(tmp_path / "run", outcome="failed", error_type="ExceptionGroup", ckpt=tmp_path / "ckpt")
    assert_failed_teardowns(raised, trace, faults)


@pytest.mark.parametrize("state,sig", matrix_params(["sigint", "sigterm"], SIGNAL_IN_CI))
def test_signal_to_the_driver_drains_and_exits(ray_cluster, tiny_task, tmp_path, reference, state, sig):
    # the CLI's own signal path (miles.cli.train.run_with_signals) in this process: the injected
    # signal reaches its handlers exactly as a signal to a `miles train` process would. With SIGINT
    # the phase finishes, then the run drains; with SIGTERM the phase also hangs (one way per state)
    # and the stop's budget (--stop-timeout) cuts it: the time from the signal to the run's end is bounded.
    # No periodic save before the last rollout's: the stop's own save is the one the resume starts from
    faults = [at_visit(state, sig, stop=True)]
    if sig == "sigterm":
        faults.append(at_visit(state, HANG_IN[state], stop=True))
    cfg, _ = parse_flags([*matrix_flags(tiny_task, tmp_path, faults), *STOP_SAVES,
                          "--stop-timeout", str(STOP_TIMEOUT_S)])
    # the hard exit (os._exit at --stop-timeout) would end pytest too: here it waits, the bound is checked below
    code = run_with_signals(cfg, "sync", prog="miles train", hard_exit_s=10 * STOP_TIMEOUT_S)
    hung_draining = sig == "sigterm" and state == "draining"     # draining itself cut: it did not finish
    assert code == (1 if hung_draining else {"sigint": 130, "sigterm": 143}[sig])
    trace = assert_clean_end(tmp_path / "run", outcome="failed" if hung_draining else "stopped",
                             error_type="PhaseTimeout" if hung_draining else None, ckpt=tmp_path / "ckpt")
    if state != "draining":   # the phase that got the signal finished (or was cut), then the run drained
        stop = [t for t in trace.of("transition") if t.trigger == "stop"]
        assert [(t.src, t.dst) for t in stop] == [(state, "draining")]
    if sig == "sigterm":
        assert [(e.state, e.get("reason")) for e in trace.of("phase_timeout")] == [(state, "stop")]
        assert signal_to_end_s(trace) < STOP_TIMEOUT_S
    assert_resume_trains_as_uninterrupted(tiny_task, tmp_path, reference[2],
                                          resume=resumes(state, "signal", sig, SIGNAL_IN_CI, RESUME_IN_CI))


# extended (CI budget): its path is covered by default tests: SIGINT in rollout through the CLI's signal path, exit
# 130 (test_signal_to_the_driver_drains_and_exits[rollout-sigint]), a real scripts/train.py process's exit code
# and its "stopped (SIG...)" line (..._process_group_stops_a_run_..., ..._hangup_...), and a real process's SIGINT
# in rollout with exit 130 (test_a_second_sigint_cuts_draining_short)
@pytest.mark.extended
def test_cli_process_exit_code_on_signal(ray_cluster, tiny_task, tmp_path):
    proc = run_cli_with_signal(tiny_task, tmp_path, ray_cluster, "rollout:sigint")
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert f"stopped (SIGINT): {tmp_path / 'run'}" in proc.stderr and "done:" not in proc.stderr
    assert_clean_end(tmp_path / "run", outcome="stopped", error_type=None, ckpt=tmp_path / "ckpt")


def test_cli_process_blocking_the_event_loop_exits_143_at_the_stop_timeout(ray_cluster, tiny_task, tmp_path):
    # nothing in the loop runs (time.sleep in the phase): only the CLI's hard deadline, a thread armed
    # by the signal handler, ends the process; the trace is cut short, the actors go with their owner
    # (a clean SIGTERM end is the in-process matrix's, above)
    proc = run_cli_with_signal(tiny_task, tmp_path, ray_cluster, ["rollout:sigterm", "rollout:hang_blocking"],
                               extra=["--stop-timeout", str(STOP_TIMEOUT_S)])
    ended = datetime.now(timezone.utc)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert "still running" in proc.stderr and "--stop-timeout" in proc.stderr
    trace = read_trace(tmp_path / "run")
    signalled = next(e for e in trace.of("fault_injected") if e.get("kind") == "sigterm")
    exit_after_s = (ended - datetime.fromisoformat(signalled.ts)).total_seconds()
    assert STOP_TIMEOUT_S <= exit_after_s < STOP_TIMEOUT_S + 3, exit_after_s
    assert trace.events[-1].event != "run_end"                    # cut short
    namespace = trace.of("cluster_ready")[0].get("namespace")
    deadline = time.monotonic() + 30                              # owner-bound actors die with their owner
    while miles_actors(namespace) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert miles_actors(namespace) == [] and leftover_actor_processes(trace) == []
    _report_row({"case": "hang_blocking", "state": "rollout", "hang": "hang_blocking",
                 "signal_to_exit_s": round(exit_after_s, 2)})


def run_cli_with_signal(task, tmp_path, gcs, fault: str | list[str], extra=()):
    argv = [sys.executable, str(ROOT / "scripts" / "train.py"),
            *matrix_flags(task, tmp_path, fault), "--ray-address", gcs, *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_sigterm_to_the_drivers_process_group_stops_a_run_on_its_own_cluster_in_order(tiny_task, tmp_path):
    # `timeout`, Slurm's scancel and `kill -- -PGID` signal the driver's whole process group. The run's
    # own local cluster (no --ray-address) must not be in it: the driver's stop then disposes every
    # actor and the cluster in order (before, the group's SIGTERM killed gcs_server and the raylet
    # under the run, and the teardowns of the placement group and the cluster timed out: `failed`)
    argv = [sys.executable, str(ROOT / "scripts" / "train.py"),
            *base_flags(tiny_task, tmp_path / "run", num_rollout=200, rollout_batch_size=2, n_samples_per_prompt=2,
                        rollout_max_response_len=3, teardown_timeout=20)]
    p = subprocess.Popen(argv, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trace_path = tmp_path / "run" / "trace.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and '"rollout_id": 1' not in (trace_path.read_text() if trace_path.exists() else ""):
        assert p.poll() is None, p.communicate()[1][-2000:]
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGTERM)          # the group, as `timeout` does
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err[-2000:]
    assert f"stopped (SIGTERM): {tmp_path / 'run'}" in err
    trace = assert_clean_end(tmp_path / "run", outcome="stopped", error_type=None, ckpt=tmp_path / "ckpt")
    assert [e.get("resource") for e in trace.of("disposed") if e.get("outcome") != "ok"] == []
    cluster, = trace.of("cluster_ready")
    assert cluster.get("started") is True
    session = Path(cluster.get("session_dir")).name
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and session in _cmdline(pid)]
    assert left == [], f"processes of Ray session {session} still running: {left}"


def test_a_hangup_of_the_drivers_terminal_stops_the_run_and_saves_it(tiny_task, tmp_path):
    # the SSH session or terminal that started `miles train` goes away: the kernel sends SIGHUP to the
    # driver (its session's leader) and every write to the terminal fails. The run stops as on SIGTERM,
    # its stop's save complete, exit 129, nothing left (before, SIGHUP's default ended the driver at once:
    # no save, the trace cut short)
    import fcntl
    import pty
    import select
    import termios
    import threading

    master, slave = pty.openpty()
    argv = [sys.executable, str(ROOT / "scripts" / "train.py"),
            *base_flags(tiny_task, tmp_path / "run", num_rollout=200, rollout_batch_size=2, n_samples_per_prompt=2,
                        rollout_max_response_len=3, teardown_timeout=20, save=tmp_path / "ckpt", save_interval=1000)]
    p = subprocess.Popen(argv, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
                         stdin=slave, stdout=slave, stderr=slave,
                         preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))   # the pty: its terminal
    os.close(slave)
    output, reading = [], threading.Event()
    reading.set()

    def drain() -> None:                      # a full pty would block the driver's writes
        while reading.is_set():
            if select.select([master], [], [], 0.1)[0]:
                try:
                    output.append(os.read(master, 65536))
                except OSError:
                    return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    trace_path = tmp_path / "run" / "trace.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and '"rollout_id": 1' not in (trace_path.read_text() if trace_path.exists() else ""):
        assert p.poll() is None, b"".join(output).decode(errors="replace")[-2000:]
        time.sleep(0.1)
    reading.clear()
    reader.join()
    os.close(master)                          # the hangup
    assert p.wait(timeout=120) == 129, b"".join(output).decode(errors="replace")[-2000:]
    trace = assert_clean_end(tmp_path / "run", outcome="stopped", error_type=None, ckpt=tmp_path / "ckpt")
    assert [e.get("resource") for e in trace.of("disposed") if e.get("outcome") != "ok"] == []
    saved, = trace.of("stop_save")
    assert saved.get("saved") is True and CheckpointStore(tmp_path / "ckpt").latest() is not None
    session = Path(trace.of("cluster_ready")[0].get("session_dir")).name
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and session in _cmdline(pid)]
    assert left == [], f"processes of Ray session {session} still running: {left}"


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_a_second_sigint_cuts_draining_short(ray_cluster, tiny_task, tmp_path):
    argv = [sys.executable, str(ROOT / "scripts" / "train.py"),
            *matrix_flags(tiny_task, tmp_path, "rollout:sigint"), "--ray-address", ray_cluster,
            "--num-rollout", "50"]
    p = subprocess.Popen(argv, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trace_path = tmp_path / "run" / "trace.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and '"stop_honoured"' not in (trace_path.read_text() if trace_path.exists() else ""):
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)          # the second one: cancel
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-2000:]
    trace = read_trace(tmp_path / "run")
    end = trace.events[-1]
    assert end.state == "shutdown" and end.get("outcome") in ("cancelled", "stopped")
    assert miles_actors(trace.of("cluster_ready")[0].get("namespace")) == []
    assert leftover_actor_processes(trace) == []


@pytest.mark.extended      # ~37 s on 2 quiet cores (85 s busy), 2 ranks starting: beyond CI's budget
def test_a_trainer_rank_killed_in_train_ends_the_run_and_leaves_no_rank(ray_cluster, tiny_task, tmp_path):
    # the torch trainer on 2 CPU ranks (FSDP2 over gloo); rank 1 dies as the step starts, rank 0 would
    # wait for it in the step's first collective: the step fails at once and teardown kills rank 0
    raised = run_in_process(tiny_task, tmp_path, ["train:kill_trainer_rank"], extra=["--actor-num-gpus-per-node", "2"])
    assert "ActorDiedError" in f"{type(raised).__name__} {raised}"
    trace = assert_clean_end(tmp_path / "run", outcome="failed", error_type="ActorDiedError", ckpt=tmp_path / "ckpt")
    assert_ranks_gone(trace, "trainer")


def assert_ranks_gone(trace, role: str) -> dict:
    """`role`'s two rank processes (the trace's `<role>_rank_pids`) ended, and its resource disposed
    at once (killed, not after a dispose timeout); returns the disposed events by resource."""
    ranks, = trace.of(f"{role}_rank_pids")
    pids = ranks.get("pids")
    assert sorted(pids) == [f"{role}-rank-0", f"{role}-rank-1"]
    deadline = time.monotonic() + 10          # ray.kill is asynchronous: give the raylet a moment
    while any(pid_running(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [n for n, p in pids.items() if pid_running(p)] == []
    disposed = {e.get("resource"): e for e in trace.of("disposed")}
    assert disposed[role].get("outcome") == "ok" and disposed[role].get("duration_s") < 10
    return disposed


@pytest.mark.extended      # 2 policy and 2 critic ranks starting: beyond CI's budget
def test_a_critic_rank_killed_in_train_ends_the_run_and_leaves_no_rank(ray_cluster, tiny_task, tmp_path):
    # PPO with the policy and the critic each on 2 CPU ranks (FSDP2 over gloo); critic rank 1 dies as
    # the train phase starts, whose first call is the critic's values: the call fails at once, and
    # teardown kills critic rank 0 and the policy's ranks
    ppo = ["--actor-num-gpus-per-node", "2", "--advantage-estimator", "ppo", "--critic-lr", "1e-2"]
    raised = run_in_process(tiny_task, tmp_path, ["train:kill_critic_rank"], extra=ppo)
    assert "ActorDiedError" in f"{type(raised).__name__} {raised}"
    trace = assert_clean_end(tmp_path / "run", outcome="failed", error_type="ActorDiedError", ckpt=tmp_path / "ckpt")
    assert trace.of("trainer_rank_pids") == [] and trace.of("fault_skipped") == []
    assert "trainer" in assert_ranks_gone(trace, "critic")
