"""The fault matrix of the async machine, on the sync matrix's harness (test_fault_matrix.py), with
--use-tis, plus what async adds: every span of work in flight (the rollout generating ahead, each
eval) ends in the trace before the executor is torn down, cancelled or finished but never left open.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.config.flags import parse_flags
from miles.cli.train import run_with_signals
from tests.faults.test_fault_matrix import (EXPECTED, FATAL, FATAL_IN_CI, STATES, STOP_SAVES, TEARDOWN_FAULTS,
                                           TEARDOWN_IN_CI, assert_clean_end, assert_failed_teardowns,
                                           assert_resume_trains_as_uninterrupted, at_visit, matrix_flags,
                                           matrix_params, resumes, run_in_process, teardown_faults_flags,
                                           uninterrupted)

pytestmark = [pytest.mark.ray, pytest.mark.slow]
# CI runs the fatal async cases where a rollout can be generating ahead or an eval in flight (from the
# rollout phase on) and leaves the earlier states, whose path the sync matrix covers, to the extended run
ASYNC_STATES_IN_CI = ("rollout", "train", "save", "draining")
# SIGINT in CI: where a rollout is asked for ahead or cancelled, and the states before the rollout phase
# (so that CI resumes the async machine from a stop in every state; save's stop path is the sync
# matrix's save case, draining's the fatal draining case here)
ASYNC_SIGNAL_STATES_IN_CI = ("init", "weight_sync", "eval", "rollout", "train")
# the way out per state whose resume CI runs (see the sync matrix's RESUME_IN_CI)
RESUME_IN_CI = {"init": "signal", "weight_sync": "signal", "eval": "signal", "rollout": "signal",
                "train": "fatal", "save": "fatal", "draining": None}
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


FATAL_IN_ASYNC_CI = {s: k for s, k in FATAL_IN_CI.items() if s in ASYNC_STATES_IN_CI}
SIGNAL_IN_ASYNC_CI = {s: "sigint" for s in ASYNC_SIGNAL_STATES_IN_CI}


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_task, tmp_path_factory):
    """The async machine's uninterrupted run, and CI's teardown case here (as in the sync matrix)."""
    root = tmp_path_factory.mktemp("uninterrupted-async")
    raised = run_in_process(tiny_task, root, teardown_faults_flags(TEARDOWN_IN_CI), machine="async", extra=ASYNC)
    return root, raised, uninterrupted(root / "run", root / "ckpt")


def assert_async_resume(tiny_task, tmp_path, reference, resume: bool) -> None:
    # the prompts, not the metrics: the first rollout after a resume is generated on the weights the
    # checkpoint holds, where the uninterrupted run generated it one step behind (off-policy)
    assert_resume_trains_as_uninterrupted(tiny_task, tmp_path, reference[2], resume=resume, machine="async",
                                          extra=ASYNC, same_metrics=False)


@pytest.mark.parametrize("state,fault", matrix_params(FATAL, FATAL_IN_ASYNC_CI))
def test_fatal_fault_in_each_state(ray_cluster, tiny_task, tmp_path, reference, state, fault):
    outcome, error_type = EXPECTED[fault]
    if fault == "kill_trainer" and state == "draining":
        outcome, error_type = "ok", None
    raised = run_in_process(tiny_task, tmp_path, [at_visit(state, fault)], machine="async", extra=ASYNC)
    trace = assert_async_end(tmp_path / "run", outcome=outcome, error_type=error_type, ckpt=tmp_path / "ckpt")
    assert trace.of("fault_injected")[0].get("state") == state
    assert (raised is None) == (outcome == "ok")
    if fault == "raise":
        assert trace.of("error")[0].state == state
    assert_async_resume(tiny_task, tmp_path, reference, resumes(state, "fatal", fault, FATAL_IN_ASYNC_CI, RESUME_IN_CI))


def test_engine_killed_in_every_state_is_restarted(ray_cluster, tiny_task, tmp_path):
    raised = run_in_process(tiny_task, tmp_path, [f"{s}:kill_engine" for s in STATES], machine="async",
                            extra=[*ASYNC, "--engine-max-restarts", "10"])
    assert raised is None, raised
    trace = assert_async_end(tmp_path / "run", outcome="ok", error_type=None, ckpt=tmp_path / "ckpt")
    assert [e.get("state") for e in trace.of("fault_injected")] == STATES
    assert len(trace.of("engine_restart")) >= 3


@pytest.mark.parametrize("faults", TEARDOWN_FAULTS)      # both kinds in one run in CI, as in the sync matrix
def test_teardowns_registered_in_every_state_that_fail(ray_cluster, tiny_task, tmp_path, request, faults):
    if faults == TEARDOWN_IN_CI:                      # the run the resumes are held to (`reference`)
        tmp_path, raised, _ = request.getfixturevalue("reference")
    else:
        raised = run_in_process(tiny_task, tmp_path, teardown_faults_flags(faults), machine="async", extra=ASYNC)
    trace = assert_async_end(tmp_path / "run", outcome="failed", error_type="ExceptionGroup", ckpt=tmp_path / "ckpt")
    assert_failed_teardowns(raised, trace, faults)


# SIGTERM takes the same path as SIGINT (the sync matrix runs both in every state, half of it extended); here SIGINT
@pytest.mark.parametrize("sig", ["sigint"])
@pytest.mark.parametrize("state", [s if s in ASYNC_SIGNAL_STATES_IN_CI else pytest.param(s, marks=pytest.mark.extended)
                                   for s in STATES])
def test_signal_drains_cancels_the_rollout_ahead_and_exits(ray_cluster, tiny_task, tmp_path, reference, state, sig):
    # no periodic save before the last rollout's, as in the sync matrix: the resume starts from the stop's save
    cfg, _ = parse_flags([*matrix_flags(tiny_task, tmp_path, at_visit(state, sig, stop=True)), *STOP_SAVES, *ASYNC])
    assert run_with_signals(cfg, "async", prog="miles train") == {"sigint": 130, "sigterm": 143}[sig]
    trace = assert_async_end(tmp_path / "run", outcome="stopped", error_type=None, ckpt=tmp_path / "ckpt")
    if state != "draining":
        stop = [t for t in trace.of("transition") if t.trigger == "stop"]
        assert [(t.src, t.dst) for t in stop] == [(state, "draining")]
    # stopped in init: nothing generated; later, rollouts 0 and 1 were asked for (stopped in train 0,
    # rollout 1 was generating ahead: draining cancels it). That a stop in a rollout phase asks for no
    # rollout ahead is tests/unit/test_data_position_on_stop.py's (here rollout 1 is the last)
    asked = [e.rollout_id for e in trace.of("prefetch_start")]
    assert asked == ([] if state == "init" else [0, 1]), asked
    assert_async_resume(tiny_task, tmp_path, reference, resumes(state, "signal", sig, SIGNAL_IN_ASYNC_CI, RESUME_IN_CI))
