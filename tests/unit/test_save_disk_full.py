"""A save that meets a full disk (ENOSPC) removes its partial folder, leaves every earlier checkpoint
intact and loadable, and says which folder and how much space is left (DiskFull). On a small tmpfs
mounted for the test (root only), and, wherever that is not possible, with an injected ENOSPC."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest

from miles.checkpoint.checkpointer import DiskFull, is_disk_full, save_atomically
from miles.checkpoint.resume import classify_load_folder
from miles.checkpoint.store import CheckpointStore, verify
from tests.conftest import small_tmpfs

MIB = 1 << 20


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs; skipped with the reason when this process may not mount one."""
    with small_tmpfs(tmp_path / "disk", "2m", "test_an_injected_enospc_*") as mnt:
        yield mnt


def write_bytes(n: int):
    async def write(folder: Path) -> None:
        (folder / "trainer").mkdir()
        with open(folder / "trainer" / "model.bin", "wb") as f:
            for _ in range(n // MIB):
                f.write(os.urandom(MIB))
            f.flush()
            os.fsync(f.fileno())
    return write


def assert_earlier_intact(store: CheckpointStore, ids: list[int]) -> None:
    assert [i for i, _ in store.list()] == ids
    for i, path in store.list():
        assert verify(path, i, deep=True) == []
    assert [e.name for e in store.root.iterdir() if e.name.startswith(".tmp-")] == []   # no partial left
    assert [c.rollout_id for c in classify_load_folder(store.root).candidates] == ids[::-1]


def test_enospc_on_a_small_tmpfs_removes_the_partial_and_names_the_folder_and_the_space(small_disk):
    store = CheckpointStore(small_disk / "ckpt")
    asyncio.run(save_atomically(store, 0, write_bytes(1 * MIB), {}))
    with pytest.raises(DiskFull) as full:
        asyncio.run(save_atomically(store, 1, write_bytes(2 * MIB), {}))
    assert is_disk_full(full.value.__cause__)
    assert full.value.root == store.root and full.value.rollout_id == 1
    assert full.value.free_bytes is not None and 0.5 * MIB < full.value.free_bytes <= 1 * MIB  # the partial is gone
    assert f"the disk of --save {store.root} is full (" in str(full.value) and "KiB free after removing the partial" in str(full.value)
    assert_earlier_intact(store, [0])
    asyncio.run(save_atomically(store, 1, write_bytes(0), {}))          # with room again, the next save works
    assert_earlier_intact(store, [0, 1])


def test_libraries_that_reword_enospc_still_make_a_disk_full(small_disk):
    # torch.save on a full disk raises RuntimeError("... unexpected pos ..."), safetensors a SafetensorError
    # saying "No space left on device (os error 28)": the save is a DiskFull either way
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    store = CheckpointStore(small_disk / "ckpt")
    asyncio.run(save_atomically(store, 0, write_bytes(0), {}))
    big = {"w": torch.zeros(1 << 20)}                                  # 4 MiB on a 2 MiB disk

    async def torch_save(folder: Path) -> None:
        torch.save(big, folder / "optimizer.pt")

    async def safetensors_save(folder: Path) -> None:
        save_file(big, str(folder / "model.safetensors"))

    for write in (torch_save, safetensors_save):
        with pytest.raises(DiskFull):
            asyncio.run(save_atomically(store, 1, write, {}))
        assert_earlier_intact(store, [0])


class RemoteError(Exception):
    """Stands for Ray's RayTaskError: the actor's own exception rides along as `cause`."""

    def __init__(self, cause: BaseException):
        super().__init__("remote failure")
        self.cause = cause


def test_an_injected_enospc_from_an_actor_is_a_disk_full_and_anything_else_passes_through(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    asyncio.run(save_atomically(store, 0, write_bytes(0), {}))

    async def full_in_actor(folder: Path) -> None:
        (folder / "trainer").mkdir()
        (folder / "trainer" / "half.bin").write_bytes(b"x" * 100)
        raise RemoteError(OSError(errno.ENOSPC, "No space left on device"))

    with pytest.raises(DiskFull) as full:
        asyncio.run(save_atomically(store, 1, full_in_actor, {}))
    assert full.value.free_bytes is not None and str(store.root) in str(full.value)
    assert_earlier_intact(store, [0])

    async def other(folder: Path) -> None:
        raise OSError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError):
        asyncio.run(save_atomically(store, 1, other, {}))
    assert_earlier_intact(store, [0])
