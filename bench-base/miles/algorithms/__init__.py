"""RL math as pure functions on torch tensors: advantages, policy/value/SFT losses, KL estimators,
entropies and logprobs (from logits, or chunked from hidden states and the LM head), loss
reductions, reward shaping (DAPO's overlong penalty, the group reward spread dynamic sampling
filters on), on-policy distillation's advantage adjustment. No Ray, no I/O, no config objects.

Variants live in registries (`ADVANTAGE_ESTIMATORS`, `POLICY_LOSSES`, `KL_ESTIMATORS`,
`LOSS_REDUCTIONS`) and are picked once at start-up with the `get_*` helpers, which fail on unknown
names and options; their names are `miles.algorithms.names` (Literal types, no torch). Per-token
tensors are [B, T] aligned to tokens; see `miles.algorithms.entropy`.

The names below load on first use, so `miles.algorithms.names` imports without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {   # submodule: the names it exports here
    "advantages": ("ADVANTAGE_ESTIMATORS", "TOKEN_LEVEL_ESTIMATORS", "broadcast_to_tokens", "gae",
                   "get_advantage_estimator", "grpo_advantages", "last_token_rewards", "normalize_advantages",
                   "reinforce_plus_plus_baseline_advantages", "reinforce_plus_plus_returns", "rloo_advantages"),
    "distillation": ("opd_advantages",),
    "entropy": ("entropy_from_logits", "logprobs_from_logits"),
    "fused_logprobs": ("linear_logprobs_entropy", "masked_logprobs_entropy"),
    "kl": ("KL_ESTIMATORS", "get_kl_estimator", "kl_estimate"),
    "losses": ("POLICY_LOSSES", "get_policy_loss", "gspo_loss", "mismatch_metrics", "ppo_clip_loss", "sft_loss",
               "tis_weights", "value_loss"),
    "reduce": ("LOSS_REDUCTIONS", "NORMALIZER_COUNTS", "count_sequences", "count_tokens", "masked_mean", "masked_sum",
               "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_mean"),
    "registry": ("select",),
    "shaping": ("group_reward_std", "overlong_penalty"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"miles.algorithms.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'miles.algorithms' has no attribute {name!r}")
