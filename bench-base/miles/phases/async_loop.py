"""The async machine's handlers (machines/async.yaml): the sync phases plus the work in flight.

- `init` is the sync composition root, then the prefetcher and the eval dispatcher
  (miles/rollout/prefetch.py, miles/rollout/evals.py), each registered with the disposer where it is
  created (after the executor and the models, so they are settled before those are torn down).
- `weight_sync` first awaits the rollout generating ahead and the evals in flight: no request
  straddles two weight versions (miles' train_async.py: "sync generate before update params").
- `rollout` takes rollout r (generated ahead) and asks for r+1 before r trains; it records the data
  position right after r's prompts, which the common `save` (miles/phases/save.py) writes.
- `eval` dispatches the evals and does not wait; `draining` cancels the rollout ahead and settles them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from miles.phases import init as sync_init
from miles.phases import weights as sync_weights_phase
from miles.phases.context import TrainingContext
from miles.phases.engines import restart_unresponsive, with_engine_restarts
from miles.phases.watch import ci_after_eval
from miles.rollout.evals import EvalDispatcher
from miles.rollout.executor import PROMPTS_KEY
from miles.rollout.prefetch import Prefetcher
from miles.rollout.protocol import EngineUnresponsive


async def init(ctx: TrainingContext) -> str:
    trigger = await sync_init.init(ctx)
    executor, timeout = ctx.c.executor.handle, ctx.cfg.trace.teardown_timeout_s
    ctx.c.prefetch = Prefetcher(lambda r: executor.generate_split.options(num_returns=2).remote(r), ctx.tracer)
    ctx.disposer.add(ctx.c.prefetch, timeout=timeout, force=ctx.c.prefetch.force)

    def on_eval(step: int, version: int, metrics: dict[str, float]) -> None:
        row = {**metrics, "kind": "eval", "weight_version": version}
        ctx.c.metrics.log(step, row)
        ctx.metrics_history.append({"step": step, **row})
        ci_after_eval(ctx, step, metrics)      # raising here fails the eval's job, which fails the run

    ctx.c.evals = EvalDispatcher(lambda step: executor.evaluate.remote(step), on_eval, ctx.tracer)
    ctx.disposer.add(ctx.c.evals, timeout=timeout, force=ctx.c.evals.force)
    ctx.in_flight += [_drain_prefetch, _drain_evals]       # `draining` settles them in this order
    return trigger


async def sync_weights(ctx: TrainingContext) -> str:
    t0 = time.monotonic()
    ahead, evals = ctx.c.prefetch.rollout_id, ctx.c.evals.in_flight
    await ctx.c.prefetch.wait()
    await _settle_evals(ctx)
    ctx.tracer.emit("in_flight_settled", rollout_ahead=ahead, evals=evals, waited_s=round(time.monotonic() - t0, 6))
    return await sync_weights_phase.sync_weights(ctx)


async def rollout(ctx: TrainingContext) -> str:
    """Take rollout r (generated ahead, or asked for now), then ask for r+1 if it will be trained."""
    r, prefetch = ctx.next_rollout, ctx.c.prefetch
    if prefetch.rollout_id != r:              # nothing generated ahead: the first rollout of a run
        prefetch.start(r, ctx.weight_version)
    t0 = time.monotonic()
    samples_ref, metrics = await _take(ctx, r)
    waited = time.monotonic() - t0
    metrics = dict(metrics)
    prompts = metrics.pop(PROMPTS_KEY, None)
    ctx.rollout_id, ctx.batch_ref = r, samples_ref
    ctx.last_metrics = {}
    ctx.record(r, {**metrics, "rollout_wait_s": waited})
    ctx.tracer.emit("rollout_done", rollout_id=r, reward_mean=metrics["reward_mean"],
                    samples=int(metrics["num_samples"]), staleness_max=metrics["staleness_max"],
                    waited_s=round(waited, 6), prompts=prompts)
    # the data position a checkpoint of rollout r holds, read before r+1's prompts are drawn (r-1's,
    # the last trained, is kept: a stop now saves that one)
    ctx.note_data_position(r, await ctx.c.executor.handle.state_dict.remote())
    if ctx.will_run(r + 1) and not ctx.stop_requested.is_set():
        prefetch.start(r + 1, ctx.weight_version)
    return "next"


async def _take(ctx: TrainingContext, r: int) -> tuple[Any, dict[str, Any]]:
    try:
        return await ctx.c.prefetch.take(r)
    except (ray.exceptions.RayActorError, EngineUnresponsive) as exc:
        # an engine died (or hung) under the generation (it may have been restarted since): ask again;
        # a dead engine found now is restarted within the budget, and the executor re-serves r's prompts
        ctx.tracer.emit("prefetch_retry", rollout_id=r, error={"type": type(exc).__name__, "message": str(exc)[:500]})
        if isinstance(exc, EngineUnresponsive) and not await restart_unresponsive(ctx, exc):
            raise

    async def again() -> tuple[Any, dict[str, Any]]:
        ctx.c.prefetch.start(r, ctx.weight_version)
        return await ctx.c.prefetch.take(r)

    return await with_engine_restarts(ctx, again)


async def dispatch_eval(ctx: TrainingContext) -> str:
    """`eval`: start every eval dataset on the weights just synced; no waiting."""
    ctx.c.evals.submit(ctx.next_rollout, ctx.weight_version)
    ctx.evaluated_version = ctx.eval_key()
    return "next"


async def _settle_evals(ctx: TrainingContext) -> None:
    """Await the evals in flight. One an engine died under is run again (the dead engine restarted,
    within the budget, with the weights it read); any other failure fails the run."""
    for job in await ctx.c.evals.wait():
        if isinstance(job.error, EngineUnresponsive) and await restart_unresponsive(ctx, job.error):
            pass                          # the hung engine is restarted: run the eval again
        elif not isinstance(job.error, ray.exceptions.RayActorError):
            raise job.error
        ctx.c.evals.submit(job.step, job.weight_version, redo=True, evaluate=lambda step: with_engine_restarts(
            ctx, lambda: ctx.c.executor.handle.evaluate.remote(step)))
    for job in await ctx.c.evals.wait():
        raise job.error


async def _drain_prefetch(ctx: TrainingContext) -> None:
    await ctx.c.prefetch.settle()


async def _drain_evals(ctx: TrainingContext) -> None:
    """`draining`: evals finish (their rows are the run's last word on quality), unless the run was
    cancelled; after a failure their own failures are traced, not raised over the first one."""
    if isinstance(ctx.failure, (asyncio.CancelledError, KeyboardInterrupt)):
        await ctx.c.evals.cancel()
    elif ctx.failure is not None:
        await ctx.c.evals.wait()
    else:
        await _settle_evals(ctx)
