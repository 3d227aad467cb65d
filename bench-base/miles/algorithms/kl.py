"""Per-token KL estimators between the policy and a reference, from log-probabilities of the sampled
tokens (Schulman, "Approximating KL divergence", 2020). With tokens sampled from the policy and
log_ratio = logp - ref:

- `k1`: log_ratio. Unbiased for KL(policy || ref), high variance, can be negative.
- `k2`: 0.5 * log_ratio^2. Biased, low variance, >= 0.
- `k3`: exp(-log_ratio) + log_ratio - 1, i.e. exp(ref - logp) - (ref - logp) - 1. Unbiased, >= 0.
- `low_var_kl`: k3 with ref - logp clamped to [-20, 20] before the exp and the result clamped to
  [-10, 10], as verl does, so one outlier token cannot blow up the loss.

Each estimator is elementwise ([B, T] in, [B, T] out); reduce with a loss reduction over the mask.
Pick one at start-up with `get_kl_estimator(--kl-loss-type)`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from miles.algorithms.names import KL_LOSS_TYPES, check_registry
from miles.algorithms.registry import select


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    neg = ref_logprobs - logprobs
    # expm1(x) - x == exp(x) - x - 1 without the cancellation near x = 0
    return torch.expm1(neg) - neg


def kl_low_var(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    neg = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (torch.expm1(neg) - neg).clamp(-10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_low_var,
}
check_registry(KL_ESTIMATORS, KL_LOSS_TYPES, "KL estimator")


def get_kl_estimator(kind: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The estimator `kind`; ValueError naming the valid kinds otherwise."""
    return select(KL_ESTIMATORS, "KL estimator (--kl-loss-type)", kind)


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of kind `kind` (k1 | k2 | k3 | low_var_kl). In the training step prefer
    an estimator chosen once with `get_kl_estimator`."""
    return get_kl_estimator(kind)(logprobs, ref_logprobs)
