"""Training losses: clipped policy-gradient surrogates (PPO, GSPO), SFT, the critic's value loss,
the truncated importance-sampling correction for rollout/train mismatch, and off-policy sequence
masking (OPSM).

Inputs are per-token [B, T] tensors aligned to tokens (see `miles.algorithms.entropy`); `mask` is
True on response tokens. Every loss reduces its per-token loss with `reduce` (a `LOSS_REDUCTIONS`
entry, `token_mean` by default) and passes `normalizer` on to it, so that micro-batch losses sum to
the global-batch loss (see `miles.algorithms.reduce`). Policy losses return `(loss, metrics)`;
metrics are detached scalars averaged over this call's response tokens, for logging.

Pick the policy loss once at start-up:

    loss_fn = get_policy_loss("ppo", eps_clip=0.2, eps_clip_high=0.28, reduce=token_mean)
    loss, metrics = loss_fn(logprobs, old_logprobs, advantages, mask, normalizer=n_tokens)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from miles.algorithms.kl import kl_k3
from miles.algorithms.reduce import masked_mean, token_mean
from miles.algorithms.registry import select

Metrics = dict[str, Tensor]
PolicyLoss = Callable[..., tuple[Tensor, Metrics]]


def _check_clip(eps_clip: float, eps_clip_high: float | None, eps_clip_c: float | None) -> float:
    if not 0.0 <= eps_clip < 1.0:
        raise ValueError(f"eps_clip must be in [0, 1), got {eps_clip}")
    high = eps_clip if eps_clip_high is None else eps_clip_high
    if high < 0.0:
        raise ValueError(f"eps_clip_high must be >= 0, got {eps_clip_high}")
    if eps_clip_c is not None and not eps_clip_c > 1.0:
        raise ValueError(f"eps_clip_c (dual clip) must be > 1, got {eps_clip_c}; leave it unset to disable")
    return high


def _clipped_surrogate(log_ratio: Tensor, advantages: Tensor, *, eps_clip: float, eps_clip_high: float | None,
                       eps_clip_c: float | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token max(-A r, -A clip(r, 1 - eps, 1 + eps_high)), then for A < 0 min(that, -c A).

    Returns (loss, ratio, clipped, dual_clipped); where a clip is active the loss does not depend
    on the policy, so its gradient is 0.
    """
    high = _check_clip(eps_clip, eps_clip_high, eps_clip_c)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    is_dual = torch.zeros_like(is_clipped)
    if eps_clip_c is not None:
        # Dual-clip PPO (Ye et al. 2020): for A < 0 the loss |A| r grows without bound in r; cap it at c |A|
        bound = -eps_clip_c * advantages
        is_dual = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return loss, ratio, is_clipped, is_dual


def _masked_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    # off the mask the ratio is exactly 1: padding logprobs (even inf / NaN) reach neither loss nor grad
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    return torch.where(mask.bool(), logprobs - old_logprobs, zero)


def opsm_masked(token_log_ratio: Tensor, advantages: Tensor, mask: Tensor, *, delta: float) -> Tensor:
    """Off-policy sequence masking (DeepSeek-V3.2; miles' --use-opsm): True [B, T] on the response
    tokens with a negative advantage in a sequence (row) whose mean over its response tokens of
    old_logp - logp (a k1 estimate of KL(old || current)) exceeds `delta`. `token_log_ratio` is
    logp - old_logp, 0 off the mask; the mask carries no gradient."""
    with torch.no_grad():
        seq_kl = -masked_mean(token_log_ratio, mask, dim=-1)     # [B]
        return mask.bool() & (advantages < 0) & (seq_kl > delta)[:, None]


def _policy_loss(log_ratio: Tensor, token_log_ratio: Tensor, advantages: Tensor, mask: Tensor, *, eps_clip: float,
                 eps_clip_high: float | None, eps_clip_c: float | None, reduce: Callable[..., Tensor],
                 normalizer: float | None, is_weights: Tensor | None,
                 opsm_delta: float | None) -> tuple[Tensor, Metrics]:
    loss, ratio, clipped, dual = _clipped_surrogate(log_ratio, advantages, eps_clip=eps_clip,
                                                    eps_clip_high=eps_clip_high, eps_clip_c=eps_clip_c)
    if is_weights is not None:
        loss = loss * is_weights
    opsm: Metrics = {}
    if opsm_delta is not None:
        masked = opsm_masked(token_log_ratio, advantages, mask, delta=opsm_delta)
        loss = torch.where(masked, torch.zeros((), dtype=loss.dtype, device=loss.device), loss)
        opsm = {"opsm_clipfrac": masked_mean(masked.to(ratio.dtype), mask)}
    with torch.no_grad():
        metrics = {**opsm,
            "clip_frac": masked_mean(clipped.to(ratio.dtype), mask),
            "dual_clip_frac": masked_mean(dual.to(ratio.dtype), mask),
            "approx_kl": masked_mean(-token_log_ratio, mask),  # mean of old - new over response tokens
            "ratio_mean": masked_mean(ratio, mask),
        }
    return reduce(loss, mask, normalizer=normalizer), metrics


def ppo_clip_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, eps_clip: float,
                  eps_clip_high: float | None = None, eps_clip_c: float | None = None,
                  reduce: Callable[..., Tensor] = token_mean, normalizer: float | None = None,
                  is_weights: Tensor | None = None, opsm_delta: float | None = None) -> tuple[Tensor, Metrics]:
    """PPO clipped surrogate with token ratio r_t = exp(logp_t - old_logp_t) (Schulman et al. 2017).

    Clip range [1 - eps_clip, 1 + eps_clip_high] (eps_clip_high defaults to eps_clip; larger is
    DAPO's clip-higher). `eps_clip_c` > 1 turns on dual clip: for A < 0 the loss is capped at -c A.
    `is_weights` [B, T] (e.g. `tis_weights`) multiplies the per-token loss. `opsm_delta` turns on
    off-policy sequence masking (`opsm_masked`): the masked tokens' loss is 0, and so is their gradient.
    Metrics: clip_frac (share of response tokens whose clip is active), dual_clip_frac, approx_kl
    (mean old - new), ratio_mean, and with OPSM opsm_clipfrac (share of response tokens masked).
    """
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, mask)
    return _policy_loss(log_ratio, log_ratio, advantages, mask, eps_clip=eps_clip, eps_clip_high=eps_clip_high,
                        eps_clip_c=eps_clip_c, reduce=reduce, normalizer=normalizer, is_weights=is_weights,
                        opsm_delta=opsm_delta)


def gspo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, eps_clip: float,
              eps_clip_high: float | None = None, eps_clip_c: float | None = None,
              reduce: Callable[..., Tensor] = token_mean, normalizer: float | None = None,
              is_weights: Tensor | None = None, opsm_delta: float | None = None) -> tuple[Tensor, Metrics]:
    """GSPO (Zheng et al. 2025): the PPO surrogate with one ratio per sequence,
    s_i = exp(mean over the response tokens of (logp - old_logp)), clipped per sequence.

    s_i is put on every response token of sequence i, so the token-level `advantages` and `reduce`
    work as in PPO; with `seq_mean_token_mean` and per-sequence advantages this is the paper's
    objective exactly. The paper's clip range is far narrower than PPO's (eps 3e-4 / 4e-4).
    Metrics as in `ppo_clip_loss`, with clip_frac the share of response tokens in clipped sequences.
    """
    token_log_ratio = _masked_log_ratio(logprobs, old_logprobs, mask)
    seq_log_ratio = masked_mean(token_log_ratio, mask, dim=-1)  # [B]
    log_ratio = seq_log_ratio[:, None].expand_as(token_log_ratio)
    return _policy_loss(log_ratio, token_log_ratio, advantages, mask, eps_clip=eps_clip,
                        eps_clip_high=eps_clip_high, eps_clip_c=eps_clip_c, reduce=reduce,
                        normalizer=normalizer, is_weights=is_weights, opsm_delta=opsm_delta)


def sft_loss(logprobs: Tensor, mask: Tensor, *, reduce: Callable[..., Tensor] = token_mean,
             normalizer: float | None = None) -> Tensor:
    """Negative log-likelihood of the response tokens, reduced by `reduce` (masked token mean)."""
    return reduce(-logprobs, mask, normalizer=normalizer)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, value_clip: float | None = None,
               reduce: Callable[..., Tensor] = token_mean, normalizer: float | None = None) -> tuple[Tensor, Metrics]:
    """Critic loss 0.5 * (V - R)^2; with `value_clip` c, PPO's clipped form
    0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2). Metric: value_clip_frac."""
    unclipped = (values - returns) ** 2
    if value_clip is None:
        loss, clipped = 0.5 * unclipped, torch.zeros_like(mask, dtype=torch.bool)
    else:
        if value_clip <= 0:
            raise ValueError(f"value_clip must be > 0, got {value_clip}; leave it unset to disable")
        v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped_sq = (v_clipped - returns) ** 2
        loss, clipped = 0.5 * torch.maximum(unclipped, clipped_sq), clipped_sq > unclipped
    metrics = {"value_clip_frac": masked_mean(clipped.to(values.dtype), mask).detach()}
    return reduce(loss, mask, normalizer=normalizer), metrics


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, clip: float,
                clip_low: float = 0.0) -> Tensor:
    """Truncated importance-sampling weights exp(old - rollout) clamped to [clip_low, clip], detached.

    Corrects for the engine sampling from a slightly different distribution than the trainer's
    `old_logprobs` (kernels, precision): multiply the per-token policy loss by them (`is_weights`).
    Off the mask the weight is 1.
    """
    if not 0.0 <= clip_low <= clip:
        raise ValueError(f"need 0 <= clip_low <= clip for TIS, got clip_low={clip_low}, clip={clip}")
    with torch.no_grad():
        w = torch.exp(_masked_log_ratio(old_logprobs, rollout_logprobs, mask)).clamp(clip_low, clip)
        return torch.where(mask.bool(), w, torch.ones((), dtype=w.dtype, device=w.device))


def mismatch_metrics(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Metrics:
    """How far the trainer's logprobs of the sampled tokens are from the engine's, over response tokens:
    logprob_abs_diff_mean, logprob_abs_diff_max, and k3_kl, a k3 estimate of KL(rollout || train)
    (the tokens were sampled by the engine)."""
    with torch.no_grad():
        diff = _masked_log_ratio(train_logprobs, rollout_logprobs, mask).abs()  # 0 off the mask
        return {
            "logprob_abs_diff_mean": masked_mean(diff, mask),
            "logprob_abs_diff_max": diff.max() if diff.numel() else diff.new_zeros(()),
            "k3_kl": masked_mean(kl_k3(rollout_logprobs, train_logprobs), mask),
        }


POLICY_LOSSES: dict[str, PolicyLoss] = {"ppo": ppo_clip_loss, "gspo": gspo_loss}


def get_policy_loss(name: str, **options: object) -> PolicyLoss:
    """The policy loss `name` (ppo | gspo) with `options` (eps_clip, eps_clip_high, eps_clip_c, reduce,
    opsm_delta) bound."""
    return select(POLICY_LOSSES, "policy loss", name, **options)
