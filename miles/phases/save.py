"""`save`: an atomic checkpoint of the rollout just trained (see miles/checkpoint/checkpointer.py)."""

from __future__ import annotations

import os
import time

from miles.checkpoint.checkpointer import save_checkpoint, save_critic_checkpoint
from miles.phases.context import TrainingContext


async def save(ctx: TrainingContext) -> str:
    rid = ctx.next_rollout - 1
    t0 = time.monotonic()
    critic = ctx.c.critic.handle if ctx.c.critic is not None else None
    path = None
    if ctx.c.store is not None:      # the critic goes inside, unless it has a store of its own (--critic-save)
        path = await save_checkpoint(ctx.c.store, rid, trainer=ctx.c.trainer.handle, executor=ctx.c.executor.handle,
                                     weight_version=ctx.next_rollout, save_hf=ctx.cfg.checkpoint.save_hf,
                                     critic=critic if ctx.c.critic_store is None else None)
    if ctx.c.critic_store is not None:
        critic_path = await save_critic_checkpoint(ctx.c.critic_store, rid, critic=critic)
        ctx.tracer.emit("critic_checkpoint_saved", rollout_id=rid, path=str(critic_path))
    ctx.save_requested = False
    sentinel = ctx.cfg.checkpoint.save_trigger_sentinel
    if sentinel and os.path.exists(sentinel):
        os.remove(sentinel)
    ctx.tracer.emit("checkpoint_saved", rollout_id=rid, path=str(path) if path else None,
                    duration_s=round(time.monotonic() - t0, 6))
    return "next"
