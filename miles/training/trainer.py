"""The torch trainer: one HF causal LM, AdamW, policy-gradient / SFT steps over scored samples.

Precision: the parameters (the master weights) and the optimizer state are always float32. The
forward runs under autocast in the compute dtype: bfloat16 on CUDA ("auto"), float32 on CPU, or
what `dtype` says. Gradients land in float32 on the parameters.

One rollout is trained in two calls. `prepare_rollout(samples, rollout_id, values)` packs the samples
(`make_train_batch`), computes the trainer's logprobs (current weights, no grad), the reference
model's when there is one, the truncated importance-sampling weights (--use-tis), and the advantages:
the executor's per-sample ones for the sequence-level estimators, or token-level ones here, where
the reference and the critic's `values` are (REINFORCE++ returns, PPO's GAE, both with --kl-coef's
KL in the token rewards); for PPO it returns the critic's targets. `train(samples, rollout_id)` then
takes one optimizer step per global batch of `train.global_batch_size` samples, each accumulated
over micro-batches of `train.micro_batch_size` samples (it prepares the rollout itself when nothing
was prepared). Every micro-batch term is reduced with the *global* batch's count (tokens, or
sequences for the seq-mean reductions) as the denominator, so the accumulated gradient equals the
gradient of the reduction over the whole global batch.

The loss: policy loss (PPO clip, or GSPO when the advantage estimator is gspo; or SFT's NLL for
--loss-type sft_loss) + kl_loss_coef * KL(policy || reference) - entropy_coef * entropy, each term
reduced by --loss-agg-mode. Which functions compute each term, the advantages and the reduction is
decided once in `__init__`; the step never looks at a name.

A plain class; the composition root makes it a Ray actor.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Callable

import structlog
import torch
from torch import Tensor

from miles.algorithms import (LOSS_REDUCTIONS, NORMALIZER_COUNTS, entropy_from_logits, gae, get_kl_estimator,
                              get_policy_loss, logprobs_from_logits, masked_mean, mismatch_metrics,
                              normalize_advantages, reinforce_plus_plus_returns, select, sft_loss, tis_weights)
from miles.algorithms.names import LOSS_AGG_MODES, LOSS_TYPES
from miles.config import AlgorithmConfig, ConfigError, RolloutConfig, TrainConfig
from miles.training.batch import TrainBatch, make_train_batch, split
from miles.training.rng import rng_state, set_rng_state
from miles.training.shell import OPTIMIZER_FILE, OptimizedModel
from miles.types import Sample
from miles.weights.checksum import state_dict_checksum, state_dict_to_cpu
from miles.weights.hf import load_causal_lm, load_tokenizer, load_weights, model_weights

log = structlog.get_logger().bind(role="trainer")

# files written by save(); load() needs all of them (REF_FILE only with --ref-update-interval)
MODEL_FILE, RNG_FILE, STATE_FILE = "model.safetensors", "rng.pt", "trainer_state.json"   # and OPTIMIZER_FILE
REF_FILE = "reference.safetensors"

# (logprobs, micro-batch, normalizer) -> (loss term, metrics averaged over the micro-batch's tokens)
Term = Callable[[Tensor, TrainBatch, float], tuple[Tensor, dict[str, Tensor]]]
# (prepared batch, critic values [B, T] or None, policy-vs-reference KL [B, T] or None) -> critic targets or None;
# fills batch.advantages
AdvantageStage = Callable[[TrainBatch, Tensor | None, Tensor | None], Tensor | None]


def _config_problems(train: TrainConfig, algorithm: AlgorithmConfig, rollout: RolloutConfig) -> list[str]:
    problems = []
    if train.micro_batch_size < 1:
        problems.append(f"--micro-batch-size must be >= 1, got {train.micro_batch_size}")
    if train.global_batch_size is not None and train.global_batch_size < 1:
        problems.append(f"--global-batch-size must be >= 1 (or unset: the whole rollout), got {train.global_batch_size}")
    if train.clip_grad < 0:
        problems.append(f"--clip-grad must be >= 0 (0 disables clipping), got {train.clip_grad}")
    if algorithm.loss_type not in LOSS_TYPES:
        problems.append(f"--loss-type must be one of {', '.join(LOSS_TYPES)}, got {algorithm.loss_type!r}")
    if algorithm.loss_agg_mode not in LOSS_AGG_MODES:
        problems.append(f"--loss-agg-mode must be one of {', '.join(LOSS_AGG_MODES)}, got {algorithm.loss_agg_mode!r}")
    if algorithm.use_tis and algorithm.use_rollout_logprobs:
        problems.append("--use-tis and --use-rollout-logprobs correct the same mismatch twice; keep one")
    if not rollout.temperature > 0:
        problems.append(f"--rollout-temperature must be > 0 to train on the rollouts (greedy ones cannot be), "
                        f"got {rollout.temperature}")
    return problems


def _policy_term(loss_fn: Callable, logprobs: Tensor, mb: TrainBatch, normalizer: float):
    return loss_fn(logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, normalizer=normalizer,
                   is_weights=mb.is_weights)


def _sft_term(reduce: Callable, logprobs: Tensor, mb: TrainBatch, normalizer: float):
    return sft_loss(logprobs, mb.loss_mask, reduce=reduce, normalizer=normalizer), {}


def _kl_term(estimator: Callable, reduce: Callable, logprobs: Tensor, mb: TrainBatch, normalizer: float):
    return reduce(estimator(logprobs, mb.ref_logprobs), mb.loss_mask, normalizer=normalizer), {}


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
    else:
        name = "gspo" if algorithm.advantage_estimator == "gspo" else "ppo"
        loss_fn = get_policy_loss(name, eps_clip=algorithm.eps_clip, eps_clip_high=algorithm.eps_clip_high,
                                  eps_clip_c=algorithm.eps_clip_c, reduce=reduce)
        policy = partial(_policy_term, loss_fn)
    kl: Term = (partial(_kl_term, get_kl_estimator(algorithm.kl_loss_type), reduce) if algorithm.use_kl_loss
                else _no_kl)
    return policy, kl


# --- advantage stages (one is picked at start-up) --------------------------------------------------
def _sequence_advantages(normalize: bool, batch: TrainBatch, values: Tensor | None, kl: Tensor | None):
    """grpo, gspo, rloo, reinforce_plus_plus_baseline: the executor's per-sample advantages, already on
    the response tokens; --normalize-advantages whitens them over the rollout's response tokens."""
    if normalize:
        batch.advantages = normalize_advantages(batch.advantages, batch.loss_mask)
    return None


def _reinforce_plus_plus(gamma: float, kl_coef: float, batch: TrainBatch, values: Tensor | None,
                         kl: Tensor | None):
    """REINFORCE++: discounted return-to-go of the token rewards (reward on the last token, -kl_coef * KL
    on every token), whitened over the rollout's response tokens as the paper does."""
    returns = reinforce_plus_plus_returns(batch.token_rewards, batch.loss_mask, gamma, kl=kl, kl_coef=kl_coef)
    batch.advantages = normalize_advantages(returns, batch.loss_mask)
    return None


def _ppo_gae(gamma: float, lambd: float, kl_coef: float, normalize: bool, batch: TrainBatch,
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
    advantages, returns = gae(rewards, values, batch.loss_mask, gamma, lambd)
    batch.advantages = normalize_advantages(advantages, batch.loss_mask) if normalize else advantages
    return returns


def _pick_advantages(a: AlgorithmConfig) -> AdvantageStage:
    if a.advantage_estimator == "ppo":
        return partial(_ppo_gae, a.gamma, a.lambd, a.kl_coef, a.normalize_advantages)
    if a.advantage_estimator == "reinforce_plus_plus":
        return partial(_reinforce_plus_plus, a.gamma, a.kl_coef)
    return partial(_sequence_advantages, a.normalize_advantages and a.loss_type == "policy_loss")


def _mismatch(train_lp: Tensor, rollout_lp: Tensor, mask: Tensor) -> dict[str, float]:
    """Train vs rollout logprobs of the sampled tokens, logged every step."""
    m = mismatch_metrics(train_lp, rollout_lp, mask)
    return {"logprob_diff_rollout": float(m["logprob_abs_diff_mean"]),
            "logprob_diff_rollout_max": float(m["logprob_abs_diff_max"]), "train_rollout_k3_kl": float(m["k3_kl"])}


def _tis_metrics(train_lp: Tensor, rollout_lp: Tensor, mask: Tensor, bounds: tuple[float, float]) -> dict[str, float]:
    raw = torch.exp(torch.where(mask, train_lp - rollout_lp, torch.zeros((), device=mask.device)))
    clipped = (raw < bounds[0]) | (raw > bounds[1])
    return {"tis_weight_mean": float(masked_mean(raw.clamp(*bounds), mask)),
            "tis_clip_frac": float(masked_mean(clipped.float(), mask))}


class Trainer(OptimizedModel):
    role, state_file, lr_hint = "trainer", STATE_FILE, "--lr"

    def __init__(self, model_path: str, *, train: TrainConfig, algorithm: AlgorithmConfig, rollout: RolloutConfig,
                 device: str = "auto", dtype: str = "auto"):
        """`rollout` says how the samples were drawn: its temperature divides the logits the trainer
        recomputes logprobs from, its max_response_len is seq_mean_token_sum_norm's constant."""
        problems = _config_problems(train, algorithm, rollout)
        if problems:
            raise ConfigError(problems)
        super().__init__(train=train, device=device, dtype=dtype)
        self._temperature = rollout.temperature
        self._kl_coef = algorithm.kl_loss_coef
        self._entropy_coef = algorithm.entropy_coef
        self._entropy_has_grad = algorithm.entropy_coef != 0  # else entropy is only a metric
        self._reduce, self._count = _pick_reduction(algorithm, rollout.max_response_len)
        self._policy_term, self._kl_term = _pick_terms(algorithm, self._reduce)
        self._advantages = _pick_advantages(algorithm)
        self._is_sft = algorithm.loss_type == "sft_loss"     # SFT needs neither old logprobs nor advantages
        self._reward_kl_coef = algorithm.kl_coef
        self._use_rollout_logprobs = algorithm.use_rollout_logprobs
        self._tis_bounds = (algorithm.tis_clip_low, algorithm.tis_clip) if algorithm.use_tis else None
        self._ref_interval = algorithm.ref_update_interval
        self._model = load_causal_lm(model_path, device=self.device, dtype=torch.float32)
        self._tokenizer = load_tokenizer(model_path)
        pad = self._tokenizer.pad_token_id
        self.pad_id = self._tokenizer.eos_token_id if pad is None else pad
        self._ref = self._make_reference(algorithm)
        self._start_optimizer(self._model)
        self._prepared: tuple[int, TrainBatch, dict[str, float]] | None = None   # prepare_rollout's, for train
        log.info("trainer_ready", model=model_path, device=str(self.device), compute_dtype=str(self.compute_dtype),
                 kl=self._ref is not None)

    def _make_reference(self, algorithm: AlgorithmConfig):
        """The frozen KL reference (--use-kl-loss or --kl-coef): --ref-load, else the initial policy."""
        if not (algorithm.use_kl_loss or algorithm.kl_coef > 0):
            return None
        if algorithm.ref_load:
            return load_causal_lm(algorithm.ref_load, device=self.device, dtype=torch.float32).requires_grad_(False)
        return copy.deepcopy(self._model).requires_grad_(False)

    @property
    def model(self):
        return self._live()

    # --- training ------------------------------------------------------------------------------
    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """Train on one rollout's samples (prepared by `prepare_rollout` for this rollout id, or here);
        returns metrics averaged over its optimizer steps, with the rollout's mismatch metrics."""
        self._live()
        if self._prepared is None or self._prepared[0] != rollout_id:
            self.prepare_rollout(samples, rollout_id)
        _, batch, prepared_metrics = self._prepared
        self._prepared = None
        size = self._train_cfg.global_batch_size or batch.size
        steps = [self._step(gb) for gb in split(batch, size)]
        metrics = {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}
        metrics.update(prepared_metrics, num_steps=len(steps), train_tokens=batch.num_tokens)
        if self._ref_interval and (rollout_id + 1) % self._ref_interval == 0:
            load_weights(self._ref, model_weights(self._model))    # in place: the reference stays frozen
            metrics["ref_updated"] = 1.0
        log.info("train_done", rollout_id=rollout_id, **{k: round(v, 6) for k, v in metrics.items()})
        return metrics

    def prepare_rollout(self, samples: list[Sample], rollout_id: int, values: Tensor | None = None) -> Tensor | None:
        """Pack and prepare one rollout for `train(samples, rollout_id)` (see `prepare`); returns the
        critic's targets [B, T] on CPU for PPO (then `values` [B, T] are the critic's), else None."""
        self._live()
        batch, returns, metrics = self._prepare(make_train_batch(samples, self.pad_id), values)
        self._prepared = (rollout_id, batch, metrics)
        return None if returns is None else returns.cpu()

    def prepare(self, batch: TrainBatch, values: Tensor | None = None) -> TrainBatch:
        """`batch` on the trainer's device with old_logprobs, ref_logprobs (with a reference),
        is_weights (--use-tis) and the advantages filled."""
        return self._prepare(batch, values)[0]

    def _prepare(self, batch: TrainBatch, values: Tensor | None) -> tuple[TrainBatch, Tensor | None, dict[str, float]]:
        batch = batch.to(self.device)
        if self._is_sft:
            return batch, None, {}
        mask = batch.loss_mask
        train_lp = self._logprobs(self._model, batch)
        batch.old_logprobs = batch.rollout_logprobs if self._use_rollout_logprobs else train_lp
        metrics = _mismatch(train_lp, batch.rollout_logprobs, mask)
        if self._tis_bounds is not None:
            batch.is_weights = tis_weights(train_lp, batch.rollout_logprobs, mask, clip=self._tis_bounds[1],
                                           clip_low=self._tis_bounds[0])
            metrics.update(_tis_metrics(train_lp, batch.rollout_logprobs, mask, self._tis_bounds))
        kl = None
        if self._ref is not None:
            batch.ref_logprobs = self._logprobs(self._ref, batch)
            if self._reward_kl_coef:
                kl = torch.where(mask, train_lp - batch.ref_logprobs, torch.zeros((), device=self.device))  # k1
                metrics["reward_kl"] = float(masked_mean(kl, mask))
        returns = self._advantages(batch, None if values is None else values.to(self.device), kl)
        metrics["advantage_abs_mean"] = float(masked_mean(batch.advantages.abs(), mask))
        return batch, returns, metrics

    def _step(self, batch: TrainBatch) -> dict[str, float]:
        start = time.perf_counter()
        self._optimizer.zero_grad(set_to_none=True)
        metrics = self.accumulate_gradients(batch)
        grad_norm = self._optimizer_step()
        return {**metrics, "grad_norm": grad_norm, "lr": float(self._optimizer.param_groups[0]["lr"]),
                "step_time_s": time.perf_counter() - start}

    def accumulate_gradients(self, batch: TrainBatch, micro_batch_size: int | None = None) -> dict[str, float]:
        """Backward over the micro-batches of a prepared global batch; gradients add up in `.grad`
        to those of the global batch's loss under --loss-agg-mode. Returns that loss's terms (loss,
        pg_loss, kl, entropy) reduced the same way, and clip_frac over the global batch's tokens."""
        normalizer = max(self._count(batch.loss_mask), 1)  # a batch without response tokens has loss 0, not NaN
        num_tokens = max(batch.num_tokens, 1)
        sums: dict[str, float] = defaultdict(float)
        for mb in split(batch, micro_batch_size or self._train_cfg.micro_batch_size):
            loss, terms = self._micro_loss(mb, normalizer, num_tokens)
            loss.backward()
            for k, v in terms.items():
                sums[k] += v
        return dict(sums)

    def _micro_loss(self, mb: TrainBatch, normalizer: float, num_tokens: int) -> tuple[Tensor, dict[str, float]]:
        with self._autocast():
            logits = self._model(input_ids=mb.tokens, attention_mask=mb.attention_mask).logits
        logprobs = logprobs_from_logits(logits, mb.tokens, self._temperature)
        pg, pg_metrics = self._policy_term(logprobs, mb, normalizer)
        kl, _ = self._kl_term(logprobs, mb, normalizer)
        with torch.set_grad_enabled(self._entropy_has_grad):
            entropy = self._reduce(entropy_from_logits(logits, self._temperature), mb.loss_mask, normalizer=normalizer)
        loss = pg + self._kl_coef * kl - self._entropy_coef * entropy
        share = mb.num_tokens / num_tokens  # pg_metrics are means over this micro-batch's tokens
        terms = {"loss": loss.item(), "pg_loss": pg.item(), "kl": kl.item(), "entropy": entropy.item(),
                 "clip_frac": float(pg_metrics.get("clip_frac", 0.0)) * share}
        return loss, terms

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch) -> Tensor:
        """[B, T] float32 logprobs of `batch.tokens` under `model`, computed micro-batch by micro-batch."""
        out = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=self.device)
        start = 0
        for mb in split(batch, self._train_cfg.micro_batch_size):
            with self._autocast():
                logits = model(input_ids=mb.tokens, attention_mask=mb.attention_mask).logits
            out[start:start + mb.size, :mb.tokens.shape[1]] = logprobs_from_logits(logits, mb.tokens, self._temperature)
            start += mb.size
        return out

    # --- weights and state ---------------------------------------------------------------------
    def weights(self) -> dict[str, Tensor]:
        """CPU float32 copies of the weights under HF names (tied aliases once): what engines load."""
        return state_dict_to_cpu(model_weights(self._live()))

    def weights_checksum(self, dtype: torch.dtype | None = None) -> str:
        """Checksum of the weights; with `dtype`, of the weights cast to it (to compare with a bf16 engine)."""
        return state_dict_checksum(model_weights(self._live()), dtype=dtype)

    def save(self, path: str | Path) -> None:
        """Write weights, optimizer state, RNG states and the step count into the folder `path`
        (created if needed). Atomicity is the caller's: it hands in a temp dir and renames it."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(self.weights(), str(path / MODEL_FILE))
        self._save_optimizer(path)
        torch.save(rng_state(), path / RNG_FILE)
        if self._ref_interval:      # a refreshed reference is no longer the initial policy: keep it
            save_file(state_dict_to_cpu(model_weights(self._ref)), str(path / REF_FILE))

    def load(self, path: str | Path) -> None:
        """Restore what `save` wrote, so the next step is the one the saved trainer would have taken."""
        from safetensors.torch import load_file

        path = Path(path)
        missing = [f for f in (MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, STATE_FILE) if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"trainer checkpoint {path} lacks {', '.join(missing)}; "
                                    f"pass a folder written by Trainer.save")
        load_weights(self._live(), load_file(str(path / MODEL_FILE)))
        self._load_optimizer(path)
        set_rng_state(torch.load(path / RNG_FILE, weights_only=True))
        if self._ref_interval and (path / REF_FILE).is_file():
            load_weights(self._ref, load_file(str(path / REF_FILE)))
        self._prepared = None

    def export_hf(self, path: str | Path) -> None:
        """`save_pretrained` the model (float32) and the tokenizer: loadable by AutoModelForCausalLM."""
        self._live().save_pretrained(str(path))
        self._tokenizer.save_pretrained(str(path))

    def _release(self) -> None:
        self._ref = self._prepared = None
