"""The on-disk layout of checkpoints, made crash-safe; what goes inside a checkpoint is the caller's.

    root/
      iter_0000007/                 one complete checkpoint per rollout id
        manifest.json               rollout_id, time, every file's size and sha256, caller's fields
        ...                         whatever the checkpointer wrote
      latest_checkpointed_iteration.txt   "7": for miles/Megatron tooling and people
      .tmp-*                        a save in progress, or what a crash left behind

A save writes into a fresh `.tmp-iter_<id>-<uuid>` directory, then `commit` fsyncs every file,
writes the manifest, fsyncs, and renames the directory to `iter_<id>`. **The rename is the commit
point**: a crash before it leaves only a `.tmp-*` directory, which readers ignore; after it, the
checkpoint is complete. `latest_checkpointed_iteration.txt` is written after the rename (atomically:
temp file + os.replace) as a hint for other tools; `latest()` does not trust it: it scans the
`iter_*` directories, newest first, and returns the first that checks out (manifest valid, every
file present with its recorded size), so a pointer to a missing or corrupt directory, or a crash
between the rename and the pointer, still resumes from the newest complete checkpoint. Contents are
checked by whoever reads them (`verify_files`, run in the trainer actor on `--load`): a same-size
corruption passes `latest()` and is caught there.

One writer per root: `cleanup_partial` deletes every `.tmp-*`, including a save in progress.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from miles.config import ConfigError

TMP_PREFIX = ".tmp-"
MANIFEST = "manifest.json"
LATEST_FILE = "latest_checkpointed_iteration.txt"
RESERVED_MANIFEST_KEYS = frozenset({"rollout_id", "time", "files"})
_ITER_DIR = re.compile(r"iter_(\d{7,})")

log = structlog.get_logger("miles.checkpoint")


class CheckpointStore:
    def __init__(self, root: str | os.PathLike[str], *, keep_last: int | None = None,
                 retain_interval: int | None = None):
        """`keep_last`: only the newest N stay; `retain_interval` (miles' --save-retain-interval): the
        checkpoint after every N rollouts (rollout id + 1 a multiple of N) and the newest stay."""
        if keep_last is not None and keep_last < 1:
            raise ConfigError(f"keep_last {keep_last} must be at least 1 (None keeps every checkpoint)")
        if retain_interval is not None and retain_interval < 1:
            raise ConfigError(f"retain_interval {retain_interval} must be at least 1 (None keeps every checkpoint)")
        self.root = Path(root)
        self.keep_last = keep_last
        self.retain_interval = retain_interval

    def path_for(self, rollout_id: int) -> Path:
        return self.root / f"iter_{rollout_id:07d}"

    # ---- writing --------------------------------------------------------------------------------

    def begin(self, rollout_id: int) -> Path:
        """A fresh, empty temporary directory to write checkpoint `rollout_id` into."""
        if rollout_id < 0:
            raise ValueError(f"rollout_id {rollout_id} must be >= 0")
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}iter_{rollout_id:07d}-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp_path: Path, rollout_id: int, manifest: dict[str, Any] | None = None) -> Path:
        """Seal `tmp_path` as checkpoint `rollout_id` (replacing an older one of that id); return its path.

        `manifest` holds the caller's own JSON fields; `rollout_id`, `time` and `files` are ours.
        """
        tmp = self._own_tmp(tmp_path)
        extra = dict(manifest or {})
        if clash := RESERVED_MANIFEST_KEYS & extra.keys():
            raise ValueError(f"manifest keys {sorted(clash)} are reserved for the store; rename them")
        if (tmp / MANIFEST).exists():
            raise ValueError(f"{tmp / MANIFEST} exists; {MANIFEST} is written by the store, name the file otherwise")
        files = _hash_and_sync_files(tmp)
        self._write_manifest(tmp, {**extra, "rollout_id": rollout_id,
                                   "time": datetime.now(UTC).isoformat(timespec="seconds"), "files": files})
        final = self._publish(tmp, rollout_id)
        self._write_latest(rollout_id)
        log.info("checkpoint_committed", rollout_id=rollout_id, path=str(final), num_files=len(files),
                 num_bytes=sum(f["size"] for f in files.values()))
        if self.keep_last is not None or self.retain_interval is not None:
            self._prune(keep=rollout_id)
        return final

    def abort(self, tmp_path: Path) -> None:
        """Delete a save in progress (no-op when it is gone already)."""
        tmp = self._own_tmp(tmp_path, must_exist=False)
        if tmp.exists():
            shutil.rmtree(tmp)
            log.info("checkpoint_aborted", path=str(tmp))

    @contextmanager
    def saving(self, rollout_id: int, manifest: dict[str, Any] | None = None) -> Iterator[Path]:
        """`with store.saving(7) as tmp:` write into tmp; commits on success, aborts on any exception."""
        tmp = self.begin(rollout_id)
        try:
            yield tmp
            self.commit(tmp, rollout_id, manifest)
        except BaseException:
            self.abort(tmp)  # after a successful rename tmp is gone and this is a no-op
            raise

    def _write_manifest(self, tmp: Path, manifest: dict[str, Any]) -> None:
        with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        for directory, _, _ in os.walk(tmp, topdown=False):  # entries of every directory durable
            _fsync_dir(Path(directory))

    def _publish(self, tmp: Path, rollout_id: int) -> Path:
        final = self.path_for(rollout_id)
        aside = None
        if final.exists():
            # No portable atomic directory swap: move the old one aside (to a .tmp- name readers
            # ignore), then rename the new one in. A crash in between loses neither.
            aside = self.root / f"{TMP_PREFIX}replaced-{final.name}-{uuid.uuid4().hex[:12]}"
            os.rename(final, aside)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        if aside is not None:
            shutil.rmtree(aside)
        return final

    def _write_latest(self, rollout_id: int) -> None:
        tmp = self.root / f"{TMP_PREFIX}latest-{uuid.uuid4().hex[:12]}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(str(rollout_id))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.root / LATEST_FILE)
        except BaseException:
            tmp.unlink(missing_ok=True)     # a full disk: no stray pointer file left behind
            raise
        _fsync_dir(self.root)

    def _prune(self, *, keep: int) -> None:
        saved = self.list()
        newest = saved[-1][0] if saved else keep
        too_old = {i for i, _ in saved[: -self.keep_last]} if self.keep_last is not None else set()
        for rollout_id, path in saved:
            if rollout_id in (keep, newest):  # never the one just saved, nor the newest
                continue
            retained = self.retain_interval is not None and (rollout_id + 1) % self.retain_interval == 0
            if rollout_id not in too_old and (retained or self.retain_interval is None):
                continue
            aside = self.root / f"{TMP_PREFIX}pruned-{path.name}-{uuid.uuid4().hex[:12]}"
            os.rename(path, aside)  # a half-deleted directory must not look like a checkpoint
            shutil.rmtree(aside)
            log.info("checkpoint_pruned", rollout_id=rollout_id)

    def _own_tmp(self, tmp_path: Path, *, must_exist: bool = True) -> Path:
        tmp = Path(tmp_path)
        if tmp.parent.resolve() != self.root.resolve() or not tmp.name.startswith(TMP_PREFIX):
            raise ValueError(f"{tmp} is not a temporary directory of the store at {self.root}; "
                             "use the path begin() returned")
        if must_exist and not tmp.is_dir():
            raise ValueError(f"{tmp} does not exist (committed or aborted already?)")
        return tmp

    # ---- reading --------------------------------------------------------------------------------

    def latest(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint as (rollout_id, path), or None when there is none."""
        for rollout_id, path in reversed(self._candidates()):
            problems = verify(path, rollout_id)
            if not problems:
                return rollout_id, path
            log.warning("checkpoint_skipped", path=str(path), problems=problems)
        return None

    def newest_first(self) -> list[tuple[int, Path, list[str]]]:
        """Every checkpoint directory, newest first, with what the shallow check (manifest, files
        present, sizes) finds wrong. The contents are the readers' to check (`verify_files`)."""
        return [(i, p, verify(p, i)) for i, p in reversed(self._candidates())]

    def list(self) -> list[tuple[int, Path]]:
        """Every complete checkpoint as (rollout_id, path), oldest first."""
        return [(i, p) for i, p in self._candidates() if not verify(p, i)]

    def cleanup_partial(self) -> list[Path]:
        """Delete what interrupted saves left (`.tmp-*`); call it only when no save is running."""
        if not self.root.is_dir():
            return []
        removed = []
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith(TMP_PREFIX):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
                removed.append(entry)
        if removed:
            log.info("checkpoint_partials_removed", paths=[str(p) for p in removed])
        return removed

    def _candidates(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), e) for e in self.root.iterdir() if (m := _ITER_DIR.fullmatch(e.name)) and e.is_dir()]
        return sorted(found)


def read_manifest(path: Path) -> dict[str, Any]:
    with open(Path(path) / MANIFEST, encoding="utf-8") as f:
        return json.load(f)


def verify(path: Path, rollout_id: int | None = None, *, deep: bool = False) -> list[str]:
    """What is wrong with the checkpoint at `path` (empty: complete). `deep` also checks every sha256."""
    try:
        manifest = read_manifest(path)
    except FileNotFoundError:
        return [f"{path / MANIFEST} is missing"]
    except (OSError, ValueError) as e:
        return [f"{path / MANIFEST} is unreadable: {e}"]
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return [f"{path / MANIFEST} has no 'files' table"]
    if rollout_id is not None and manifest.get("rollout_id") != rollout_id:
        return [f"{path / MANIFEST} says rollout_id {manifest.get('rollout_id')!r}, the directory {rollout_id}"]
    return [p for name, entry in files.items() if (p := _check_file(path, name, entry, deep))]


def manifest_files(path: Path, under: str = "") -> dict[str, Any]:
    """The manifest's entries (size, sha256) of the files under `under` ("trainer/", "rollout.json")."""
    files = read_manifest(path)["files"]
    return {name: entry for name, entry in files.items() if name == under or name.startswith(under)}


def verify_files(root: str | os.PathLike[str], files: dict[str, Any]) -> list[str]:
    """Check each file's size and sha256 against its manifest entry; what differs, one line each.

    Meant to run where the files are read (the trainer actor for `trainer/`), so no byte crosses a
    process boundary; large files are hashed in parallel (hashlib releases the GIL).
    """
    from concurrent.futures import ThreadPoolExecutor

    names = sorted(files)
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(names)))) as pool:
        found = pool.map(lambda n: _check_file(Path(root), n, files[n], True), names)
        return [p for p in found if p]


def _check_file(root: Path, name: str, entry: Any, deep: bool) -> str | None:
    if Path(name).is_absolute() or ".." in Path(name).parts:
        return f"manifest entry {name!r} points outside the checkpoint"
    file = root / name
    if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
        return f"manifest entry {name!r} is malformed: {entry!r}"
    if not file.is_file():
        return f"{file} is missing"
    if (size := file.stat().st_size) != entry["size"]:
        return f"{file} has {size} bytes, the manifest says {entry['size']}"
    if deep and _sha256(file) != entry.get("sha256"):
        return f"{file} does not match its sha256 in the manifest"
    return None


def _hash_and_sync_files(root: Path) -> dict[str, dict[str, Any]]:
    files: dict[str, dict[str, Any]] = {}
    for directory, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(directory) / name
            with open(path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
                os.fsync(f.fileno())  # the bytes must be on disk before the rename publishes them
                size = os.fstat(f.fileno()).st_size
            files[path.relative_to(root).as_posix()] = {"size": size, "sha256": digest}
    return files


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
