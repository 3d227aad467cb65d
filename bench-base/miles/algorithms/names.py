"""The names of the algorithm variants a run can pick, as `Literal` types: the one list.

The config types its fields with them, the flags offer them as choices, validation checks them, and
each registry (`ADVANTAGE_ESTIMATORS`, `KL_ESTIMATORS`, `LOSS_REDUCTIONS`) is checked against them
when its module loads, so a variant added to a registry without its name here (or the other way
round) fails at import. Importing this module loads no torch: the flag table reads it before a run
starts anything.
"""

from __future__ import annotations

from typing import Literal, get_args

AdvantageEstimator = Literal["grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]
LossType = Literal["policy_loss", "sft_loss", "custom_loss"]
LossAggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KlLossType = Literal["k1", "k2", "k3", "low_var_kl"]

ADVANTAGE_ESTIMATOR_NAMES: tuple[str, ...] = get_args(AdvantageEstimator)
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
KL_LOSS_TYPES: tuple[str, ...] = get_args(KlLossType)

# estimators computed per token in the trainer (from the critic's values, or the token rewards with
# --kl-coef's KL in them); the others are per sequence, in the rollout executor's registry
TOKEN_LEVEL_ESTIMATORS: tuple[str, ...] = ("ppo", "reinforce_plus_plus")


def check_registry(registry: object, names: tuple[str, ...], what: str) -> None:
    """A registry's keys are exactly `names` (an internal invariant: a mismatch is a bug in miles)."""
    keys = set(registry)  # type: ignore[call-overload]
    assert keys == set(names), f"{what} registry {sorted(keys)} != names {sorted(names)} (miles/algorithms/names.py)"
