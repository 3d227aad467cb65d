"""`rollout`: the executor samples, scores and computes advantages for the next batch of prompts.

The samples stay in Ray's object store (the trainer reads them from there); the driver keeps their
reference and reads only the metrics.
"""

from __future__ import annotations

from miles.phases.context import TrainingContext


async def rollout(ctx: TrainingContext) -> str:
    ctx.rollout_id = ctx.next_rollout
    samples_ref, metrics_ref = ctx.c.executor.handle.generate_split.options(num_returns=2).remote(ctx.rollout_id)
    metrics = await metrics_ref
    ctx.batch_ref = samples_ref
    ctx.last_metrics = {}
    ctx.record(ctx.rollout_id, metrics)
    ctx.tracer.emit("rollout_done", rollout_id=ctx.rollout_id, reward_mean=metrics["reward_mean"],
                    samples=int(metrics["num_samples"]))
    return "next"
