"""Fault injection (`--inject-fault STATE:KIND[:VISIT]`): the fault matrix's lever, and a user's
way to rehearse a failure before it happens on a real cluster (miles: --ci-ft-test-actions).

A fault fires when STATE's phase starts on its VISIT-th visit (default 1); in `init` it fires when
the phase ends, since nothing exists to break before. Kinds:

    raise           the phase raises InjectedFault
    kill_engine     SIGKILL engine-0's worker process (the run restarts it, within its budget)
    kill_trainer    SIGKILL the trainer's worker process (unrecoverable: the run fails)
    sigint/sigterm  the driver sends itself the signal (the CLI drains, then exits 130/143)
    teardown_raise  register a teardown that raises
    teardown_hang   register a teardown that hangs past a 1 s timeout, with no force
    hang            the phase hangs (a stuck collective, say) until cancelled or killed
    hang_engine     SIGSTOP engine-0's worker process: alive but answering nothing (a hung engine);
                    the health probe or the generate timeout finds it, and the run restarts it
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from typing import Any, Callable

from miles.config import ConfigError
from miles.runtime.machine import STATES
from miles.runtime.procs import pid_running

FAULT_KINDS = ("raise", "kill_engine", "kill_trainer", "sigint", "sigterm", "teardown_raise", "teardown_hang",
               "hang", "hang_engine")


class InjectedFault(RuntimeError):
    """The failure --inject-fault asked for."""


@dataclass(frozen=True)
class FaultSpec:
    state: str
    kind: str
    visit: int = 1


def parse_fault(text: str) -> FaultSpec:
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[0] not in STATES or parts[1] not in FAULT_KINDS \
            or (len(parts) == 3 and not parts[2].isdigit()):
        raise ConfigError(f"--inject-fault {text}: expected STATE:KIND[:VISIT] with STATE one of "
                          f"{', '.join(STATES)} and KIND one of {', '.join(FAULT_KINDS)}")
    return FaultSpec(parts[0], parts[1], int(parts[2]) if len(parts) == 3 else 1)


def with_faults(handlers: dict[str, Callable[..., Any]], faults: list[FaultSpec]) -> dict[str, Callable[..., Any]]:
    """Wrap the handlers of the states that have faults; the others are left as they are."""
    out = dict(handlers)
    for state in {f.state for f in faults}:
        if state in out:
            out[state] = _wrap(out[state], [f for f in faults if f.state == state])
    return out


def _wrap(handler: Callable[..., Any], faults: list[FaultSpec]) -> Callable[..., Any]:
    visits = 0

    async def phase(ctx: Any) -> str:
        nonlocal visits
        visits += 1
        due = [f for f in faults if f.visit == visits]
        if ctx.state != "init":
            for f in due:
                await _fire(ctx, f)
        trigger = await handler(ctx)
        if ctx.state == "init":
            for f in due:
                await _fire(ctx, f)
        return trigger

    return phase


async def _fire(ctx: Any, f: FaultSpec) -> None:
    ctx.tracer.emit("fault_injected", state=f.state, kind=f.kind, visit=f.visit)
    if f.kind == "raise":
        raise InjectedFault(f"injected fault in {f.state} (visit {f.visit})")
    if f.kind in ("kill_engine", "kill_trainer"):
        actor = ctx.c.engines[0] if f.kind == "kill_engine" else ctx.c.trainer
        if actor.pid is None or not pid_running(actor.pid):
            ctx.tracer.emit("fault_skipped", state=f.state, kind=f.kind, reason="the actor is dead already")
            return
        os.kill(actor.pid, signal.SIGKILL)
        await asyncio.sleep(0.5)       # let Ray notice before the phase uses the actor
    elif f.kind == "hang_engine":
        engine = ctx.c.engines[0]
        if engine.pid is None or not pid_running(engine.pid):
            ctx.tracer.emit("fault_skipped", state=f.state, kind=f.kind, reason="the engine is dead already")
            return
        os.kill(engine.pid, signal.SIGSTOP)
    elif f.kind in ("sigint", "sigterm"):
        os.kill(os.getpid(), signal.SIGINT if f.kind == "sigint" else signal.SIGTERM)
        await asyncio.sleep(0.05)      # the loop runs the handler before the phase goes on
    elif f.kind == "teardown_raise":
        ctx.disposer.add(_raise_on_teardown, name="injected_teardown_raise")
    elif f.kind == "teardown_hang":
        ctx.disposer.add(_hang_on_teardown, name="injected_teardown_hang", timeout=1.0)
    elif f.kind == "hang":
        await asyncio.sleep(1e9)


def _raise_on_teardown() -> None:
    raise InjectedFault("injected teardown failure")


async def _hang_on_teardown() -> None:
    await asyncio.sleep(3600)
