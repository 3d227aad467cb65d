"""One run per folder: an exclusive lock on a run directory and on a `--save` folder.

Two runs writing one run directory interleave their traces and metrics; two runs saving into one
folder overwrite each other's checkpoints. Each folder a run writes gets a lock file, `LOCK_FILE`,
held with `fcntl.flock` for the life of the run and holding a JSON record of its holder (pid, host,
start time, run id, which flag). A second run finds the lock taken and raises `FolderLocked`
naming the holder before it starts anything.

The kernel drops a `flock` when its holder dies (`kill -9` included), so a lock file left by a dead
run is taken at once; its record tells who left it (`FolderLock.taken_over`), which the run reports.
A clean release empties the record. A folder the lock itself created and that still holds nothing
but the lock file (a run refused before it wrote anything) is removed again, so a refused run leaves
no litter; the file is unlinked while its lock is held, and a run that locked a file unlinked under
it finds so (the path's inode is no longer its descriptor's) and locks the new one instead.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .files import WriteFailed

LOCK_FILE = ".miles.lock"


class FolderLocked(RuntimeError):
    """Another live run holds the folder. The input's fault: the CLI exits 2."""

    input_fault = True

    def __init__(self, folder: Path, what: str, holder: dict[str, Any]):
        self.folder, self.what, self.holder = folder, what, holder
        super().__init__(f"{what} {folder} is in use by another run: {describe_holder(holder)}; wait for it to "
                         f"end, stop it, or pass another {what}")


def describe_holder(holder: dict[str, Any]) -> str:
    """'pid 123 on host h since 2026-12-03 13:45:23 UTC (run 2026...-abc, --save)' from a record."""
    if not holder:
        return "a process that left no record"
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder["started"])) \
        if isinstance(holder.get("started"), (int, float)) else "an unknown time"
    run = f"run {holder['run_id']}, " if holder.get("run_id") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')} since {since} ({run}{holder.get('what', '?')})"


@dataclass
class FolderLock:
    """A held lock on one folder; `release` (the disposer's teardown) lets it go."""

    folder: Path
    what: str                         # the flag naming the folder: --run-dir, --save
    fd: int | None
    taken_over: dict[str, Any] | None = None   # the record a dead holder left behind, if any
    created: bool = False             # the lock made the folder: removed again if nothing else is written there

    @property
    def resource_name(self) -> str:
        return f"lock {self.what} {self.folder}"

    def release(self) -> None:
        """Empty the record and unlock (the file stays: see the module docstring). Idempotent."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.ftruncate(fd, 0)
            if self.created and _only_the_lock(self.folder):
                (self.folder / LOCK_FILE).unlink()      # still held: nobody can lock this inode meanwhile
        finally:
            os.close(fd)          # closing the last descriptor drops the flock
        if self.created:
            try:
                self.folder.rmdir()                     # only if still empty
            except OSError:
                pass

    def dispose(self) -> None:
        self.release()


def lock_folder(folder: str | os.PathLike[str], *, what: str, run_id: str = "") -> FolderLock:
    """Take `folder`'s lock (creating the folder) or raise FolderLocked naming its holder. Never waits."""
    folder = Path(folder)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    fd = _locked_fd(folder, what)
    try:
        left = _read_record(fd)             # a record under a free lock: its holder died holding it
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": round(time.time(), 3),
                  "run_id": run_id, "what": what}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            os.fsync(fd)
        except OSError as exc:              # a full disk: say which file
            raise WriteFailed(f"the lock of {what}", folder / LOCK_FILE, exc)
    except BaseException:
        os.close(fd)
        raise
    return FolderLock(folder, what, fd, taken_over=left or None, created=created)


def _locked_fd(folder: Path, what: str) -> int:
    """A descriptor of the folder's lock file holding its flock; a file another run unlinked while we
    waited for it to let go is not the folder's lock any more, so the path is opened again."""
    path = folder / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd)
            os.close(fd)
            raise FolderLocked(folder, what, holder) from None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _only_the_lock(folder: Path) -> bool:
    try:
        return [e.name for e in folder.iterdir()] == [LOCK_FILE]
    except OSError:
        return False


def run_folders(run_dir: str | None, run_id: str, *, save: str | None = None,
                critic_save: str | None = None) -> list[tuple[str, Path]]:
    """The folders a run writes and must have to itself, as (flag, folder): the run dir (default
    `runs/<run id>`), and the checkpoint folders it saves into."""
    folders = [("--run-dir", Path(run_dir or f"runs/{run_id}"))]
    return folders + [(flag, Path(p)) for flag, p in (("--save", save), ("--critic-save", critic_save)) if p]


def lock_folders(folders: list[tuple[str, str | os.PathLike[str]]], *, run_id: str = "") -> list[FolderLock]:
    """Lock each (flag, folder) in order, one lock per distinct folder; all or none (on a refusal,
    those taken so far are released)."""
    held: list[FolderLock] = []
    seen: set[Path] = set()
    try:
        for what, folder in folders:
            resolved = Path(folder).absolute()
            if resolved in seen:
                continue
            seen.add(resolved)
            held.append(lock_folder(folder, what=what, run_id=run_id))
    except BaseException:
        for lock in held:
            lock.release()
        raise
    return held


def read_holder(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The record in `folder`'s lock file ({} when none or empty)."""
    try:
        return json.loads((Path(folder) / LOCK_FILE).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _read_record(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, 4096, 0)
        record = json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
