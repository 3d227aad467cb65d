"""Restart intensity, OTP-supervisor style: at most `max_restarts` restarts in any `window_s`.

Past the budget the supervisor gives up and the failure takes the run's fail route.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable


class RestartBudgetExceeded(RuntimeError):
    """More restarts were needed than the budget allows; the last failure is the cause."""


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float, *, clock: Callable[[], float] = time.monotonic):
        if max_restarts < 0 or window_s <= 0:
            raise ValueError(f"restart budget needs max_restarts >= 0 and window_s > 0; got {max_restarts}, {window_s}")
        self.max_restarts, self.window_s, self._clock = max_restarts, window_s, clock
        self._times: deque[float] = deque()

    def spend(self, what: str) -> int:
        """Record one restart of `what`; raise RestartBudgetExceeded past the budget. Returns the count in the window."""
        now = self._clock()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            raise RestartBudgetExceeded(
                f"{what}: {len(self._times)} restarts in the last {self.window_s:g}s already, budget is "
                f"{self.max_restarts}; giving up (raise --engine-max-restarts or --engine-restart-window)")
        self._times.append(now)
        return len(self._times)
