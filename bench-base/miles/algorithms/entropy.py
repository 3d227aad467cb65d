"""Log-probabilities and entropies from logits, and the token alignment the whole project uses.

Alignment: `tokens` [B, T] is the full sequence (prompt then response, right-padded), and every
per-token tensor [B, T] (logprobs, advantages, masks, KL, ...) holds at position t the value for
tokens[:, t]. A causal LM's logits[:, t] predict tokens[:, t + 1], so

    logprobs[:, t] = log_softmax(logits[:, t - 1] / temperature)[tokens[:, t]]   for t >= 1
    logprobs[:, 0] = 0.0                                                         (nothing predicts it)
    entropy[:, t]  = H(softmax(logits[:, t - 1] / temperature))                  likewise shifted

Position 0 is always a prompt token, so `loss_mask` (True on response tokens) excludes it. Engines
report their logprobs in the same layout, so train and rollout logprobs compare position by position.

Both functions work in float32 (logits may be bf16) on chunks of rows, so the full [B, T, V] float32
copy never exists at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

_CHUNK_ROWS = 1024  # rows of V logits per step: 1024 x 152k vocab x 4 bytes ≈ 620 MB peak per temporary


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the rollout's sampling temperature), got {temperature}")


def shift_right(x: Tensor) -> Tensor:
    """[B, T] values computed from logits[:, t] → aligned to tokens[:, t + 1]; position 0 gets 0."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


def _entropy_rows(z: Tensor) -> Tensor:
    # H = logsumexp(z) - sum softmax(z) * z: stable for any scale of z
    z = z.float()
    lse = torch.logsumexp(z, dim=-1)
    return lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, *, chunk_rows: int = _CHUNK_ROWS) -> Tensor:
    """Entropy of softmax(logits / temperature) at every position: [B, T, V] → [B, T] float32,
    aligned to tokens like `logprobs_from_logits` (position 0 = 0.0)."""
    _check_temperature(temperature)
    b, t, v = logits.shape
    flat = logits.reshape(b * t, v)
    parts = [_entropy_rows(flat[i:i + chunk_rows] / temperature) for i in range(0, b * t, chunk_rows)]
    if not parts:  # empty batch
        return logits.new_zeros((b, t), dtype=torch.float32)
    return shift_right(torch.cat(parts).view(b, t))


def _gathered_logprobs(z: Tensor, target: Tensor) -> Tensor:
    z = z.float()
    return z.gather(-1, target[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


def logprobs_from_logits(logits: Tensor, tokens: Tensor, temperature: float = 1.0, *,
                         chunk_rows: int = _CHUNK_ROWS) -> Tensor:
    """log_softmax(logits[:, t - 1] / temperature)[tokens[:, t]] at position t, 0.0 at position 0.

    logits [B, T, V] (any float dtype), tokens [B, T] int64 → [B, T] float32.
    """
    _check_temperature(temperature)
    if logits.shape[:2] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} must share [B, T]")
    b, t, v = logits.shape
    flat = logits[:, :-1].reshape(b * (t - 1), v)
    target = tokens[:, 1:].reshape(-1)
    parts = [_gathered_logprobs(flat[i:i + chunk_rows] / temperature, target[i:i + chunk_rows])
             for i in range(0, b * (t - 1), chunk_rows)]
    shifted = torch.cat(parts).view(b, t - 1) if parts else logits.new_zeros((b, 0), dtype=torch.float32)
    return torch.cat([shifted.new_zeros((b, 1)), shifted], dim=1)
