"""The async machine's `init` and `weight_sync`: the sync phases plus the in-flight work.

- `init` is the sync composition root, then the prefetcher and the eval dispatcher, each registered
  with the disposer where it is created (after the executor and the models, so they are settled
  before those are torn down).
- `weight_sync` first awaits the rollout generating ahead and the evals in flight: no request
  straddles two weight versions (miles' train_async.py: "sync generate before update params").
- `save` is the sync one (miles/phases/save.py): it writes the data position the async rollout
  phase recorded for the rollout saved (`ctx.data_states`).
"""

from __future__ import annotations

import time

from miles.phases import init as sync_init
from miles.phases import weights as sync_weights_phase
from miles.phases.context import TrainingContext
from miles.phases.eval_dispatch import drain_evals, make_eval_dispatcher, settle_evals
from miles.phases.prefetch import Prefetcher


async def init(ctx: TrainingContext) -> str:
    trigger = await sync_init.init(ctx)
    ctx.c.prefetch = Prefetcher(ctx.c.executor.handle, ctx.tracer)
    ctx.disposer.add(ctx.c.prefetch, timeout=ctx.cfg.trace.teardown_timeout_s, force=ctx.c.prefetch.force)
    ctx.c.evals = make_eval_dispatcher(ctx)
    ctx.in_flight += [_drain_prefetch, drain_evals]       # `draining` settles them in this order
    return trigger


async def _drain_prefetch(ctx: TrainingContext) -> None:
    await ctx.c.prefetch.settle()


async def sync_weights(ctx: TrainingContext) -> str:
    t0 = time.monotonic()
    ahead, evals = ctx.c.prefetch.rollout_id, ctx.c.evals.in_flight
    await ctx.c.prefetch.wait()
    await settle_evals(ctx)
    ctx.tracer.emit("in_flight_settled", rollout_ahead=ahead, evals=evals, waited_s=round(time.monotonic() - t0, 6))
    return await sync_weights_phase.sync_weights(ctx)
