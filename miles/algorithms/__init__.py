"""RL math as pure functions on torch tensors: advantages, policy/value/SFT losses, KL estimators,
entropies and logprobs, loss reductions, reward shaping (DAPO's overlong penalty, the group reward
spread dynamic sampling filters on). No Ray, no I/O, no config objects.

Variants live in registries (`ADVANTAGE_ESTIMATORS`, `POLICY_LOSSES`, `KL_ESTIMATORS`,
`LOSS_REDUCTIONS`) and are picked once at start-up with the `get_*` helpers, which fail on unknown
names and options. Per-token tensors are [B, T] aligned to tokens; see `miles.algorithms.entropy`.
"""

from miles.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    TOKEN_LEVEL_ESTIMATORS,
    broadcast_to_tokens,
    gae,
    get_advantage_estimator,
    grpo_advantages,
    last_token_rewards,
    normalize_advantages,
    reinforce_plus_plus_baseline_advantages,
    reinforce_plus_plus_returns,
    rloo_advantages,
)
from miles.algorithms.entropy import entropy_from_logits, logprobs_from_logits
from miles.algorithms.kl import KL_ESTIMATORS, get_kl_estimator, kl_estimate
from miles.algorithms.losses import (
    POLICY_LOSSES,
    get_policy_loss,
    gspo_loss,
    mismatch_metrics,
    ppo_clip_loss,
    sft_loss,
    tis_weights,
    value_loss,
)
from miles.algorithms.reduce import (
    LOSS_REDUCTIONS,
    NORMALIZER_COUNTS,
    count_sequences,
    count_tokens,
    masked_mean,
    masked_sum,
    seq_mean_token_mean,
    seq_mean_token_sum_norm,
    token_mean,
)
from miles.algorithms.registry import select
from miles.algorithms.shaping import group_reward_std, overlong_penalty

__all__ = [
    "ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "LOSS_REDUCTIONS", "NORMALIZER_COUNTS", "POLICY_LOSSES",
    "TOKEN_LEVEL_ESTIMATORS", "broadcast_to_tokens", "count_sequences", "count_tokens", "entropy_from_logits",
    "gae", "get_advantage_estimator", "get_kl_estimator", "get_policy_loss", "group_reward_std", "grpo_advantages",
    "gspo_loss", "overlong_penalty",
    "kl_estimate", "last_token_rewards", "logprobs_from_logits", "masked_mean", "masked_sum",
    "mismatch_metrics", "normalize_advantages", "ppo_clip_loss", "reinforce_plus_plus_baseline_advantages",
    "reinforce_plus_plus_returns", "rloo_advantages", "select", "seq_mean_token_mean",
    "seq_mean_token_sum_norm", "sft_loss", "tis_weights", "token_mean", "value_loss",
]
