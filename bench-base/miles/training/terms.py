"""The policy trainer's algorithm, picked once from the run's flags and shared by every training
backend: how a rollout is prepared (old logprobs, truncated importance sampling, the reference's KL
in the token rewards, advantages, on-policy distillation's teacher term, whitening) and how a
micro-batch's loss is made (policy loss, or SFT's NLL, + kl_loss_coef * KL(policy || reference)
- entropy_coef * entropy, each term reduced by --loss-agg-mode with the global batch's normalizer).

A backend computes logits or logprobs its own way (an HF model's logits or chunked from its hidden
states, a megatron-core pipeline) and hands them to `PolicyObjective`; the losses, advantages and
reductions themselves are `miles.algorithms`'. Which function computes each term is decided in
`PolicyObjective.__init__`; the step never looks at a name.

The skipped old-logprob pass: when a rollout takes one optimizer step and nothing but the PPO ratio
reads the pre-step logprobs (`may_skip_old_pass`), a backend may prepare without them (`train_lp`
None); the step's own logprobs, detached, are then the old ones (ratio 1 at the step, exactly what
the pass would have given), and the backend reports the mismatch metrics from them (`mismatch`).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from miles.algorithms import (LOSS_REDUCTIONS, NORMALIZER_COUNTS, entropy_from_logits, gae, get_kl_estimator,
                              get_policy_loss, logprobs_from_logits, masked_mean, mismatch_metrics,
                              normalize_advantages, opd_advantages, reinforce_plus_plus_returns, select, sft_loss,
                              tis_weights)
from miles.config import AlgorithmConfig, RolloutConfig
from miles.training.batch import TrainBatch
from miles.training.pg_reducer import GetReducer, load_reducer, miles_reduction
from miles.user_code import display_name, import_user_function, install_custom_args

# --use-opsm's metric: the share of the step's response tokens masked out of the policy loss
OPSM_KEYS = ("opsm_clipfrac",)

# (logprobs, micro-batch, normalizer) -> (loss term, metrics averaged over the micro-batch's tokens)
Term = Callable[[Tensor, TrainBatch, float], tuple[Tensor, dict[str, Tensor]]]
# (prepared batch, critic values [B, T] or None, policy-vs-reference KL [B, T] or None) -> critic targets or None;
# fills batch.advantages (unwhitened)
AdvantageStage = Callable[[TrainBatch, Tensor | None, Tensor | None], Tensor | None]


def _policy_term(loss_fn: Callable, logprobs: Tensor, mb: TrainBatch, normalizer: float):
    return loss_fn(logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, normalizer=normalizer,
                   is_weights=mb.is_weights)


def _reduced_policy_term(loss_fn: Callable, get_reducer: GetReducer, per_token_loss: bool, logprobs: Tensor,
                         mb: TrainBatch, normalizer: float):
    """The policy term reduced by --custom-pg-loss-reducer-function-path's reducer (miles.training.pg_reducer)."""
    reduce = partial(_user_reduction, get_reducer, mb.attention_mask, per_token_loss)
    return loss_fn(logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, normalizer=normalizer,
                   is_weights=mb.is_weights, reduce=reduce)


def _user_reduction(get_reducer: GetReducer, attention_mask: Tensor, per_token_loss: bool, loss: Tensor,
                    mask: Tensor, *, normalizer: float | None = None) -> Tensor:
    assert normalizer is not None, "the policy term is always reduced with the global batch's normalizer"
    return miles_reduction(get_reducer, loss, mask, attention_mask, per_token_loss=per_token_loss,
                           normalizer=normalizer)


def _sft_term(reduce: Callable, logprobs: Tensor, mb: TrainBatch, normalizer: float):
    return sft_loss(logprobs, mb.loss_mask, reduce=reduce, normalizer=normalizer), {}


def _kl_term(estimator: Callable, reduce: Callable, logprobs: Tensor, mb: TrainBatch, normalizer: float):
    return reduce(estimator(logprobs, mb.ref_logprobs), mb.loss_mask, normalizer=normalizer), {}


def _unbiased_kl_term(estimator: Callable, reduce: Callable, logprobs: Tensor, mb: TrainBatch, normalizer: float):
    """--use-unbiased-kl (DeepSeek-V3.2): the tokens were sampled by the old policy, so each token's KL
    estimate is weighted by the importance ratio exp(logp - old logp), 1 before the first step."""
    ratio = torch.exp(torch.where(mb.loss_mask, logprobs - mb.old_logprobs, torch.zeros((), device=logprobs.device)))
    return reduce(ratio * estimator(logprobs, mb.ref_logprobs), mb.loss_mask, normalizer=normalizer), {}


def _custom_term(loss_fn: Callable, reduce: Callable, logprobs: Tensor, mb: TrainBatch, normalizer: float):
    """--custom-loss-function-path: loss_fn(logprobs [B, T], micro-batch, reduce) -> loss or (loss,
    metrics); reduce(per_token [B, T], mask) is --loss-agg-mode over the global batch, so micro-batch
    losses add up to the global batch's."""
    out = loss_fn(logprobs, mb, partial(reduce, normalizer=normalizer))
    loss, metrics = out if isinstance(out, tuple) else (out, {})
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise TypeError(f"--custom-loss-function-path {display_name(loss_fn)} returned {type(loss).__name__} "
                        f"{tuple(getattr(loss, 'shape', ()))}; expected a scalar tensor (or (scalar, metrics))")
    return loss, {f"custom/{k}": v for k, v in metrics.items()}


def _no_kl(logprobs: Tensor, mb: TrainBatch, normalizer: float):
    return logprobs.new_zeros(()), {}


def _pick_reduction(algorithm: AlgorithmConfig,
                    max_response_len: int) -> tuple[Callable[..., Tensor], Callable[[Tensor], int]]:
    """The loss reduction of --loss-agg-mode and what each micro-batch adds to its normalizer."""
    mode = algorithm.loss_agg_mode
    options = {"max_len": max_response_len} if mode == "seq_mean_token_sum_norm" else {}
    return select(LOSS_REDUCTIONS, "loss reduction (--loss-agg-mode)", mode, **options), NORMALIZER_COUNTS[mode]


def _pick_terms(algorithm: AlgorithmConfig, reduce: Callable[..., Tensor]) -> tuple[Term, Term]:
    if algorithm.loss_type == "sft_loss":
        policy: Term = partial(_sft_term, reduce)
    elif algorithm.loss_type == "custom_loss":
        path = algorithm.custom_loss_function_path
        policy = partial(_custom_term, import_user_function(path, "--custom-loss-function-path"), reduce)
    else:
        name = "gspo" if algorithm.advantage_estimator == "gspo" else "ppo"
        clip = dict(eps_clip=algorithm.eps_clip, eps_clip_high=algorithm.eps_clip_high, eps_clip_c=algorithm.eps_clip_c,
                    opsm_delta=algorithm.opsm_delta if algorithm.use_opsm else None)
        if algorithm.pg_loss_reducer_path:      # miles' reducer for the policy loss only; KL and entropy keep `reduce`
            policy = partial(_reduced_policy_term, get_policy_loss(name, **clip),
                             load_reducer(algorithm.pg_loss_reducer_path), algorithm.loss_agg_mode == "token_mean")
        else:
            policy = partial(_policy_term, get_policy_loss(name, **clip, reduce=reduce))
    kl_term = _unbiased_kl_term if algorithm.use_unbiased_kl else _kl_term
    kl: Term = (partial(kl_term, get_kl_estimator(algorithm.kl_loss_type), reduce) if algorithm.use_kl_loss
                else _no_kl)
    return policy, kl


def _pick_tis(algorithm: AlgorithmConfig) -> Callable[[Tensor, Tensor, Tensor], tuple[Tensor, dict]] | None:
    """--use-tis: the weights, clipped to [--tis-clip-low, --tis-clip], or --custom-tis-function-path's."""
    if not algorithm.use_tis:
        return None
    if algorithm.custom_tis_function_path:
        custom = import_user_function(algorithm.custom_tis_function_path, "--custom-tis-function-path")

        def by_path(train_lp: Tensor, rollout_lp: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, float]]:
            out = custom(train_lp, rollout_lp, mask)
            weights, metrics = out if isinstance(out, tuple) else (out, {})
            return weights, {f"custom_tis/{k}": float(v) for k, v in metrics.items()}
        return by_path
    bounds = (algorithm.tis_clip_low, algorithm.tis_clip)

    def clipped(train_lp: Tensor, rollout_lp: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, float]]:
        weights = tis_weights(train_lp, rollout_lp, mask, clip=bounds[1], clip_low=bounds[0])
        return weights, _tis_metrics(train_lp, rollout_lp, mask, bounds)
    return clipped


# --- advantage stages (one is picked at start-up) --------------------------------------------------
# Each fills batch.advantages unwhitened; `prepare` then applies OPD's reverse KL (--use-opd) and whitens
# when the estimator does (`_pick_advantages`), miles' order (compute_advantages_and_returns).
def _sequence_advantages(batch: TrainBatch, values: Tensor | None, kl: Tensor | None):
    """grpo, gspo, rloo, reinforce_plus_plus_baseline: the executor's per-sample advantages, already on
    the response tokens (--normalize-advantages whitens them over the rollout's response tokens)."""
    return None


def _reinforce_plus_plus(gamma: float, kl_coef: float, batch: TrainBatch, values: Tensor | None,
                         kl: Tensor | None):
    """REINFORCE++: discounted return-to-go of the token rewards (reward on the last token, -kl_coef * KL
    on every token), whitened over the rollout's response tokens as the paper does."""
    batch.advantages = reinforce_plus_plus_returns(batch.token_rewards, batch.loss_mask, gamma, kl=kl, kl_coef=kl_coef)
    return None


def _ppo_gae(gamma: float, lambd: float, kl_coef: float, batch: TrainBatch,
             values: Tensor | None, kl: Tensor | None):
    """PPO: GAE over the token rewards (reward on the last token, -kl_coef * KL on every token) and the
    critic's values; returns the critic's targets (advantages + values)."""
    if values is None:
        raise ValueError("--advantage-estimator ppo needs the critic's values: call "
                         "prepare_rollout(samples, rollout_id, values) with Critic.values(samples) first")
    if values.shape != batch.loss_mask.shape:
        raise ValueError(f"critic values {tuple(values.shape)} do not match the batch {tuple(batch.loss_mask.shape)}; "
                         "critic and trainer must pack the same samples")
    rewards = batch.token_rewards if kl is None else batch.token_rewards - kl_coef * kl
    batch.advantages, returns = gae(rewards, values, batch.loss_mask, gamma, lambd)
    return returns


def _pick_advantages(a: AlgorithmConfig) -> tuple[AdvantageStage, bool]:
    """The stage, and whether its advantages are whitened afterwards (REINFORCE++ always)."""
    if a.needs_critic:
        return partial(_ppo_gae, a.gamma, a.lambd, a.kl_coef), a.normalize_advantages
    if a.advantage_estimator == "reinforce_plus_plus":
        return partial(_reinforce_plus_plus, a.gamma, a.kl_coef), True
    return _sequence_advantages, a.normalize_advantages and a.loss_type != "sft_loss"


def _opd_stage(kl_coef: float, batch: TrainBatch) -> dict[str, float]:
    """--use-opd: advantages -= kl_coef * (student - teacher logprob) on the trained tokens; the student's
    are the old policy's (the trainer's before the step, or the engine's with --use-rollout-logprobs)."""
    if batch.teacher_logprobs is None:
        raise ValueError("--use-opd needs the teacher's logprobs of the samples: the trainer's teacher "
                         "(--opd-type megatron) or the rollout's teacher servers (--opd-type sglang) gave none")
    assert batch.old_logprobs is not None, "OPD keeps the old-logprob pass (may_skip_old_pass)"
    batch.advantages, reverse_kl = opd_advantages(batch.advantages, batch.old_logprobs, batch.teacher_logprobs,
                                                  batch.loss_mask, kl_coef)
    return {"opd_reverse_kl": float(masked_mean(reverse_kl, batch.loss_mask)),
            "opd_teacher_logprob": float(masked_mean(batch.teacher_logprobs, batch.loss_mask))}


def _mismatch(train_lp: Tensor, rollout_lp: Tensor, mask: Tensor) -> dict[str, float]:
    """Train vs rollout logprobs of the sampled tokens, logged every step."""
    m = mismatch_metrics(train_lp, rollout_lp, mask)
    return {"logprob_diff_rollout": float(m["logprob_abs_diff_mean"]),
            "logprob_diff_rollout_max": float(m["logprob_abs_diff_max"]), "train_rollout_k3_kl": float(m["k3_kl"])}


def _ref_diff(train_lp: Tensor, ref_lp: Tensor, mask: Tensor) -> dict[str, float]:
    """--ci-test reads it: 0 before the first step, when the reference is the initial policy."""
    return {"ref_logprob_diff_max": float((train_lp - ref_lp).abs().masked_fill(~mask, 0).max())}


def _tis_metrics(train_lp: Tensor, rollout_lp: Tensor, mask: Tensor, bounds: tuple[float, float]) -> dict[str, float]:
    raw = torch.exp(torch.where(mask, train_lp - rollout_lp, torch.zeros((), device=mask.device)))
    clipped = (raw < bounds[0]) | (raw > bounds[1])
    return {"tis_weight_mean": float(masked_mean(raw.clamp(*bounds), mask)),
            "tis_clip_frac": float(masked_mean(clipped.float(), mask))}


def _detached(v):
    return v.detach() if isinstance(v, Tensor) else float(v)


class TermSums:
    """A step's loss terms summed over its micro-batches where they were computed (0-dim tensors on the
    trainer's device, or floats), read on the host once at the end (`floats`): a `.item()` per term
    and micro-batch would make the host wait for each forward before launching its backward, leaving
    the GPU idle at every micro-batch."""

    def __init__(self):
        self._sums: dict[str, Tensor | float] = {}

    def add(self, terms: dict[str, Tensor | float], weight: float = 1.0) -> None:
        """Adds `terms` times `weight` (0: the keys only, as zeros: a padding micro-batch)."""
        for k, v in terms.items():
            v = 0.0 if weight == 0 else _detached(v) if weight == 1 else _detached(v) * weight
            self._sums[k] = self._sums[k] + v if k in self._sums else v

    def floats(self) -> dict[str, float]:
        """The sums as floats: one device-to-host read for all the tensors."""
        out = {k: float(v) for k, v in self._sums.items() if not isinstance(v, Tensor)}
        tensors = {k: v for k, v in self._sums.items() if isinstance(v, Tensor)}
        if tensors:
            out.update(zip(tensors, torch.stack([v.double().reshape(()) for v in tensors.values()]).tolist()))
        return {k: out[k] for k in self._sums}


class PolicyObjective:
    """The policy's side of one rollout: `prepare` it from the backend's logprobs, then the loss of
    each micro-batch from the backend's logits (`micro_loss`) or logprobs (`loss`)."""

    def __init__(self, algorithm: AlgorithmConfig, rollout: RolloutConfig):
        """`rollout` says how the samples were drawn: its temperature divides the logits logprobs are
        recomputed from, its max_response_len is seq_mean_token_sum_norm's constant; its custom_args are
        what `miles.user_code.custom_args()` answers here, for the custom loss and TIS functions."""
        install_custom_args(rollout.custom_args)
        self.temperature = rollout.temperature
        self.reduce, self.count = _pick_reduction(algorithm, rollout.max_response_len)
        self._policy_term, self._kl_term = _pick_terms(algorithm, self.reduce)
        self._advantages, self._whiten = _pick_advantages(algorithm)
        self._opd = partial(_opd_stage, algorithm.opd_kl_coef) if algorithm.use_opd else None
        self._kl_coef = algorithm.kl_loss_coef
        self._entropy_coef = algorithm.entropy_coef
        self.entropy_has_grad = algorithm.entropy_coef != 0  # else entropy is only a metric
        self.is_sft = algorithm.loss_type == "sft_loss"       # SFT needs neither old logprobs nor advantages
        self.uses_reference = algorithm.use_kl_loss or algorithm.kl_coef > 0
        self._reward_kl_coef = algorithm.kl_coef
        self.uses_rollout_logprobs = algorithm.use_rollout_logprobs
        self._tis = _pick_tis(algorithm)
        self.metric_keys = OPSM_KEYS if algorithm.use_opsm and algorithm.loss_type == "policy_loss" else ()
        # --skip-actor-forward-only: never the pass (validation refused what reads it besides the ratio);
        # else the pre-step logprobs read for more than the PPO ratio (or not at all, SFT) keep it
        self.skips_old_pass = algorithm.skip_actor_forward_only
        self.may_skip_old_pass = self.skips_old_pass or not (self.is_sft or self._tis is not None
                                                             or self.uses_rollout_logprobs or self._reward_kl_coef
                                                             or self._opd is not None)

    def logprobs(self, logits: Tensor, tokens: Tensor) -> Tensor:
        """[B, T] float32 logprobs of `tokens` under `logits` [B, T, V] at the rollout's temperature."""
        return logprobs_from_logits(logits, tokens, self.temperature)

    def prepare(self, batch: TrainBatch, train_lp: Tensor | None, ref_lp: Tensor | None,
                values: Tensor | None) -> tuple[Tensor | None, dict[str, float]]:
        """Fill old_logprobs, ref_logprobs, is_weights (--use-tis) and the advantages of `batch` from
        the current weights' logprobs `train_lp` [B, T] (None: the pass was skipped, allowed only when
        `may_skip_old_pass`; old_logprobs stay None, or are the engine's with --use-rollout-logprobs)
        and the reference's `ref_lp` (None without one);
        returns the critic's targets (PPO, from the critic's `values`) or None, and the metrics."""
        if train_lp is None and not self.may_skip_old_pass:
            raise ValueError("the old-logprob pass can be skipped only when nothing but the PPO ratio reads it "
                             "(no --use-tis, --use-rollout-logprobs, --kl-coef, --use-opd or SFT); pass the trainer's "
                             "logprobs")
        mask = batch.loss_mask
        metrics = self._old_policy(batch, train_lp)
        kl = None
        if ref_lp is not None:
            batch.ref_logprobs = ref_lp
            if train_lp is not None:    # skipped: `mismatch` reports it from the step's own logprobs
                metrics.update(_ref_diff(train_lp, ref_lp, mask))
            if self._reward_kl_coef:    # train_lp is there: may_skip_old_pass is False
                kl = torch.where(mask, train_lp - ref_lp, torch.zeros((), device=mask.device))  # k1
                metrics["reward_kl"] = float(masked_mean(kl, mask))
        metrics["logprob_passes"] = float((train_lp is not None) + (ref_lp is not None))   # no-grad forwards (MFU)
        returns = self._advantages(batch, None if values is None else values.to(mask.device), kl)
        if self._opd is not None:
            metrics.update(self._opd(batch))
        if self._whiten:
            batch.advantages = normalize_advantages(batch.advantages, mask)
        metrics["advantage_abs_mean"] = float(masked_mean(batch.advantages.abs(), mask))
        return returns, metrics

    def _old_policy(self, batch: TrainBatch, train_lp: Tensor | None) -> dict[str, float]:
        """old_logprobs (the trainer's, or the engine's with --use-rollout-logprobs) and TIS weights from
        the pre-step logprobs; the train-vs-rollout mismatch metrics. Without them (the skipped pass)
        only the engine's are set: else `loss` takes the step's own, and the step reports the mismatch."""
        mask = batch.loss_mask
        batch.old_logprobs = batch.rollout_logprobs if self.uses_rollout_logprobs else train_lp
        if train_lp is None:
            return {}
        metrics = _mismatch(train_lp, batch.rollout_logprobs, mask)
        if self._tis is not None:
            out = self._tis(train_lp, batch.rollout_logprobs, mask)
            batch.is_weights, tis_metrics = out if isinstance(out, tuple) else (out, {})
            metrics.update({"tis_weight_mean": float(masked_mean(batch.is_weights, mask)), **tis_metrics})
        return metrics

    def mismatch(self, train_lp: Tensor, batch: TrainBatch) -> dict[str, float]:
        """Train vs rollout logprobs of `batch`'s sampled tokens (after a skipped pass: the step's own),
        and vs the reference's when there is one."""
        metrics = _mismatch(train_lp, batch.rollout_logprobs, batch.loss_mask)
        if batch.ref_logprobs is not None:
            metrics.update(_ref_diff(train_lp, batch.ref_logprobs, batch.loss_mask))
        return metrics

    def normalizers(self, batch: TrainBatch) -> tuple[float, int]:
        """(the reduction's normalizer, response tokens) of a global batch, each at least 1: a batch
        without response tokens has loss 0, not NaN."""
        return max(self.count(batch.loss_mask), 1), max(batch.num_tokens, 1)

    def micro_loss(self, logits: Tensor, mb: TrainBatch, normalizer: float,
                   num_tokens: int) -> tuple[Tensor, dict[str, Tensor | float]]:
        """The loss of micro-batch `mb` from its logits [B, T, V]; see `loss`."""
        with torch.set_grad_enabled(self.entropy_has_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits, self.temperature)
        return self.loss(self.logprobs(logits, mb.tokens), entropy, mb, normalizer, num_tokens)

    def loss(self, logprobs: Tensor, entropy: Tensor, mb: TrainBatch, normalizer: float,
             num_tokens: int) -> tuple[Tensor, dict[str, Tensor | float]]:
        """The loss of micro-batch `mb` (a share of the global batch's, by `normalizer`) from its
        logprobs [B, T] and token entropies [B, T] (with gradients only when `entropy_has_grad`); its
        terms (detached 0-dim tensors, or floats: sum them with `TermSums`), clip_frac weighted by the
        micro-batch's share of `num_tokens`. Without old_logprobs (the skipped pass) the old policy is
        this step's own logprobs, detached."""
        if mb.old_logprobs is None and not self.is_sft:
            mb = replace(mb, old_logprobs=logprobs.detach())
        pg, pg_metrics = self._policy_term(logprobs, mb, normalizer)
        kl, _ = self._kl_term(logprobs, mb, normalizer)
        with torch.set_grad_enabled(self.entropy_has_grad and torch.is_grad_enabled()):
            ent = self.reduce(entropy, mb.loss_mask, normalizer=normalizer)
        loss = pg + self._kl_coef * kl - self._entropy_coef * ent
        share = mb.num_tokens / num_tokens  # pg_metrics are means over this micro-batch's tokens
        # device tensors (or floats), read once a step by `TermSums.floats`
        terms = {"loss": loss.detach(), "pg_loss": pg.detach(), "kl": kl.detach(), "entropy": ent.detach(),
                 "clip_frac": _detached(pg_metrics.get("clip_frac", 0.0)) * share,
                 **{k: _detached(pg_metrics[k]) * share for k in OPSM_KEYS if k in pg_metrics},
                 **{k: _detached(v) * share for k, v in pg_metrics.items() if k.startswith("custom/")}}
        return loss, terms
