"""The runner: owns the lifecycle loop of one run.

It awaits the current state's phase handler, then fires the trigger the phase returned on a plain
`transitions.Machine`; the guards pick the destination. Phase work never runs inside a `transitions`
callback (AsyncMachine 0.9.3 swallows CancelledError, pytransitions #704, and gathers callbacks
concurrently): the library is the authority on legal moves and nothing else.

Every way out ends the same: an exception (or cancellation, or KeyboardInterrupt) in a phase fires
`fail` → `draining` → `shutdown`; a stop request fires `stop` → `draining` once the current phase
ends; an error while draining fires `fail` → `shutdown`. Entering `shutdown` unwinds the disposer.
The first failure is what `run()` raises; teardown errors are attached to it. A trace that could not
be written (a full disk) fails the run at the end of the phase it broke in; one that broke while
draining or during the teardown, when the run's work is done, leaves the outcome to what the run did
(the tracer says what was lost).

The runner names no state: where `fail` and `stop` lead, and whether a trigger is legal at all, are
the machine's (`transitions` answers `get_triggers`); the final state ends the loop. Each guard is
called once per decision: the machine decides on those values and the `transition` event records them.

Nothing waits forever. Each phase runs as a task with its state's deadline (`deadlines`, from the
machine YAML and --phase-timeout): past it the task is cancelled (abandoned if it ignores the cancel
for CANCEL_GRACE_S: a shielded await, a thread it waits on) and PhaseTimeout takes the fail route. A
stop request bounds the rest of the run by `stop_timeout_s` from the moment the runner sees it: the
running phase gets PHASE_SHARE of it (then it is cut and `stop` fires), draining until DRAIN_SHARE,
the teardown until TEARDOWN_SHARE; the rest is the process's exit. A phase cut by its own deadline
bounds the rest of the run the same way, by AFTER_DEADLINE_S (or the stop timeout, if shorter): what
the cut phase left hung (an actor blocked in a call, a thread) is forced by then, not waited on for
each resource's whole --teardown-timeout. `ctx.deadline` tells the running phase when it will be cut
(draining budgets a stop's save by it).

Nothing waits in silence either: a phase still running HEARTBEAT_S after its start (and every
HEARTBEAT_S after that) gets a `phase_waiting` event: how long it has run, when its deadline cuts
it, and what `ctx.waiting_for()` says it waits on (a training run's context asks the rollout
executor how many samples are done and which calls still run). The question gets ASK_S to answer;
an unanswered one is said (`unanswered`), and never delays the phase or its cut.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from .disposer import Disposer, merge_teardown_errors
from .machine import FAIL, STOP, MachineDef
from .trace import Tracer

DEFAULT_STOP_TIMEOUT_S = 20.0  # a cluster's preemption grace is ~30 s, then SIGKILL
PHASE_SHARE = 0.25             # of the stop timeout: the phase running when the stop came may finish
DRAIN_SHARE = 0.7              # draining (with a stop's save) is cut by then
TEARDOWN_SHARE = 0.9           # the teardown's deadline; the rest is the process's exit
CANCEL_GRACE_S = 1.0           # a cancelled phase gets this long to unwind before it is abandoned
AFTER_DEADLINE_S = 8.0         # a phase past its deadline: draining and the teardown end within this
HEARTBEAT_S = 30.0             # a running phase says what it waits on this often (a progress line each time)
ASK_S = 5.0                    # how long the heartbeat waits for `waiting_for()`'s answer


class StopRequest(asyncio.Event):
    """The run's stop event, which also says who asked (`why`: the signal's name, "the host (Run.stop)"),
    for the `stop_requested` event; the first asker is kept. A plain asyncio.Event works as well."""

    why: str | None = None

    def request(self, why: str) -> None:
        if self.why is None:
            self.why = why
        self.set()


class PhaseContext:
    """What every phase handler receives. Training contexts subclass it and add guards."""

    def __init__(self, *, tracer: Tracer, disposer: Disposer):
        self.tracer = tracer
        self.disposer = disposer
        self.failure: BaseException | None = None   # set by the runner before `draining` runs
        self.state: str | None = None
        self.rollout_id: int | None = None
        self.stop_requested: asyncio.Event = StopRequest()
        self.deadline: float | None = None          # time.monotonic() at which the running phase is cut

    def rollout_of(self, state: str) -> int | None:
        """The rollout the phase of `state` works on, for its `phase_start` (a training context knows
        that a rollout phase makes the next one)."""
        return self.rollout_id

    async def waiting_for(self) -> dict[str, Any]:
        """What the running phase waits on, for its `phase_waiting` heartbeat (a training context asks
        its components); plain JSON values."""
        return {}


class _Model:
    """The object `transitions` hangs its state and trigger methods on."""

    state: str


class Runner:
    def __init__(self, definition: MachineDef, context: PhaseContext,
                 handlers: dict[str, Callable[..., Any]] | None = None, *,
                 deadlines: dict[str, float] | None = None, stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
                 heartbeat_s: float = HEARTBEAT_S):
        self.definition = definition
        self.ctx = context
        self.handlers = handlers if handlers is not None else definition.resolve_phases()
        self.deadlines = definition.deadlines() if deadlines is None else {**definition.deadlines(), **deadlines}
        self.stop_timeout_s = stop_timeout_s
        self.heartbeat_s = heartbeat_s
        self._stop_at: float | None = None          # when the rest of the run became bounded: a stop, a deadline
        self._deadline_bound_s: float | None = None  # ... by how long, when a deadline did it (else the stop timeout)
        self._model = _Model()
        definition.check_guards(context)           # every guard exists before any phase runs
        self._decided: dict[str, bool] = {}         # the guards' values for the move being made
        self._machine = definition.build(self._model, self._decided_guard)
        self.failure: BaseException | None = None
        self.history: list[tuple[str, str, str]] = []   # (src, trigger, dst)
        self._trace_broke = False                   # the trace's write error was raised (once) as the run's

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
        start = self.tracer.emit("phase_start", state=state, rollout_id=self.ctx.rollout_of(state),
                                 deadline_s=self.deadlines[state])
        trigger = await self._run_phase(state, handler, start)
        if trigger is not None and not isinstance(trigger, str):
            raise TypeError(f"phase {state!r} returned {trigger!r}; a phase returns the trigger name to fire")
        end = self.tracer.emit("phase_end", state=state, rollout_id=self.ctx.rollout_id, trigger=trigger,
                               duration_s=round(time.monotonic() - t0, 6), cause=start,
                               cut="stop" if trigger is None else None)
        if self.tracer.write_error is not None and not self._trace_broke and state != self.definition.drain_state:
            self._trace_broke = True           # a run that goes on without its record fails; draining ends it anyway
            raise self.tracer.write_error
        # a stop is honoured where the machine has a stop route (not while draining: it would be moot)
        if self.ctx.stop_requested.is_set() and trigger != STOP and self._allows(state, STOP):
            self.tracer.emit("stop_honoured", state=state, ignored_trigger=trigger, cause=end)
            trigger = STOP
        self._fire(trigger, cause=end)

    async def _run_phase(self, state: str, handler: Callable[..., Any], start: int) -> str | None:
        """The phase's trigger, or None when a stop cut it; PhaseTimeout past its deadline."""
        began = time.monotonic()
        deadline = began + self.deadlines[state]
        self._note_stop(state, start)
        cut_at, why = self._cut(state, deadline)
        self.ctx.deadline = cut_at
        task = asyncio.ensure_future(handler(self.ctx))
        stop_seen = asyncio.ensure_future(self.ctx.stop_requested.wait())
        waiting = {task, stop_seen}
        beat_at, beats = began + self.heartbeat_s, set()
        try:
            while not task.done() and time.monotonic() < cut_at:
                await asyncio.wait(waiting, timeout=min(cut_at, beat_at) - time.monotonic(),
                                   return_when=asyncio.FIRST_COMPLETED)
                if stop_seen.done():            # a stop came: the phase's cut moves up
                    waiting.discard(stop_seen)
                    self._note_stop(state, start)
                    cut_at, why = self._cut(state, deadline)
                    self.ctx.deadline = cut_at
                if not task.done() and time.monotonic() >= beat_at:
                    beat_at += self.heartbeat_s
                    beats.add(asyncio.ensure_future(self._heartbeat(state, began, start)))
        except asyncio.CancelledError:          # the runner itself was cancelled (a second signal, a host)
            await _cancel(task)
            raise
        finally:
            stop_seen.cancel()
            for beat in beats:
                beat.cancel()
        if task.done():
            return task.result()
        return await self._cut_phase(state, task, why, deadline, start)

    async def _heartbeat(self, state: str, began: float, start: int) -> None:
        """A `phase_waiting` event: the phase's age, its cut, and what it waits on (if that answers)."""
        try:
            info = await asyncio.wait_for(self.ctx.waiting_for(), ASK_S)
        except asyncio.TimeoutError:
            info = {"unanswered": f"no answer within {ASK_S:g} s"}
        except Exception as exc:  # noqa: BLE001 - a heartbeat never fails the phase
            info = {"unanswered": f"{type(exc).__name__}: {exc}"}
        now = time.monotonic()
        cut_in = None if self.ctx.deadline is None else round(max(self.ctx.deadline - now, 0.0), 1)
        self.tracer.emit("phase_waiting", state=state, rollout_id=self.ctx.rollout_id,
                         running_s=round(now - began, 1), cut_in_s=cut_in, cause=start, **info)

    @property
    def _bound_s(self) -> float:
        return self.stop_timeout_s if self._deadline_bound_s is None else self._deadline_bound_s

    def _cut(self, state: str, deadline: float) -> tuple[float, str]:
        """When the running phase is cut, and why: its own deadline, or the stop's share of the budget."""
        if self._stop_at is None:
            return deadline, "deadline"
        share = DRAIN_SHARE if state == self.definition.drain_state else PHASE_SHARE
        stop_cut = self._stop_at + share * self._bound_s
        return (stop_cut, "stop") if stop_cut < deadline else (deadline, "deadline")

    def _note_stop(self, state: str, cause: int) -> None:
        if self._stop_at is None and self.ctx.stop_requested.is_set():
            self._stop_at = time.monotonic()
            self.tracer.emit("stop_requested", state=state, stop_timeout_s=self.stop_timeout_s, cause=cause,
                             why=getattr(self.ctx.stop_requested, "why", None),
                             phase_cut_s=PHASE_SHARE * self.stop_timeout_s,
                             draining_cut_s=DRAIN_SHARE * self.stop_timeout_s,
                             teardown_by_s=TEARDOWN_SHARE * self.stop_timeout_s)

    async def _cut_phase(self, state: str, task: asyncio.Future, why: str, deadline: float, start: int) -> None:
        """Cancel the phase; a stop's cut of a phase with a stop route returns None, the rest raise."""
        cut_at = time.monotonic()
        abandoned = await _cancel(task)
        timeout_s = round(time.monotonic() - (deadline - self.deadlines[state]), 6)
        seq = self.tracer.emit("phase_timeout", state=state, rollout_id=self.ctx.rollout_id, reason=why,
                               after_s=timeout_s, abandoned=abandoned, cause=start)
        if why == "deadline" and self._stop_at is None:     # the rest of the run is bounded, as after a stop
            self._stop_at, self._deadline_bound_s = cut_at, min(AFTER_DEADLINE_S, self.stop_timeout_s)
            self.tracer.emit("exit_bounded", state=state, reason="deadline", budget_s=self._bound_s, cause=seq,
                             draining_cut_s=DRAIN_SHARE * self._bound_s, teardown_by_s=TEARDOWN_SHARE * self._bound_s)
        if why == "stop" and self._allows(state, STOP):
            return None
        budget = (f"its {self.deadlines[state]:g} s deadline" if why == "deadline"
                  else f"the stop's budget ({DRAIN_SHARE:.0%} of --stop-timeout {self.stop_timeout_s:g} s)"
                  if self.ctx.stop_requested.is_set()
                  else f"the exit's budget after a phase deadline ({DRAIN_SHARE:.0%} of {self._bound_s:g} s)")
        raise PhaseTimeout(f"phase {state!r} ran past {budget} and was "
                           f"{'abandoned (it ignored the cancel)' if abandoned else 'cancelled'}")

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
        if self._stop_at is not None:           # the teardown fits in what the stop's (deadline's) budget leaves
            left = self._stop_at + TEARDOWN_SHARE * self._bound_s - time.monotonic()
            self.ctx.disposer.deadline = min(self.ctx.disposer.deadline, max(left, 0.0))
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


class PhaseTimeout(TimeoutError):
    """A phase ran past its deadline (or draining past a stop's budget) and was cancelled or abandoned."""


async def _cancel(task: asyncio.Future) -> bool:
    """Cancel `task` and give it CANCEL_GRACE_S to unwind; True if it is still running (abandoned:
    nothing awaits it any more, and its late outcome is retrieved so it is not reported)."""
    task.cancel()
    await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
    if not task.done():
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return True
    if not task.cancelled():
        task.exception()
    return False
