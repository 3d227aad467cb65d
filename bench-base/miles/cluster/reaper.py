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
   `session_latest` link when it points at this session. The folder goes whatever happened to the
   logs: when they do not fit in the run directory (a full disk), what was copied is removed again
   (the run's trace needs that space for its last events) and the report says they were lost.

It also takes world and group write off what Ray's processes create in the session folder while the
cluster runs (Ray makes some folders 0777 on purpose, `ray._common.utils.try_make_directory_shared`,
again at each worker's start), and off the logs it moved; then it deletes the cluster's private temp
folder (`private_dir`) around the session.

Its report is one JSON line on stdout, a pipe the driver reads (`LocalCluster.close`): not a file in
the run directory, whose disk may be the full one. It exits 0 when the session folder is gone, 1 if not.
It runs as a plain script (`python reaper.py SPEC`): stdlib and psutil only, no miles import.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import stat
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


def wait_for_eof(root: int, session_dir: Path, private_dir: Path | None = None) -> dict[int, float]:
    """Record the cluster's processes (and keep its folders unwritable by others) until the driver's
    pipe closes; return what was recorded."""
    recorded: dict[int, float] = {}
    fd = sys.stdin.fileno()
    while True:
        recorded.update(ray_processes(root, session_dir.name))
        no_shared_write(private_dir or session_dir)
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


def no_shared_write(root: Path) -> list[str]:
    """Take group and world write off every file and folder under `root` (and `root`) that has it without
    the sticky bit; return their paths. What this process's umask forbids goes too."""
    umask = os.umask(0)
    os.umask(umask)
    drop = 0o022 | (umask & 0o077)
    fixed = []
    for folder, _dirs, files in os.walk(root):
        for path in [folder, *(os.path.join(folder, f) for f in files)]:
            try:
                mode = os.lstat(path).st_mode
                if not stat.S_ISLNK(mode) and mode & drop and not mode & stat.S_ISVTX:
                    os.chmod(path, stat.S_IMODE(mode) & ~drop)
                    fixed.append(path)
            except OSError:            # gone while we looked, or not ours
                continue
    return fixed


def keep_logs(session_dir: Path, logs_to: Path) -> dict | None:
    """Move the session's logs to `logs_to` (private to the run's user); None when they are there, else
    what was lost: the logs, where, why and the space left (what was copied is removed again)."""
    if not (session_dir / "logs").is_dir():
        return None
    if logs_to.exists():                # a second cluster in one run dir: keep both
        logs_to = logs_to.with_name(f"{logs_to.name}-{session_dir.name}")
    try:
        logs_to.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(session_dir / "logs"), str(logs_to))
    except (OSError, shutil.Error) as exc:
        shutil.rmtree(logs_to, ignore_errors=True)
        return {"what": "Ray's logs", "path": str(logs_to), "error": _reason(exc), "free_bytes": _free(logs_to.parent)}
    no_shared_write(logs_to)
    return None


def remove_session(session_dir: Path, logs_to: Path | None) -> dict | None:
    """Keep the logs in the run directory, then delete the session folder and a link to it, whatever
    happened to the logs; return what was lost (None: nothing)."""
    lost = None
    try:
        if logs_to is not None:
            lost = keep_logs(session_dir, logs_to)
    finally:
        shutil.rmtree(session_dir, ignore_errors=True)
        latest = session_dir.parent / "session_latest"
        if latest.is_symlink() and Path(os.readlink(latest)) == session_dir:
            latest.unlink()
    return lost


def _reason(exc: BaseException) -> str:
    """Why the logs did not move, short: shutil.move's Error lists (source, destination, why) per file
    that failed, each `why` naming both paths; the system's reason and the count say it."""
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        failed = exc.args[0]
        why = str(failed[0][-1]) if isinstance(failed[0], tuple) else str(failed[0])
        return f"{_ERRNO_TEXT.sub('', why).split(': ')[0]} ({len(failed)} files not copied)"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


_ERRNO_TEXT = re.compile(r"^\[Errno \d+\] ")


def _free(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path if path.exists() else path.parent).free
    except OSError:
        return None


def report(record: dict) -> None:
    """One JSON line to the driver's pipe; a driver that is gone (kill -9) reads nothing, and that is fine."""
    try:
        print(json.dumps(record), flush=True)
    except (OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # the exit's own flush goes nowhere


def main(spec: dict) -> int:
    session_dir = Path(spec["session_dir"])
    private = Path(spec["private_dir"]) if spec.get("private_dir") else None
    recorded = wait_for_eof(int(spec["root"]), session_dir, private)
    t0 = time.monotonic()
    killed = kill_recorded(recorded)
    try:
        lost = remove_session(session_dir, Path(spec["logs_to"]) if spec.get("logs_to") else None)
    finally:
        if private is not None:          # the cluster's own temp folder (miles.cluster.local.private_temp_dir)
            shutil.rmtree(private, ignore_errors=True)
    report({"event": "reaped", "killed": killed, "session_dir": str(session_dir), "removed": not session_dir.exists(),
            "lost": lost, "duration_s": round(time.monotonic() - t0, 3)})
    return 0 if not session_dir.exists() else 1


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # a terminal's Ctrl-C is the driver's business
    sys.exit(main(json.loads(sys.argv[1])))
