"""GPU memory handed back and forth between colocated engines and the trainer (sync machine).

Once per iteration, on GPUs only (a CPU run never moves memory):
- `to_engines`, at the end of `weight_sync` (before rollout and eval): the trainer's optimizer
  state goes to host memory (--offload-train / --offload; not with PPO's critic, as in miles), the
  trainer returns its cached CUDA blocks, then the engines take their KV cache back (`resume_memory`).
- `to_trainer`, at the start of `train`: the engines free their KV cache (`release_memory`;
  --offload-rollout / --offload / --colocate), then the trainer takes its optimizer state back.
Engines without `release_memory` keep theirs. Each hand-off is a trace event with its duration.
"""

from __future__ import annotations

import asyncio
import time

from miles.phases.context import TrainingContext
from miles.phases.engines import with_engine_restarts


def _engines_release(ctx: TrainingContext) -> bool:
    p = ctx.c.placement
    return bool(p is not None and p.gpus and ctx.cfg.cluster.offloads_rollout and ctx.c.engines
                and hasattr(ctx.backends.engine, "release_memory"))


def _trainer_offloads(ctx: TrainingContext) -> bool:
    p = ctx.c.placement
    return bool(p is not None and p.gpus and ctx.cfg.cluster.offloads_train and ctx.c.trainer is not None
                and ctx.c.critic is None and hasattr(ctx.backends.trainer, "offload"))


async def _engines(ctx: TrainingContext, method: str) -> None:
    await with_engine_restarts(ctx, lambda: asyncio.gather(*(getattr(e.handle, method).remote()
                                                             for e in ctx.c.engines)))


async def to_engines(ctx: TrainingContext) -> None:
    release, offload = _engines_release(ctx), _trainer_offloads(ctx)
    if not (release or offload):
        return
    t0 = time.monotonic()
    moved = await ctx.c.trainer.handle.offload.remote() if offload else 0
    if release:
        if ctx.c.trainer is not None and hasattr(ctx.backends.trainer, "release_cached_memory"):
            await ctx.c.trainer.handle.release_cached_memory.remote()   # the last step's activations, cached
        await _engines(ctx, "resume_memory")
    ctx.tracer.emit("memory_to_engines", duration_s=round(time.monotonic() - t0, 6), trainer_offloaded_bytes=moved,
                    engines_resumed=release)


async def to_trainer(ctx: TrainingContext) -> None:
    release, offload = _engines_release(ctx), _trainer_offloads(ctx)
    if not (release or offload):
        return
    t0 = time.monotonic()
    if release:
        await _engines(ctx, "release_memory")
    moved = await ctx.c.trainer.handle.onload.remote() if offload else 0
    ctx.tracer.emit("memory_to_trainer", duration_s=round(time.monotonic() - t0, 6), trainer_onloaded_bytes=moved,
                    engines_released=release)
