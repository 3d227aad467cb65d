"""The disposer: one reverse-order teardown for everything a run creates.

The seed's contract: `asyncio.run(with_disposer(train, args))` calls `train(args, disposer=d)`, and a
driver registers each object where it creates it: `disposer.add(controller, executor)`. An object
with `dispose` is registered by that method, anything else must be callable; an async callable
(`functools.partial` of an async function included) is awaited, a plain one called. On the way out
every entry runs, in reverse registration order, even when some raise.

Beyond the seed:
- nothing is lost: with a primary failure, teardown errors are attached to it (notes and
  `teardown_errors(exc)`) and the primary propagates; without one, a single teardown error
  propagates as itself and several as an `ExceptionGroup` (contrast `AsyncExitStack`, CPython #102201);
- each entry has a timeout, then an optional `force` callable (graceful, then forced); the whole
  unwind has a deadline: an entry gets at most an equal share of the time left (one hung teardown
  cannot spend the others' time), and never less than a short floor, even past the deadline;
- plain callables run in a daemon thread so a hung one can be abandoned and the unwind goes on;
- every registration and teardown is a trace event (`registered`, `disposed`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

from .threads import in_daemon_thread

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_DEADLINE_S = 300.0
FORCE_TIMEOUT_S = 10.0
FLOOR_AFTER_DEADLINE_S = 0.5
CANCEL_GRACE_S = 1.0


class Emitter(Protocol):
    def emit(self, event: str, **fields: Any) -> int: ...


class DisposerClosedError(RuntimeError):
    """`add` was called while the disposer was unwinding or after it finished."""


class TeardownTimeout(TimeoutError):
    """A teardown did not finish within its time and had no `force`, or its `force` timed out too."""


@dataclass(frozen=True)
class _Entry:
    position: int
    name: str
    fn: Callable[[], Any]
    timeout: float
    force: Callable[[], Any] | None


@dataclass(frozen=True)
class TeardownOutcome:
    position: int
    name: str
    outcome: str            # ok | error | forced | timeout | force_failed
    duration_s: float
    error: BaseException | None = None


def teardown_errors(exc: BaseException) -> list[BaseException]:
    """The teardown errors a disposer attached to the failure that started its unwind."""
    return list(getattr(exc, "__miles_teardown_errors__", ()))


class Disposer:
    """Registers teardowns; unwinds them once, in reverse order. See the module docstring."""

    def __init__(
        self,
        *,
        tracer: Emitter | None = None,
        default_timeout: float = DEFAULT_TIMEOUT_S,
        deadline: float = DEFAULT_DEADLINE_S,
        force_timeout: float = FORCE_TIMEOUT_S,
    ):
        self._tracer = tracer
        self.default_timeout = default_timeout
        self.deadline = deadline
        self.force_timeout = force_timeout
        self._entries: list[_Entry] = []
        self._state = "open"        # open | unwinding | closed
        self.outcomes: list[TeardownOutcome] = []

    # -- registration ----------------------------------------------------------------------------
    def add(self, *objs: Any, name: str | None = None, timeout: float | None = None,
            force: Callable[[], Any] | None = None) -> None:
        """Register objects in order. `name`, `timeout` and `force` apply to each of them."""
        if self._state != "open":
            raise DisposerClosedError(
                f"disposer.add({', '.join(_describe(o) for o in objs)}) after the unwind started: "
                "register resources before the run ends")
        if name is not None and len(objs) != 1:
            raise TypeError("disposer.add(name=...) names one object; register several one by one")
        if force is not None and not callable(force):
            raise TypeError(f"disposer.add(force={force!r}): force must be callable")
        fns = [_teardown_of(o) for o in objs]          # validate all before registering any
        for obj, fn in zip(objs, fns):
            entry = _Entry(position=len(self._entries), name=name or _describe(obj), fn=fn,
                           timeout=self.default_timeout if timeout is None else timeout, force=force)
            self._entries.append(entry)
            self._emit("registered", position=entry.position, resource=entry.name,
                       timeout_s=entry.timeout, has_force=force is not None)

    def bind_tracer(self, tracer: Emitter) -> None:
        """Attach a tracer after creation; registrations made so far are written to it."""
        self._tracer = tracer
        for e in self._entries:
            self._emit("registered", position=e.position, resource=e.name, timeout_s=e.timeout,
                       has_force=e.force is not None)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self._entries]

    @property
    def closed(self) -> bool:
        return self._state != "open"

    # -- unwinding -------------------------------------------------------------------------------
    async def unwind(self) -> list[BaseException]:
        """Run every teardown in reverse order; return what they raised. Never raises itself."""
        if self._state != "open":
            return []
        self._state = "unwinding"
        start = time.monotonic()
        self._emit("unwind_start", resources=len(self._entries))
        errors: list[BaseException] = []
        entries = list(reversed(self._entries))
        for i, entry in enumerate(entries):
            remaining = self.deadline - (time.monotonic() - start)
            # at most its own timeout, and an equal share of what is left: one hung teardown cannot
            # spend the time of those after it (what an entry does not use rolls over to the rest)
            share = max(remaining / (len(entries) - i), FLOOR_AFTER_DEADLINE_S)
            outcome = await self._dispose_one(entry, min(entry.timeout, share), min(self.force_timeout, share))
            self.outcomes.append(outcome)
            if outcome.error is not None:
                errors.append(outcome.error)
        self._state = "closed"
        self._emit("unwind_end", duration_s=round(time.monotonic() - start, 6), errors=len(errors))
        return errors

    async def close(self, primary: BaseException | None = None) -> None:
        """Unwind; attach teardown errors to `primary`, or raise them when there is none."""
        errors = await self.unwind()
        outcome = merge_teardown_errors(primary, errors)
        if outcome is not None and outcome is not primary:
            raise outcome

    async def _dispose_one(self, entry: _Entry, budget: float, force_budget: float) -> TeardownOutcome:
        t0 = time.monotonic()
        error: BaseException | None = None
        try:
            finished = await _call_within(entry.fn, budget, entry.name)
            outcome = "ok" if finished else "timeout"
        except BaseException as exc:  # noqa: BLE001 - a teardown's failure must not stop the others
            outcome, error = "error", exc
        if outcome == "timeout":
            outcome, error = await self._escalate(entry, budget, force_budget)
        out = TeardownOutcome(entry.position, entry.name, outcome, time.monotonic() - t0, error)
        self._emit("disposed", position=entry.position, resource=entry.name, outcome=outcome,
                   duration_s=round(out.duration_s, 6), error=error)
        return out

    async def _escalate(self, entry: _Entry, budget: float, force_budget: float) -> tuple[str, BaseException | None]:
        if entry.force is None:
            return "timeout", TeardownTimeout(
                f"teardown of {entry.name} did not finish within {budget:.1f}s and has no force")
        try:
            if await _call_within(entry.force, force_budget, f"{entry.name}.force"):
                return "forced", None
            return "force_failed", TeardownTimeout(
                f"teardown of {entry.name} timed out after {budget:.1f}s, and so did its force "
                f"after {force_budget:.1f}s")
        except BaseException as exc:  # noqa: BLE001
            return "force_failed", exc

    def _emit(self, event: str, **fields: Any) -> None:
        if self._tracer is not None:
            self._tracer.emit(event, **fields)

    # -- context manager -------------------------------------------------------------------------
    async def __aenter__(self) -> "Disposer":
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        await self.close(exc)
        return False


def merge_teardown_errors(primary: BaseException | None, errors: list[BaseException]) -> BaseException | None:
    """What should propagate: the primary with the errors attached, else the errors themselves."""
    if primary is not None:
        if errors:
            attach_teardown_errors(primary, errors)
        return primary
    if not errors:
        return None
    if len(errors) == 1:
        return errors[0]
    if all(isinstance(e, Exception) for e in errors):
        return ExceptionGroup(f"{len(errors)} teardowns failed", errors)
    return BaseExceptionGroup(f"{len(errors)} teardowns failed", errors)


def attach_teardown_errors(primary: BaseException, errors: list[BaseException]) -> None:
    """Chain teardown errors onto the failure that started the unwind, without replacing it."""
    existing = getattr(primary, "__miles_teardown_errors__", [])
    primary.__miles_teardown_errors__ = [*existing, *errors]  # type: ignore[attr-defined]
    for e in errors:
        primary.add_note(f"while unwinding after this error, a teardown failed: {type(e).__name__}: {e}")


async def with_disposer(main: Callable[..., Awaitable[Any]], *args: Any, disposer: Disposer | None = None,
                        **kwargs: Any) -> Any:
    """Run `main(*args, disposer=d, **kwargs)` and unwind `d` on every way out."""
    d = disposer if disposer is not None else Disposer()
    async with d:
        return await main(*args, disposer=d, **kwargs)


# -- helpers ---------------------------------------------------------------------------------------


def _teardown_of(obj: Any) -> Callable[[], Any]:
    dispose = getattr(obj, "dispose", None)
    if dispose is not None:
        if not callable(dispose):
            raise TypeError(f"disposer.add: {_describe(obj)}.dispose is not callable")
        return dispose
    if callable(obj):
        return obj
    raise TypeError(
        f"disposer.add: {obj!r} has no dispose() and is not callable; register its close method "
        "or a functools.partial that tears it down")


def _describe(obj: Any) -> str:
    explicit = getattr(obj, "resource_name", None)
    if isinstance(explicit, str):
        return explicit
    if isinstance(obj, functools.partial):
        return f"partial({_describe(obj.func)})"
    if inspect.ismethod(obj):
        return f"{type(obj.__self__).__name__}.{obj.__name__}"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return obj.__qualname__
    return type(obj).__name__


def _is_async_callable(fn: Callable[[], Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


async def _call_within(fn: Callable[[], Any], budget: float, name: str) -> bool:
    """Call `fn` (awaiting it if async); True if it finished within `budget`, raise what it raised."""
    deadline = time.monotonic() + budget
    if _is_async_callable(fn):
        fut: asyncio.Future[Any] = asyncio.ensure_future(fn())
    else:
        fut = in_daemon_thread(fn, name=f"miles-dispose-{name}")   # a hung one cannot keep the process alive
    if not await _wait(fut, deadline - time.monotonic()):
        return False
    result = fut.result()
    if inspect.isawaitable(result):     # a plain callable that returned an awaitable (an ObjectRef)
        inner = asyncio.ensure_future(result)
        if not await _wait(inner, deadline - time.monotonic()):
            return False
        inner.result()
    return True


async def _wait(fut: asyncio.Future[Any], timeout: float) -> bool:
    done, _ = await asyncio.wait({fut}, timeout=max(timeout, 0.0))
    if done:
        return True
    fut.cancel()                          # a task that ignores cancellation is abandoned after a grace
    await asyncio.wait({fut}, timeout=CANCEL_GRACE_S)
    if fut.done() and not fut.cancelled():
        fut.exception()                   # mark retrieved: its late failure is the timeout's business
    return False
