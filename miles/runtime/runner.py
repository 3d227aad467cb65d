"""The runner: owns the lifecycle loop of one run.

It awaits the current state's phase handler, then fires the trigger the phase returned on a plain
`transitions.Machine`; the guards pick the destination. Phase work never runs inside a `transitions`
callback (AsyncMachine 0.9.3 swallows CancelledError, pytransitions #704, and gathers callbacks
concurrently): the library is the authority on legal moves and nothing else.

Every way out ends the same: an exception (or cancellation, or KeyboardInterrupt) in a phase fires
`fail` → `draining` → `shutdown`; a stop request fires `stop` → `draining` once the current phase
ends; an error while draining fires `fail` → `shutdown`. Entering `shutdown` unwinds the disposer.
The first failure is what `run()` raises; teardown errors are attached to it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from transitions import MachineError

from .disposer import Disposer, merge_teardown_errors
from .machine import FAIL, STOP, MachineDef
from .trace import Tracer


class PhaseContext:
    """What every phase handler receives. Training contexts subclass it and add guards."""

    def __init__(self, *, tracer: Tracer, disposer: Disposer):
        self.tracer = tracer
        self.disposer = disposer
        self.failure: BaseException | None = None   # set by the runner before `draining` runs
        self.state: str | None = None
        self.rollout_id: int | None = None
        self.stop_requested = asyncio.Event()


class _Model:
    """The object `transitions` hangs its state and trigger methods on."""

    state: str


class Runner:
    def __init__(self, definition: MachineDef, context: PhaseContext,
                 handlers: dict[str, Callable[..., Any]] | None = None):
        self.definition = definition
        self.ctx = context
        self.handlers = handlers if handlers is not None else definition.resolve_phases()
        self._model = _Model()
        definition.build(self._model, context)     # validates guards before any phase runs
        self.failure: BaseException | None = None
        self.history: list[tuple[str, str, str]] = []   # (src, trigger, dst)

    @property
    def state(self) -> str:
        return self._model.state

    @property
    def tracer(self) -> Tracer:
        return self.ctx.tracer

    async def run(self) -> str:
        """Drive the machine to its final state; re-raise the first failure after the teardown."""
        t0 = time.monotonic()
        self.tracer.emit("run_start", state=self.state, states=list(self.definition.states))
        while self.state not in self.definition.final_states:
            try:
                await self._step()
            except BaseException as exc:  # noqa: BLE001 - every failure takes the fail route
                self._on_failure(exc)
        await self._shutdown(t0)
        if self.failure is not None:
            raise self.failure
        return self.state

    async def _step(self) -> None:
        state = self.ctx.state = self.state
        handler = self.handlers[state]
        t0 = time.monotonic()
        start = self.tracer.emit("phase_start", state=state, rollout_id=self.ctx.rollout_id)
        trigger = await handler(self.ctx)
        if not isinstance(trigger, str):
            raise TypeError(f"phase {state!r} returned {trigger!r}; a phase returns the trigger name to fire")
        end = self.tracer.emit("phase_end", state=state, rollout_id=self.ctx.rollout_id, trigger=trigger,
                               duration_s=round(time.monotonic() - t0, 6), cause=start)
        if self.ctx.stop_requested.is_set() and state != "draining" and trigger != STOP:
            self.tracer.emit("stop_honoured", state=state, ignored_trigger=trigger, cause=end)
            trigger = STOP
        self._fire(trigger, cause=end)

    def _fire(self, trigger: str, *, cause: int | None) -> None:
        src = self.state
        guards = self._guard_values(src, trigger)
        try:
            moved = self._model.trigger(trigger)
        except (MachineError, AttributeError) as exc:
            raise IllegalTransition(f"trigger {trigger!r} is not allowed from state {src!r} in machine "
                                    f"{self.definition.name} ({self.definition.source})") from exc
        if not moved:
            raise IllegalTransition(f"trigger {trigger!r} from state {src!r}: no guard allowed any "
                                    f"destination ({self.definition.source})")
        self.history.append((src, trigger, self.state))
        self.tracer.emit("transition", src=src, dst=self.state, trigger=trigger,
                         rollout_id=self.ctx.rollout_id, cause=cause, guards=guards)

    def _guard_values(self, src: str, trigger: str) -> dict[str, bool] | None:
        """The guards deciding this move, as evaluated now (the trace checker replays them)."""
        names = {g for t in self.definition.transitions_from(src, trigger) for g in (*t.conditions, *t.unless)}
        return {g: bool(getattr(self.ctx, g)()) for g in sorted(names)} or None

    def _on_failure(self, exc: BaseException) -> None:
        state = self.state
        if self.failure is None:
            self.failure = exc
            self.ctx.failure = exc
        elif exc is not self.failure:
            self.failure.add_note(f"then, in state {state!r}: {type(exc).__name__}: {exc}")
        seq = self.tracer.emit("error", state=state, rollout_id=self.ctx.rollout_id, error=exc,
                               cancelled=isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)))
        try:
            self._fire(FAIL, cause=seq)
        except IllegalTransition as bad:  # a validated definition makes this unreachable
            self.tracer.emit("error", state=state, error=bad)
            self._model.state = "shutdown"

    async def _shutdown(self, t0: float) -> None:
        self.ctx.state = self.state
        errors = await self.ctx.disposer.unwind()
        self.failure = merge_teardown_errors(self.failure, errors)
        if self.failure is None:
            outcome = "stopped" if self.ctx.stop_requested.is_set() else "ok"
        else:
            outcome = "cancelled" if isinstance(self.failure, (asyncio.CancelledError, KeyboardInterrupt)) else "failed"
        self.tracer.emit("run_end", state=self.state, outcome=outcome,
                         duration_s=round(time.monotonic() - t0, 6),
                         error=self.failure if self.failure is not None else None)


class IllegalTransition(RuntimeError):
    """A phase returned a trigger the machine does not allow from the current state."""
