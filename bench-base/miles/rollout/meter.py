"""What the rollout executor is doing right now, for the progress line of a phase that runs long.

A `Meter` counts one activity (a rollout, an eval) from its samples' side: how many are to be made,
how many came back from the engines, how many were scored, and how many wait in engine and reward
calls still running (the oldest call's age, against its bound). The executor opens one per `generate` and
`evaluate` call (`metering`); the engine and reward calls made inside that call find it through a
context variable, so a rollout generating ahead and an eval running beside it count apart.
`snapshot()` is what the driver's once-a-minute question (`RolloutExecutor.progress`) gets back.
Plain counters in the executor's own event loop: no lock, no Ray call, no cost on the hot path.
"""

from __future__ import annotations

import contextvars
import itertools
import time
from contextlib import contextmanager
from typing import Any, Iterator

_CURRENT: contextvars.ContextVar["Meter | None"] = contextvars.ContextVar("miles_meter", default=None)


class Meter:
    def __init__(self, activity: str, *, reward_timeout_s: float | None = None):
        self.activity = activity
        self.reward_timeout_s = reward_timeout_s
        self.total = 0                      # samples this activity makes (known once it draws them)
        self.generated = 0                  # samples the engines (or the generate function) returned
        self.scored = 0                     # samples whose reward call returned (or timed out)
        self._ids = itertools.count()
        self._engine_calls: dict[int, tuple[float, int]] = {}   # id -> (start, samples)
        self._reward_calls: dict[int, tuple[float, int]] = {}

    def add_total(self, n: int) -> None:
        self.total += n

    @contextmanager
    def engine_call(self, samples: int) -> Iterator[None]:
        key = next(self._ids)
        self._engine_calls[key] = (time.monotonic(), samples)
        try:
            yield
            self.generated += samples
        finally:
            del self._engine_calls[key]

    @contextmanager
    def reward_call(self, samples: int) -> Iterator[None]:
        key = next(self._ids)
        self._reward_calls[key] = (time.monotonic(), samples)
        try:
            yield
        finally:
            self.scored += samples
            del self._reward_calls[key]

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        out: dict[str, Any] = {"activity": self.activity, "samples": self.total, "generated": self.generated,
                               "scored": self.scored}
        for name, calls in (("engine", self._engine_calls), ("reward", self._reward_calls)):
            if calls:                       # samples in calls still running, and the oldest call's age
                out[f"{name}_pending"] = sum(n for _, n in calls.values())
                out[f"{name}_oldest_s"] = round(now - min(t for t, _ in calls.values()), 1)
        if self._reward_calls and self.reward_timeout_s:
            out["reward_timeout_s"] = self.reward_timeout_s
        return out


def current() -> Meter | None:
    """The meter of the activity this code runs for (None outside `generate` / `evaluate`)."""
    return _CURRENT.get()


class Meters:
    """The executor's open meters, one per running activity."""

    def __init__(self, *, reward_timeout_s: float | None = None):
        self._open: list[Meter] = []
        self._reward_timeout_s = reward_timeout_s

    @contextmanager
    def metering(self, activity: str) -> Iterator[Meter]:
        meter = Meter(activity, reward_timeout_s=self._reward_timeout_s)
        self._open.append(meter)
        token = _CURRENT.set(meter)
        try:
            yield meter
        finally:
            _CURRENT.reset(token)
            self._open.remove(meter)

    def snapshot(self) -> list[dict[str, Any]]:
        return [m.snapshot() for m in self._open]


@contextmanager
def engine_call(samples: int) -> Iterator[None]:
    """Count an engine call on the current activity's meter (nothing outside one)."""
    meter = current()
    if meter is None:
        yield
        return
    with meter.engine_call(samples):
        yield


@contextmanager
def reward_call(samples: int) -> Iterator[None]:
    """Count a reward call on the current activity's meter (nothing outside one)."""
    meter = current()
    if meter is None:
        yield
        return
    with meter.reward_call(samples):
        yield
