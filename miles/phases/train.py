"""`train`: the trainer takes one rollout's samples and steps the policy.

With PPO's critic (--advantage-estimator ppo) the critic goes first, as miles does: its values feed
the trainer's GAE, it steps on the returns, then the policy steps, except during the first
--num-critic-only-steps rollouts, which train the critic alone.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from miles.phases.context import TrainingContext
from miles.cluster.memory import to_trainer
from miles.metrics.watch import ci_after_train, ci_checks, watch_reward_variance


async def train(ctx: TrainingContext) -> str:
    rid = ctx.rollout_id
    t0 = time.monotonic()
    ctx.training = rid                   # stays set if the phase is cut short: a stop's save then knows
    await to_trainer(ctx)          # colocated GPUs: the engines' cache out, the optimizer state in
    if ctx.c.critic is not None:
        metrics = await _train_with_critic(ctx, rid)
    else:
        metrics = await _train_policy(ctx, ctx.c.trainer.handle, ctx.batch_ref, rid)
    ctx.training = ctx.train_submitted = None
    ctx.batch_ref = None
    ctx.next_rollout = rid + 1
    ci_after_train(ctx, rid, metrics)    # takes the per-step norms out of the row
    ctx.record(rid, {**metrics, "train_time_s": time.monotonic() - t0, "kind": "train"})
    ctx.c.metrics.log(rid, ctx.last_metrics)
    ctx.metrics_history.append(dict(ctx.last_metrics))
    extra = watch_reward_variance(ctx, ctx.last_metrics)
    # graphs the trainer compiled in this phase (a new kind of micro-batch, mid-run): `trace show` notes them
    compiles = {"layer_compiles": ctx.last_metrics["layer_compiles"]} if ctx.last_metrics.get("layer_compiles") else {}
    ctx.tracer.emit("metrics", rollout_id=rid, **{k: v for k, v in ctx.last_metrics.items()
                                                  if k in ("reward_mean", "loss", "kl", "grad_norm", "train_tokens")},
                    **compiles, **extra)
    ci_checks(ctx, rid, ctx.last_metrics)
    return "next"


async def _train_with_critic(ctx: TrainingContext, rid: int) -> dict:
    critic, actor, batch = ctx.c.critic.handle, ctx.c.trainer.handle, ctx.batch_ref
    values = critic.values.remote(batch)                      # before the critic's step: GAE's and the clip's anchor
    returns = actor.prepare_rollout.remote(batch, rid, values)   # advantages stay in the trainer for its step
    metrics = await critic.train.remote(batch, values, returns, rid)
    if rid < ctx.cfg.algorithm.num_critic_only_steps:
        return {**metrics, "actor_trained": 0.0}
    return {**metrics, **await _train_policy(ctx, actor, batch, rid), "actor_trained": 1.0}


def _train_policy(ctx: TrainingContext, trainer: Any, batch: ray.ObjectRef, rid: int) -> ray.ObjectRef:
    """Send the policy's step on rollout `rid`; from now on a call sent to the trainer gets its weights after
    this step (`ctx.trainer_version`: an engine restarted meanwhile is labelled with that version)."""
    ref = trainer.train.remote(batch, rid)          # Ray resolves the batch's ref in the trainer
    ctx.train_submitted = rid
    return ref
