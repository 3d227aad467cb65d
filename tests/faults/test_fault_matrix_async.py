"""The fault matrix of the async machine, on the sync matrix's harness (test_fault_matrix.py), with
--use-tis, plus what async adds: every span of work in flight (the rollout generating ahead, each
eval) ends in the trace before the executor is torn down, cancelled or finished but never left open.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.config.flags import parse_flags
from miles.cli.train import run_with_signals
from tests.faults.test_fault_matrix import (EXPECTED, FATAL, FATAL_IN_CI, STATES, TEARDOWN_FAULTS, assert_clean_end,
                                           assert_failed_teardowns, matrix_flags, matrix_params, run_in_process,
                                           teardown_faults_flags)

pytestmark = [pytest.mark.ray, pytest.mark.slow]
# CI runs the async cases where a rollout can be generating ahead or an eval in flight (from the rollout
# phase on) and leaves the earlier states, whose path the sync matrix covers, to the extended run
ASYNC_STATES_IN_CI = ("rollout", "train", "save", "draining")
# SIGINT in CI: where a rollout is asked for ahead or cancelled (save's stop path is the sync matrix's save case)
ASYNC_SIGNAL_STATES_IN_CI = ("rollout", "train", "draining")
SPANS = {"prefetch_start": "prefetch_end", "eval_start": "eval_end"}
ASYNC = ["--use-tis"]


def assert_async_end(run_dir: Path, **kw):
    trace = assert_clean_end(run_dir, machine="async", **kw)
    executor_gone = next((e.seq for e in trace.of("disposed") if e.get("resource") == "rollout-executor"), None)
    for start in trace.of(*SPANS):
        ends = [e for e in trace.of(SPANS[start.event]) if e.cause == start.seq]
        assert len(ends) == 1, f"{start.event} seq {start.seq} has {len(ends)} ends"
        assert executor_gone is None or ends[0].seq < executor_gone, (start.event, start.rollout_id)
    return trace


@pytest.mark.parametrize("state,fault", matrix_params(FATAL, {s: k for s, k in FATAL_IN_CI.items()
                                                                if s in ASYNC_STATES_IN_CI}))
def test_fatal_fault_in_each_state(ray_cluster, tiny_task, tmp_path, state, fault):
    outcome, error_type = EXPECTED[fault]
    if fault == "kill_trainer" and state == "draining":
        outcome, error_type = "ok", None
    raised = run_in_process(tiny_task, tmp_path, [f"{state}:{fault}"], machine="async", extra=ASYNC)
    trace = assert_async_end(tmp_path / "run", outcome=outcome, error_type=error_type, ckpt=tmp_path / "ckpt")
    assert trace.of("fault_injected")[0].get("state") == state
    assert (raised is None) == (outcome == "ok")
    if fault == "raise":
        assert trace.of("error")[0].state == state


def test_engine_killed_in_every_state_is_restarted(ray_cluster, tiny_task, tmp_path):
    raised = run_in_process(tiny_task, tmp_path, [f"{s}:kill_engine" for s in STATES], machine="async",
                            extra=[*ASYNC, "--engine-max-restarts", "10"])
    assert raised is None, raised
    trace = assert_async_end(tmp_path / "run", outcome="ok", error_type=None, ckpt=tmp_path / "ckpt")
    assert [e.get("state") for e in trace.of("fault_injected")] == STATES
    assert len(trace.of("engine_restart")) >= 3


@pytest.mark.parametrize("faults", TEARDOWN_FAULTS)      # both kinds in one run in CI, as in the sync matrix
def test_teardowns_registered_in_every_state_that_fail(ray_cluster, tiny_task, tmp_path, faults):
    raised = run_in_process(tiny_task, tmp_path, teardown_faults_flags(faults), machine="async", extra=ASYNC)
    trace = assert_async_end(tmp_path / "run", outcome="failed", error_type="ExceptionGroup", ckpt=tmp_path / "ckpt")
    assert_failed_teardowns(raised, trace, faults)


# SIGTERM takes the same path as SIGINT (the sync matrix runs both in every state, half of it extended); here SIGINT
@pytest.mark.parametrize("sig", ["sigint"])
@pytest.mark.parametrize("state", [s if s in ASYNC_SIGNAL_STATES_IN_CI else pytest.param(s, marks=pytest.mark.extended)
                                   for s in STATES])
def test_signal_drains_cancels_the_rollout_ahead_and_exits(ray_cluster, tiny_task, tmp_path, state, sig):
    cfg, _ = parse_flags([*matrix_flags(tiny_task, tmp_path, f"{state}:{sig}"), *ASYNC])
    assert run_with_signals(cfg, "async", prog="miles train") == {"sigint": 130, "sigterm": 143}[sig]
    trace = assert_async_end(tmp_path / "run", outcome="stopped", error_type=None, ckpt=tmp_path / "ckpt")
    if state != "draining":
        stop = [t for t in trace.of("transition") if t.trigger == "stop"]
        assert [(t.src, t.dst) for t in stop] == [(state, "draining")]
    # stopped before the first rollout: nothing generated; in the first rollout phase: nothing asked
    # for ahead (the stop is already requested); later, rollout 1 was asked for (draining cancels it)
    asked = [e.rollout_id for e in trace.of("prefetch_start")]
    assert asked == {"init": [], "weight_sync": [], "eval": [], "rollout": [0]}.get(state, [0, 1]), asked
