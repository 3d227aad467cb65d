"""A traced background job: work that runs while the loop goes on (a rollout generating ahead, an
eval), written to the trace as one span.

`start_job` emits `<span>_start`, then runs a task that awaits the work and emits exactly one
`<span>_end` with its outcome: `ok` (with what the caller's `on_ok` adds), `error` (with the error),
or `cancelled` (through Ray, or the task cancelled, even before it first ran). `cancel_jobs` stops
jobs through Ray first, so the actor's own task stops too, then cancels the asyncio tasks. The
prefetcher and the eval dispatcher are built on these two functions.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable

import ray

from miles.runtime.trace import Tracer

CANCEL_GRACE_S = 5.0      # how long a job cancelled through Ray gets to end before its task is cancelled


@dataclass
class Job:
    pending: Awaitable[Any]     # the work (a Ray ObjectRef in a run: cancellable through Ray)
    task: asyncio.Task          # awaits `pending`, then traces the span's end; its result is `pending`'s
    start_seq: int


def start_job(tracer: Tracer, span_name: str, pending: Awaitable[Any], fields: dict[str, Any],
              on_ok: Callable[[Any], dict[str, Any]]) -> Job:
    """Trace `<span_name>_start` with `fields` and await `pending` in a task. On success `on_ok(result)`
    runs first (it records the result) and returns what `<span_name>_end` adds to `fields`."""
    seq = tracer.emit(f"{span_name}_start", **fields)
    span, t0, end = {**fields, "cause": seq}, time.monotonic(), f"{span_name}_end"

    async def run() -> Any:
        try:
            result = await pending
        except ray.exceptions.TaskCancelledError:
            tracer.emit(end, outcome="cancelled", duration_s=elapsed_since(t0), **span)
            raise
        except Exception as exc:
            tracer.emit(end, outcome="error", duration_s=elapsed_since(t0), error=exc, **span)
            raise
        tracer.emit(end, outcome="ok", duration_s=elapsed_since(t0), **span, **on_ok(result))
        return result

    task = asyncio.ensure_future(run())
    # a task cancelled while it awaits (or before it ever ran) ends here, not in `run`
    task.add_done_callback(lambda t: t.cancelled() and tracer.emit(
        end, outcome="cancelled", duration_s=elapsed_since(t0), **span))
    return Job(pending, task, seq)


async def cancel_jobs(jobs: Iterable[Job], grace_s: float = CANCEL_GRACE_S) -> None:
    """Cancel every unfinished job: through Ray first (its actor task stops too), then, for what did
    not end within `grace_s` or is not a Ray task, the asyncio task. Returns once all have ended."""
    jobs = [j for j in jobs if not j.task.done()]
    through_ray = {j.task for j in jobs if isinstance(j.pending, ray.ObjectRef)}
    for j in jobs:
        if j.task in through_ray:
            ray.cancel(j.pending)
    if through_ray:
        await asyncio.wait(through_ray, timeout=grace_s)
    for j in jobs:
        j.task.cancel()
    if jobs:
        await asyncio.wait({j.task for j in jobs})


def elapsed_since(t0: float) -> float:
    return round(time.monotonic() - t0, 6)
