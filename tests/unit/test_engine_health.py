"""Engine health without Ray: the embedded engine's heartbeat, health() beside a running call, abort()
and per-prompt caps; the health monitor's decisions on fake engines (hung, stalled, busy, dead)."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from types import SimpleNamespace

import pytest
import ray

from miles.config import RolloutConfig, TraceConfig
from miles.rollout.health import HealthMonitor
from miles.rollout.engines.embedded.engine import EmbeddedEngine
from miles.rollout.engines.fast.engine import FastEngine
from miles.rollout.engines.registry import ENGINES
from miles.rollout.protocol import SupportsHealth
from miles.runtime.machine import import_object
from miles.types import SamplingParams
from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="module", params=[EmbeddedEngine, FastEngine], ids=["embedded", "fast"])
def engine(request, tmp_path_factory):
    return request.param(make_tiny_model(tmp_path_factory.mktemp("m")), device="cpu", dtype="float32", seed=0)


def slow_steps(engine, monkeypatch, delay: float, stall: threading.Event | None = None):
    name = "_decode" if isinstance(engine, FastEngine) else "_forward"      # each engine's decode step
    step = getattr(engine, name)

    def slowed(*args, **kw):
        if stall is not None:
            stall.wait()            # a decode loop that stopped making progress
        time.sleep(delay)
        return step(*args, **kw)

    monkeypatch.setattr(engine, name, slowed)


def in_thread(fn, *args):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("value", fn(*args)), daemon=True)
    t.start()
    return t, out


def test_idle_engine_health_runs_a_one_token_generate(engine):
    assert engine.health() == {"busy": False, "since_progress_s": 0.0}


def test_health_reports_progress_of_a_running_call_and_abort_stops_it(engine, monkeypatch):
    slow_steps(engine, monkeypatch, delay=0.02)
    params = SamplingParams(temperature=1.0, max_new_tokens=200, seed=1)
    t, out = in_thread(engine.generate, [[5, 6], [7]], params)
    time.sleep(0.3)
    state = engine.health()                      # answered while the call holds the model
    assert state["busy"] and state["since_progress_s"] < 0.2
    t0 = time.monotonic()
    engine.abort()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - t0 < 1.0
    assert {g.finish_reason for g in out["value"]} <= {"abort", "stop"}
    assert any(g.finish_reason == "abort" and len(g.response_ids) < 200 for g in out["value"])
    # a call that starts after the abort is not aborted
    monkeypatch.undo()
    g = engine.generate([[5]], SamplingParams(temperature=1.0, max_new_tokens=3, seed=1))[0]
    assert g.finish_reason != "abort"


def test_a_stalled_call_shows_in_since_progress(engine, monkeypatch):
    stall = threading.Event()
    slow_steps(engine, monkeypatch, delay=0.0, stall=stall)
    t, _ = in_thread(engine.generate, [[5]], SamplingParams(max_new_tokens=4, seed=1))
    time.sleep(0.5)
    assert engine.health()["since_progress_s"] >= 0.4
    stall.set()
    t.join(5)


def test_per_prompt_caps(engine):
    never_stop = SamplingParams(temperature=1.0, max_new_tokens=9, seed=2)
    gens = engine.generate([[5], [6], [7]], never_stop, [1, 4, 2])
    assert [len(g.response_ids) <= c for g, c in zip(gens, [1, 4, 2])] == [True] * 3
    assert all(g.finish_reason in ("stop", "length") for g in gens)
    with pytest.raises(ValueError, match="cap >= 1"):
        engine.generate([[5]], never_stop, [0])


# --- the monitor ----------------------------------------------------------------------------------

class FakeTracer:
    def __init__(self):
        self.events = []

    def emit(self, event, **fields):
        self.events.append((event, fields))
        return len(self.events)


class Handle:
    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.health = SimpleNamespace(remote=self._health)

    async def _health(self):
        if self.behaviour == "hung":
            await asyncio.sleep(60)
        if self.behaviour == "dead":
            raise ray.exceptions.RayActorError()
        if self.behaviour == "broken":       # health() itself raised, inside the actor
            error = ray.exceptions.RayTaskError("health", "Traceback ...", RuntimeError("server gone"))
            raise error.as_instanceof_cause()
        return {"busy": self.behaviour != "idle", "since_progress_s": 5.0 if self.behaviour == "stalled" else 0.1}


class FakeEngine:
    def __init__(self, behaviour):
        self.handle, self.pid, self.forced = Handle(behaviour), 123, 0

    def force(self):
        self.forced += 1


def monitor(engines):
    ctx = SimpleNamespace(cfg=SimpleNamespace(rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1, health_check_timeout_s=0.3),
                                              trace=TraceConfig()),
                          c=SimpleNamespace(engines=engines), tracer=FakeTracer(),
                          disposer=SimpleNamespace(closed=False))
    return HealthMonitor(ctx), ctx


def test_monitor_kills_hung_and_stalled_engines_only():
    engines = [FakeEngine(b) for b in ("idle", "busy", "hung", "stalled", "dead")]
    m, ctx = monitor(engines)
    asyncio.run(m.probe_all())
    assert [e.forced for e in engines] == [0, 0, 1, 1, 0]
    events = [(name, f["engine"], f.get("reason", "")) for name, f in ctx.tracer.events]
    assert ("engine_unhealthy", 4, "dead") in events
    hung = next(r for n, i, r in events if n == "engine_unhealthy" and i == 2)
    stalled = next(r for n, i, r in events if n == "engine_unhealthy" and i == 3)
    assert "no answer to a health probe within --rollout-health-check-timeout 0.3s" in hung
    assert "no progress for 5.0s" in stalled
    assert [n for n, f in ctx.tracer.events if f["engine"] == 2] == ["engine_unhealthy", "engine_killed"]
    asyncio.run(m.probe_all())           # reported engines are not probed (nor killed) again
    assert [e.forced for e in engines] == [0, 0, 1, 1, 0] and len(ctx.tracer.events) == 5


def test_a_probe_that_raises_counts_as_hung_and_the_monitor_goes_on():
    engines = [FakeEngine("broken"), FakeEngine("idle"), FakeEngine("hung")]
    m, ctx = monitor(engines)
    asyncio.run(m.probe_all())           # before: the error ended the monitor's task, silently
    assert [e.forced for e in engines] == [1, 0, 1]
    [reason] = [f["reason"] for n, f in ctx.tracer.events if n == "engine_unhealthy" and f["engine"] == 0]
    assert reason == "the health probe failed: RuntimeError: server gone"


def test_only_engines_whose_spec_declares_health_are_probed_and_they_answer_beside_a_running_call():
    declared = {name for name, spec in ENGINES.items() if spec.supports(SupportsHealth)}
    assert declared == {"embedded", "fast", "sglang"}
    for name in declared:       # two actor threads (the engine guards its model), or an async actor's coroutine
        spec = ENGINES[name]
        health = import_object(spec.engine).health
        assert (spec.actor_threads or 1) >= 2 or inspect.iscoroutinefunction(health), name


def test_engines_going_in_the_runs_teardown_are_not_reported_or_killed():
    engines = [FakeEngine("broken"), FakeEngine("hung"), FakeEngine("dead")]    # disposed, being disposed
    m, ctx = monitor(engines)
    ctx.disposer.closed = True           # unwinding: a restarted engine is disposed before the monitor
    asyncio.run(m.probe_all())
    assert [e.forced for e in engines] == [0, 0, 0] and ctx.tracer.events == []
