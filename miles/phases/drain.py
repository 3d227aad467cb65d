"""`draining`: stop new work and settle in-flight work before the teardown.

In the sync machine nothing is in flight between phases: a rollout batch not yet trained is
dropped (its object-store reference released) and the metrics file is flushed. The async machine
adds its prefetched rollout here.
"""

from __future__ import annotations

from miles.phases.context import TrainingContext


async def drain(ctx: TrainingContext) -> str:
    dropped = ctx.batch_ref is not None
    ctx.batch_ref = None
    ctx.tracer.emit("drained", dropped_rollout=dropped, after_failure=ctx.failure is not None)
    return "finish"
