"""`save`: an atomic checkpoint of the rollout just trained (see miles/checkpoint/checkpointer.py)."""

from __future__ import annotations

import os
import time

from pathlib import Path

from miles.checkpoint.checkpointer import export_hf_copy, save_checkpoint, save_critic_checkpoint
from miles.phases.context import TrainingContext


async def save(ctx: TrainingContext) -> str:
    rid = ctx.next_rollout - 1
    t0 = time.monotonic()
    c = ctx.cfg.checkpoint
    critic = ctx.c.critic.handle if ctx.c.critic is not None else None
    path = None
    if ctx.c.store is not None:      # the critic goes inside, unless it has a store of its own (--critic-save)
        path = await save_checkpoint(ctx.c.store, rid, trainer=ctx.c.trainer.handle, executor=ctx.c.executor.handle,
                                     weight_version=ctx.next_rollout, save_hf=c.save_hf,
                                     critic=critic if ctx.c.critic_store is None else None,
                                     save_optimizer=c.save_optimizer)
    if ctx.c.critic_store is not None:
        critic_path = await save_critic_checkpoint(ctx.c.critic_store, rid, critic=critic,
                                                   save_optimizer=c.save_optimizer)
        ctx.tracer.emit("critic_checkpoint_saved", rollout_id=rid, path=str(critic_path))
    await finish_save(ctx, rid, path, t0)
    return "next"


async def finish_save(ctx: TrainingContext, rid: int, path: Path | None, t0: float) -> None:
    """After the checkpoint: --save-hf's export, the sentinel removed, the save traced."""
    template = ctx.cfg.checkpoint.save_hf_path
    if template:
        hf = await export_hf_copy(ctx.c.trainer.handle, template, rid)
        ctx.tracer.emit("hf_exported", rollout_id=rid, path=str(hf))
    ctx.save_requested = False
    sentinel = ctx.cfg.checkpoint.save_trigger_sentinel
    if sentinel and os.path.exists(sentinel):
        os.remove(sentinel)
    ctx.tracer.emit("checkpoint_saved", rollout_id=rid, path=str(path) if path else None,
                    duration_s=round(time.monotonic() - t0, 6))
