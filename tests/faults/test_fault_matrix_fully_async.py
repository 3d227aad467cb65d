"""The fault matrix of the fully-async machine (machines/fully_async.yaml), on the sync matrix's harness
(test_fault_matrix.py): a fatal fault, a killed engine and a signal in each of its states. Beyond the
clean end every machine owes (ordered teardown, no actor left, a conforming trace), what fully async
adds: the producer is drained before the executor and the engines go, with no engine call left running,
and every group it drew is accounted for (trained, held by the checkpoint, redrawn from its position, or
counted as dropped); a resume from the case's checkpoint trains no group twice.

Whole runs: all of it is `extended` (CI's budget); tests/integration/test_fully_async.py holds the
SIGTERM + --load story.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles.checkpoint.checkpointer import read_data_position
from miles.checkpoint.store import CheckpointStore
from miles.cli.train import run_with_signals
from miles.config.flags import parse_flags
from miles.api.launch import train
from miles.runtime import read_trace, with_disposer
from tests.faults.test_fault_matrix import (EXPECTED, FATAL, STATES, STOP_SAVES, assert_clean_end, at_visit,
                                           matrix_flags, run_in_process)

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.extended]
MACHINE = "fully_async"
FA = ["--use-tis", "--fully-async", "--max-weight-staleness", "2"]


def assert_fully_async_end(run_dir: Path, **kw):
    trace = assert_clean_end(run_dir, machine=MACHINE, **kw)
    drained = trace.of("producer_drained")
    if trace.of("producer_start"):
        assert drained, "the producer started and was never drained"
        executor_gone = next(e.seq for e in trace.of("disposed") if e.get("resource") == "rollout-executor")
        assert drained[-1].seq < executor_gone
        submitted = {t for e in trace.of("producer_submit") for t in e.get("tickets")}
        returned = {t for e in trace.of("producer_groups", "producer_cut") for t in e.get("tickets")}
        in_flight = {t for e in drained for t in e.get("in_flight_tickets")}
        assert submitted <= returned | in_flight, submitted - returned - in_flight
        assert not [e for e in trace.of("producer_submit") if e.seq > drained[-1].seq]
    return trace


def trained_tickets(run_dir: Path) -> dict[int, list[int]]:
    return {e.rollout_id: e.get("tickets") for e in read_trace(run_dir).of("groups_taken")}


def assert_resume_trains_each_group_once(task, tmp_path: Path) -> None:
    """The case's newest checkpoint accounts for every ticket drawn by then; a run resumed from it trains
    the steps after it, no group of them trained before."""
    latest = CheckpointStore(tmp_path / "ckpt").latest()
    if latest is None:
        return
    rid, path = latest
    first = trained_tickets(tmp_path / "run")
    before = [t for r in sorted(first) if r <= rid for t in first[r]]
    state = read_data_position(path)["fully_async"]
    held = {g["ticket"] for g in state["buffer"]} | {t for t, _, _ in state["regenerate"]}
    dropped = {e.get("ticket") for e in read_trace(tmp_path / "run").of("group_dropped")}
    assert len(before) == len(set(before)) and not (set(before) & held)
    assert set(before) | held | dropped == set(range(state["next_ticket"]))
    cfg, _ = parse_flags([*matrix_flags(task, tmp_path, None, run="resumed"), "--load", str(tmp_path / "ckpt"), *FA])
    asyncio.run(with_disposer(train, cfg, machine=MACHINE))
    again = trained_tickets(tmp_path / "resumed")
    assert min(again, default=rid + 1) == rid + 1
    after = [t for r in sorted(again) for t in again[r]]
    assert not set(after) & set(before), "a group trained twice across the resume"
    assert_fully_async_end(tmp_path / "resumed", outcome="ok", error_type=None, ckpt=tmp_path / "ckpt")


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("fault", FATAL)
def test_fatal_fault_in_each_state(ray_cluster, tiny_task, tmp_path, state, fault):
    outcome, error_type = EXPECTED[fault]
    if fault == "kill_trainer" and state == "draining":
        outcome, error_type = "ok", None
    raised = run_in_process(tiny_task, tmp_path, [at_visit(state, fault)], machine=MACHINE, extra=FA)
    trace = assert_fully_async_end(tmp_path / "run", outcome=outcome, error_type=error_type, ckpt=tmp_path / "ckpt")
    assert trace.of("fault_injected")[0].get("state") == state
    assert (raised is None) == (outcome == "ok")
    assert_resume_trains_each_group_once(tiny_task, tmp_path)


def test_engine_killed_in_every_state_is_restarted(ray_cluster, tiny_task, tmp_path):
    raised = run_in_process(tiny_task, tmp_path, [f"{s}:kill_engine" for s in STATES], machine=MACHINE,
                            extra=[*FA, "--engine-max-restarts", "10", "--check-weight-update-equal"])
    assert raised is None, raised
    trace = assert_fully_async_end(tmp_path / "run", outcome="ok", error_type=None, ckpt=tmp_path / "ckpt")
    assert [e.get("state") for e in trace.of("fault_injected")] == STATES
    assert len(trace.of("engine_restart")) >= 3
    # the weight check across the restarts: a restarted engine loads the trainer's weights as they are, under
    # their own version, and its next swap's "before" checksum is compared with the trainer's of those (it
    # matches); every push compared its checksums
    assert trace.of("weights_pushed") and all(e.get("checksum") for e in trace.of("weights_pushed"))
    taken = [t for e in trace.of("groups_taken") for t in e.get("tickets")]
    assert len(taken) == len(set(taken))


@pytest.mark.parametrize("state", STATES)
def test_signal_drains_the_producer_and_exits(ray_cluster, tiny_task, tmp_path, state):
    cfg, _ = parse_flags([*matrix_flags(tiny_task, tmp_path, at_visit(state, "sigint", stop=True)), *STOP_SAVES, *FA])
    assert run_with_signals(cfg, MACHINE, prog="miles train") == 130
    trace = assert_fully_async_end(tmp_path / "run", outcome="stopped", error_type=None, ckpt=tmp_path / "ckpt")
    if state != "draining":
        stop = [t for t in trace.of("transition") if t.trigger == "stop"]
        assert [(t.src, t.dst) for t in stop] == [(state, "draining")]
    assert_resume_trains_each_group_once(tiny_task, tmp_path)
