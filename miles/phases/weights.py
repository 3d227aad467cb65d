"""`weight_sync`: the trainer's weights go to every engine, stamped with a version.

The transport is chosen once, in `init`: CUDA IPC buckets when the engines are colocated with the
trainer on GPUs (`ctx.c.ipc_weights`), else Ray's object store (the trainer puts one CPU copy, each
engine loads it). With IPC the driver walks the buckets: the trainer fills bucket i and hands out
its handle, every engine copies it, then the trainer frees it, so the extra GPU memory is one
bucket. With --check-weight-update-equal both sides' checksums are compared, whatever the transport,
and a mismatch fails the run. Then the GPU memory goes to the engines for the rollout
(miles.phases.memory).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from miles.phases.context import TrainingContext
from miles.phases.engines import with_engine_restarts
from miles.phases.memory import to_engines


class WeightSyncMismatch(RuntimeError):
    """An engine holds different weights than the trainer after a sync."""


class IpcWeights:
    """The CUDA IPC transport of a run, driver side: how many buckets the trainer's weights make, and
    the release of whatever bucket is still alive when the run ends (registered after the trainer,
    so it runs before the trainer's own teardown)."""

    resource_name = "ipc_weight_buckets"

    def __init__(self, trainer: Any, count: int):
        self.trainer, self.count = trainer, count

    async def dispose(self) -> None:
        """Free the trainer's live buckets. The trainer itself is the run's."""
        try:
            await self.trainer.release_weight_buckets.remote()
        except ray.exceptions.RayActorError:
            pass                      # a dead trainer holds no GPU memory


async def sync_weights(ctx: TrainingContext) -> str:
    t0 = time.monotonic()
    version = ctx.next_rollout
    ipc = ctx.c.ipc_weights
    await with_engine_restarts(ctx, lambda: _push_ipc(ctx, ipc, version) if ipc else _push_object_store(ctx, version))
    ctx.weight_version = version
    fields = {"version": version, "duration_s": round(time.monotonic() - t0, 6),
              "transport": "cuda_ipc" if ipc else "object_store"}
    if ctx.cfg.check_weights:
        fields["checksum"] = await _check_equal(ctx)
    ctx.tracer.emit("weights_synced", **fields)
    await to_engines(ctx)
    return "next"


async def _push_object_store(ctx: TrainingContext, version: int) -> None:
    weights = ctx.c.trainer.handle.weights.remote()
    await asyncio.gather(*(e.handle.update_weights.remote(weights, version) for e in ctx.c.engines))


async def _push_ipc(ctx: TrainingContext, ipc: IpcWeights, version: int) -> None:
    """Bucket by bucket; a retry after an engine restart starts again at bucket 0 (engines reset there)."""
    for i in range(ipc.count):
        bucket = ipc.trainer.weight_bucket.remote(i, version)       # a ref: engines read it from the trainer
        await asyncio.gather(*(e.handle.load_weight_bucket.remote(bucket) for e in ctx.c.engines))
        await ipc.trainer.release_weight_buckets.remote(i)


async def _check_equal(ctx: TrainingContext) -> str:
    dtype = await ctx.c.engines[0].handle.weights_dtype.remote()   # compare in the engines' dtype (bf16 on GPU)
    expected = await ctx.c.trainer.handle.weights_checksum.remote(dtype)
    got = await asyncio.gather(*(e.handle.weights_checksum.remote() for e in ctx.c.engines))
    bad = [f"engine-{i}: {g[:12]}" for i, g in enumerate(got) if g != expected]
    if bad:
        raise WeightSyncMismatch(f"weights differ after sync v{ctx.weight_version}: trainer {expected[:12]}, "
                                 + ", ".join(bad))
    return expected
