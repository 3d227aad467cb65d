"""What a checkpoint holds and how the run writes and reads it, on top of the atomic store.

    iter_<id>/trainer/    weights (safetensors), optimizer, RNG states, step count (Trainer.save)
    iter_<id>/rollout.json  the prompt iterator's position (RolloutExecutor.state_dict)
    iter_<id>/hf/         an HF-format export (AutoModelForCausalLM.from_pretrained loads it)
    iter_<id>/critic/     PPO's critic (Critic.save), unless --critic-save keeps it in a store of its own
    iter_<id>/manifest.json  rollout_id, weight_version, files (written by the store at commit)

With --no-save-optim the trainer's (and critic's) optimizer state is left out, and a resume from
that checkpoint starts a fresh optimizer. --save-hf PATH also exports the weights in HF format to
PATH (a template with {rollout_id}) at each save, outside the checkpoint (`export_hf_copy`).

Everything is written into the store's temporary directory; the rename at commit publishes it, so
a crash at any point of a save leaves the previous checkpoint the newest complete one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from miles.checkpoint.store import CheckpointStore

TRAINER_DIR, ROLLOUT_FILE, HF_DIR, CRITIC_DIR = "trainer", "rollout.json", "hf", "critic"


async def save_checkpoint(store: CheckpointStore, rollout_id: int, *, trainer: Any, executor: Any,
                          weight_version: int, save_hf: bool, critic: Any = None, save_optimizer: bool = True) -> Path:
    """`trainer`, `executor` (and `critic`, when given) are Ray actor handles (their methods are
    awaited through `.remote`)."""
    tmp = store.begin(rollout_id)
    try:
        await trainer.save.remote(str(tmp / TRAINER_DIR), optimizer=save_optimizer)
        state = await executor.state_dict.remote()
        (tmp / ROLLOUT_FILE).write_text(json.dumps(state))
        if save_hf:
            await trainer.export_hf.remote(str(tmp / HF_DIR))
        if critic is not None:
            await critic.save.remote(str(tmp / CRITIC_DIR), optimizer=save_optimizer)
        return store.commit(tmp, rollout_id, {"weight_version": weight_version, "hf_export": save_hf,
                                              "critic": critic is not None, "optimizer": save_optimizer})
    except BaseException:
        store.abort(tmp)
        raise


async def save_critic_checkpoint(store: CheckpointStore, rollout_id: int, *, critic: Any,
                                 save_optimizer: bool = True) -> Path:
    """The critic alone, as `iter_<id>/critic/` of its own store (--critic-save)."""
    tmp = store.begin(rollout_id)
    try:
        await critic.save.remote(str(tmp / CRITIC_DIR), optimizer=save_optimizer)
        return store.commit(tmp, rollout_id, {"critic": True})
    except BaseException:
        store.abort(tmp)
        raise


async def load_checkpoint(path: Path, *, trainer: Any, executor: Any, critic: Any = None) -> None:
    """Restore trainer and data position, and the critic when given and the checkpoint holds one (a
    critic kept under --critic-save comes back through --critic-load instead)."""
    await trainer.load.remote(str(path / TRAINER_DIR))
    await executor.load_state_dict.remote(json.loads((path / ROLLOUT_FILE).read_text()))
    if critic is not None and (path / CRITIC_DIR).is_dir():
        await critic.load.remote(str(path / CRITIC_DIR))


def hf_copy_path(template: str, rollout_id: int) -> Path:
    """--save-hf PATH for one rollout: {rollout_id} filled in (miles' convention), else PATH itself."""
    return Path(template.format(rollout_id=rollout_id) if "{rollout_id}" in template else template)


async def export_hf_copy(trainer: Any, template: str, rollout_id: int) -> Path:
    """The trainer's HF export at `hf_copy_path`, written beside it and renamed into place, so a
    crash never leaves half a model where a reader looks (an older export there is replaced)."""
    final = hf_copy_path(template, rollout_id)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-{uuid.uuid4().hex[:12]}")
    try:
        await trainer.export_hf.remote(str(tmp))
        if final.exists():
            aside = final.with_name(f".tmp-replaced-{final.name}-{uuid.uuid4().hex[:12]}")
            os.rename(final, aside)
            shutil.rmtree(aside)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final
