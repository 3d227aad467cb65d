"""Owned processes: the whole group goes, graceful first, forced when it must."""

from __future__ import annotations

import asyncio
import sys
import time

import psutil

from miles.runtime import Disposer
from miles.runtime.procs import OwnedProcess

# a parent that starts a child sleeper, then sleeps; with IGNORE both ignore SIGTERM
TREE = """
import os, signal, subprocess, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, sys, time\\n"
    "if sys.argv[1] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
    "time.sleep(600)", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(600)
"""


def start(mode: str, **kw) -> tuple[OwnedProcess, int]:
    import subprocess
    p = OwnedProcess([sys.executable, "-c", TREE, mode], name=f"tree-{mode}", stdout=subprocess.PIPE, **kw)
    child = int(p.proc.stdout.readline())
    return p, child


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_graceful_teardown_takes_the_whole_group():
    p, child = start("plain")
    assert p.alive() and not gone(child)
    t0 = time.monotonic()
    p.dispose()
    assert not p.alive() and gone(child) and not p.escalated
    assert time.monotonic() - t0 < 5


def test_a_group_that_ignores_sigterm_is_killed_after_the_timeout():
    p, child = start("ignore", term_timeout_s=0.5)
    p.dispose()
    assert p.escalated and not p.alive() and gone(child)


def test_registered_with_the_disposer_it_is_reaped_on_failure():
    p, child = start("plain")

    async def main():
        d = Disposer()
        d.add(p)
        try:
            raise RuntimeError("phase failed")
        except RuntimeError as exc:
            await d.close(exc)

    asyncio.run(main())
    assert not p.alive() and gone(child)
