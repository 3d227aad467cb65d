"""The local cluster's reaper: a small process that outlives the driver only to end what its cluster left.

Started by `miles.cluster.local` right after `ray.init` started a local cluster, in a session of its
own (a Ctrl-C to the terminal's process group does not reach it), with a pipe from the driver on its
stdin. While the pipe is open it records, every second, the driver's Ray processes (direct children
whose command line names the Ray session: gcs_server, raylet, monitors, the API server) and all their
descendants (the raylet's agents and workers). When the pipe closes (the driver closed it after
`ray.shutdown()`, or the driver died, `kill -9` included) it:

1. SIGKILLs every recorded process still alive (the same pid *and* start time: never a reused pid).
   Ray's dashboard and runtime-env agents notice a dead raylet within ~2 s, then try to report it to
   the dead GCS with a 60 s timeout (`ray._private.utils.publish_error_to_driver`): without this they
   linger ~60 s after `kill -9` of the driver;
2. moves the session's `logs/` into the run directory (the `logs_to` argument), then deletes the
   session folder (Ray leaves one per cluster under its temp dir, forever), and Ray's
   `session_latest` link when it points at this session.

It runs as a plain script (`python reaper.py SPEC`): stdlib and psutil only, no miles import.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import sys
import time
from pathlib import Path

import psutil

POLL_S = 1.0          # how often the cluster's processes are recorded while the driver lives
KILL_WAIT_S = 3.0     # how long SIGKILLed processes get to disappear before the folder goes


def ray_processes(root: int, session_name: str) -> dict[int, float]:
    """pid -> start time of `root`'s Ray processes and their descendants."""
    found: dict[int, float] = {}
    try:
        children = psutil.Process(root).children()
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            if child.pid == os.getpid() or session_name not in " ".join(child.cmdline()):  # our argv names it too
                continue
            for p in [child, *child.children(recursive=True)]:
                found[p.pid] = p.create_time()
        except psutil.Error:         # exited while we looked: nothing to record
            continue
    return found


def wait_for_eof(root: int, session_name: str) -> dict[int, float]:
    """Record the cluster's processes until the driver's pipe closes; return what was recorded."""
    recorded: dict[int, float] = {}
    fd = sys.stdin.fileno()
    while True:
        recorded.update(ray_processes(root, session_name))
        readable, _, _ = select.select([fd], [], [], POLL_S)
        if readable and not os.read(fd, 4096):
            return recorded


def kill_recorded(recorded: dict[int, float]) -> list[int]:
    """SIGKILL what is still alive (same pid, same start time); return the pids killed."""
    alive = []
    for pid, started in recorded.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                p.send_signal(signal.SIGKILL)
                alive.append(p)
        except psutil.Error:
            continue
    psutil.wait_procs(alive, timeout=KILL_WAIT_S)
    return [p.pid for p in alive]


def remove_session(session_dir: Path, logs_to: Path | None) -> None:
    """Keep the logs in the run directory, then delete the session folder and a link to it."""
    if logs_to is not None and (session_dir / "logs").is_dir():
        logs_to.parent.mkdir(parents=True, exist_ok=True)
        if logs_to.exists():            # a second cluster in one run dir: keep both
            logs_to = logs_to.with_name(f"{logs_to.name}-{session_dir.name}")
        shutil.move(str(session_dir / "logs"), str(logs_to))
    shutil.rmtree(session_dir, ignore_errors=True)
    latest = session_dir.parent / "session_latest"
    if latest.is_symlink() and Path(os.readlink(latest)) == session_dir:
        latest.unlink()


def main(spec: dict) -> int:
    session_dir = Path(spec["session_dir"])
    recorded = wait_for_eof(int(spec["root"]), session_dir.name)
    t0 = time.monotonic()
    killed = kill_recorded(recorded)
    remove_session(session_dir, Path(spec["logs_to"]) if spec.get("logs_to") else None)
    print(json.dumps({"event": "reaped", "killed": killed, "session_dir": str(session_dir),
                      "duration_s": round(time.monotonic() - t0, 3)}), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # a terminal's Ctrl-C is the driver's business
    sys.exit(main(json.loads(sys.argv[1])))
