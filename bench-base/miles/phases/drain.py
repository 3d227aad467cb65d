"""`draining`: stop new work, settle in-flight work, and save what a stop would lose, before the teardown.

In the sync machine nothing is in flight between phases: a rollout batch not yet trained is
dropped (its object-store reference released) and the metrics file is flushed. A machine with
work in flight between phases (async: the rollout generating ahead, evals) lists how to settle
each in `ctx.in_flight`; they are settled here, in order, before anything is torn down. Then a
background save still being written (--async-save) is committed: within the stop's budget after a
stop (past it, it is aborted and `checkpoint_failed` says so); after a failure too, when its files
all arrive, since its snapshot was taken between two rollouts (if they do not, `checkpoint_failed`
says why and the run's own failure stands).

After a stop request (a preemption's SIGTERM, say) with --save set, the last trained rollout is saved
when it is not already and the stop's budget allows (`ctx.deadline`, set by the runner from
--stop-timeout): `stop_save` says whether it was, and why not. A failed run saves nothing: its state
is not known to be sound.
"""

from __future__ import annotations

import asyncio
import time

from miles.phases.context import TrainingContext
from miles.phases.save import save_checkpoint, settle_background_save
from miles.phases.watch import ci_at_end

END_MARGIN_S = 1.0          # of draining's budget, kept for what follows the save (the metrics flush)
CANCEL_GRACE_S = 1.0        # a save past its budget gets this long to abort its temporary folder


async def drain(ctx: TrainingContext) -> str:
    for settle in ctx.in_flight:
        await settle(ctx)
    await _settle_background_save(ctx)
    dropped = ctx.batch_ref is not None
    ctx.batch_ref = None
    if ctx.stop_requested.is_set() and ctx.failure is None:
        await save_on_stop(ctx)
    if ctx.c.metrics is not None:        # every sink's rows on disk before the teardown closes them
        ctx.c.metrics.flush()
    ctx.tracer.emit("drained", dropped_rollout=dropped, after_failure=ctx.failure is not None)
    ci_at_end(ctx)          # the evals have settled: --ci-metric-checker-key's verdict
    return "finish"


async def _settle_background_save(ctx: TrainingContext) -> None:
    pending = ctx.c.background_save
    if pending is None or not pending.pending:
        return
    rid = pending.rollout_id
    budget = None if ctx.deadline is None else max(ctx.deadline - time.monotonic() - END_MARGIN_S, 0.0)
    try:
        await settle_background_save(ctx, budget)
    except Exception as exc:
        if ctx.failure is None and not isinstance(exc, TimeoutError):
            raise
        ctx.tracer.emit("checkpoint_failed", rollout_id=rid, background=True, error=f"{type(exc).__name__}: {exc}")


async def save_on_stop(ctx: TrainingContext) -> None:
    """Save the last trained rollout within draining's budget; trace `stop_save` either way."""
    rid = ctx.next_rollout - 1
    budget = None if ctx.deadline is None else ctx.deadline - time.monotonic() - END_MARGIN_S
    reason = why_not_save_on_stop(ctx, rid, budget)
    if reason is not None:
        ctx.tracer.emit("stop_save", saved=False, rollout_id=rid, reason=reason)
        return
    t0 = time.monotonic()
    task = asyncio.ensure_future(save_checkpoint(ctx, background=False))
    done, _ = await asyncio.wait({task}, timeout=budget)
    if not done:                          # the save aborts its temporary folder: the store stays sound
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        ctx.tracer.emit("stop_save", saved=False, rollout_id=rid, reason=f"the save did not finish within the "
                        f"{budget:.1f} s left of the stop's budget (--stop-timeout); it was aborted")
        return
    task.result()
    ctx.tracer.emit("stop_save", saved=True, rollout_id=rid, duration_s=round(time.monotonic() - t0, 6))


def why_not_save_on_stop(ctx: TrainingContext, rid: int, budget: float | None) -> str | None:
    """Why a stop does not save rollout `rid` now (None: it does)."""
    c = ctx.cfg.checkpoint
    if not c.saves:
        return "--save is not set (nor --critic-save, --save-hf)"
    if rid < ctx.start_rollout:
        return "no rollout was trained since the run started"
    if ctx.saved_rollout == rid:
        return f"rollout {rid} is saved already"
    if ctx.training is not None:
        return (f"train was cut short while the trainer stepped on rollout {ctx.training}: its state is "
                "between two rollouts")
    if budget is not None and ctx.save_duration_s is not None and ctx.save_duration_s > budget:
        return (f"the last save took {ctx.save_duration_s:.1f} s and {max(budget, 0.0):.1f} s are left of the "
                "stop's budget (--stop-timeout)")
    return None
