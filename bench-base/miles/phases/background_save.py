"""--async-save, the driver's half: a checkpoint under --save whose files are written while the run goes on.

The save phase begins the store's temporary folder, has every actor that owns a part take a CPU
snapshot of it (`Folders.start_save`: the trainer's state, its HF export, PPO's critic; the data
position is the driver's own and written at once), and returns: the phase costs the snapshot, not
the writes. A task of its own (`BackgroundSave`) then waits for every part's files, and commits the
folder exactly as a synchronous save does (manifest with every file's sha256, then the rename), off
the event loop. Until the rename the folder is a `.tmp-*` one that no reader takes, so a write that
fails, a run that is killed, or a teardown that cancels the task never leaves a checkpoint behind
that is not whole: a failed or cancelled task removes its folder.

At most one background save is pending: the next save (and a stop's save) first waits for the one
before to commit; `draining` settles it (within the stop's budget after a stop; after a failure it
still commits a snapshot whose files were all written, since the snapshot was taken between two
rollouts, and only says so if it cannot); the disposer cancels one still pending. A pending save's
failure surfaces where it is settled: a full disk as `DiskFull` (with --save-retries the run goes on
without it), anything else fails the run.

The trainer side: `miles.checkpoint.background`; the actors run `wait_saved` on a Ray concurrency
group of their own (`SAVE_GROUP`), so the driver can wait for the files while the trainer trains.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Awaitable, Callable, Coroutine

from miles.checkpoint.checkpointer import abort_checkpoint
from miles.checkpoint.store import CheckpointStore

CANCEL_GRACE_S = 1.0        # a cancelled pending save gets this long to remove its folder before the teardown goes on


class BackgroundSave:
    """The pending background save of a run (at most one), as the task that commits it. Registered
    with the disposer after the trainer and the critic, so it is settled before they go."""

    resource_name = "background_save"

    def __init__(self) -> None:
        self._task: asyncio.Task | None = None
        self._abort: Callable[[], None] = lambda: None
        self.rollout_id: int | None = None

    @property
    def pending(self) -> bool:
        return self._task is not None

    def start(self, rollout_id: int, commit: Coroutine[Any, Any, Path], abort: Callable[[], None]) -> None:
        """`commit`: the task's coroutine (`commit_when_written`); `abort`: removes the folder (idempotent),
        run after a cancel too, for a task cancelled before it ever ran."""
        assert self._task is None, "settle the pending background save before starting another"
        self._task, self._abort, self.rollout_id = asyncio.ensure_future(commit), abort, rollout_id

    async def settle(self, timeout: float | None = None) -> Path | None:
        """Wait for the pending save to commit (None pending: None). Its failure is raised. Past
        `timeout` seconds it is cancelled (its folder removed) and TimeoutError raised."""
        task, self._task = self._task, None
        if task is None:
            return None
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            await self._cancel(task)
            raise TimeoutError(f"the background save of rollout {self.rollout_id} was not written within "
                               f"{timeout:.1f} s; it was aborted")
        return task.result()

    async def dispose(self) -> None:
        """Cancel a save still pending (its task removes its folder); a settled one leaves nothing."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            await self._cancel(task)

    async def _cancel(self, task: asyncio.Task) -> None:
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        self._abort()


async def start_parts(store: CheckpointStore, tmp: Path, rollout_id: int,
                      starts: list[Callable[[], Awaitable[Callable[[], Awaitable[None]]]]]) -> list:
    """Run each part's start (an actor's snapshot) in order; the finishers they return. If one fails,
    the parts already started finish first (none keeps writing into a folder about to go, nor leaves
    its error for the next save's wait), then the folder is removed and the failure raised."""
    finishers = []
    try:
        for start in starts:
            finishers.append(await start())
    except BaseException as exc:
        await asyncio.gather(*(finish() for finish in finishers), return_exceptions=True)
        raise abort_checkpoint(store, tmp, rollout_id, exc)
    return finishers


async def commit_when_written(store: CheckpointStore, tmp: Path, rollout_id: int, finishers: list,
                              manifest: dict[str, Any], committed: Callable[[Path], None]) -> Path:
    """The pending save's task: every part's files written, then the store's commit (in a thread: it
    hashes and fsyncs every file), then `committed(path)`; on any failure or cancellation the folder
    is removed."""
    try:
        results = await asyncio.gather(*(finish() for finish in finishers), return_exceptions=True)
    except asyncio.CancelledError as exc:
        raise abort_checkpoint(store, tmp, rollout_id, exc)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise abort_checkpoint(store, tmp, rollout_id, errors[0])
    commit = asyncio.get_running_loop().run_in_executor(None, store.commit, tmp, rollout_id, manifest)
    try:
        path = await asyncio.shield(commit)
    except asyncio.CancelledError:
        await asyncio.wait({commit})        # a commit is not cut in half: it ends, then the cancel goes on
        raise
    except BaseException as exc:
        raise abort_checkpoint(store, tmp, rollout_id, exc)
    committed(path)
    return path
