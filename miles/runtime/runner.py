"""The runner: owns the lifecycle loop of one run.

It awaits the current state's phase handler, then fires the trigger the phase returned on a plain
`transitions.Machine`; the guards pick the destination. Phase work never runs inside a `transitions`
callback (AsyncMachine 0.9.3 swallows CancelledError, pytransitions #704, and gathers callbacks
concurrently): the library is the authority on legal moves and nothing else.

Every way out ends the same: an exception (or cancellation, or KeyboardInterrupt) in a phase fires
`fail` → `draining` → `shutdown`; a stop request fires `stop` → `draining` once the current phase
ends; an error while draining fires `fail` → `shutdown`. Entering `shutdown` unwinds the disposer.
The first failure is what `run()` raises; teardown errors are attached to it.

The runner names no state: where `fail` and `stop` lead, and whether a trigger is legal at all, are
the machine's (`transitions` answers `get_triggers`); the final state ends the loop. Each guard is
called once per decision: the machine decides on those values and the `transition` event records them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

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
        definition.check_guards(context)           # every guard exists before any phase runs
        self._decided: dict[str, bool] = {}         # the guards' values for the move being made
        self._machine = definition.build(self._model, self._decided_guard)
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
        # a stop is honoured where the machine has a stop route (not while draining: it would be moot)
        if self.ctx.stop_requested.is_set() and trigger != STOP and self._allows(state, STOP):
            self.tracer.emit("stop_honoured", state=state, ignored_trigger=trigger, cause=end)
            trigger = STOP
        self._fire(trigger, cause=end)

    def _fire(self, trigger: str, *, cause: int | None) -> None:
        src = self.state
        if not self._allows(src, trigger):
            raise IllegalTransition(f"trigger {trigger!r} is not allowed from state {src!r} in machine "
                                    f"{self.definition.name} ({self.definition.source})")
        self._decided = self._evaluate_guards(src, trigger)
        moved = self._model.trigger(trigger)
        if not moved:
            raise IllegalTransition(f"trigger {trigger!r} from state {src!r}: no guard allowed any "
                                    f"destination ({self.definition.source})")
        self.history.append((src, trigger, self.state))
        self.tracer.emit("transition", src=src, dst=self.state, trigger=trigger,
                         rollout_id=self.ctx.rollout_id, cause=cause, guards=self._decided or None)

    def _allows(self, state: str, trigger: str) -> bool:
        """Whether the machine has `trigger` from `state` at all (its guards decide where it leads)."""
        return trigger in self._machine.get_triggers(state)

    def _evaluate_guards(self, src: str, trigger: str) -> dict[str, bool]:
        """Each guard deciding this move, called once: the machine decides on these values and the
        trace records them (a guard that reads the filesystem is not read twice)."""
        names = {g for t in self.definition.transitions_from(src, trigger) for g in (*t.conditions, *t.unless)}
        return {g: bool(getattr(self.ctx, g)()) for g in sorted(names)}

    def _decided_guard(self, name: str) -> Callable[[], bool]:
        return lambda: self._decided[name]

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
            self._model.state = self.definition.terminal_state

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
