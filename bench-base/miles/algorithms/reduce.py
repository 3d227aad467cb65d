"""Masked reductions, and the loss reductions that turn a per-token loss [B, T] into a scalar.

Three loss reductions, picked once at start-up from `LOSS_REDUCTIONS` (--loss-agg-mode in verl):

- `token_mean`: every response token of the batch weighs the same (DAPO). Long answers weigh more.
- `seq_mean_token_mean`: mean over each sequence's tokens, then mean over sequences (GRPO paper).
- `seq_mean_token_sum_norm`: each sequence's token sum divided by a constant `max_len`, then mean
  over sequences (Dr. GRPO): removes the 1/|y| length bias of `seq_mean_token_mean`.

All reductions share one signature, `reduce(loss, mask, *, normalizer=None) -> scalar`;
`seq_mean_token_sum_norm` also needs `max_len`, bound with `functools.partial` at start-up.

Micro-batching. A global batch is split into micro-batches whose gradients are accumulated; the sum
of the micro-batch losses must equal the loss of the whole batch. A mean over one micro-batch does
not give that (micro-batches hold different numbers of tokens), so every reduction takes an optional
`normalizer`: the denominator of the *global* batch. With it, the reduction returns the micro-batch's
numerator divided by `normalizer`, and summing over micro-batches gives the global mean exactly:

    n = sum(NORMALIZER_COUNTS["token_mean"](mb.mask) for mb in micro_batches)   # all of them first
    for mb in micro_batches:
        token_mean(loss_fn(mb), mb.mask, normalizer=n).backward()              # grads add up to the global mean

`NORMALIZER_COUNTS[name](mask)` is what each micro-batch contributes to its reduction's normalizer:
response tokens for `token_mean`, non-empty sequences for the two `seq_mean_*`. Across data-parallel
ranks, all-reduce (sum) the counts too, and sum (not average) the gradients, or multiply the loss by
the number of ranks when the backend averages them.

Rows without response tokens add nothing and, in the `seq_mean_*` reductions, are not counted as
sequences; a batch with no response tokens at all reduces to 0, never NaN.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from miles.algorithms.names import LOSS_AGG_MODES, check_registry


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of `x` where `mask` is true. Masked-out entries are dropped (not multiplied), so NaN or
    inf there, e.g. logprobs of padding, cannot leak into the result."""
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of `x` where `mask` is true; 0 (not NaN) where nothing is kept."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def count_tokens(mask: Tensor) -> int:
    """Response tokens in `mask`: a micro-batch's share of `token_mean`'s normalizer."""
    return int(mask.bool().sum())


def count_sequences(mask: Tensor) -> int:
    """Rows of `mask` with at least one response token: a share of the `seq_mean_*` normalizers."""
    return int(mask.bool().any(dim=-1).sum())


def _denominator(count: Callable[[Tensor], int], mask: Tensor, normalizer: float | None) -> float:
    """`normalizer`, else `count(mask)` (at least 1): counted only without a normalizer, since the count
    is a read from the device (the trainer always passes the global batch's)."""
    if normalizer is None:
        return max(count(mask), 1)
    if normalizer <= 0:
        raise ValueError(f"normalizer must be > 0 (the global batch's count), got {normalizer}")
    return normalizer


def token_mean(loss: Tensor, mask: Tensor, *, normalizer: float | None = None) -> Tensor:
    """Sum of `loss` over response tokens / number of response tokens (or `normalizer`)."""
    return masked_sum(loss, mask) / _denominator(count_tokens, mask, normalizer)


def seq_mean_token_mean(loss: Tensor, mask: Tensor, *, normalizer: float | None = None) -> Tensor:
    """Per-sequence token mean, summed over sequences / number of non-empty sequences (or `normalizer`)."""
    per_seq = masked_mean(loss, mask, dim=-1)  # [B]; empty rows give 0
    return per_seq.sum() / _denominator(count_sequences, mask, normalizer)


def seq_mean_token_sum_norm(
    loss: Tensor, mask: Tensor, *, max_len: int, normalizer: float | None = None
) -> Tensor:
    """Per-sequence token sum / `max_len` (a constant, e.g. the max response length), summed over
    sequences / number of non-empty sequences (or `normalizer`). Dr. GRPO (Liu et al. 2025)."""
    if max_len <= 0:
        raise ValueError(f"max_len must be > 0 (use the max response length), got {max_len}")
    per_seq = masked_sum(loss, mask, dim=-1) / max_len
    return per_seq.sum() / _denominator(count_sequences, mask, normalizer)


LOSS_REDUCTIONS: dict[str, Callable[..., Tensor]] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,  # bind max_len
}

NORMALIZER_COUNTS: dict[str, Callable[[Tensor], int]] = {
    "token_mean": count_tokens,
    "seq_mean_token_mean": count_sequences,
    "seq_mean_token_sum_norm": count_sequences,
}
check_registry(LOSS_REDUCTIONS, LOSS_AGG_MODES, "loss reduction")
check_registry(NORMALIZER_COUNTS, LOSS_AGG_MODES, "normalizer count")
