"""Owned processes: a subprocess a component starts (an inference server, say) and must reap.

It runs in its own process group (a new session), so one signal reaches everything it spawned.
Teardown is graceful, then forced: SIGTERM to the group, wait, SIGKILL to the group and to any
descendant that left it (found with psutil before the first signal), then reap. The component
that starts it registers it with the disposer (or disposes it from its own `dispose`) before the
component itself goes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any, Sequence

import psutil


class OwnedProcess:
    def __init__(self, argv: Sequence[str], *, name: str, term_timeout_s: float = 10.0, **popen: Any):
        self.resource_name = name
        self.term_timeout_s = term_timeout_s
        self.proc = subprocess.Popen(list(argv), start_new_session=True, **popen)
        self.pid = self.proc.pid
        self.escalated = False

    @property
    def pgid(self) -> int:
        return self.pid           # a new session's leader: its pid is the group id

    def alive(self) -> bool:
        return self.proc.poll() is None

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def dispose(self) -> None:
        """SIGTERM the group, wait up to `term_timeout_s`, then SIGKILL the group and strays; reap."""
        strays = self.descendants()
        self._signal_group(signal.SIGTERM)
        if not self._wait(self.term_timeout_s, strays):
            self.force(strays)

    def force(self, strays: list[psutil.Process] | None = None) -> None:
        self.escalated = True
        strays = self.descendants() if strays is None else strays
        self._signal_group(signal.SIGKILL)
        for p in strays:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self._wait(5.0, strays)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    def _wait(self, timeout: float, strays: list[psutil.Process]) -> bool:
        deadline = time.monotonic() + timeout
        try:
            self.proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            return False
        _, still = psutil.wait_procs(strays, timeout=max(deadline - time.monotonic(), 0))
        return not still


def pid_running(pid: int) -> bool:
    """True while `pid` is a live process (a zombie counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
