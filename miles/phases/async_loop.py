"""The async machine's `init`, `weight_sync` and `save`: the sync phases plus the in-flight work.

- `init` is the sync composition root, then the prefetcher and the eval dispatcher, each registered
  with the disposer where it is created (after the executor and the models, so they are settled
  before those are torn down).
- `weight_sync` first awaits the rollout generating ahead and the evals in flight: no request
  straddles two weight versions (miles' train_async.py: "sync generate before update params").
- `save` writes the data position of the rollout just trained, read before the next rollout's
  prompts were drawn: by the time of the save the executor has already served them.
"""

from __future__ import annotations

import time
from typing import Any

from miles.checkpoint.checkpointer import save_checkpoint
from miles.phases import init as sync_init
from miles.phases import save as sync_save
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


async def save(ctx: TrainingContext) -> str:
    rid = ctx.next_rollout - 1
    state = ctx.data_states.get(rid)
    if state is None or ctx.c.store is None:   # nothing was asked for since: the executor's position is rid's
        return await sync_save.save(ctx)
    t0 = time.monotonic()
    critic = ctx.c.critic.handle if ctx.c.critic is not None and ctx.c.critic_store is None else None
    path = await save_checkpoint(ctx.c.store, rid, trainer=ctx.c.trainer.handle, executor=_DataPosition(state),
                                 weight_version=ctx.next_rollout, save_hf=ctx.cfg.checkpoint.save_hf, critic=critic,
                                 save_optimizer=ctx.cfg.checkpoint.save_optimizer)
    await sync_save.finish_save(ctx, rid, path, t0)     # as the sync save does
    return "next"


class _DataPosition:
    """Stands in for the executor handle in `save_checkpoint`: `state_dict.remote()` answers the
    position recorded after rollout r's prompts were drawn (miles saves the live one, which is
    already past r+1's prompts: a resume would skip them)."""

    def __init__(self, state: dict[str, Any]):
        self.state_dict = _Remote(state)


class _Remote:
    def __init__(self, value: Any):
        self._value = value

    async def remote(self) -> Any:
        return self._value
