"""What a checkpoint holds, and writing one atomically on top of the store.

    iter_<id>/trainer/    weights (safetensors), optimizer, RNG states, step count (the trainer's `save`)
    iter_<id>/rollout.json  the prompt iterator's position (RolloutExecutor.state_dict)
    iter_<id>/hf/         an HF-format export (AutoModelForCausalLM.from_pretrained loads it)
    iter_<id>/critic/     PPO's critic (the critic's `save`), unless --critic-save keeps it in a store of its own
    iter_<id>/manifest.json  rollout_id, weight_version, files (written by the store at commit)

Everything is written into the store's temporary directory; the rename at commit publishes it, so
a crash at any point of a save leaves the previous checkpoint the newest complete one. With
--no-save-optim the trainer's (and critic's) optimizer state is left out (the manifest says
"optimizer": false) and a resume from it starts a fresh optimizer. --save-hf PATH also exports the
model in HF format to PATH (`hf_copy_path`), outside the checkpoint, published the same way
(`publish_folder`). This module
takes plain values (paths, dicts, a coroutine function that writes the parts): who writes each part
(a Ray actor, in a run) is the save phase's business.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

from miles.checkpoint.store import CheckpointStore
from miles.runtime.files import NEARLY_FULL_BYTES, free_space, human_bytes, is_disk_full   # shared with the run dir's files

TRAINER_DIR, ROLLOUT_FILE, HF_DIR, CRITIC_DIR = "trainer", "rollout.json", "hf", "critic"


class DiskFull(RuntimeError):
    """A save ran out of disk space (ENOSPC, raised here or in the actor writing its part). The partial
    checkpoint is removed; the earlier ones are untouched. Not the input's fault: the run fails (exit 1),
    or with --save-retries goes on without this checkpoint."""

    def __init__(self, root: Path, rollout_id: int, free_bytes: int | None):
        self.root, self.rollout_id, self.free_bytes = root, rollout_id, free_bytes
        free = human_bytes(free_bytes)
        super().__init__(f"the disk of --save {root} is full ({free} free after removing the partial checkpoint "
                         f"of rollout {rollout_id}); the earlier checkpoints are intact: free some space (or "
                         "--keep-last-checkpoints N), then resume with --load")




async def save_atomically(store: CheckpointStore, rollout_id: int, write: Callable[[Path], Awaitable[Any]],
                          manifest: dict[str, Any]) -> Path:
    """`await write(folder)` into a fresh temporary folder, then commit it as checkpoint `rollout_id`
    with the caller's manifest fields; any failure (or cancellation) aborts it and re-raises (a full
    disk as DiskFull, naming the folder and the space left)."""
    tmp = begin_checkpoint(store, rollout_id)
    try:
        await write(tmp)
        return store.commit(tmp, rollout_id, manifest)
    except BaseException as exc:
        raise abort_checkpoint(store, tmp, rollout_id, exc)


def begin_checkpoint(store: CheckpointStore, rollout_id: int) -> Path:
    """`store.begin(rollout_id)`: a fresh temporary folder; no room for it raises DiskFull."""
    try:
        return store.begin(rollout_id)
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFull(store.root, rollout_id, free_space(store.root)) from exc
        raise


def abort_checkpoint(store: CheckpointStore, tmp: Path, rollout_id: int, exc: BaseException) -> BaseException:
    """Remove the save in `tmp` that failed with `exc`; what to raise: `exc`, or DiskFull (caused by it)
    when the disk is why."""
    # torch.save says only "unexpected pos ..." when the disk is full: the space left then tells
    free = free_space(store.root)
    full = isinstance(exc, Exception) and (is_disk_full(exc) or (free is not None and free < NEARLY_FULL_BYTES))
    store.abort(tmp)
    if not full:
        return exc
    error = DiskFull(store.root, rollout_id, free_space(store.root))
    error.__cause__ = exc
    return error


def write_data_position(folder: Path, state: dict[str, Any]) -> None:
    (folder / ROLLOUT_FILE).write_text(json.dumps(state))


def read_data_position(folder: Path) -> dict[str, Any]:
    return json.loads((folder / ROLLOUT_FILE).read_text())


def hf_copy_path(template: str, rollout_id: int) -> Path:
    """--save-hf PATH for one rollout: {rollout_id} filled in (miles' convention), else PATH itself."""
    return Path(template.format(rollout_id=rollout_id) if "{rollout_id}" in template else template)


async def publish_folder(final: Path, write: Callable[[Path], Awaitable[Any]]) -> Path:
    """`await write(folder)` into a temporary folder beside `final`, then rename it to `final`
    (moving an older one aside first), so a reader never finds half a folder there."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-{uuid.uuid4().hex[:12]}")
    try:
        await write(tmp)
        if final.exists():
            aside = final.with_name(f".tmp-replaced-{final.name}-{uuid.uuid4().hex[:12]}")
            os.rename(final, aside)
            shutil.rmtree(aside)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final
