"""Reward shaping applied to sequence rewards before advantages: DAPO's overlong penalty, and the
group statistic dynamic sampling filters on.

Both take plain tensors: `lengths` [N] response lengths in tokens, `rewards` [N] with the
`group_size` samples of a prompt contiguous (as `RolloutBatch.samples` holds them).
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, *, max_len: int, buffer_len: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), one value per response, to add to its reward:

        0                                           if |y| <= max_len - buffer_len
        ((max_len - buffer_len) - |y|) / buffer_len * factor   if max_len - buffer_len < |y| <= max_len
        -factor                                     if |y| > max_len

    so the penalty grows linearly from 0 to -factor over the last `buffer_len` tokens of the budget.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer length must be in (0, max_len={max_len}], got {buffer_len}")
    if factor < 0:
        raise ValueError(f"overlong penalty factor must be >= 0, got {factor}")
    expected = max_len - buffer_len
    over = (lengths.to(torch.float32) - expected).clamp(min=0.0)
    return -(over / buffer_len).clamp(max=1.0) * factor


def group_reward_std(rewards: Tensor, group_size: int) -> Tensor:
    """[N] rewards → [N / group_size] population std of each group's rewards (0 for all-equal groups)."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{tuple(rewards.shape)} rewards do not split into groups of {group_size}")
    return rewards.view(-1, group_size).std(dim=1, unbiased=False)
