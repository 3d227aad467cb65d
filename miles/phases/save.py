"""`save`, for every machine: an atomic checkpoint of the rollout just trained.

The checkpoint under --save holds the trainer (its optimizer state unless --no-save-optim), the data
position, the HF export (unless --no-save-hf) and PPO's critic; a critic with a store of its own (--critic-save elsewhere) is saved there instead,
and with --critic-save alone only the critic is saved. The data position is the one recorded right
after the saved rollout's prompts were drawn (`ctx.data_states`, which the async machine fills: by
now its executor has already served the next rollout's prompts); with none recorded (sync) the
executor's live position is that one. --save-hf PATH also exports the HF model to PATH, outside the
checkpoints (and with no --save, alone). Layout: miles/checkpoint/checkpointer.py. The actors' folders
reach the driver in place or through Ray, as `ctx.c.folders` does it (miles/phases/checkpoint_io.py).
A save the disk has no room for removes its partial folder and fails the run naming the folder and the
space left (DiskFull, exit 1), or with --save-retries N goes on without that checkpoint N times.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from miles.checkpoint.checkpointer import (CRITIC_DIR, HF_DIR, TRAINER_DIR, DiskFull, hf_copy_path, publish_folder,
                                           save_atomically, write_data_position)
from miles.phases.context import TrainingContext


async def save(ctx: TrainingContext) -> str:
    rid = ctx.next_rollout - 1
    t0 = time.monotonic()
    path = None
    if ctx.c.store is not None:
        try:
            path = await _save_run(ctx, rid)
        except DiskFull as exc:
            _go_on_without(ctx, exc)           # within --save-retries; else the run fails (exit 1)
            return "next"
    folders = ctx.c.folders                    # in place, or through Ray (miles.phases.checkpoint_io)
    if ctx.c.critic_store is not None:
        critic, optimizer = ctx.c.critic, ctx.cfg.checkpoint.save_optimizer
        critic_path = await save_atomically(
            ctx.c.critic_store, rid, lambda folder: folders.save(critic, "save", folder / CRITIC_DIR, optimizer=optimizer),
            {"critic": True, "optimizer": optimizer})
        ctx.tracer.emit("critic_checkpoint_saved", rollout_id=rid, path=str(critic_path))
    template = ctx.cfg.checkpoint.save_hf_path
    if template:                               # --save-hf: the HF export, outside the checkpoints
        trainer = ctx.c.trainer
        hf = await publish_folder(hf_copy_path(template, rid), lambda folder: folders.save(trainer, "export_hf", folder))
        ctx.tracer.emit("hf_exported", rollout_id=rid, path=str(hf))
    ctx.save_requested = False
    sentinel = ctx.cfg.checkpoint.save_trigger_sentinel
    if sentinel and os.path.exists(sentinel):
        os.remove(sentinel)
    ctx.saved_rollout, ctx.save_duration_s = rid, time.monotonic() - t0     # a stop's save reads both
    ctx.tracer.emit("checkpoint_saved", rollout_id=rid, path=str(path) if path else None,
                    duration_s=round(ctx.save_duration_s, 6))
    return "next"


def _go_on_without(ctx: TrainingContext, exc: DiskFull) -> None:
    """A save the disk had no room for: re-raise, unless --save-retries has some left; then the run
    goes on without that checkpoint (said on the console and in the trace)."""
    left = ctx.cfg.checkpoint.save_retries - ctx.saves_failed
    if left <= 0:
        raise exc
    ctx.saves_failed += 1
    ctx.save_requested = False
    ctx.tracer.emit("checkpoint_failed", rollout_id=exc.rollout_id, path=str(exc.root), free_bytes=exc.free_bytes,
                    retries_left=left - 1)
    ctx.tracer.emit("warning", code="disk_full", message=f"{exc}; going on without it ({left - 1} of "
                                                         "--save-retries left)")


async def _save_run(ctx: TrainingContext, rid: int) -> Path:
    """Trainer, data position, HF export and (without a store of its own) the critic, under --save."""
    trainer, save_hf, optimizer = ctx.c.trainer, ctx.cfg.checkpoint.save_hf, ctx.cfg.checkpoint.save_optimizer
    critic = ctx.c.critic if ctx.c.critic is not None and ctx.c.critic_store is None else None
    folders = ctx.c.folders
    position = ctx.data_states.get(rid)
    if position is None:                       # nothing drawn since rollout rid: the live position is its
        position = await ctx.c.executor.handle.state_dict.remote()

    async def write(folder: Path) -> Any:
        await folders.save(trainer, "save", folder / TRAINER_DIR, optimizer=optimizer)
        write_data_position(folder, position)
        if save_hf:
            await folders.save(trainer, "export_hf", folder / HF_DIR)
        if critic is not None:
            await folders.save(critic, "save", folder / CRITIC_DIR, optimizer=optimizer)

    return await save_atomically(ctx.c.store, rid, write, {"weight_version": ctx.next_rollout, "hf_export": save_hf,
                                                           "critic": critic is not None, "optimizer": optimizer})
