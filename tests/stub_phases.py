"""Stub phases: drive any machine definition without ML, counting what each phase does.

The stub context keeps the same counters the training context does (rollout id, evaluated weight
version, saves) so the shipped guards make the same decisions; a fault can be injected in any state.
"""

from __future__ import annotations

import asyncio
from typing import Any

from miles.runtime import Disposer, PhaseContext, Runner, Tracer, load_machine

TRIGGERS = {"init": "ready", "draining": "finish"}


class InjectedFault(RuntimeError):
    pass


class StubContext(PhaseContext):
    def __init__(self, *, tracer: Tracer, disposer: Disposer, num_rollout: int = 3,
                 eval_interval: int | None = 2, save_interval: int | None = 2,
                 fail_in: str | None = None, fail_visit: int = 1, hang_in: str | None = None,
                 resources: int = 3):
        super().__init__(tracer=tracer, disposer=disposer)
        self.num_rollout, self.eval_interval, self.save_interval = num_rollout, eval_interval, save_interval
        self.fail_in, self.fail_visit, self.hang_in = fail_in, fail_visit, hang_in
        self.resources = resources
        self.next_rollout = 0          # the rollout the next `rollout` phase produces
        self.weight_version = -1
        self.evaluated_version: int | None = None
        self.visits: dict[str, int] = {}
        self.disposed: list[str] = []
        self.drained_after: BaseException | None = None

    # guards (the same names and meaning as the training context's)
    def rollouts_left(self) -> bool:
        return self.next_rollout < self.num_rollout

    def eval_due(self) -> bool:
        if self.eval_interval is None or self.evaluated_version == self.weight_version:
            return False
        done = self.next_rollout
        return done == 0 or done % self.eval_interval == 0 or done == self.num_rollout

    def save_due(self) -> bool:
        done = self.next_rollout
        return self.save_interval is not None and (done % self.save_interval == 0 or done == self.num_rollout)


async def stub_phase(ctx: StubContext) -> str:
    state = ctx.state
    ctx.visits[state] = ctx.visits.get(state, 0) + 1
    if state == ctx.fail_in and ctx.visits[state] == ctx.fail_visit:
        raise InjectedFault(f"injected in {state}")
    if state == ctx.hang_in:
        await asyncio.sleep(3600)
    await asyncio.sleep(0)
    if state == "init":
        for i in range(ctx.resources):
            ctx.disposer.add(_Resource(f"res{i}", ctx.disposed))
    elif state == "weight_sync":
        ctx.weight_version += 1
    elif state == "eval":
        ctx.evaluated_version = ctx.weight_version
    elif state == "rollout":
        ctx.rollout_id = ctx.next_rollout
    elif state == "train":
        ctx.next_rollout += 1
    elif state == "draining":
        ctx.drained_after = ctx.failure
    return TRIGGERS.get(state, "next")


class _Resource:
    def __init__(self, name: str, log: list[str]):
        self.resource_name, self._log = name, log

    async def dispose(self) -> None:
        self._log.append(self.resource_name)


def make_stub_run(machine: str, trace_path, **kw: Any) -> tuple[Runner, StubContext]:
    definition = load_machine(machine)
    tracer = Tracer(trace_path, run_id="stub", machine=definition.name, machine_hash=definition.hash)
    disposer = Disposer(tracer=tracer, default_timeout=2.0)
    ctx = StubContext(tracer=tracer, disposer=disposer, **kw)
    handlers = {s: stub_phase for s, d in definition.states.items() if not d.final}
    return Runner(definition, ctx, handlers=handlers), ctx
