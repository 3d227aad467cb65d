"""`save`, for every machine: an atomic checkpoint of the rollout just trained.

The checkpoint under --save holds the trainer (its optimizer state unless --no-save-optim), the data
position, the HF export (unless --no-save-hf) and PPO's critic; a critic with a store of its own (--critic-save elsewhere) is saved there instead,
and with --critic-save alone only the critic is saved. The data position is the one the rollout
phase recorded right after the saved rollout's prompts were drawn (`ctx.note_data_position`): by
the time a checkpoint is written the executor may be past the next rollout's prompts too (the async
machine's rollout generated ahead; a stop that let the next rollout finish before it drained). Only
a machine whose executor draws nothing (train_only) records none; its live position is the one.
--save-hf PATH also exports the HF model to PATH, outside the checkpoints (and with no --save, alone). Layout: miles/checkpoint/checkpointer.py. The actors' folders
reach the driver in place or through Ray, as `ctx.c.folders` does it (miles/phases/checkpoint_io.py).
A save the disk has no room for removes its partial folder and fails the run naming the folder and the
space left (DiskFull, exit 1), or with --save-retries N goes on without that checkpoint N times.
With --async-save (and a trainer that can: `SupportsBackgroundSave`) the checkpoint under --save is
a background one: the phase takes the snapshots and a task commits the folder when its files are
written (miles/phases/background_save.py); the save before it is settled first. A stop's save is
always synchronous.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from miles.checkpoint.checkpointer import (CRITIC_DIR, HF_DIR, TRAINER_DIR, DiskFull, abort_checkpoint, begin_checkpoint,
                                           hf_copy_path, publish_folder, save_atomically, write_data_position)
from miles.phases.background_save import commit_when_written, start_parts
from miles.phases.context import TrainingContext
from miles.phases.watch import ci_save_model_hash


async def save(ctx: TrainingContext) -> str:
    await save_checkpoint(ctx, background=ctx.c.background_save is not None)
    return "next"


async def save_checkpoint(ctx: TrainingContext, *, background: bool) -> None:
    """Save the last trained rollout (see the module docstring); `background`: --async-save's way."""
    rid = ctx.next_rollout - 1
    await settle_background_save(ctx)          # the one before, committed (or its failure raised) first
    t0 = time.monotonic()
    path = None
    if ctx.c.store is not None:
        try:
            path = await (_start_background_run(ctx, rid, t0) if background else _save_run(ctx, rid))
        except DiskFull as exc:
            _go_on_without(ctx, exc)           # within --save-retries; else the run fails (exit 1)
            return
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
    if background and path is not None:        # committed later, by the pending save's task
        ctx.tracer.emit("checkpoint_snapshot", rollout_id=rid, path=str(path), duration_s=round(time.monotonic() - t0, 6))
        return
    ctx.saved_rollout, ctx.save_duration_s = rid, time.monotonic() - t0     # a stop's save reads both
    ctx.tracer.emit("checkpoint_saved", rollout_id=rid, path=str(path) if path else None,
                    duration_s=round(ctx.save_duration_s, 6))


async def settle_background_save(ctx: TrainingContext, timeout: float | None = None) -> None:
    """The pending background save (--async-save), if any, committed: its full disk is handled as a
    synchronous save's (--save-retries); any other failure, or `timeout` passing, is raised."""
    if ctx.c.background_save is None:
        return
    try:
        await ctx.c.background_save.settle(timeout)
    except DiskFull as exc:
        _go_on_without(ctx, exc)


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
    parts, position, manifest = await _run_parts(ctx, rid)
    folders = ctx.c.folders

    async def write(folder: Path) -> Any:
        write_data_position(folder, position)
        for actor, method, sub, kwargs in parts:
            await folders.save(actor, method, folder / sub, **kwargs)
        await ci_save_model_hash(ctx, folder)

    return await save_atomically(ctx.c.store, rid, write, manifest)


async def _start_background_run(ctx: TrainingContext, rid: int, t0: float) -> Path:
    """`_save_run`'s parts as a background save: each actor's snapshot now, the commit by the pending
    save's task once their files are written (miles/phases/background_save.py); returns the path the
    checkpoint will have."""
    parts, position, manifest = await _run_parts(ctx, rid)
    store, folders = ctx.c.store, ctx.c.folders
    tmp = begin_checkpoint(store, rid)
    try:
        write_data_position(tmp, position)
        await ci_save_model_hash(ctx, tmp)     # the weights the snapshots below take
    except BaseException as exc:
        raise abort_checkpoint(store, tmp, rid, exc)
    finishers = await start_parts(store, tmp, rid, [
        lambda a=actor, m=method, f=tmp / sub, k=kwargs: folders.start_save(a, m, f, **k)
        for actor, method, sub, kwargs in parts])

    def committed(path: Path) -> None:         # a stop's save reads both
        ctx.saved_rollout, ctx.save_duration_s = rid, time.monotonic() - t0
        ctx.tracer.emit("checkpoint_saved", rollout_id=rid, path=str(path), background=True,
                        duration_s=round(ctx.save_duration_s, 6))

    ctx.c.background_save.start(rid, commit_when_written(store, tmp, rid, finishers, manifest, committed),
                                abort=lambda: store.abort(tmp))
    return store.path_for(rid)


async def _run_parts(ctx: TrainingContext, rid: int) -> tuple[list, dict[str, Any], dict[str, Any]]:
    """What a checkpoint under --save holds: the actors' parts (actor, method, folder, kwargs) in order,
    the data position, and the manifest's fields."""
    trainer, save_hf, optimizer = ctx.c.trainer, ctx.cfg.checkpoint.save_hf, ctx.cfg.checkpoint.save_optimizer
    critic = ctx.c.critic if ctx.c.critic is not None and ctx.c.critic_store is None else None
    position = ctx.data_states.get(rid)
    if position is None:                       # nothing drawn (train_only): the live position is its
        position = await ctx.c.executor.handle.state_dict.remote()
    parts = [(trainer, "save", TRAINER_DIR, {"optimizer": optimizer})]
    if save_hf:
        parts.append((trainer, "export_hf", HF_DIR, {}))
    if critic is not None:
        parts.append((critic, "save", CRITIC_DIR, {"optimizer": optimizer}))
    return parts, position, {"weight_version": ctx.next_rollout, "hf_export": save_hf, "critic": critic is not None,
                             "optimizer": optimizer}
