"""Writing the run's files: what a write error says, what a full disk is, and who may write there.

- **A write error names its file.** `WriteFailed` is the OSError a run raises (or records) when one of
  its files cannot be written: which file (path and what it is: the trace, the metrics file, a log,
  config.yaml), the system's reason, and the space left on its disk, so that a full disk reads as one
  ("no space left ... 0 B free") and not as a bare `OSError: [Errno 28]`. The checkpoint store's
  `DiskFull` (miles.checkpoint.checkpointer) says the same of a --save folder, with these helpers.
- **A full disk is ENOSPC** wherever it was raised: in an actor (Ray keeps the original as `cause`),
  chained, or reworded by a library (safetensors: "No space left on device (os error 28)").
- **No world write.** `RUN_UMASK` is the least umask the run's processes keep (`restrict_umask`): files
  and folders the run creates are writable by their owner only.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# group and others may read what a run writes (a colleague reads its trace) but not write: on many shared
# hosts every user is in one primary group ("users"), so a group-writable folder is writable by everyone
RUN_UMASK = 0o022

NEARLY_FULL_BYTES = 16 << 20    # a write that fails with less than this free failed for the disk (torch.save
                                # says only "unexpected pos ..." when the disk is full)
_ENOSPC_TEXT = re.compile(r"No space left on device|os error 28|\[Errno 28\]")


def restrict_umask() -> int:
    """Add RUN_UMASK to this process's umask (a stricter one, 0o077 say, stays); return the umask now.
    The processes it starts later (Ray's included) inherit it."""
    old = os.umask(0)
    new = old | RUN_UMASK
    os.umask(new)
    return new


@contextmanager
def restricted_umask() -> Iterator[int]:
    """`restrict_umask` for the block, then the umask there was (a host's own, in `miles.Run`): what
    starts in the block (a local Ray cluster's processes) keeps the restricted one."""
    old = os.umask(0)
    os.umask(old | RUN_UMASK)
    try:
        yield old | RUN_UMASK
    finally:
        os.umask(old)


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC, also when it came from an actor (Ray keeps the original as `cause`), was chained, or was
    reworded by a library."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or _ENOSPC_TEXT.search(str(e)):
            return True
        inner = getattr(e, "cause", None)
        todo += [inner if isinstance(inner, BaseException) else None, e.__cause__, e.__context__]
    return False


def free_space(path: str | os.PathLike) -> int | None:
    """Bytes free to an unprivileged writer on `path`'s file system (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def human_bytes(n: int | None) -> str:
    """`n` bytes in B, KiB, MiB or GiB ("unknown" for None)."""
    if n is None:
        return "unknown"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


class WriteFailed(OSError):
    """Writing `what` at `path` failed: the message names both, the system's reason and the space left on
    the file's disk. Keeps the original's errno (ENOSPC stays a full disk) and chains it."""

    def __init__(self, what: str, path: str | os.PathLike, cause: OSError):
        self.what, self.free_bytes = what, free_space(path)
        super().__init__(cause.errno, cause.strerror or str(cause), str(path))
        self.__cause__ = cause

    @property
    def disk_full(self) -> bool:
        return self.errno == errno.ENOSPC

    def __str__(self) -> str:
        return (f"cannot write {self.what} {self.filename}: {self.strerror} "
                f"({human_bytes(self.free_bytes)} free on its disk)")

    def __reduce__(self):            # across Ray (pickled): rebuilt from the same parts
        return (_rebuild, (self.what, self.filename, self.errno, self.strerror))


def _rebuild(what: str, path: str, code: int, strerror: str) -> WriteFailed:
    return WriteFailed(what, path, OSError(code, strerror))


def write_failed(what: str, path: str | os.PathLike, exc: OSError) -> WriteFailed:
    """`exc` as a WriteFailed naming `what` at `path` (itself when it is one already)."""
    return exc if isinstance(exc, WriteFailed) else WriteFailed(what, path, exc)


class LineFile:
    """An append-only file of whole lines (JSONL), written unbuffered: a line is in the file when
    `write_line` returns (a killed process loses nothing it wrote). A line that cannot be written whole
    (the disk filled in the middle of it) is cut back out, so readers find whole lines only, and the
    write raises WriteFailed naming `what` and the path. The file is the caller's to `close`."""

    def __init__(self, path: str | os.PathLike, what: str):
        self.path, self.what, self.closed = Path(path), what, False
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            raise WriteFailed(what, self.path, exc)

    def write_line(self, text: str) -> None:
        data = memoryview((text + "\n").encode("utf-8"))
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as exc:
            try:
                os.ftruncate(self._fd, start)        # the part of the line that fitted goes again
            except OSError:
                pass
            raise WriteFailed(self.what, self.path, exc)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._fd)
