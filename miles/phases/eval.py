"""`eval`: every eval dataset, on the weights just synced to the engines."""

from __future__ import annotations

from miles.phases.context import TrainingContext
from miles.phases.engines import with_engine_restarts
from miles.phases.watch import ci_after_eval


async def evaluate(ctx: TrainingContext) -> str:
    done = ctx.next_rollout
    metrics = await with_engine_restarts(ctx, lambda: ctx.c.executor.handle.evaluate.remote(done))
    ctx.evaluated_version = ctx.eval_key()
    row = {**metrics, "kind": "eval", "weight_version": ctx.weight_version}
    ctx.c.metrics.log(done, row)
    ctx.metrics_history.append({"step": done, **row})
    ctx.tracer.emit("eval_done", rollout_id=done, **{k: v for k, v in metrics.items() if k.endswith("pass@1")})
    ci_after_eval(ctx, done, metrics)
    return "next"
