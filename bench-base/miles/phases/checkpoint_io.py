"""Checkpoint folders that actors write and read, for the save and resume code: in place when the driver
and the actors share a filesystem, copied through Ray when they do not (--shared-fs / --no-shared-fs).

The save phase and `init`'s resume call one object, picked once in `init` (`pick_folders`); nothing
else looks at the flag.
- `SharedFolders`: the actor writes the folder itself and reads it in place (a local cluster, or nodes
  mounting the driver's storage). After a save the driver checks that it sees what the actor wrote,
  so a cluster wrongly taken as shared fails the save with the fix instead of committing an empty
  folder.
- `CopiedFolders`: the actor writes into a scratch folder on its own node; the driver fetches every
  file in chunks (`miles.checkpoint.transfer`), checks each against the size and sha256 the actor
  listed, and the scratch folder is deleted. A load goes the other way: the driver sends the files,
  the actor's copy is checked against the driver's listing, read, and deleted. The driver's folder is
  the checkpoint store's temporary one, so the commit (the manifest with every file's sha256, then the
  rename) stays the store's and comes last: a save cut short anywhere leaves no checkpoint, as before.

With --async-save, `start_save` has the actor take its snapshot (`method(path, background=True)`)
and returns what finishes the part later: wait for the actor's writes (`wait_saved`, on the actor's
`SAVE_GROUP` thread, beside its training), then check the folder (shared) or fetch it (copied).

Verifying a checkpoint before loading it (--load's sha256 check) happens where its files are read:
in the actor when shared, on the driver (which reads them to send them) when copied.

Default, with neither flag: shared when the run started its cluster or every node of the cluster has
the driver's address (one machine); copied otherwise. A cluster that gains nodes on other machines
later (autoscaling) should be given --no-shared-fs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Protocol

import ray

from miles.checkpoint import transfer
from miles.checkpoint.store import verify_files

if TYPE_CHECKING:
    from miles.cluster.ray_cluster import ActorResource

SAVE_GROUP = "checkpoint_writes"     # the Ray concurrency group `wait_saved` runs in (--async-save)
Finish = Callable[[], Awaitable[None]]


class Folders(Protocol):
    shared: bool

    async def save(self, actor: ActorResource, method: str, folder: Path, **kwargs: Any) -> None:
        """`actor.<method>(path, **kwargs)` writes a folder; it ends up at `folder` on the driver."""

    async def start_save(self, actor: ActorResource, method: str, folder: Path, **kwargs: Any) -> Finish:
        """`actor.<method>(path, background=True, **kwargs)`: the snapshot taken, the files being written;
        awaiting the returned function leaves them at `folder` on the driver."""

    async def load(self, actor: ActorResource, method: str, folder: Path, **kwargs: Any) -> None:
        """`actor.<method>(path, **kwargs)` reads the folder that is at `folder` on the driver."""

    async def verify(self, actor: ActorResource, root: Path, files: dict[str, Any]) -> list[str]:
        """What is wrong with `files` (manifest entries under `root`) where `actor` would read them."""


class SharedFolders:
    """The actors see the driver's paths: they write and read checkpoint folders in place."""

    shared = True

    async def save(self, actor: ActorResource, method: str, folder: Path, **kwargs: Any) -> None:
        # absolute: a relative --save means the driver's working directory, which the actor does not share
        await getattr(actor.handle, method).remote(str(folder.absolute()), **kwargs)
        _arrived(actor, folder)

    async def start_save(self, actor: ActorResource, method: str, folder: Path, **kwargs: Any) -> Finish:
        await getattr(actor.handle, method).remote(str(folder.absolute()), background=True, **kwargs)

        async def finish() -> None:
            await wait_saved(actor)
            _arrived(actor, folder)
        return finish

    async def load(self, actor: ActorResource, method: str, folder: Path, **kwargs: Any) -> None:
        await getattr(actor.handle, method).remote(str(folder.absolute()), **kwargs)

    async def verify(self, actor: ActorResource, root: Path, files: dict[str, Any]) -> list[str]:
        return await actor.handle.__ray_call__.remote(_plain, verify_files, str(root.absolute()), files)


@dataclass
class CopiedFolders:
    """The actors' nodes share no filesystem with the driver: folders travel in chunks through Ray."""

    chunk_bytes: int = transfer.CHUNK_BYTES
    shared = False

    async def save(self, actor: ActorResource, method: str, folder: Path, **kwargs: Any) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        scratch = await _in(actor, transfer.make_scratch)
        try:
            part = f"{scratch}/part"
            await getattr(actor.handle, method).remote(part, **kwargs)
            await self._fetch(actor, part, folder)
        finally:
            await _remove_scratch(actor, scratch)

    async def start_save(self, actor: ActorResource, method: str, folder: Path, **kwargs: Any) -> Finish:
        folder.mkdir(parents=True, exist_ok=True)
        scratch = await _in(actor, transfer.make_scratch)
        part = f"{scratch}/part"
        try:
            await getattr(actor.handle, method).remote(part, background=True, **kwargs)
        except BaseException:
            await _remove_scratch(actor, scratch)
            raise

        async def finish() -> None:
            try:
                await wait_saved(actor)
                await self._fetch(actor, part, folder)
            finally:
                await _remove_scratch(actor, scratch)
        return finish

    async def _fetch(self, actor: ActorResource, part: str, folder: Path) -> None:
        """The actor's folder `part` (on its node) into `folder`, every file checked on arrival."""
        for name, entry in (await _in(actor, transfer.listing, part)).items():
            with transfer.FileReceiver(folder, name, entry) as receiver:
                for offset, size in transfer.chunks(entry["size"], self.chunk_bytes):
                    receiver.write(await _in(actor, transfer.read_chunk, part, name, offset, size))
                receiver.check()

    async def load(self, actor: ActorResource, method: str, folder: Path, **kwargs: Any) -> None:
        sent = transfer.listing(folder)
        scratch = await _in(actor, transfer.make_scratch)
        try:
            part = f"{scratch}/part"
            for name, entry in sent.items():
                for offset, size in transfer.chunks(entry["size"], self.chunk_bytes):
                    data = transfer.read_chunk(str(folder), name, offset, size)
                    await _in(actor, transfer.write_chunk, part, name, offset, data)
            if problems := transfer.mismatches(sent, await _in(actor, transfer.listing, part)):
                raise OSError(f"{folder} did not arrive intact at {actor.resource_name}: {'; '.join(problems[:5])}")
            await getattr(actor.handle, method).remote(part, **kwargs)
        finally:
            await _remove_scratch(actor, scratch)

    async def verify(self, actor: ActorResource, root: Path, files: dict[str, Any]) -> list[str]:
        return verify_files(root, files)           # read here, to be sent: checked here


def pick_folders(shared_fs: bool | None, *, started: bool, node_ips: Iterable[str],
                 driver_ip: str) -> tuple[Folders, str]:
    """The run's folders and why: the flag when given, else shared on one machine (module docstring)."""
    if shared_fs is not None:
        return (SharedFolders() if shared_fs else CopiedFolders()), ("--shared-fs" if shared_fs else "--no-shared-fs")
    if started:
        return SharedFolders(), "the run started the cluster on this machine"
    elsewhere = sorted(set(node_ips) - {driver_ip})
    if not elsewhere:
        return SharedFolders(), f"every node of the cluster is at the driver's address {driver_ip}"
    return CopiedFolders(), f"nodes at {', '.join(elsewhere)} are not the driver's machine ({driver_ip})"


async def wait_saved(actor: ActorResource) -> float:
    """The actor's background writes finished (their error raised); on its `SAVE_GROUP` thread, so it
    does not queue behind the actor's other calls."""
    return await actor.handle.wait_saved.options(concurrency_group=SAVE_GROUP).remote()


def _arrived(actor: ActorResource, folder: Path) -> None:
    if not folder.is_dir() or not any(folder.iterdir()):
        raise RuntimeError(f"{actor.resource_name} saved into {folder} on its node, but the driver finds "
                           "nothing there: they do not share a filesystem; pass --no-shared-fs (checkpoints "
                           "then travel through Ray)")


async def _in(actor: ActorResource, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` run in the actor's process, on its node."""
    return await actor.handle.__ray_call__.remote(_plain, fn, *args)


def _plain(_actor: Any, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


async def _remove_scratch(actor: ActorResource, scratch: str) -> None:
    try:
        await _in(actor, transfer.remove_scratch, scratch)
    except ray.exceptions.RayActorError:
        pass            # the actor is gone; its node's temp folder keeps the scratch (nothing else can reach it)
