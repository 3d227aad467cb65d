"""The fault matrix of the async machine: every state crossed with every fault, on real parts.

The sync matrix's cases and expectations (tests/faults/test_fault_matrix.py), on machines/async.yaml
with --use-tis, plus what async adds: every span of work in flight (the rollout generating ahead,
each eval) ends in the trace before the executor is torn down, cancelled or finished but never
left open; a killed engine is restarted once, whichever of the phases or the work in flight meets
it first.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.checkpoint.store import CheckpointStore
from miles.cli_args import parse_flags
from miles.launch import train
from miles.runtime import load_machine, read_trace, teardown_errors, with_disposer
from miles.tracetools.check import check_trace
from tests.conftest import miles_actors
from tests.faults.test_fault_matrix import EXPECTED, STATES, leftover_actor_processes, matrix_flags

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SPANS = {"prefetch_start": "prefetch_end", "eval_start": "eval_end"}


def async_flags(task, tmp_path, fault):
    # the sync matrix's run (2 rollouts, save and eval after each), one step off-policy
    return [*matrix_flags(task, tmp_path, fault), "--use-tis"]


def assert_clean_end(run_dir: Path, *, outcome: str, error_type: str | None, ckpt: Path):
    trace = read_trace(run_dir)
    end = trace.events[-1]
    assert end.event == "run_end" and end.state == "shutdown", end
    assert end.get("outcome") == outcome, (end.get("outcome"), end.error)
    if error_type:
        assert error_type in end.error["type"] or error_type in end.error["message"], end.error
    report = check_trace(trace, load_machine("async"))
    assert report.ok, [v.message for v in report.violations]
    registered = [e.get("position") for e in trace.of("registered")]
    assert [e.get("position") for e in trace.of("disposed")] == sorted(registered, reverse=True)
    executor_gone = next((e.seq for e in trace.of("disposed") if e.get("resource") == "rollout-executor"), None)
    for start in trace.of(*SPANS):
        ends = [e for e in trace.of(SPANS[start.event]) if e.cause == start.seq]
        assert len(ends) == 1, f"{start.event} seq {start.seq} has {len(ends)} ends"
        assert executor_gone is None or ends[0].seq < executor_gone, (start.event, start.rollout_id)
    cluster = trace.of("cluster_ready")
    if cluster:
        assert miles_actors(cluster[0].get("namespace")) == []
    if trace.of("components_ready"):
        assert leftover_actor_processes(trace) == []
    latest = CheckpointStore(ckpt).latest()
    if latest is not None:
        from transformers import AutoModelForCausalLM
        AutoModelForCausalLM.from_pretrained(latest[1] / "hf")
    return trace


@pytest.mark.parametrize("fault", list(EXPECTED))
@pytest.mark.parametrize("state", STATES)
def test_fault_in_process(ray_cluster, tiny_task, tmp_path, state, fault):
    outcome, error_type = EXPECTED[fault]
    if fault == "kill_trainer" and state == "draining":
        outcome, error_type = "ok", None              # nothing uses the trainer after draining starts
    cfg, _ = parse_flags(async_flags(tiny_task, tmp_path, f"{state}:{fault}"))
    raised = None
    try:
        asyncio.run(with_disposer(train, cfg, machine="async"))
    except BaseException as exc:  # noqa: BLE001
        raised = exc
    trace = assert_clean_end(tmp_path / "run", outcome=outcome, error_type=error_type, ckpt=tmp_path / "ckpt")
    assert trace.of("fault_injected")[0].get("state") == state
    if outcome == "ok":
        assert raised is None
    else:
        assert error_type in type(raised).__name__ or error_type in str(raised)
    if fault == "raise":
        assert trace.of("error")[0].state == state
    if fault == "kill_engine":
        # in draining only the final eval can meet the dead engine, if it had not finished yet
        assert len(trace.of("engine_restart")) in ((0, 1) if state == "draining" else (1,))
    if fault == "teardown_raise" and state != "draining":
        assert raised is not None and teardown_errors(raised) == []


@pytest.mark.parametrize("state", STATES)
def test_sigint_drains_cancels_the_rollout_ahead_and_exits_130(ray_cluster, tiny_task, tmp_path, state):
    argv = [sys.executable, str(ROOT / "scripts" / "train_async.py"),
            *async_flags(tiny_task, tmp_path, f"{state}:sigint"), "--ray-address", ray_cluster]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 130, proc.stderr[-2000:]
    trace = assert_clean_end(tmp_path / "run", outcome="stopped", error_type=None, ckpt=tmp_path / "ckpt")
    if state != "draining":
        stop = [t for t in trace.of("transition") if t.trigger == "stop"]
        assert [(t.src, t.dst) for t in stop] == [(state, "draining")]
    # stopped before the first rollout: nothing generated; in the first rollout phase: nothing asked
    # for ahead (the stop is already requested); later, rollout 1 was asked for (draining cancels it
    # if it is still generating)
    asked = [e.rollout_id for e in trace.of("prefetch_start")]
    assert asked == {"init": [], "weight_sync": [], "eval": [], "rollout": [0]}.get(state, [0, 1]), asked
