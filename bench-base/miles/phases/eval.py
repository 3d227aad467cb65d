"""`eval`: every eval dataset, on the weights just synced to the engines."""

from __future__ import annotations

from miles.phases.context import TrainingContext
from miles.phases.engines import with_engine_restarts
from miles.phases.watch import ci_after_eval


async def evaluate(ctx: TrainingContext) -> str:
    done = ctx.next_rollout
    ctx.tracer.emit("eval_begin", rollout_id=done, why=why_due(ctx))
    metrics = await with_engine_restarts(ctx, lambda: ctx.c.executor.handle.evaluate.remote(done))
    ctx.evaluated_version = ctx.eval_key()
    row = {**metrics, "kind": "eval", "weight_version": ctx.weight_version}
    ctx.c.metrics.log(done, row)
    ctx.metrics_history.append({"step": done, **row})
    ctx.tracer.emit("eval_done", rollout_id=done, **{k: v for k, v in metrics.items() if k.endswith("pass@1")})
    ci_after_eval(ctx, done, metrics)
    return "next"


def why_due(ctx: TrainingContext) -> str:
    """Why this eval runs now, in the words of its progress line (the rule is `ctx.eval_due`)."""
    e = ctx.cfg.eval
    if ctx.next_rollout == ctx.start_rollout:
        return ("before the first rollout, the baseline (miles runs it whatever --eval-interval is; "
                "--skip-eval-before-train skips it)")
    if e.interval is not None and ctx.next_rollout % e.interval == 0:
        return f"every --eval-interval {e.interval} rollouts"
    return "after the last rollout"
