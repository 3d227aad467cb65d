"""Bounded phases: each state's deadline (machine YAML, overridable), and the stop's budget
(`stop_timeout_s`) over the phase, draining and the teardown; with stub phases, no Ray."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from miles.runtime import MachineDefinitionError, PhaseTimeout, load_machine, parse_machine, read_trace
from miles.runtime.machine import DEFAULT_PHASE_TIMEOUT_S
from miles.runtime.runner import AFTER_DEADLINE_S, CANCEL_GRACE_S, DRAIN_SHARE, PHASE_SHARE, TEARDOWN_SHARE
from tests.stub_phases import make_stub_run, stub_phase

# this checkout's definition (an editable install elsewhere may serve `miles.machines`)
SYNC = Path(__file__).resolve().parents[2] / "machines" / "sync.yaml"


def stub(tmp_path, *, hang_in: str, how: str = "sleep", stop_in: str | None = None, stop_timeout_s: float = 2.0,
         deadlines: dict[str, float] | None = None):
    """A sync stub run whose `hang_in` phase hangs (`sleep`: cancellable; `stubborn`: ignores the first
    cancel), with a stop requested at the start of `stop_in`."""
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl", num_rollout=2, eval_interval=None,
                                save_interval=None)
    runner.deadlines.update(deadlines or {})
    runner.stop_timeout_s = stop_timeout_s
    seen: dict[str, float | None] = {}

    async def phase(c):
        seen[c.state] = c.deadline
        if c.state == stop_in:
            c.stop_requested.set()
        if c.state == hang_in:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if how != "stubborn":
                    raise
                await asyncio.sleep(3600)       # cleanup that never ends: the runner abandons it
        return await stub_phase(c)

    runner.handlers = {s: phase for s in runner.handlers}
    return runner, ctx, seen


def run_timed(runner) -> tuple[float, BaseException | None]:
    t0 = time.monotonic()
    try:
        asyncio.run(runner.run())
    except BaseException as exc:  # noqa: BLE001
        return time.monotonic() - t0, exc
    return time.monotonic() - t0, None


def test_a_phase_past_its_deadline_is_cancelled_traced_and_the_run_drains(tmp_path):
    runner, ctx, _ = stub(tmp_path, hang_in="rollout", deadlines={"rollout": 0.3})
    elapsed, raised = run_timed(runner)
    assert isinstance(raised, PhaseTimeout) and "'rollout' ran past its 0.3 s deadline" in str(raised)
    assert elapsed < 0.3 + CANCEL_GRACE_S
    trace = read_trace(tmp_path / "trace.jsonl")
    timeout = trace.of("phase_timeout")[0]
    assert (timeout.state, timeout.get("reason"), timeout.get("abandoned")) == ("rollout", "deadline", False)
    assert [(t.src, t.trigger, t.dst) for t in trace.of("transition")][-2:] == [
        ("rollout", "fail", "draining"), ("draining", "finish", "shutdown")]
    assert ctx.disposed == ["res2", "res1", "res0"] and trace.events[-1].get("outcome") == "failed"


def test_a_phase_that_ignores_the_cancel_is_abandoned_after_the_grace(tmp_path):
    runner, _, _ = stub(tmp_path, hang_in="train", how="stubborn", deadlines={"train": 0.2})
    elapsed, raised = run_timed(runner)
    assert isinstance(raised, PhaseTimeout) and "abandoned" in str(raised)
    assert elapsed < 0.2 + CANCEL_GRACE_S + 1.0
    assert read_trace(tmp_path / "trace.jsonl").of("phase_timeout")[0].get("abandoned") is True


def test_a_stop_cuts_a_hung_phase_at_its_share_of_the_budget_and_the_run_stops(tmp_path):
    runner, ctx, seen = stub(tmp_path, hang_in="rollout", stop_in="rollout", stop_timeout_s=2.0)
    elapsed, raised = run_timed(runner)
    assert raised is None and elapsed < 2.0
    trace = read_trace(tmp_path / "trace.jsonl")
    cut = trace.of("phase_timeout")[0]
    assert (cut.state, cut.get("reason")) == ("rollout", "stop")
    assert cut.get("after_s") == pytest.approx(PHASE_SHARE * 2.0, abs=0.3)
    assert [(t.src, t.trigger) for t in trace.of("transition")][-2:] == [("rollout", "stop"), ("draining", "finish")]
    assert trace.events[-1].get("outcome") == "stopped" and ctx.disposed == ["res2", "res1", "res0"]
    assert seen["draining"] is not None                     # draining knows its budget (a stop's save uses it)


def test_a_hung_draining_is_cut_by_the_stop_budget_and_the_teardown_still_runs(tmp_path):
    runner, ctx, _ = stub(tmp_path, hang_in="draining", stop_in="rollout", stop_timeout_s=2.0)
    elapsed, raised = run_timed(runner)
    assert isinstance(raised, PhaseTimeout) and "stop's budget" in str(raised)
    assert DRAIN_SHARE * 2.0 - 0.2 < elapsed < 2.0
    assert ctx.disposed == ["res2", "res1", "res0"]


def test_the_teardown_after_a_stop_fits_in_what_the_budget_leaves(tmp_path):
    runner, ctx, _ = stub(tmp_path, hang_in="", stop_in="rollout", stop_timeout_s=2.0)

    async def hung_teardown():
        await asyncio.sleep(3600)

    init = runner.handlers["init"]

    async def init_with_a_hung_resource(c):
        c.disposer.add(hung_teardown, name="hung", timeout=60)    # its own timeout is far past the budget
        return await init(c)

    runner.handlers["init"] = init_with_a_hung_resource
    elapsed, raised = run_timed(runner)
    assert type(raised).__name__ == "TeardownTimeout"
    assert elapsed < TEARDOWN_SHARE * 2.0 + 1.5              # the unwind's floor for the entries after it


@pytest.mark.parametrize("hang_after", ["teardown", "draining"])
def test_after_a_phase_deadline_the_rest_of_the_run_is_bounded_as_after_a_stop(tmp_path, hang_after):
    # the phase cut by its deadline left something hung: a resource whose teardown never returns (60 s
    # of its own, forced), or draining stuck settling it; both end within the bound, not after 60 s
    runner, ctx, _ = stub(tmp_path, hang_in="rollout", deadlines={"rollout": 0.3}, stop_timeout_s=20.0)
    init = runner.handlers["init"]
    forced: list[bool] = []

    async def hung_teardown():
        await asyncio.sleep(3600)

    async def init_with_a_hung_resource(c):
        c.disposer.add(hung_teardown, name="hung", timeout=60, force=lambda: forced.append(True))
        return await init(c)

    runner.handlers["init"] = init_with_a_hung_resource
    if hang_after == "draining":
        drain = runner.handlers["draining"]

        async def hung_draining(c):
            await asyncio.sleep(3600)
            return await drain(c)

        runner.handlers["draining"] = hung_draining
    elapsed, raised = run_timed(runner)
    assert isinstance(raised, PhaseTimeout) and "'rollout' ran past its 0.3 s deadline" in str(raised)
    assert elapsed < 0.3 + AFTER_DEADLINE_S
    assert forced == [True]
    trace = read_trace(tmp_path / "trace.jsonl")
    bound = trace.of("exit_bounded")[0]
    assert (bound.state, bound.get("reason"), bound.get("budget_s")) == ("rollout", "deadline", AFTER_DEADLINE_S)
    hung = next(e for e in trace.of("disposed") if e.get("resource") == "hung")
    assert hung.get("outcome") == "forced"
    if hang_after == "draining":
        cut = trace.of("phase_timeout")[1]
        assert (cut.state, cut.get("reason")) == ("draining", "stop")
        assert cut.get("after_s") == pytest.approx(DRAIN_SHARE * AFTER_DEADLINE_S, abs=0.5)
        assert "the exit's budget after a phase deadline" in " ".join(raised.__notes__)
    assert ctx.disposed == ["res2", "res1", "res0"] and trace.events[-1].get("outcome") == "failed"


def test_every_state_gets_its_yaml_timeout_and_flags_override_them():
    d = load_machine(SYNC)
    deadlines = d.deadlines({"rollout": 5.0})
    assert deadlines["rollout"] == 5.0 and deadlines["init"] == d.states["init"].timeout_s
    assert set(deadlines) == {s for s, x in d.states.items() if not x.final}
    text = d.text.replace('timeout: 600}', '}', 1)             # weight_sync without one
    assert parse_machine(text).deadlines()["weight_sync"] == DEFAULT_PHASE_TIMEOUT_S


@pytest.mark.parametrize("value", ["-1", "soon", "true"])
def test_a_bad_timeout_in_the_yaml_is_reported_with_its_line(value):
    text = load_machine(SYNC).text.replace("timeout: 3600", f"timeout: {value}", 1)
    with pytest.raises(MachineDefinitionError, match=r"line \d+: state '\w+': timeout .* must be a number"):
        parse_machine(text)


# ---- a phase that runs long says so: the `phase_waiting` heartbeat --------------------------------

def test_a_long_phase_beats_with_what_it_waits_on_and_an_unanswered_question_is_said(tmp_path, monkeypatch):
    """Every heartbeat_s a running phase gets a `phase_waiting` event with its age, its cut and the
    context's answer; a question that hangs is said, and delays neither the phase nor its cut."""
    runner, ctx, _ = stub(tmp_path, hang_in="rollout", deadlines={"rollout": 1.6})
    runner.heartbeat_s = 0.3
    asked = []

    async def waiting_for():
        asked.append(ctx.state)
        if len(asked) == 3:
            await asyncio.sleep(3600)            # the executor's event loop blocked: no answer
        return {"waiting_for": "the engines", "activities": [{"activity": "rollout 0", "samples": 8, "scored": 3}]}

    ctx.waiting_for = waiting_for
    monkeypatch.setattr("miles.runtime.runner.ASK_S", 0.2)
    elapsed, raised = run_timed(runner)
    assert isinstance(raised, PhaseTimeout)
    trace = read_trace(tmp_path / "trace.jsonl")
    beats = trace.of("phase_waiting")
    assert [b.state for b in beats] and {b.state for b in beats} == {"rollout"}   # only the long phase beat
    assert len(beats) >= 4 and all(0.0 <= b.get("cut_in_s") < 1.6 for b in beats)
    ages = [b.get("running_s") for b in beats]
    assert ages == sorted(ages) and ages[0] >= 0.3
    assert beats[0].get("activities") == [{"activity": "rollout 0", "samples": 8, "scored": 3}]
    assert any(b.get("unanswered") == "no answer within 0.2 s" for b in beats)
    cut = trace.of("phase_timeout")[0]
    assert all(b.seq < cut.seq for b in beats)          # no beat after the phase was cut
    assert 1.6 <= cut.get("after_s") < 1.6 + CANCEL_GRACE_S


def test_a_phase_shorter_than_the_heartbeat_never_beats(tmp_path):
    runner, _, _ = stub(tmp_path, hang_in="none")
    runner.heartbeat_s = 30.0
    assert run_timed(runner)[1] is None
    assert read_trace(tmp_path / "trace.jsonl").of("phase_waiting") == []
