"""Checkpoint folders between an actor's node and the driver's disk when they share no filesystem
(miles.checkpoint.transfer, miles.checkpoint.folders.CopiedFolders), and the shared case's guard.

The actor is a fake of one layer: `handle.__ray_call__.remote(fn, *args)` runs `fn(actor, *args)` in
this process, `handle.<method>.remote(...)` calls the method, as Ray would in the actor's process. Its
"node" is a folder of its own; the driver's folders are elsewhere.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from miles.checkpoint import transfer
from miles.checkpoint.checkpointer import save_atomically
from miles.checkpoint.store import CheckpointStore, verify
from miles.checkpoint.folders import CopiedFolders, SharedFolders


class _Method:
    def __init__(self, fn):
        self.remote = fn


class FakeTrainer:
    """Writes a checkpoint folder of a few files (one bigger than a chunk); reads one back."""

    resource_name = "trainer"

    def __init__(self, node: Path, *, tamper: bool = False, fail_save: bool = False):
        self.node, self.tamper, self.fail_save, self.loaded = node, tamper, fail_save, None
        self.handle = self

        async def ray_call(fn, *args):
            result = fn(self, *args)
            if self.tamper and fn.__name__ == "_plain" and args[0] is transfer.read_chunk and result:
                result = bytes([result[0] ^ 1]) + result[1:]       # a chunk altered on its way
            return result

        async def save(path: str, *, optimizer: bool = True) -> None:
            if self.fail_save:
                raise RuntimeError("disk full")
            folder = Path(path)
            (folder / "sub").mkdir(parents=True)
            (folder / "model.safetensors").write_bytes(bytes(range(256)) * 3)     # 768 bytes: several chunks
            (folder / "sub" / "rng.pt").write_bytes(b"rng")
            (folder / "empty").write_bytes(b"")
            if optimizer:
                (folder / "optimizer.pt").write_bytes(b"adam")

        async def load(path: str) -> None:
            self.loaded = {p.relative_to(path).as_posix(): p.read_bytes() for p in Path(path).rglob("*") if p.is_file()}

        self.__ray_call__, self.save, self.load = _Method(ray_call), _Method(save), _Method(load)


@pytest.fixture
def node(tmp_path, monkeypatch):
    """The actor's node: its temp directory, where transfer scratch folders go."""
    root = tmp_path / "node-tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def run(coro):
    return asyncio.run(coro)


def test_chunks_cover_a_file_exactly_and_an_empty_file_once():
    assert list(transfer.chunks(10, 4)) == [(0, 4), (4, 4), (8, 2)]
    assert list(transfer.chunks(8, 4)) == [(0, 4), (4, 4)]
    assert list(transfer.chunks(0, 4)) == [(0, 0)]


def test_a_save_arrives_whole_under_the_driver_folder_and_leaves_nothing_on_the_node(tmp_path, node):
    trainer, folders = FakeTrainer(node), CopiedFolders(chunk_bytes=100)
    run(folders.save(trainer, "save", tmp_path / "driver" / "trainer", optimizer=False))
    got = transfer.listing(tmp_path / "driver" / "trainer")
    assert sorted(got) == ["empty", "model.safetensors", "sub/rng.pt"]          # --no-save-optim honoured
    assert (tmp_path / "driver" / "trainer" / "model.safetensors").read_bytes() == bytes(range(256)) * 3
    assert list(node.iterdir()) == []                                           # the scratch folder is gone


def test_a_load_sends_the_folder_the_actor_reads_and_removes_its_copy(tmp_path, node):
    folder = tmp_path / "ck" / "trainer"
    (folder / "sub").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * 250)
    (folder / "sub" / "rng.pt").write_bytes(b"r")
    trainer = FakeTrainer(node)
    run(CopiedFolders(chunk_bytes=100).load(trainer, "load", folder))
    assert trainer.loaded == {"model.safetensors": b"w" * 250, "sub/rng.pt": b"r"}
    assert list(node.iterdir()) == []


def test_a_chunk_altered_on_the_way_fails_the_save_and_no_checkpoint_is_committed(tmp_path, node):
    store = CheckpointStore(tmp_path / "ck")
    trainer, folders = FakeTrainer(node, tamper=True), CopiedFolders(chunk_bytes=100)
    with pytest.raises(OSError, match="model.safetensors arrived with 768 bytes and sha256"):
        run(save_atomically(store, 3, lambda folder: folders.save(trainer, "save", folder / "trainer"), {}))
    assert store.list() == [] and list((tmp_path / "ck").iterdir()) == []      # aborted: no iter_, no .tmp-
    assert list(node.iterdir()) == []


def test_an_actor_that_fails_to_save_leaves_no_scratch_and_no_checkpoint(tmp_path, node):
    store = CheckpointStore(tmp_path / "ck")
    trainer, folders = FakeTrainer(node, fail_save=True), CopiedFolders()
    with pytest.raises(RuntimeError, match="disk full"):
        run(save_atomically(store, 1, lambda folder: folders.save(trainer, "save", folder / "trainer"), {}))
    assert store.list() == [] and list(node.iterdir()) == []


def test_a_committed_copy_has_every_file_in_its_manifest_with_its_sha256(tmp_path, node):
    store = CheckpointStore(tmp_path / "ck")
    trainer, folders = FakeTrainer(node), CopiedFolders(chunk_bytes=64)
    path = run(save_atomically(store, 2, lambda folder: folders.save(trainer, "save", folder / "trainer"), {}))
    assert verify(path, 2, deep=True) == []
    assert store.latest() == (2, path)


def test_verifying_a_copied_load_reads_the_files_on_the_driver(tmp_path, node):
    store = CheckpointStore(tmp_path / "ck")
    trainer, folders = FakeTrainer(node), CopiedFolders()
    path = run(save_atomically(store, 2, lambda folder: folders.save(trainer, "save", folder / "trainer"), {}))
    from miles.checkpoint.store import manifest_files
    files = manifest_files(path, "trainer/")
    assert run(folders.verify(trainer, path, files)) == []
    (path / "trainer" / "sub" / "rng.pt").write_bytes(b"RNG")             # same size, other bytes
    assert run(folders.verify(trainer, path, files)) == [f"{path / 'trainer/sub/rng.pt'} does not match its sha256 "
                                                         "in the manifest"]


def test_a_shared_save_the_driver_cannot_see_names_no_shared_fs(tmp_path, node):
    class Elsewhere(FakeTrainer):       # an actor on a node whose /path is not the driver's
        def __init__(self, node):
            super().__init__(node)
            inner = self.save.remote

            async def save(path: str, **kw):
                await inner(str(node / "their-disk" / Path(path).name), **kw)
            self.save = _Method(save)

    with pytest.raises(RuntimeError, match="pass --no-shared-fs"):
        run(SharedFolders().save(Elsewhere(node), "save", tmp_path / "driver" / "trainer"))
    run(SharedFolders().save(FakeTrainer(node), "save", tmp_path / "driver" / "trainer"))   # same disk: fine


def test_names_from_a_listing_cannot_leave_the_folder(tmp_path):
    with pytest.raises(ValueError, match="outside"):
        transfer.write_chunk(str(tmp_path), "../escape", 0, b"x")
    with pytest.raises(ValueError, match="not a transfer scratch folder"):
        transfer.remove_scratch(str(tmp_path))
    assert tmp_path.is_dir()
    assert transfer.mismatches({"a": {"size": 1}}, {"b": {"size": 1}}) == ["a was not received", "b was not sent"]
