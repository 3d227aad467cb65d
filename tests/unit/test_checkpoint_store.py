"""The checkpoint store: atomic commit, crash at every step, corrupt checkpoints, pruning."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from miles.checkpoint.store import LATEST_FILE, CheckpointStore, manifest_files, read_manifest, verify, verify_files


class Crash(BaseException):
    """Stands for the process dying: nothing after it runs, no abort, no cleanup."""


def save(store: CheckpointStore, rollout_id: int, payload: bytes = b"weights", **manifest) -> None:
    with store.saving(rollout_id, manifest) as tmp:
        (tmp / "model.bin").write_bytes(payload)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "rng.json").write_text(json.dumps({"seed": rollout_id}))


def tmp_entries(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))


def test_commit_writes_manifest_and_pointer(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 3, b"abc", format="torch")
    path = tmp_path / "iter_0000003"
    assert store.latest() == (3, path)
    manifest = read_manifest(path)
    assert manifest["rollout_id"] == 3 and manifest["format"] == "torch"
    assert manifest["files"]["model.bin"] == {"size": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}
    assert set(manifest["files"]) == {"model.bin", "sub/rng.json"}
    assert (tmp_path / LATEST_FILE).read_text() == "3"
    assert tmp_entries(tmp_path) == []
    assert verify(path, 3, deep=True) == []


def test_empty_or_missing_root_has_no_latest(tmp_path):
    assert CheckpointStore(tmp_path / "nothing").latest() is None
    assert CheckpointStore(tmp_path).list() == []


@pytest.mark.parametrize("step, expected_latest", [
    ("_write_manifest", 1),   # files written, no manifest yet
    ("_publish", 1),          # manifest written, not renamed
    ("_write_latest", 2),     # renamed (the commit point), pointer not updated
])
def test_crash_at_each_step_leaves_a_loadable_checkpoint(tmp_path, monkeypatch, step, expected_latest):
    save(CheckpointStore(tmp_path), 1, b"one")

    def crash(*args, **kwargs):
        raise Crash

    crashing = CheckpointStore(tmp_path)
    monkeypatch.setattr(crashing, step, crash)
    tmp = crashing.begin(2)
    (tmp / "model.bin").write_bytes(b"two")
    with pytest.raises(Crash):
        crashing.commit(tmp, 2, {})

    restarted = CheckpointStore(tmp_path)  # a new process after the crash
    assert restarted.latest() == (expected_latest, tmp_path / f"iter_{expected_latest:07d}")
    assert verify(tmp_path / "iter_0000001", 1, deep=True) == []
    assert (tmp_path / LATEST_FILE).read_text() == "1"  # the pointer is only ever a hint
    restarted.cleanup_partial()
    assert tmp_entries(tmp_path) == []
    assert restarted.latest()[0] == expected_latest


def test_crash_while_replacing_the_same_id_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    save(store, 1)
    save(store, 2, b"old two")
    real_rename = os.rename
    calls = []

    def rename_then_crash(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the old iter_2 is aside; the new one is not in place yet
            raise Crash
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename_then_crash)
    with pytest.raises(Crash):
        save(store, 2, b"new two")
    monkeypatch.setattr(os, "rename", real_rename)
    assert CheckpointStore(tmp_path).latest() == (1, tmp_path / "iter_0000001")


def test_saving_the_same_id_again_replaces_it(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 2, b"old")
    save(store, 2, b"newer")
    assert (tmp_path / "iter_0000002" / "model.bin").read_bytes() == b"newer"
    assert tmp_entries(tmp_path) == []


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_saving_aborts_on_any_exception(tmp_path, exc):
    store = CheckpointStore(tmp_path)
    save(store, 1)
    with pytest.raises(type(exc)):
        with store.saving(2) as tmp:
            (tmp / "model.bin").write_bytes(b"partial")
            raise exc
    assert tmp_entries(tmp_path) == [] and not (tmp_path / "iter_0000002").exists()
    assert store.latest() == (1, tmp_path / "iter_0000001")


def corrupt_truncate(path):
    (path / "model.bin").write_bytes(b"wei")


def corrupt_no_manifest(path):
    (path / "manifest.json").unlink()


def corrupt_bad_json(path):
    (path / "manifest.json").write_text("{not json")


def corrupt_missing_file(path):
    (path / "sub" / "rng.json").unlink()


@pytest.mark.parametrize("corrupt", [corrupt_truncate, corrupt_no_manifest, corrupt_bad_json, corrupt_missing_file])
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, corrupt):
    store = CheckpointStore(tmp_path)
    save(store, 1)
    save(store, 2)
    corrupt(tmp_path / "iter_0000002")
    assert store.latest() == (1, tmp_path / "iter_0000001")
    assert [i for i, _ in store.list()] == [1]


def test_pointer_to_a_missing_directory_falls_back_to_scanning(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 1)
    (tmp_path / LATEST_FILE).write_text("9")
    assert store.latest() == (1, tmp_path / "iter_0000001")


def test_deep_verify_catches_a_same_size_change(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 1, b"weights")
    (tmp_path / "iter_0000001" / "model.bin").write_bytes(b"WEIGHTS")
    assert verify(tmp_path / "iter_0000001", 1) == []  # the cheap check only sees sizes
    [problem] = verify(tmp_path / "iter_0000001", 1, deep=True)
    assert "model.bin does not match its sha256" in problem


def test_keep_last_prunes_older_checkpoints(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    for i in range(1, 5):
        save(store, i)
    assert [i for i, _ in store.list()] == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "iter_0000004", LATEST_FILE]


def test_cleanup_partial_removes_only_temporaries(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 1)
    store.begin(2)
    (tmp_path / ".tmp-latest-stale").write_text("5")
    removed = store.cleanup_partial()
    assert len(removed) == 2 and tmp_entries(tmp_path) == []
    assert store.latest() == (1, tmp_path / "iter_0000001")


def test_abort_refuses_paths_the_store_does_not_own(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 1)
    with pytest.raises(ValueError, match="not a temporary directory of the store"):
        store.abort(tmp_path / "iter_0000001")
    assert store.latest() == (1, tmp_path / "iter_0000001")


def test_reserved_manifest_keys_are_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    tmp = store.begin(1)
    with pytest.raises(ValueError, match=r"\['files'\] are reserved"):
        store.commit(tmp, 1, {"files": []})


def test_verify_files_checks_the_contents_of_the_files_it_is_given(tmp_path):
    # what --load runs where the files are read: a same-size flip passes the size check, not this one
    store = CheckpointStore(tmp_path)
    save(store, 1, b"weights")
    path = tmp_path / "iter_0000001"
    assert verify_files(path, manifest_files(path, "sub/")) == []
    (path / "model.bin").write_bytes(b"weightz")
    assert verify(path, 1) == []                                    # sizes still match
    assert verify_files(path, manifest_files(path, "sub/")) == []   # not a file it reads
    assert verify_files(path, manifest_files(path, "model.bin")) == [
        f"{path / 'model.bin'} does not match its sha256 in the manifest"]


def test_newest_first_lists_every_checkpoint_with_what_the_size_check_finds(tmp_path):
    store = CheckpointStore(tmp_path)
    for i in (1, 2, 3):
        save(store, i)
    (tmp_path / "iter_0000003" / "model.bin").write_bytes(b"short")
    found = store.newest_first()
    assert [(i, p.name) for i, p, _ in found] == [(3, "iter_0000003"), (2, "iter_0000002"), (1, "iter_0000001")]
    assert [bool(problems) for _, _, problems in found] == [True, False, False]
    assert "has 5 bytes, the manifest says 7" in found[0][2][0]
