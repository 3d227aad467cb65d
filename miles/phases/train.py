"""`train`: the trainer takes one rollout's samples and steps the policy."""

from __future__ import annotations

import time

from miles.phases.context import TrainingContext


async def train(ctx: TrainingContext) -> str:
    rid = ctx.rollout_id
    t0 = time.monotonic()
    metrics = await ctx.c.trainer.handle.train.remote(ctx.batch_ref, rid)   # Ray resolves the ref in the trainer
    ctx.batch_ref = None
    ctx.next_rollout = rid + 1
    ctx.record(rid, {**metrics, "train_time_s": time.monotonic() - t0, "kind": "train"})
    ctx.c.metrics.log(rid, ctx.last_metrics)
    ctx.metrics_history.append(dict(ctx.last_metrics))
    ctx.tracer.emit("metrics", rollout_id=rid, **{k: v for k, v in ctx.last_metrics.items()
                                                  if k in ("reward_mean", "loss", "kl", "grad_norm")})
    return "next"
