"""One run per folder (miles.runtime.runlock): a second holder is refused naming the first, a lock a
dead process left is taken over and says whose it was, a release lets the next run in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.runtime.runlock import LOCK_FILE, FolderLocked, lock_folder, lock_folders, read_holder, run_folders

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_lock_is_refused_naming_the_holder_and_a_release_lets_the_next_in(tmp_path):
    first = lock_folder(tmp_path / "run", what="--run-dir", run_id="r1")
    assert first.taken_over is None
    with pytest.raises(FolderLocked) as refused:
        lock_folder(tmp_path / "run", what="--run-dir", run_id="r2")
    holder = refused.value.holder
    assert (holder["pid"], holder["run_id"], holder["what"]) == (os.getpid(), "r1", "--run-dir")
    assert f"--run-dir {tmp_path / 'run'} is in use by another run: pid {os.getpid()} on host" in str(refused.value)
    assert "(run r1, --run-dir)" in str(refused.value)
    first.release()
    first.release()                                   # idempotent: the disposer and the CLI both may
    assert read_holder(tmp_path / "run") == {}       # a clean release leaves no record
    second = lock_folder(tmp_path / "run", what="--run-dir", run_id="r2")
    assert second.taken_over is None                  # nobody died holding it
    second.release()


def test_a_lock_of_a_process_that_died_is_taken_over_and_says_whose_it_was(tmp_path):
    folder = tmp_path / "ckpt"
    code = ("import sys, os; from miles.runtime.runlock import lock_folder; "
            "lock_folder(sys.argv[1], what='--save', run_id='dead'); os._exit(0)")   # dies holding it
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    left = json.loads((folder / LOCK_FILE).read_text())
    assert left["run_id"] == "dead" and left["pid"] != os.getpid()
    lock = lock_folder(folder, what="--save", run_id="next")
    assert lock.taken_over == left
    assert read_holder(folder)["run_id"] == "next"
    lock.release()


def test_a_second_process_is_refused_within_a_second(tmp_path):
    held = lock_folder(tmp_path / "run", what="--run-dir", run_id="r1")
    code = ("import sys; from miles.runtime.runlock import lock_folder, FolderLocked\n"
            "try:\n    lock_folder(sys.argv[1], what='--run-dir')\nexcept FolderLocked as e:\n    print(e); sys.exit(2)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and f"pid {os.getpid()}" in proc.stdout, proc
    held.release()


def test_folders_are_locked_all_or_none_once_each(tmp_path):
    folders = run_folders(str(tmp_path / "run"), "id", save=str(tmp_path / "run"), critic_save=str(tmp_path / "c"))
    assert [w for w, _ in folders] == ["--run-dir", "--save", "--critic-save"]
    busy = lock_folder(tmp_path / "c", what="--critic-save")
    with pytest.raises(FolderLocked):
        lock_folders(folders)
    assert read_holder(tmp_path / "run") == {}        # the run dir's lock, taken first, was let go
    busy.release()
    locks = lock_folders(folders)
    assert [lock.what for lock in locks] == ["--run-dir", "--critic-save"]    # --save is the run dir: one lock
    for lock in locks:
        lock.release()
    assert run_folders(None, "20261203-x")[0] == ("--run-dir", Path("runs/20261203-x"))


def test_a_folder_the_lock_made_goes_again_when_nothing_else_was_written_there(tmp_path):
    made = lock_folder(tmp_path / "new" / "run", what="--run-dir")
    made.release()
    assert not (tmp_path / "new" / "run").exists()               # a refused run leaves no litter
    used = lock_folder(tmp_path / "used", what="--run-dir")
    (tmp_path / "used" / "trace.jsonl").write_text("{}\n")
    used.release()
    assert sorted(p.name for p in (tmp_path / "used").iterdir()) == [LOCK_FILE, "trace.jsonl"]
    (tmp_path / "mine").mkdir()
    kept = lock_folder(tmp_path / "mine", what="--save")
    kept.release()
    assert (tmp_path / "mine").is_dir()                           # the user's folder stays, lock file and all


def test_a_lock_file_unlinked_between_open_and_lock_is_not_taken_as_the_lock(tmp_path, monkeypatch):
    import miles.runtime.runlock as runlock

    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / LOCK_FILE
    real_flock, calls = runlock.fcntl.flock, []

    def flock_after_another_run_let_go(fd, op):
        calls.append(fd)
        if len(calls) == 1:
            path.unlink()              # the run holding it released and removed it after we opened it
        return real_flock(fd, op)

    monkeypatch.setattr(runlock.fcntl, "flock", flock_after_another_run_let_go)
    lock = lock_folder(tmp_path / "run", what="--run-dir")
    try:
        assert len(calls) == 2                                      # the unlinked file was let go, the path reopened
        assert os.fstat(lock.fd).st_ino == os.stat(path).st_ino    # the lock held is the folder's file
    finally:
        lock.release()
