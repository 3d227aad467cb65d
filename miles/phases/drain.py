"""`draining`: stop new work and settle in-flight work before the teardown.

In the sync machine nothing is in flight between phases: a rollout batch not yet trained is
dropped (its object-store reference released) and the metrics file is flushed. A machine with
work in flight between phases (async: the rollout generating ahead, evals) lists how to settle
each in `ctx.in_flight`; they are settled here, in order, before anything is torn down.
"""

from __future__ import annotations

from miles.phases.context import TrainingContext


async def drain(ctx: TrainingContext) -> str:
    for settle in ctx.in_flight:
        await settle(ctx)
    dropped = ctx.batch_ref is not None
    ctx.batch_ref = None
    if ctx.c.metrics is not None:        # every sink's rows on disk before the teardown closes them
        ctx.c.metrics.flush()
    ctx.tracer.emit("drained", dropped_rollout=dropped, after_failure=ctx.failure is not None)
    return "finish"
