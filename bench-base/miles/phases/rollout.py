"""`rollout`: the executor samples, scores and computes advantages for the next batch of prompts.

The samples stay in Ray's object store (the trainer reads them from there); the driver keeps their
reference and reads only the metrics.
"""

from __future__ import annotations

from typing import Any

from miles.phases.context import TrainingContext
from miles.phases.engines import with_engine_restarts
from miles.rollout.executor import PROMPTS_KEY


async def rollout(ctx: TrainingContext) -> str:
    ctx.rollout_id = ctx.next_rollout

    async def attempt() -> tuple[Any, dict[str, Any]]:
        # the executor re-serves the same prompts when a rollout id is retried after an engine restart
        samples, metrics = ctx.c.executor.handle.generate_split.options(num_returns=2).remote(ctx.rollout_id)
        return samples, await metrics

    samples_ref, metrics = await with_engine_restarts(ctx, attempt)
    prompts = metrics.pop(PROMPTS_KEY, None)
    ctx.batch_ref = samples_ref
    ctx.last_metrics = {}
    ctx.record(ctx.rollout_id, metrics)
    ctx.tracer.emit("rollout_done", rollout_id=ctx.rollout_id, reward_mean=metrics["reward_mean"],
                    samples=int(metrics["num_samples"]), prompts=prompts)
    # the data position a checkpoint of this rollout holds (the last trained one's is kept: a stop now
    # saves that one, and the executor has moved past its prompts)
    ctx.note_data_position(ctx.rollout_id, await ctx.c.executor.handle.state_dict.remote())
    if ctx.cfg.debug_rollout_data_path:
        await _save_debug_data(ctx, samples_ref, metrics)
    return "next"


async def _save_debug_data(ctx: TrainingContext, samples_ref: Any, metrics: dict[str, Any]) -> None:
    """--save-debug-rollout-data (or --dump-details): the samples come to the driver (a debugging cost, off
    by default)."""
    from miles.tracking.rollout_data import rollout_data_path, save_rollout_data

    path = rollout_data_path(ctx.cfg.debug_rollout_data_path, ctx.rollout_id)
    save_rollout_data(path, ctx.rollout_id, await samples_ref, metrics)
    ctx.tracer.emit("rollout_data_saved", rollout_id=ctx.rollout_id, path=str(path))
