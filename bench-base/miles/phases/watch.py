"""Checks the driver makes on each trained rollout's metrics: a run that cannot learn (every group's
rewards equal, rollout after rollout), and --ci-test's checks, which fail the run; and the phases'
calls into miles' CI gates (miles.phases.ci_gates: the eval metric, gradient norms, the model hash).

Every group with one reward has GRPO advantage 0 everywhere: the loss is 0 and nothing is learned.
One such rollout happens; `ZERO_VARIANCE_ROLLOUTS` in a row is a run training on nothing (a reward
that always returns 0, often because --label-key is missing), so it is traced as a `warning` and the
progress line says so until a rollout has signal again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from miles.phases.ci_gates import CICheckFailed, check_model_hash, write_model_hash
from miles.phases.context import TrainingContext

ZERO_VARIANCE_ROLLOUTS = 3
CI_MAX_LOGPROB_DIFF = 0.05   # mean |engine - trainer| logprob per token; bf16 engines stay well below it
CI_MAX_REF_DIFF = 1e-6       # the reference is a copy of the initial policy: equal logprobs at the start


def watch_reward_variance(ctx: TrainingContext, metrics: dict[str, Any]) -> dict[str, Any]:
    """Count rollouts in a row whose every group had equal rewards; the fields for the metrics event."""
    cfg = ctx.cfg
    if cfg.algorithm.loss_type == "sft_loss" or cfg.rollout.n_samples_per_prompt < 2 \
            or "zero_std_group_ratio" not in metrics:
        return {}
    streak = ctx.zero_variance_streak + 1 if metrics["zero_std_group_ratio"] >= 1.0 else 0
    ctx.zero_variance_streak = streak
    if streak < ZERO_VARIANCE_ROLLOUTS:
        return {}
    if streak == ZERO_VARIANCE_ROLLOUTS:
        reward = metrics.get("reward_mean")
        ctx.tracer.emit("warning", code="zero_reward_variance", rollouts=streak, reward_mean=reward,
                        message=f"every group had the same reward (mean {reward:.4g}) in the last {streak} rollouts: "
                                "the advantages and the loss are 0, nothing is learned; check the reward "
                                "function and --label-key")
    return {"zero_variance_rollouts": streak}


def ci_checks(ctx: TrainingContext, rid: int, metrics: dict[str, Any]) -> None:
    """--ci-test: engine and trainer agree on the rollout's logprobs; at a fresh run's first rollout
    the reference (the initial policy) gives the policy's logprobs exactly. Weights are compared
    after every sync (`RunConfig.check_weights`)."""
    if not ctx.cfg.ci_test:
        return
    diff = metrics.get("logprob_diff_rollout")
    if diff is not None and diff > CI_MAX_LOGPROB_DIFF:
        raise CICheckFailed(f"--ci-test: rollout {rid}: engine and trainer logprobs differ by {diff:.4g} per token "
                            f"on average (more than {CI_MAX_LOGPROB_DIFF}); the engine does not run the trainer's "
                            "weights or numerics")
    ref = metrics.get("ref_logprob_diff_max")
    fresh = rid == ctx.start_rollout and not ctx.resumed and ctx.cfg.algorithm.ref_load is None
    if fresh and ref is not None and ref > CI_MAX_REF_DIFF:
        raise CICheckFailed(f"--ci-test: rollout {rid}: the reference differs from the initial policy by {ref:.4g} "
                            "in logprob; they must be equal before the first step")
    ctx.tracer.emit("ci_checked", rollout_id=rid, logprob_diff=diff, ref_diff=ref if fresh else None)


def ci_after_train(ctx: TrainingContext, rid: int, metrics: dict[str, Any]) -> None:
    """The step norms out of the train call's metrics; recorded or compared (--ci-save/load-grad-norm)."""
    steps = ctx.ci.after_train(rid, metrics)
    if steps:
        gate = ctx.ci.grad_norms
        ctx.tracer.emit("ci_grad_norms", rollout_id=rid, steps=steps, action="saved" if gate.save else "matched",
                        path=gate.template)


def ci_after_eval(ctx: TrainingContext, step: int, metrics: dict[str, Any]) -> None:
    """--ci-metric-checker-key: the eval logged the key (else the run fails); whether it reached the threshold."""
    gate = ctx.ci.metric
    if gate is not None:
        reached = gate.on_eval(step, metrics)
        ctx.tracer.emit("ci_metric_checked", step=step, key=gate.metric, value=gate.values[-1],
                        threshold=gate.threshold, reached=reached)


def ci_at_end(ctx: TrainingContext) -> None:
    """A run that trained its rollouts (not failed, not stopped): some eval reached the threshold."""
    gate = ctx.ci.metric
    if gate is not None and ctx.failure is None and not ctx.stop_requested.is_set():
        gate.finish()
        ctx.tracer.emit("ci_metric_passed", key=gate.metric, best=max(gate.values), threshold=gate.threshold)


async def trainer_hash(ctx: TrainingContext) -> str:
    """sha256 of the trainer's weights in float32 (--ci-save-model-hash / --ci-check-model-hash)."""
    return await ctx.c.trainer.handle.weights_checksum.remote(torch.float32)


async def ci_save_model_hash(ctx: TrainingContext, folder: Path) -> None:
    if ctx.ci.model_hash_saved:
        write_model_hash(folder, await trainer_hash(ctx))


async def ci_check_model_hash(ctx: TrainingContext, folder: Path) -> None:
    if ctx.ci.model_hash_checked:
        digest = await trainer_hash(ctx)
        check_model_hash(folder, digest)
        ctx.tracer.emit("ci_model_hash_matched", path=str(folder), sha256=digest)
