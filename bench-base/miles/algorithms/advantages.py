"""Advantage estimators.

Sequence-level estimators (GRPO, GSPO, RLOO, REINFORCE++-baseline) take one reward per sample,
`rewards` [N] with N = num_prompts * group_size, the `group_size` samples of a prompt contiguous
(as `RolloutBatch.samples` holds them), and return one advantage per sample [N]; `broadcast_to_tokens`
spreads them over the response tokens. They share the signature `fn(rewards, group_size, **options)`
and live in `ADVANTAGE_ESTIMATORS`; pick one at start-up with `get_advantage_estimator`. Their
optional `mask` [N] bool says which samples count: a sample that was aborted or failed (no reward,
nothing to train on) is left out of its group's statistics and gets advantage 0, so a broken tool
call does not move its group's baseline. Without a mask (or with every sample valid) they compute
exactly what they computed before masks existed.

Token-level estimators need more than rewards, so they are not in the registry:
- `gae(token_rewards, values, mask, gamma, lambd)`: PPO with a critic; needs per-token values.
- `reinforce_plus_plus_returns(token_rewards, mask, gamma, kl=..., kl_coef=...)`: REINFORCE++,
  discounted return-to-go with a per-token KL penalty; whiten the result with `normalize_advantages`.
`last_token_rewards` puts a sequence reward on the last response token for both.

Per-token tensors are [B, T], position t holding the value for tokens[t]; `mask` is True on response
tokens. Prompt tokens (left) and padding (right) are masked out; masked-out tokens inside a response
(tool output in a multi-turn sample) are skipped: they neither get an advantage nor break the
discounting between the response tokens around them.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from miles.algorithms.names import ADVANTAGE_ESTIMATOR_NAMES, TOKEN_LEVEL_ESTIMATORS, check_registry
from miles.algorithms.reduce import masked_mean
from miles.algorithms.registry import select


def _groups(rewards: Tensor, group_size: int, *, min_size: int = 1, why: str = "") -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * group_size], got shape {tuple(rewards.shape)}")
    if group_size < min_size:
        raise ValueError(f"group_size must be >= {min_size}{why}, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}; "
                         f"pass num_prompts * --n-samples-per-prompt rewards")
    return rewards.view(-1, group_size)


def _valid(mask: Tensor | None, rewards: Tensor, group_size: int) -> Tensor | None:
    """The [G, n] validity mask, or None when every sample counts (the unmasked formulas apply)."""
    if mask is None:
        return None
    if mask.shape != rewards.shape:
        raise ValueError(f"mask must be [N] like rewards {tuple(rewards.shape)}, got {tuple(mask.shape)}")
    mask = mask.bool()
    return None if bool(mask.all()) else mask.view(-1, group_size)


def _masked_group_stats(r: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per group: number of valid samples c, their mean, and their unbiased variance (0 when c < 2)."""
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    c = valid.sum(dim=1, keepdim=True).to(r.dtype)
    mean = torch.where(valid, r, zero).sum(dim=1, keepdim=True) / c.clamp(min=1)
    ss = torch.where(valid, (r - mean) ** 2, zero).sum(dim=1, keepdim=True)
    return c, mean, ss / (c - 1).clamp(min=1)


def grpo_advantages(rewards: Tensor, group_size: int, *, std_norm: bool = True, eps: float = 1e-6,
                    mask: Tensor | None = None) -> Tensor:
    """(r - group mean) / (group std + eps), or just r - group mean when `std_norm` is False
    (--disable-grpo-std-normalization, as Dr. GRPO recommends).

    The std is torch's default, the unbiased one (divides by n - 1), as miles and slime use; it is
    undefined for one sample, so std_norm needs group_size >= 2. A group whose rewards are all equal
    gets advantage 0 (0 / eps), never NaN. With `mask`, mean and std are over the group's valid
    samples; a group with one valid sample gives it 0.
    """
    r = _groups(rewards, group_size, min_size=2 if std_norm else 1,
                why=" for std normalization (or disable it)" if std_norm else "")
    valid = _valid(mask, rewards, group_size)
    if valid is None:
        centered = r - r.mean(dim=1, keepdim=True)
        if std_norm:
            centered = centered / (r.std(dim=1, keepdim=True) + eps)
        return centered.flatten()
    _, mean, var = _masked_group_stats(r, valid)
    centered = r - mean
    if std_norm:
        centered = centered / (var.sqrt() + eps)
    return torch.where(valid, centered, torch.zeros((), dtype=r.dtype, device=r.device)).flatten()


def rloo_advantages(rewards: Tensor, group_size: int, *, mask: Tensor | None = None) -> Tensor:
    """r_i - mean of the other samples' rewards (leave-one-out baseline, Ahmadian et al. 2024).

    Equals n / (n - 1) * (r_i - group mean): r_i - (S - r_i) / (n - 1) = (n r_i - S) / (n - 1).
    With `mask`, "the others" are the group's other valid samples; a sample without one gets 0.
    """
    r = _groups(rewards, group_size, min_size=2, why=" (the leave-one-out baseline needs another sample)")
    valid = _valid(mask, rewards, group_size)
    if valid is None:
        others_mean = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
        return (r - others_mean).flatten()
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    kept = torch.where(valid, r, zero)
    others = valid.sum(dim=1, keepdim=True).to(r.dtype) - 1
    adv = r - (kept.sum(dim=1, keepdim=True) - kept) / others.clamp(min=1)
    return torch.where(valid & (others > 0), adv, zero).flatten()


def reinforce_plus_plus_baseline_advantages(rewards: Tensor, group_size: int, *, mask: Tensor | None = None) -> Tensor:
    """r - group mean (REINFORCE++-baseline, Hu et al. 2025). The paper then whitens over the whole
    batch: apply `normalize_advantages` to the token-level result. With `mask`, the mean is over the
    group's valid samples and the others get 0."""
    r = _groups(rewards, group_size)
    valid = _valid(mask, rewards, group_size)
    if valid is None:
        return (r - r.mean(dim=1, keepdim=True)).flatten()
    _, mean, _ = _masked_group_stats(r, valid)
    return torch.where(valid, r - mean, torch.zeros((), dtype=r.dtype, device=r.device)).flatten()


def normalize_advantages(adv: Tensor, mask: Tensor | None = None, *, eps: float = 1e-8) -> Tensor:
    """Whiten over the whole batch: (adv - mean) / (std + eps), mean and std over the entries where
    `mask` is true (all entries without a mask); masked-out entries come back 0.

    The std is the population one (divides by n), so one entry is well defined (it becomes 0).
    """
    if mask is None:
        mask = torch.ones_like(adv, dtype=torch.bool)
    mask = mask.bool()
    mean = masked_mean(adv, mask)
    var = masked_mean((adv - mean) ** 2, mask)
    out = (adv - mean) / (var.sqrt() + eps)
    return torch.where(mask, out, torch.zeros((), dtype=adv.dtype, device=adv.device))


def broadcast_to_tokens(seq_adv: Tensor, mask: Tensor) -> Tensor:
    """[B] per-sequence values → [B, T]: the value on every response token, 0 elsewhere."""
    if seq_adv.dim() != 1 or seq_adv.shape[0] != mask.shape[0]:
        raise ValueError(f"seq_adv must be [B] with B = mask.shape[0] = {mask.shape[0]}, got {tuple(seq_adv.shape)}")
    return seq_adv[:, None] * mask.to(seq_adv.dtype)


def last_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """[B] sequence rewards → [B, T] token rewards: the reward on each row's last response token,
    0 elsewhere (and an all-zero row when the row has no response token)."""
    mask = mask.bool()
    t = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, t, -1).amax(dim=1)                     # [B], -1 for empty rows
    hit = (t[None, :] == last[:, None]) & mask
    values = rewards if rewards.is_floating_point() else rewards.float()
    return torch.where(hit, values[:, None], torch.zeros((), dtype=values.dtype, device=values.device))


def reinforce_plus_plus_returns(
    token_rewards: Tensor, mask: Tensor, gamma: float, *, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """Discounted return-to-go G_t = r_t - kl_coef * kl_t + gamma * G_next over response tokens
    (REINFORCE++, Hu et al. 2025). `token_rewards` usually holds the reward on the last response
    token (`last_token_rewards`); `kl` [B, T] is a per-token KL estimate against the reference.
    Returns [B, T], 0 off the mask; whiten it with `normalize_advantages(returns, mask)`."""
    mask = mask.bool()
    r = token_rewards if kl is None else token_rewards - kl_coef * kl
    r = torch.where(mask, r, torch.zeros((), dtype=r.dtype, device=r.device))
    ret = torch.zeros_like(r[:, 0])
    out = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        # masked-out tokens carry the running return through unchanged (no discount, no reward)
        ret = torch.where(mask[:, t], r[:, t] + gamma * ret, ret)
        out[:, t] = ret
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lambd: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) → (advantages, returns), both [B, T].

    delta_t = r_t + gamma * V_next - V_t and A_t = delta_t + gamma * lambd * A_next, where "next"
    is the next *response* token: masked-out tokens are skipped, and after a row's last response
    token the episode ends (V_next = 0, A_next = 0), so right padding and its values are ignored.
    returns = advantages + values. Both are 0 off the mask. Whitening is left to the caller.
    """
    mask = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a_t = delta + gamma * lambd * next_adv
        next_adv = torch.where(mask[:, t], a_t, next_adv)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        adv[:, t] = torch.where(mask[:, t], a_t, zero)
    returns = torch.where(mask, adv + values, zero)
    return adv, returns


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo_advantages,
    "gspo": grpo_advantages,  # GSPO changes the loss (sequence-level ratio), not the advantage
    "rloo": rloo_advantages,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
}

# ppo and reinforce_plus_plus are token-level (TOKEN_LEVEL_ESTIMATORS): gae / reinforce_plus_plus_returns
check_registry({*ADVANTAGE_ESTIMATORS, *TOKEN_LEVEL_ESTIMATORS}, ADVANTAGE_ESTIMATOR_NAMES, "advantage estimator")


def get_advantage_estimator(name: str, **options: object) -> Callable[[Tensor, int], Tensor]:
    """The sequence-level estimator `name` with `options` bound (e.g. std_norm=False for grpo)."""
    if name in TOKEN_LEVEL_ESTIMATORS:
        raise ValueError(f"advantage estimator {name!r} is token-level: it needs values or KL, so use "
                         f"miles.algorithms.gae / reinforce_plus_plus_returns instead of the registry")
    return select(ADVANTAGE_ESTIMATORS, "advantage estimator", name, **options)
