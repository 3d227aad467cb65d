"""`weight_sync`: the trainer's weights go to every engine, stamped with a version, and are read back.

The transport is chosen once, in `init`: CUDA IPC buckets when the engines are colocated with the
trainer on GPUs (`ctx.c.ipc_weights`), else Ray's object store (the trainer puts one CPU copy, each
engine loads it). With IPC the driver walks the buckets: the trainer fills bucket i and hands out
its handle, every engine copies it, then the trainer frees it, so the extra GPU memory is one
bucket. (SGLang loads the object-store copy from disk: `SGLangEngine.update_weights`.) Engines that
released their weights while the trainer trained (SGLang) take them back before the push; after
it, the rest of the GPU memory goes to the engines for the rollout (miles.phases.memory).

After the push every engine is asked which version it holds (cheap, always): an engine that did
not take the update fails the run, named. With --check-weight-update-equal (or --ci-test) the
engines' checksums are compared with the trainer's too, whatever the transport, and, before the
next push, with what each engine was given: weights that changed between two syncs (a corrupted
engine) fail the run with the engine named, before its rollouts are trained on any further.

With --debug-skip-weight-update nothing is pushed: the state still runs (the memory hand-off to the
engines included) and writes a `weights_sync_skipped` event instead of `weights_synced`; the engines
keep the weights they hold (the initial ones) and `ctx.weight_version` stays theirs. Validation
refuses the flag with the checks that compare engine and trainer weights.
"""

from __future__ import annotations

import asyncio
import time

from miles.phases.context import TrainingContext
from miles.phases.engines import with_engine_restarts
from miles.phases.memory import resume_engine_weights, to_engines


class WeightSyncMismatch(RuntimeError):
    """An engine holds different weights than the trainer gave it."""


async def sync_weights(ctx: TrainingContext) -> str:
    if ctx.cfg.debug_skip_weight_update:
        return await _skip_sync(ctx)
    t0 = time.monotonic()
    version = ctx.next_rollout
    await resume_engine_weights(ctx)          # engines that released their weights (SGLang) need them back first
    check = ctx.cfg.check_weights
    if check and ctx.engine_weights_checksum is not None:       # still what the last sync gave them?
        await with_engine_restarts(ctx, lambda: _read_back(ctx, ctx.weight_version, ctx.engine_weights_checksum,
                                                           when="before the next update"))
    ipc = ctx.c.ipc_weights
    await with_engine_restarts(ctx, lambda: _push_ipc(ctx, ipc, version) if ipc else _push_object_store(ctx, version))
    ctx.weight_version = version
    expected = await _expected_checksum(ctx) if check else None
    await _read_back(ctx, version, expected, when="after the update")
    ctx.engine_weights_checksum = expected
    fields = {"version": version, "duration_s": round(time.monotonic() - t0, 6),
              "transport": "cuda_ipc" if ipc else "object_store"}
    if expected is not None:
        fields["checksum"] = expected
    ctx.tracer.emit("weights_synced", **fields)
    await to_engines(ctx)
    return "next"


async def _skip_sync(ctx: TrainingContext) -> str:
    """--debug-skip-weight-update: say so in the trace, and hand the memory to the engines as a sync would."""
    await resume_engine_weights(ctx)
    ctx.tracer.emit("weights_sync_skipped", version=ctx.next_rollout, engines_hold=ctx.weight_version,
                    reason="--debug-skip-weight-update")
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


async def _expected_checksum(ctx: TrainingContext) -> str:
    dtype = await ctx.c.engines[0].handle.weights_dtype.remote()   # compare in the engines' dtype (bf16 on GPU)
    return await ctx.c.trainer.handle.weights_checksum.remote(dtype)


async def _read_back(ctx: TrainingContext, version: int, checksum: str | None, *, when: str) -> None:
    """Ask every engine what it holds; raise WeightSyncMismatch naming each one that differs."""
    engines = ctx.c.engines
    versions = await asyncio.gather(*(e.handle.weight_version.remote() for e in engines))
    sums = (await asyncio.gather(*(e.handle.weights_checksum.remote() for e in engines))
            if checksum is not None else [None] * len(engines))
    bad = engine_problems([e.resource_name for e in engines], version, checksum, list(zip(versions, sums)))
    if bad:
        raise WeightSyncMismatch(f"{when} to v{version}: " + "; ".join(bad))


def engine_problems(names: list[str], version: int, checksum: str | None,
                    held: list[tuple[int, str | None]]) -> list[str]:
    """What each engine holds (version, checksum) against what it was given; one line per bad engine."""
    bad = []
    for name, (got_version, got_sum) in zip(names, held):
        if got_version != version:
            bad.append(f"{name} holds weight version {got_version}, not {version}")
        elif checksum is not None and got_sum != checksum:
            bad.append(f"{name} holds weights with checksum {str(got_sum)[:12]}, the trainer's v{version} "
                       f"is {checksum[:12]}")
    return bad
