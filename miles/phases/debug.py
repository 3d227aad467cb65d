"""Half runs for debugging, as miles has them: roll out without training, or train without engines.

- `--debug-rollout-only` (machine `rollout_only`): engines and the executor, no trainer. Each
  rollout is generated, scored and logged (a metrics row of kind "rollout"); the weights stay the
  initial ones. With `--save-debug-rollout-data PATH`, each rollout's samples go to disk.
- `--load-debug-rollout-data PATH` (machine `train_only`): the trainer and no engines. The `rollout`
  phase reads rollout r from PATH instead of generating it; `train` and `save` are the usual ones.
  Replaying the rollouts of a run that trained on them gives the same losses, step for step.

`miles train` picks the machine from the flag; the config's checks (`miles.config.validate`, run with
the machine) refuse a machine that does not fit (a `sync` run cannot train from disk: it would still start engines and sync weights).
"""

from __future__ import annotations

import ray

from miles.config import RunConfig
from miles.config.validate import DEBUG_MACHINES
from miles.phases.context import TrainingContext
from miles.phases.rollout import rollout
from miles.metrics.watch import watch_reward_variance
from miles.rollout.debug_data import load_rollout_data, rollout_data_path

MACHINES = DEBUG_MACHINES        # the flag -> (its machine, the flag's name); its rules: miles.config.validate


def debug_machine(cfg: RunConfig) -> str | None:
    """The machine a debug flag implies (None: no debug flag)."""
    picked = [machine for field, (machine, _) in MACHINES.items() if getattr(cfg, field)]
    return picked[0] if len(picked) == 1 else None


async def load_rollout(ctx: TrainingContext) -> str:
    """train_only's `rollout`: rollout r from disk, into the object store for the trainer."""
    ctx.rollout_id = rid = ctx.next_rollout
    path = rollout_data_path(ctx.cfg.load_debug_rollout_data, rid)
    saved = load_rollout_data(path, expect_rollout_id=rid)
    ctx.batch_ref = ray.put(saved.samples)
    ctx.last_metrics = {}
    ctx.record(rid, saved.metrics)
    ctx.tracer.emit("rollout_done", rollout_id=rid, reward_mean=saved.metrics.get("reward_mean"),
                    samples=len(saved.samples), loaded_from=str(path))
    return "next"


async def rollout_only(ctx: TrainingContext) -> str:
    """rollout_only's `rollout`: the usual rollout (saved when asked), logged, and nothing trains on it."""
    trigger = await rollout(ctx)
    rid = ctx.rollout_id
    ctx.batch_ref = None
    ctx.next_rollout = rid + 1
    ctx.record(rid, {"kind": "rollout"})
    ctx.c.metrics.log(rid, ctx.last_metrics)
    ctx.metrics_history.append(dict(ctx.last_metrics))
    ctx.tracer.emit("metrics", rollout_id=rid, reward_mean=ctx.last_metrics.get("reward_mean"),
                    **watch_reward_variance(ctx, ctx.last_metrics))
    return trigger
