"""`weight_sync`: the trainer's weights go to every engine, stamped with a version.

Transport is Ray's object store: the trainer puts one CPU copy, each engine loads it. With
--check-weight-update-equal both sides' checksums are compared and a mismatch fails the run.
"""

from __future__ import annotations

import asyncio
import time

from miles.phases.context import TrainingContext
from miles.phases.engines import resume_engine_memory, with_engine_restarts


class WeightSyncMismatch(RuntimeError):
    """An engine holds different weights than the trainer after a sync."""


async def sync_weights(ctx: TrainingContext) -> str:
    t0 = time.monotonic()
    version = ctx.next_rollout
    weights = ctx.c.trainer.handle.weights.remote()

    async def push() -> None:
        await asyncio.gather(*(e.handle.update_weights.remote(weights, version) for e in ctx.c.engines))

    await resume_engine_memory(ctx, ("weights",))             # --offload-rollout: weights first, then the rest
    await with_engine_restarts(ctx, push)     # a restarted engine gets the current weights, then all get these
    await resume_engine_memory(ctx, ("kv_cache", "cuda_graph"))
    ctx.weight_version = version
    fields = {"version": version, "duration_s": round(time.monotonic() - t0, 6)}
    if ctx.cfg.check_weight_update_equal:
        fields["checksum"] = await _check_equal(ctx)
    ctx.tracer.emit("weights_synced", **fields)
    return "next"


async def _check_equal(ctx: TrainingContext) -> str:
    dtype = await ctx.c.engines[0].handle.weights_dtype.remote()   # compare in the engines' dtype (bf16 on GPU)
    expected = await ctx.c.trainer.handle.weights_checksum.remote(dtype)
    got = await asyncio.gather(*(e.handle.weights_checksum.remote() for e in ctx.c.engines))
    bad = [f"engine-{i}: {g[:12]}" for i, g in enumerate(got) if g != expected]
    if bad:
        raise WeightSyncMismatch(f"weights differ after sync v{ctx.weight_version}: trainer {expected[:12]}, "
                                 + ", ".join(bad))
    return expected
