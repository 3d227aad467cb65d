"""What lets an in-process engine answer `health()` and `abort()` on a second actor thread while a
generate call runs on the first (`SupportsHealth`, `SupportsAbort` in miles.rollout.protocol).

A lock keeps one model call at a time (generate, weight updates, memory release, checksums: every
method that touches the model holds it via `_holding`); the running call stamps `_heartbeat` at each
step; `health()` reads it without the lock, or, the engine idle, takes the lock and runs the engine's
own one-token probe; `abort()` bumps `_abort_epoch`, which a running call compares with the one it
started under at each step, and returns at once. EmbeddedEngine and FastEngine share it.

The in-flight weight swap (`SupportsInFlightWeightSwap`, --fully-async) is shared the same way:
`swap_weights` (on another actor thread) leaves the new weights pending; the running call takes them
at its next token boundary (`_take_swap`, under the model lock it holds), and when no call runs the
waiting thread takes the lock and loads them itself. The engine says how weights are loaded
(`_load_weights`, under the lock) and where its token boundaries are.

With `checksum=True` (--check-weight-update-equal or --ci-test under --fully-async) the swap also
records, at that same boundary (decode paused, the model lock held), the checksum of what the engine
held just before the load and of what it holds just after (`_weights_checksum_locked`, the engine's
`weights_checksum` without taking the lock), kept by version: `swapped_weights_checksum(v)` answers
from that record, waiting (bounded) until v was applied, and never takes the model lock, so it neither
waits for the requests in flight nor races them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog

log = structlog.get_logger().bind(role="engine")

SWAP_POLL_S = 0.02      # how often a waiting swap_weights checks that a call still runs to take it
SWAP_CHECKSUMS_KEPT = 4  # versions whose swap checksums an engine keeps (the driver asks for the newest)
SWAP_CHECKSUM_WAIT_S = 120.0   # how long `swapped_weights_checksum` waits for its version to be applied


class EngineGuard:
    def _init_guard(self) -> None:
        self._lock = threading.Lock()        # one model call at a time (health and abort run beside it)
        self._heartbeat = time.monotonic()   # the last step of the running call (or its start)
        self._abort_epoch = 0                # abort() bumps it; a call stops when it changes under it
        self._swap_lock = threading.Lock()   # swap_weights: one at a time
        self._swap: tuple[Any, int, threading.Event, bool] | None = None   # pending: taken at a token boundary
        self._swap_paused = 0
        self._swap_sums: dict[int, dict[str, Any]] = {}   # version -> checksums recorded at its swap (checksum=True)
        self._swap_sums_changed = threading.Condition()

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

    # --- in-flight weight swap (SupportsInFlightWeightSwap) --------------------------------------------
    def swap_weights(self, state_dict: Any, version: int, checksum: bool = False) -> dict[str, Any]:
        """New weights without waiting for the generate call running (--fully-async): its requests pause
        at the next token boundary (every running sequence has sampled its token, the forward that feeds
        it back has not run), the weights are loaded, and they go on under `version`; each later token
        records it (`Generation.token_versions`). An idle engine loads them at once. Their KV cache (the
        prompt's and the tokens so far) stays as the old weights computed it: the tokens after the swap
        are sampled from the new weights over the old cache, and their logprobs are what was sampled from.
        With `checksum`, the checksums of the weights held before and after the load are recorded at the
        boundary too (`swapped_weights_checksum`).
        Returns {"paused_requests": requests in flight at the swap (0: idle), "waited_s": time to the
        boundary, "version"}."""
        t0 = time.monotonic()
        done = threading.Event()
        with self._swap_lock:                  # one swap at a time
            self._swap = (state_dict, int(version), done, bool(checksum))
            while not done.wait(SWAP_POLL_S):
                if self._lock.acquire(blocking=False):      # no call running (or it ended before the boundary)
                    try:
                        self._take_swap(paused=0)
                    finally:
                        self._lock.release()
        paused = self._swap_paused
        log.info("weights_swapped", version=int(version), paused_requests=paused)
        return {"paused_requests": paused, "waited_s": round(time.monotonic() - t0, 6), "version": int(version)}

    def _take_swap(self, paused: int) -> bool:
        """Under the model lock, at a token boundary: load the pending swap's weights, if one is pending
        (`paused`: the requests in flight). True when it loaded them."""
        pending, self._swap = self._swap, None
        if pending is None:
            return False
        state_dict, version, done, checksum = pending
        try:
            held = (self._version, self._weights_checksum_locked()) if checksum else None
            self._load_weights(state_dict)
            self._version = version
            self._swap_paused = paused
            if checksum:
                self._record_swap_checksum(version, held, self._weights_checksum_locked(), paused)
        finally:
            done.set()          # a load that raised leaves the version as it was: the push checks it
        return True

    def _record_swap_checksum(self, version: int, held: tuple[int, str], checksum: str, paused: int) -> None:
        with self._swap_sums_changed:
            self._swap_sums[version] = {"version": version, "checksum": checksum, "paused_requests": paused,
                                        "before": {"version": held[0], "checksum": held[1]}}
            for old in sorted(self._swap_sums)[:-SWAP_CHECKSUMS_KEPT]:
                del self._swap_sums[old]
            self._swap_sums_changed.notify_all()

    def swapped_weights_checksum(self, version: int, timeout_s: float = SWAP_CHECKSUM_WAIT_S) -> dict[str, Any]:
        """What a `swap_weights(..., version, checksum=True)` recorded at its token boundary: {"version",
        "checksum" (of the weights right after the load), "before": {"version", "checksum"} (of the weights
        held right before it), "paused_requests"}. Waits until that swap was applied (an idle engine applies
        it at once; a running call at its next token), at most `timeout_s`: TimeoutError then. Never takes
        the model lock, so a request in flight does not hold it up."""
        version = int(version)
        with self._swap_sums_changed:
            if not self._swap_sums_changed.wait_for(lambda: version in self._swap_sums, timeout=timeout_s):
                raise TimeoutError(f"no swap to weight version {version} with a checksum was applied within "
                                   f"{timeout_s:g}s (the engine holds version {self._version}; swap_weights("
                                   f"..., checksum=True) records one)")
            return dict(self._swap_sums[version])

    def weights_checksum(self) -> str:
        """`state_dict_checksum` of the weights the engine holds (`_weights_checksum_locked`, under the lock)."""
        with self._holding():
            return self._weights_checksum_locked()

    def _weights_checksum_locked(self) -> str:
        """`state_dict_checksum` of the weights the engine holds, the model lock already held (by
        `weights_checksum`, or by a swap that records its checksums)."""
        raise NotImplementedError

    def _load_weights(self, state_dict: Any) -> None:
        """Copy `state_dict` into the engine's weights (the model lock held)."""
        raise NotImplementedError
