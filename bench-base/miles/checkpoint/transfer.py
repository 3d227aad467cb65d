"""A checkpoint folder moved, file by file and chunk by chunk, between an actor's node and the driver's
disk, for clusters whose nodes share no filesystem with the driver (--no-shared-fs).

Two sides, plain functions on local paths:
- the actor's side, run inside the actor's process (`miles.phases.checkpoint_io` calls them there): a
  scratch folder on the actor's node, the listing of a folder (every file's size and sha256), a chunk
  of a file read or written at an offset;
- the driver's side: `FileReceiver` writes a file's chunks as they arrive and checks the whole against
  the listing's size and sha256, so a file that arrives short or altered fails the save.

Chunks are at most CHUNK_BYTES, so neither side holds a whole weights file in memory and no message
comes near Ray's size limits. Who calls whom over Ray is the phases' business.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

CHUNK_BYTES = 64 * 2**20
SCRATCH_PREFIX = "miles-transfer-"


def make_scratch() -> str:
    """A fresh folder in this node's temp directory (the actor's side of a transfer)."""
    return tempfile.mkdtemp(prefix=SCRATCH_PREFIX)


def remove_scratch(path: str) -> None:
    """Delete a folder `make_scratch` made; anything else is refused (it is a `rm -r`)."""
    if not Path(path).name.startswith(SCRATCH_PREFIX):
        raise ValueError(f"{path} is not a transfer scratch folder ({SCRATCH_PREFIX}*); not deleting it")
    shutil.rmtree(path, ignore_errors=True)


def listing(root: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Every file under `root` (posix path relative to it) → {"size", "sha256"}."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(_walk(Path(root))):
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
            size = os.fstat(f.fileno()).st_size
        files[path.relative_to(root).as_posix()] = {"size": size, "sha256": digest}
    return files


def read_chunk(root: str, name: str, offset: int, size: int) -> bytes:
    with open(_inside(root, name), "rb") as f:
        f.seek(offset)
        return f.read(size)


def write_chunk(root: str, name: str, offset: int, data: bytes) -> None:
    """Write `data` at `offset` of file `name` under `root` (the first chunk creates the file)."""
    path = _inside(root, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "r+b" if offset else "wb") as f:
        f.seek(offset)
        f.write(data)


def chunks(size: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, int]]:
    """(offset, length) of each chunk of a file of `size` bytes; one empty chunk for an empty file."""
    if size == 0:
        yield 0, 0
        return
    for offset in range(0, size, chunk_bytes):
        yield offset, min(chunk_bytes, size - offset)


class FileReceiver:
    """One file arriving in chunks, in order, on this side: written as they come, hashed on the way."""

    def __init__(self, root: Path, name: str, expected: dict[str, Any]):
        self.path, self.name, self.expected = _inside(str(root), name), name, expected
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "wb")
        self._hash, self._size = hashlib.sha256(), 0

    def write(self, data: bytes) -> None:
        self._file.write(data)
        self._hash.update(data)
        self._size += len(data)

    def __enter__(self) -> "FileReceiver":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self._file.close()          # on success too: `check` (called inside the block) has the verdict

    def check(self) -> None:
        """Raise if what arrived is not what the listing said (call it after the last chunk)."""
        self._file.flush()
        if self._size != self.expected["size"] or self._hash.hexdigest() != self.expected["sha256"]:
            raise OSError(f"{self.name} arrived with {self._size} bytes and sha256 {self._hash.hexdigest()[:12]}..., "
                          f"the sender listed {self.expected['size']} bytes, {self.expected['sha256'][:12]}...")


def mismatches(sent: dict[str, dict[str, Any]], received: dict[str, dict[str, Any]]) -> list[str]:
    """What differs between the listing of a folder sent and of its copy, one line per file."""
    problems = [f"{n} was not received" for n in sorted(sent.keys() - received.keys())]
    problems += [f"{n} was not sent" for n in sorted(received.keys() - sent.keys())]
    problems += [f"{n} arrived as {received[n]} instead of {sent[n]}" for n in sorted(sent.keys() & received.keys())
                 if sent[n] != received[n]]
    return problems


def _walk(root: Path) -> Iterator[Path]:
    for directory, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            yield Path(directory) / name


def _inside(root: str, name: str) -> Path:
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise ValueError(f"file name {name!r} points outside the folder being transferred")
    return Path(root) / name
