"""The runner on stub phases: normal path, a fault in every state, cancellation, interrupts, stop."""

from __future__ import annotations

import asyncio

import pytest

from miles.runtime import IllegalTransition, read_trace, teardown_errors
from tests.stub_phases import InjectedFault, make_stub_run

SYNC_STATES = ["init", "weight_sync", "eval", "rollout", "train", "save", "draining"]


def states_visited(trace):
    return [e.state for e in trace.of("phase_start")]


def test_normal_path_visits_states_in_order_and_unwinds(tmp_path):
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl", num_rollout=3)
    assert asyncio.run(runner.run()) == "shutdown"
    trace = read_trace(tmp_path)
    assert states_visited(trace) == [
        "init", "weight_sync", "eval",
        "rollout", "train", "weight_sync",
        "rollout", "train", "save", "weight_sync", "eval",
        "rollout", "train", "save", "weight_sync", "eval",
        "draining",
    ]
    assert ctx.disposed == ["res2", "res1", "res0"]
    assert trace.events[-1].event == "run_end" and trace.events[-1].get("outcome") == "ok"
    last_transition = trace.of("transition")[-1]
    assert (last_transition.src, last_transition.dst, last_transition.trigger) == ("draining", "shutdown", "finish")


@pytest.mark.parametrize("state", SYNC_STATES)
def test_fault_in_each_state_drains_shuts_down_and_reports_where(tmp_path, state):
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl", fail_in=state)
    with pytest.raises(InjectedFault, match=f"injected in {state}"):
        asyncio.run(runner.run())
    trace = read_trace(tmp_path)
    err = trace.of("error")[0]
    assert err.state == state and err.error["type"] == "InjectedFault"
    fail = [t for t in trace.of("transition") if t.trigger == "fail"][0]
    assert fail.src == state and fail.dst == ("shutdown" if state == "draining" else "draining")
    assert fail.cause == err.seq
    assert trace.of("transition")[-1].dst == "shutdown"
    # init fails before registering anything; elsewhere all three resources go, in reverse
    assert ctx.disposed == ([] if state == "init" else ["res2", "res1", "res0"])
    assert [e.get("resource") for e in trace.of("disposed")] == ctx.disposed
    if state != "draining":
        assert isinstance(ctx.drained_after, InjectedFault)   # draining ran and saw the failure


def test_what_init_registered_before_failing_is_torn_down(tmp_path):
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl", fail_in="weight_sync")
    with pytest.raises(InjectedFault):
        asyncio.run(runner.run())
    assert ctx.disposed == ["res2", "res1", "res0"]


@pytest.mark.parametrize("state", ["rollout", "train", "draining"])
def test_cancellation_takes_the_fail_route_and_is_reraised(tmp_path, state):
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl", hang_in=state)

    async def host():
        task = asyncio.create_task(runner.run())
        while ctx.state != state:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(host())
    trace = read_trace(tmp_path)
    assert trace.of("error")[0].state == state and trace.of("error")[0].get("cancelled") is True
    assert trace.events[-1].get("outcome") == "cancelled"
    assert ctx.disposed == ["res2", "res1", "res0"]


def test_keyboard_interrupt_in_a_phase_unwinds_and_propagates(tmp_path):
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl")

    async def interrupt(c):
        raise KeyboardInterrupt

    runner.handlers["train"] = interrupt
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(runner.run())
    assert ctx.disposed == ["res2", "res1", "res0"]
    assert read_trace(tmp_path).events[-1].get("outcome") == "cancelled"


def test_stop_request_finishes_the_current_phase_then_drains(tmp_path):
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl", num_rollout=100)
    original = runner.handlers["rollout"]

    async def rollout_then_stop(c):
        c.stop_requested.set()
        return await original(c)

    runner.handlers["rollout"] = rollout_then_stop
    assert asyncio.run(runner.run()) == "shutdown"
    trace = read_trace(tmp_path)
    stop = [t for t in trace.of("transition") if t.trigger == "stop"]
    assert [(t.src, t.dst) for t in stop] == [("rollout", "draining")]
    assert trace.events[-1].get("outcome") == "stopped" and ctx.failure is None


def test_teardown_error_after_a_clean_run_is_raised_and_traced(tmp_path):
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl", num_rollout=1)

    def broken():
        raise OSError("could not release port")

    original = runner.handlers["init"]

    async def init(c):
        c.disposer.add(broken)
        return await original(c)

    runner.handlers["init"] = init
    with pytest.raises(OSError, match="release port"):
        asyncio.run(runner.run())
    assert read_trace(tmp_path).events[-1].get("outcome") == "failed"


def test_teardown_errors_are_attached_to_the_phase_failure(tmp_path):
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl", fail_in="train")
    original = runner.handlers["init"]

    async def init(c):
        c.disposer.add(lambda: (_ for _ in ()).throw(OSError("leaked port")), name="port")
        return await original(c)

    runner.handlers["init"] = init
    with pytest.raises(InjectedFault) as info:
        asyncio.run(runner.run())
    assert [str(e) for e in teardown_errors(info.value)] == ["leaked port"]


def test_a_phase_returning_an_illegal_trigger_fails_the_run(tmp_path):
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl")

    async def bad(c):
        return "ready"   # not a trigger of rollout

    runner.handlers["rollout"] = bad
    with pytest.raises(IllegalTransition, match="'ready' is not allowed from state 'rollout'"):
        asyncio.run(runner.run())
    assert ctx.disposed == ["res2", "res1", "res0"]


def test_eval_only_machine(tmp_path):
    runner, ctx = make_stub_run("eval_only", tmp_path / "trace.jsonl")
    asyncio.run(runner.run())
    assert states_visited(read_trace(tmp_path)) == ["init", "weight_sync", "eval", "draining"]


def test_each_guard_is_evaluated_once_per_decision_and_the_traced_value_decides(tmp_path):
    # save_due answers differently on every call (a sentinel file appearing between two reads): the
    # transition must follow the value the trace records, and read it once per decision
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl", num_rollout=4, eval_interval=None,
                                save_interval=None)
    calls: list[bool] = []

    def flapping_save_due() -> bool:
        calls.append(len(calls) % 2 == 0)
        return calls[-1]

    ctx.save_due = flapping_save_due
    asyncio.run(runner.run())
    trace = read_trace(tmp_path)
    decisions = [t for t in trace.of("transition") if t.src == "train"]
    assert len(calls) == len(decisions) == 4                   # once per move out of train, not twice
    for t, value in zip(decisions, calls):
        assert t.get("guards")["save_due"] is value
        assert (t.dst == "save") is value


def test_drain_and_terminal_states_come_from_the_definition():
    from miles.runtime import load_machine, parse_machine

    for name in ("sync", "async", "eval_only"):
        d = load_machine(name)
        assert (d.drain_state, d.terminal_state) == ("draining", "shutdown")
    assert parse_machine(TINY).drain_state == "draining"


TINY = """\
name: tiny
initial: init
states:
  init:     {phase: "tests.stub_phases:stub_phase"}
  draining: {phase: "tests.stub_phases:stub_phase"}
  shutdown: {final: true}
transitions:
  - {trigger: ready,  source: init,     dest: draining}
  - {trigger: finish, source: draining, dest: shutdown}
  - {trigger: fail,   source: draining, dest: shutdown}
  - {trigger: fail,   source: "*",      dest: draining}
  - {trigger: stop,   source: "*",      dest: draining}
"""


def test_a_stop_request_while_draining_is_not_honoured_since_draining_has_no_stop_route(tmp_path):
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl", num_rollout=1)
    original = runner.handlers["draining"]

    async def stop_then_drain(c):
        c.stop_requested.set()
        return await original(c)

    runner.handlers["draining"] = stop_then_drain
    assert asyncio.run(runner.run()) == "shutdown"
    trace = read_trace(tmp_path)
    assert not trace.of("stop_honoured") and trace.of("transition")[-1].trigger == "finish"
