"""What lets an in-process engine answer `health()` and `abort()` on a second actor thread while a
generate call runs on the first (`SupportsHealth`, `SupportsAbort` in miles.rollout.protocol).

A lock keeps one model call at a time (generate, weight updates, memory release, checksums: every
method that touches the model holds it via `_holding`); the running call stamps `_heartbeat` at each
step; `health()` reads it without the lock, or, the engine idle, takes the lock and runs the engine's
own one-token probe; `abort()` bumps `_abort_epoch`, which a running call compares with the one it
started under at each step, and returns at once. EmbeddedEngine and FastEngine share it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class EngineGuard:
    def _init_guard(self) -> None:
        self._lock = threading.Lock()        # one model call at a time (health and abort run beside it)
        self._heartbeat = time.monotonic()   # the last step of the running call (or its start)
        self._abort_epoch = 0                # abort() bumps it; a call stops when it changes under it

    @contextmanager
    def _holding(self) -> Iterator[None]:
        """The model lock, with the heartbeat stamped when it is taken: a probe measures a holder's
        progress from there (then from each step)."""
        with self._lock:
            self._heartbeat = time.monotonic()
            yield

    def _probe_ready(self) -> bool:
        """Whether an idle engine can run its probe (not while its memory is given to a trainer)."""
        return True

    def _probe(self) -> None:
        """A one-token generate, under the lock (the engine's own)."""
        raise NotImplementedError

    def health(self) -> dict[str, Any]:
        """{"busy", "since_progress_s"}: while a call holds the model, the seconds since its last step
        (or its start); idle, a one-token generate first proves the model still answers."""
        if not self._lock.acquire(blocking=False):
            return {"busy": True, "since_progress_s": time.monotonic() - self._heartbeat}
        try:
            self._heartbeat = time.monotonic()
            if self._probe_ready():
                self._probe()
        finally:
            self._lock.release()
        return {"busy": False, "since_progress_s": 0.0}

    def abort(self) -> None:
        """The generate calls that started before this return at their next step, the requests still
        generating finishing with "abort"."""
        self._abort_epoch += 1
