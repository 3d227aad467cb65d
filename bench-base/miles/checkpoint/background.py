"""Checkpoint writes that finish on a thread of their own while the trainer trains on (--async-save),
the actor's half; the driver's half is `miles.phases.background_save`.

A background save is two steps. The snapshot happens in the actor's call (`Trainer.save(path,
background=True)`): every tensor the checkpoint holds is copied to the CPU, so the next optimizer
step cannot change what is written. The call returns with the files still to write; `submit` queues
their writing here, on one thread, in submission order. `wait` (the driver calls it through a Ray
concurrency group of its own, so it does not queue behind a `train` call) returns when every queued
write has finished, or raises the first one's error once all have ended: only then does the driver
commit the folder, so a failed or cut-short write never becomes a checkpoint.

Nothing here knows about Ray or the store: the folder is a temporary one the driver commits.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class BackgroundWrites:
    """Writes queued by `submit`, run one at a time on a thread made at the first one."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._queued: list[Future] = []

    def submit(self, write: Callable[..., Any], *args: Any) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-checkpoint-write")
        self._queued.append(self._pool.submit(write, *args))

    def wait(self) -> float:
        """Block until every queued write has ended; seconds waited. The first failure is raised after
        all have ended (none is left running into a folder the driver is about to remove)."""
        t0 = time.monotonic()
        queued, self._queued = self._queued, []
        errors = [f.exception() for f in queued]     # waits for each
        for error in errors:
            if error is not None:
                raise error
        return time.monotonic() - t0

    def close(self) -> None:
        """Drop the writes not started and let the thread end after the one running, without waiting
        for it: at a teardown the driver has already committed or removed the folder. Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._queued = []
