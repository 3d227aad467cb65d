"""Programmatic runs: `miles.Run` for hosts that start, watch and stop trainings in-process.

    async with miles.Run(cfg, machine="sync") as run:
        async for event in run.events():
            if isinstance(event, miles.Transition) and event.dst == "save":
                ...
        print(run.result)

A Run installs no signal handlers, never exits the process, and never shuts down a Ray cluster it
did not start (start Ray in the host, `ray.init()`, to share one cluster between concurrent runs).
Cancelling the task that awaits `run.wait()` tears the run down, then re-raises.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from miles.config import RunConfig
from miles.runtime import Disposer, StopRequest


# -- typed event records ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RunEvent:
    seq: int
    event: str
    data: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Transition(RunEvent):
    src: str = ""
    dst: str = ""
    trigger: str = ""
    rollout_id: int | None = None


@dataclass(frozen=True)
class Metrics(RunEvent):
    step: int = 0
    values: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Teardown(RunEvent):
    resource: str = ""
    outcome: str = ""
    duration_s: float = 0.0


@dataclass(frozen=True)
class RunEnded(RunEvent):
    outcome: str = ""
    error: dict[str, Any] | None = None


def to_record(ev: dict[str, Any]) -> RunEvent:
    seq, kind = ev.get("seq", 0), ev["event"]
    if kind == "transition":
        return Transition(seq, kind, ev, ev.get("src", ""), ev.get("dst", ""), ev.get("trigger", ""), ev.get("rollout_id"))
    if kind == "metrics":
        values = {k: v for k, v in ev.items() if k not in ("seq", "event", "ts", "mono", "run_id", "rollout_id")}
        return Metrics(seq, kind, ev, ev.get("rollout_id", 0), values)
    if kind == "disposed":
        return Teardown(seq, kind, ev, ev.get("resource", ""), ev.get("outcome", ""), ev.get("duration_s", 0.0))
    if kind == "run_end":
        return RunEnded(seq, kind, ev, ev.get("outcome", ""), ev.get("error"))
    return RunEvent(seq, kind, ev)


# -- the run ---------------------------------------------------------------------------------------


@dataclass
class Result:
    final_state: str
    outcome: str                   # ok | stopped | failed | cancelled
    error: BaseException | None
    metrics: dict[str, Any]        # the last train row, and the last eval row's keys
    run_dir: Path
    trace_path: Path
    lost: list[dict[str, Any]] = field(default_factory=list)   # what it lost without failing (Ray's logs, ...)


class Run:
    def __init__(self, config: RunConfig, machine: str = "sync", *, run_id: str | None = None):
        self.config, self.machine, self._run_id = config, machine, run_id
        self._subscribers: list[asyncio.Queue[RunEvent | None]] = []
        self._state_hooks: dict[str, list[Callable[[str], Any]]] = {}
        self._task: asyncio.Task[Any] | None = None
        self._runner: Any = None
        self._ctx: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outcome = "running"
        self.result: Result | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Validate, prepare the run directory and trace, and start the lifecycle in a task."""
        from miles.api.launch import prepare_run
        from miles.config.validate import validate

        if self._task is not None:
            raise RuntimeError("this Run was started already; make a new Run for another training")
        validate(self.config)              # a config built in code gets the checks flags get
        self._loop = asyncio.get_running_loop()
        disposer = Disposer()
        self._runner, self._ctx = prepare_run(self.config, machine=self.machine, run_id=self._run_id,
                                              disposer=disposer, listeners=[self._on_event])
        self._task = asyncio.create_task(self._drive(), name=f"miles-run-{self._ctx.run_id}")

    async def _drive(self) -> str:
        try:
            return await self._runner.run()
        finally:
            self._ctx.tracer.close()

    async def wait(self) -> Result:
        """Wait for the end; raise the run's failure (after its teardown)."""
        task = self._require_task()
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():            # our waiter was cancelled: the run goes down with it
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise
        assert self.result is not None
        if self.result.error is not None:
            raise self.result.error
        return self.result

    async def stop(self) -> Result | None:
        """Graceful: the current phase finishes, then `draining`, then `shutdown`."""
        self._require_task()
        stop = self._ctx.stop_requested
        if isinstance(stop, StopRequest):
            stop.request("the host (Run.stop)")
        else:
            stop.set()
        try:
            return await self.wait()
        except BaseException:  # noqa: BLE001 - a stop's caller wants the run gone, not its error
            return self.result

    def request_save(self) -> None:
        """Save at the next opportunity (after the current rollout is trained), like a sentinel file."""
        self._require_task()
        self._ctx.save_requested = True

    @property
    def state(self) -> str | None:
        return None if self._runner is None else self._runner.state

    @property
    def run_dir(self) -> Path | None:
        return None if self._ctx is None else self._ctx.run_dir

    # -- watching -------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[RunEvent]:
        """Every event from now until the run ends (the last is RunEnded)."""
        queue: asyncio.Queue[RunEvent | None] = asyncio.Queue()
        self._subscribers.append(queue)
        try:
            while (item := await queue.get()) is not None:
                yield item
        finally:
            self._subscribers.remove(queue)

    def on_state(self, state: str, callback: Callable[[str], Any]) -> None:
        """Call `callback(state)` whenever the run enters `state` (an async callback is scheduled,
        not awaited: the run does not wait for hosts)."""
        self._state_hooks.setdefault(state, []).append(callback)

    def _on_event(self, ev: dict[str, Any]) -> None:
        # called by the run's tracer on the loop thread (or a teardown thread: hop to the loop)
        if self._loop is not None and self._loop.is_closed():
            return
        if self._loop is not None and not _on_loop(self._loop):
            self._loop.call_soon_threadsafe(self._on_event, ev)
            return
        record = to_record(ev)
        if isinstance(record, Transition):
            for hook in self._state_hooks.get(record.dst, []):
                result = hook(record.dst)
                if inspect.isawaitable(result):
                    asyncio.ensure_future(result)
        if isinstance(record, RunEnded):
            self._finish(record)
        for q in self._subscribers:
            q.put_nowait(record)
            if isinstance(record, RunEnded):
                q.put_nowait(None)

    def _finish(self, ended: RunEnded) -> None:
        metrics: dict[str, Any] = {}
        for row in self._ctx.metrics_history:
            metrics.update(row)
        self.result = Result(final_state=self._runner.state, outcome=ended.outcome, error=self._runner.failure,
                             metrics=metrics, run_dir=self._ctx.run_dir, trace_path=self._ctx.tracer.path,
                             lost=self._ctx.tracer.losses())

    def _require_task(self) -> asyncio.Task[Any]:
        if self._task is None:
            raise RuntimeError("the Run has not been started: `await run.start()` or `async with Run(...)`")
        return self._task

    async def __aenter__(self) -> "Run":
        await self.start()
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        task = self._require_task()
        if not task.done():
            if exc is None:
                await asyncio.gather(task, return_exceptions=True)      # the body is done watching: let it finish
            else:
                task.cancel()                                            # the host failed: take the run down
                await asyncio.gather(task, return_exceptions=True)
        return False


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def run_sync(config: RunConfig, machine: str = "sync", **kwargs: Any) -> Result:
    """Blocking wrapper for plain scripts: run to the end and return the Result (raise on failure)."""
    async def main() -> Result:
        run = Run(config, machine, **kwargs)
        await run.start()
        return await run.wait()

    return asyncio.run(main())
