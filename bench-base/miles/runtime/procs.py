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
import socket
import subprocess
import sys
import time
from typing import Any, Sequence

import psutil

STRAY_POLL_S = 0.02       # how often a teardown looks whether the group's strays have exited


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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
        # a stray that exited stays a zombie until whoever adopted it reaps it, which a container's
        # PID 1 may do only every second or two: exited is gone, as for pid_running (psutil.wait_procs
        # waited for the reaping)
        while any(not _exited(p) for p in strays):
            if time.monotonic() >= deadline:
                return False
            time.sleep(STRAY_POLL_S)
        return True


def _exited(p: psutil.Process) -> bool:
    """True once `p` (the same process: psutil checks its start time) has exited, reaped or not."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def pid_running(pid: int) -> bool:
    """True while `pid` is a live process (a zombie counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def die_with_parent() -> None:
    """For `preexec_fn`: the child gets SIGKILL when the thread that started it exits (Linux
    PR_SET_PDEATHSIG), so a server does not outlive an owner killed with -9. Elsewhere: nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1          # noqa: N806  (prctl's name, <linux/prctl.h>)
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the kernel's pick; another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: str | os.PathLike, max_bytes: int = 4000) -> str:
    """The last `max_bytes` of a log file (what an error message quotes), or a note that there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - max_bytes, 0))
            return f.read().decode(errors="replace")
    except OSError as exc:
        return f"(no log at {path}: {exc})"
