"""Checks the driver makes on each trained rollout's metrics: a run that cannot learn (every group's
rewards equal, rollout after rollout), and --ci-test's checks, which fail the run.

Every group with one reward has GRPO advantage 0 everywhere: the loss is 0 and nothing is learned.
One such rollout happens; `ZERO_VARIANCE_ROLLOUTS` in a row is a run training on nothing (a reward
that always returns 0, often because --label-key is missing), so it is traced as a `warning` and the
progress line says so until a rollout has signal again.
"""

from __future__ import annotations

from typing import Any

from miles.phases.context import TrainingContext

ZERO_VARIANCE_ROLLOUTS = 3
CI_MAX_LOGPROB_DIFF = 0.05   # mean |engine - trainer| logprob per token; bf16 engines stay well below it
CI_MAX_REF_DIFF = 1e-6       # the reference is a copy of the initial policy: equal logprobs at the start


class CICheckFailed(RuntimeError):
    """A --ci-test check failed."""


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
