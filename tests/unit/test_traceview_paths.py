"""Model-based: drive the runner along every simple path of every machine, then `trace check` it.

As xstate's path generation does for a statechart: enumerate the simple paths through the graph
(plus one path through each back edge), drive the real runner with scripted phases whose guards
answer so that the runner takes exactly that path, and check the resulting trace against the
definition. A fail step raises in the phase; the runner must then take the fail route itself.
"""

from __future__ import annotations

import asyncio
import functools

import pytest

from miles.runtime import Disposer, PhaseContext, Runner, Tracer, builtin_machines, load_machine, read_trace
from miles.runtime.machine import FAIL, MachineDef
from miles.traceview import build_timeline, check_trace, covering_paths, guard_values, simple_paths
from miles.traceview.paths import Step


class ScriptedFault(RuntimeError):
    pass


class ScriptedContext(PhaseContext):
    """Guards answer what the current step needs; every state registers a resource on first visit."""

    def __init__(self, definition: MachineDef, path: list[Step], *, tracer: Tracer, disposer: Disposer):
        super().__init__(tracer=tracer, disposer=disposer)
        self.path, self.i = path, 0
        self.answers: dict[str, bool] = {}
        self.disposed: list[str] = []
        for g in definition.guards:
            setattr(self, g, functools.partial(lambda name: self.answers[name], g))


async def scripted_phase(ctx: ScriptedContext) -> str:
    step = ctx.path[ctx.i]
    assert step.src == ctx.state, f"path expects {step.src}, runner is in {ctx.state}"
    ctx.i += 1
    ctx.answers = step.guards
    name = f"{ctx.state}-resource"
    if name not in [n for n in ctx.disposer.names]:
        ctx.disposer.add(functools.partial(ctx.disposed.append, name), name=name)
    if ctx.state == "rollout":
        ctx.rollout_id = (ctx.rollout_id or 0) + 1
    if step.trigger == FAIL:
        raise ScriptedFault(f"scripted failure in {ctx.state}")
    return step.trigger


def drive(definition: MachineDef, path: list[Step], trace_path) -> ScriptedContext:
    tracer = Tracer(trace_path, run_id="path", machine=definition.name, machine_hash=definition.hash)
    disposer = Disposer(tracer=tracer, default_timeout=2.0)
    ctx = ScriptedContext(definition, path, tracer=tracer, disposer=disposer)
    runner = Runner(definition, ctx, handlers={s: scripted_phase for s in definition.states
                                               if not definition.states[s].final})
    fails = any(s.trigger == FAIL for s in path)
    try:
        asyncio.run(runner.run())
    except ScriptedFault:
        assert fails
    else:
        assert not fails
    tracer.close()
    return ctx


CASES = [(m, i, p) for m in builtin_machines() for i, p in enumerate(covering_paths(load_machine(m)))]


@pytest.mark.parametrize("machine,i,path", CASES, ids=[f"{m}-{i}" for m, i, _ in CASES])
def test_every_path_runs_and_its_trace_conforms(tmp_path, machine, i, path):
    definition = load_machine(machine)
    ctx = drive(definition, path, tmp_path / "trace.jsonl")
    trace = read_trace(tmp_path / "trace.jsonl")
    assert [(t.src, t.trigger, t.dst) for t in trace.of("transition")] == [(s.src, s.trigger, s.dst) for s in path]
    report = check_trace(trace, definition)
    assert report.ok, [v.message for v in report.violations]
    registered = [e.get("resource") for e in trace.of("registered")]
    assert ctx.disposed == registered[::-1]
    timeline = build_timeline(trace)
    assert timeline.outcome == ("failed" if any(s.trigger == FAIL for s in path) else "ok")


def test_paths_cover_every_edge_of_every_machine():
    for m in builtin_machines():
        d = load_machine(m)
        taken = {(s.src, s.trigger, s.dst) for p in covering_paths(d) for s in p}
        assert taken == {(t.source, t.trigger, t.dest) for t in d.transitions}, m


def test_simple_paths_of_a_small_machine_by_hand():
    d = load_machine("eval_only")
    paths = [" ".join(f"{s.trigger}>{s.dst}" for s in p) for p in simple_paths(d)]
    # ways into draining: init -fail|stop- (2); init -ready- weight_sync -fail|stop- (2);
    # ... weight_sync -next- eval -next|fail|stop- (3): 7 ways in, times 2 out (finish|fail) = 14
    assert len(paths) == 14
    assert "ready>weight_sync next>eval next>draining finish>shutdown" in paths
    assert "fail>draining fail>shutdown" in paths
    assert all(len(set(p.split())) == len(p.split()) for p in paths)


def test_guard_values_pick_the_first_allowed_transition():
    d = load_machine("sync")
    # weight_sync -next-> eval [eval_due], rollout [rollouts_left], draining (else)
    assert guard_values(d, "weight_sync", "next", "eval") == {"eval_due": True, "rollouts_left": False}
    assert guard_values(d, "weight_sync", "next", "rollout") == {"eval_due": False, "rollouts_left": True}
    assert guard_values(d, "weight_sync", "next", "draining") == {"eval_due": False, "rollouts_left": False}
    assert guard_values(d, "weight_sync", "next", "save") is None
