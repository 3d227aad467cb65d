"""GPU memory handed back and forth between the engines and the trainer (sync machine).

Once per iteration:
- `to_trainer`, at the start of `train`: the engines release their memory (`release_memory(MEMORY_TAGS)`:
  FastEngine its KV cache and CUDA graphs, an SGLang server its weights too), then the trainer takes
  its optimizer state back.
- `resume_engine_weights`, in `weight_sync` before the push: engines that released their weights
  (SGLang) take them back, so that the update has somewhere to go.
- `to_engines`, at the end of `weight_sync` (before rollout and eval): the trainer's optimizer state
  goes to host memory (--offload-train / --offload; not with PPO's critic, as in miles), the trainer
  returns its cached CUDA blocks, then the engines take back the rest (`resume_memory`).

Engines release with --offload-rollout / --offload on any device (on CPU the same calls, for an
SGLang server or a test), and with --colocate on GPUs; the trainer offloads on GPUs only. Engines
whose spec does not declare `SupportsMemoryRelease` keep theirs; a trainer whose spec does not declare
`SupportsOffload` keeps its optimizer state. `ctx.engines_released` holds the tags the engines have released,
so that a resume asks for exactly those and a restarted engine is put in the same state
(miles.phases.engines). Each hand-off is a trace event with its duration.
"""

from __future__ import annotations

import asyncio
import time

from miles.phases.context import TrainingContext
from miles.phases.engines import with_engine_restarts
from miles.rollout.protocol import MEMORY_TAGS, SupportsMemoryRelease
from miles.training.protocol import SupportsCachedMemoryRelease, SupportsOffload


def _engines_release(ctx: TrainingContext) -> bool:
    p, c = ctx.c.placement, ctx.cfg.cluster
    asked = c.offloads_rollout and bool(c.offload or c.offload_rollout)     # --no-offload-rollout wins
    on_gpus = p is not None and p.gpus and c.offloads_rollout      # --colocate implies it on GPUs
    return bool((asked or on_gpus) and ctx.c.engines and ctx.backends.engine_spec.supports(SupportsMemoryRelease))


def trainer_offloads(ctx: TrainingContext) -> bool:
    p = ctx.c.placement
    return bool(p is not None and p.gpus and ctx.cfg.cluster.offloads_train and ctx.c.trainer is not None
                and ctx.c.critic is None and ctx.backends.train_spec.supports(SupportsOffload))


async def _engines(ctx: TrainingContext, method: str, tags: tuple[str, ...]) -> None:
    await with_engine_restarts(ctx, lambda: asyncio.gather(*(getattr(e.handle, method).remote(tags)
                                                             for e in ctx.c.engines)))


async def resume_engine_weights(ctx: TrainingContext) -> None:
    if "weights" not in ctx.engines_released:
        return
    t0 = time.monotonic()
    await _engines(ctx, "resume_memory", ("weights",))
    ctx.engines_released = tuple(t for t in ctx.engines_released if t != "weights")
    ctx.tracer.emit("engine_memory_resumed", tags=["weights"], duration_s=round(time.monotonic() - t0, 6))


async def to_engines(ctx: TrainingContext) -> None:
    release, offload = _engines_release(ctx), trainer_offloads(ctx)
    if not (release or offload):
        return
    t0 = time.monotonic()
    moved = await ctx.c.trainer.handle.offload.remote() if offload else 0
    rest = ctx.engines_released
    if rest:
        if ctx.c.trainer is not None and ctx.backends.train_spec.supports(SupportsCachedMemoryRelease):
            await ctx.c.trainer.handle.release_cached_memory.remote()   # the last step's activations, cached
        await _engines(ctx, "resume_memory", rest)
        ctx.engines_released = ()
    ctx.tracer.emit("memory_to_engines", duration_s=round(time.monotonic() - t0, 6), trainer_offloaded_bytes=moved,
                    engines_resumed=list(rest))


async def to_trainer(ctx: TrainingContext) -> None:
    release, offload = _engines_release(ctx), trainer_offloads(ctx)
    if not (release or offload):
        return
    t0 = time.monotonic()
    if release:
        await _engines(ctx, "release_memory", MEMORY_TAGS)
        ctx.engines_released = MEMORY_TAGS
    moved = await ctx.c.trainer.handle.onload.remote() if offload else 0
    ctx.tracer.emit("memory_to_trainer", duration_s=round(time.monotonic() - t0, 6), trainer_onloaded_bytes=moved,
                    engines_released=list(MEMORY_TAGS) if release else [])
