"""The torch trainer: one HF causal LM, AdamW, policy-gradient / SFT steps over scored samples.

Precision: the parameters (the master weights) and the optimizer state are always float32. The
forward runs under autocast in the compute dtype: bfloat16 on CUDA ("auto"), float32 on CPU, or
what `dtype` says. Gradients land in float32 on the parameters.

One `train(samples)` call: pack the samples (`make_train_batch`), compute the old logprobs (current
weights, no grad) and, with a KL loss, the reference model's; then one optimizer step per global
batch of `train.global_batch_size` samples, each accumulated over micro-batches of
`train.micro_batch_size` samples. Every micro-batch term is reduced with the *global* batch's
response-token count as the denominator, so the accumulated gradient equals the gradient of the
token mean over the whole global batch.

The loss: policy loss (PPO clip, or GSPO when the advantage estimator is gspo; or SFT's NLL for
--loss-type sft_loss) + kl_loss_coef * KL(policy || reference) - entropy_coef * entropy. Which
functions compute each term is decided once in `__init__`.

A plain class; the composition root makes it a Ray actor.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import time
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Callable

import structlog
import torch
from torch import Tensor

from miles.algorithms import (entropy_from_logits, get_kl_estimator, get_policy_loss, logprobs_from_logits,
                              mismatch_metrics, sft_loss, token_mean)
from miles.config import AlgorithmConfig, ConfigError, TrainConfig
from miles.training.batch import TrainBatch, make_train_batch, split
from miles.training.rng import rng_state, seed_everything, set_rng_state
from miles.types import Sample
from miles.weights.checksum import state_dict_checksum, state_dict_to_cpu
from miles.weights.hf import load_causal_lm, load_tokenizer, load_weights, model_weights, resolve_device, resolve_dtype

log = structlog.get_logger().bind(role="trainer")

# files written by save(); load() needs all of them
MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, STATE_FILE = "model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json"

# (logprobs, micro-batch, normalizer) -> (loss term, metrics averaged over the micro-batch's tokens)
Term = Callable[[Tensor, TrainBatch, float], tuple[Tensor, dict[str, Tensor]]]


def _config_problems(train: TrainConfig, algorithm: AlgorithmConfig) -> list[str]:
    problems = []
    if train.micro_batch_size < 1:
        problems.append(f"--micro-batch-size must be >= 1, got {train.micro_batch_size}")
    if train.global_batch_size is not None and train.global_batch_size < 1:
        problems.append(f"--global-batch-size must be >= 1 (or unset: the whole rollout), got {train.global_batch_size}")
    if train.clip_grad < 0:
        problems.append(f"--clip-grad must be >= 0 (0 disables clipping), got {train.clip_grad}")
    if algorithm.loss_type not in ("policy_loss", "sft_loss"):
        problems.append(f"--loss-type must be policy_loss or sft_loss, got {algorithm.loss_type!r}")
    if not algorithm.temperature > 0:
        problems.append(f"the train-side temperature must be > 0 (greedy rollouts cannot be trained on), "
                        f"got {algorithm.temperature}")
    return problems


def _policy_term(loss_fn: Callable, logprobs: Tensor, mb: TrainBatch, normalizer: float):
    return loss_fn(logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, normalizer=normalizer)


def _sft_term(logprobs: Tensor, mb: TrainBatch, normalizer: float):
    return sft_loss(logprobs, mb.loss_mask, normalizer=normalizer), {}


def _kl_term(estimator: Callable, logprobs: Tensor, mb: TrainBatch, normalizer: float):
    return token_mean(estimator(logprobs, mb.ref_logprobs), mb.loss_mask, normalizer=normalizer), {}


def _no_kl(logprobs: Tensor, mb: TrainBatch, normalizer: float):
    return logprobs.new_zeros(()), {}


def _pick_terms(algorithm: AlgorithmConfig) -> tuple[Term, Term]:
    if algorithm.loss_type == "sft_loss":
        policy: Term = _sft_term
    else:
        name = "gspo" if algorithm.advantage_estimator == "gspo" else "ppo"
        loss_fn = get_policy_loss(name, eps_clip=algorithm.eps_clip, eps_clip_high=algorithm.eps_clip_high,
                                  eps_clip_c=algorithm.eps_clip_c)
        policy = partial(_policy_term, loss_fn)
    kl: Term = partial(_kl_term, get_kl_estimator(algorithm.kl_loss_type)) if algorithm.use_kl_loss else _no_kl
    return policy, kl


class Trainer:
    def __init__(self, model_path: str, *, train: TrainConfig, algorithm: AlgorithmConfig, device: str = "auto",
                 dtype: str = "auto"):
        problems = _config_problems(train, algorithm)
        if problems:
            raise ConfigError(problems)
        seed_everything(train.seed)
        self.device = resolve_device(device)
        self.compute_dtype = resolve_dtype(dtype, self.device)
        self._train_cfg = train
        self._temperature = algorithm.temperature
        self._kl_coef = algorithm.kl_loss_coef
        self._entropy_coef = algorithm.entropy_coef
        self._entropy_has_grad = algorithm.entropy_coef != 0  # else entropy is only a metric
        self._policy_term, self._kl_term = _pick_terms(algorithm)
        self._max_grad_norm = train.clip_grad if train.clip_grad > 0 else math.inf
        self._model = load_causal_lm(model_path, device=self.device, dtype=torch.float32)
        self._tokenizer = load_tokenizer(model_path)
        pad = self._tokenizer.pad_token_id
        self.pad_id = self._tokenizer.eos_token_id if pad is None else pad
        # the reference is the model as loaded from disk, frozen; it exists only for the KL loss
        self._ref = copy.deepcopy(self._model).requires_grad_(False) if algorithm.use_kl_loss else None
        self._optimizer = torch.optim.AdamW(self._model.parameters(), lr=train.lr, weight_decay=train.weight_decay,
                                            betas=(train.adam_beta1, train.adam_beta2))
        self._num_steps = 0
        log.info("trainer_ready", model=model_path, device=str(self.device), compute_dtype=str(self.compute_dtype),
                 kl=self._ref is not None)

    @property
    def model(self):
        return self._live()

    @property
    def num_steps(self) -> int:
        """Optimizer steps taken since the initial weights (restored by `load`)."""
        return self._num_steps

    # --- training ------------------------------------------------------------------------------
    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """Train on one rollout's samples; returns metrics averaged over its optimizer steps."""
        self._live()
        batch = self.prepare(make_train_batch(samples, self.pad_id))
        size = self._train_cfg.global_batch_size or batch.size
        steps = [self._step(gb) for gb in split(batch, size)]
        metrics = {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}
        mismatch = mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask)
        metrics.update(num_steps=len(steps), train_tokens=batch.num_tokens,
                       logprob_diff_rollout=float(mismatch["logprob_abs_diff_mean"]),
                       logprob_diff_rollout_max=float(mismatch["logprob_abs_diff_max"]))
        log.info("train_done", rollout_id=rollout_id, **{k: round(v, 6) for k, v in metrics.items()})
        return metrics

    def prepare(self, batch: TrainBatch) -> TrainBatch:
        """`batch` on the trainer's device with old_logprobs (and ref_logprobs with a KL loss) filled."""
        batch = batch.to(self.device)
        batch.old_logprobs = self._logprobs(self._model, batch)
        if self._ref is not None:
            batch.ref_logprobs = self._logprobs(self._ref, batch)
        return batch

    def _step(self, batch: TrainBatch) -> dict[str, float]:
        start = time.perf_counter()
        self._optimizer.zero_grad(set_to_none=True)
        metrics = self.accumulate_gradients(batch)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._model.parameters(), self._max_grad_norm))
        if not math.isfinite(grad_norm):
            # stepping would write NaN/inf into every weight; stop with the weights still good
            raise FloatingPointError(f"gradient norm is {grad_norm} at optimizer step {self._num_steps}; "
                                     f"lower --lr, set --clip-grad, or look for bad samples")
        self._optimizer.step()
        self._num_steps += 1
        return {**metrics, "grad_norm": grad_norm, "lr": float(self._optimizer.param_groups[0]["lr"]),
                "step_time_s": time.perf_counter() - start}

    def accumulate_gradients(self, batch: TrainBatch, micro_batch_size: int | None = None) -> dict[str, float]:
        """Backward over the micro-batches of a prepared global batch; gradients add up in `.grad`
        to those of the global batch's token-mean loss. Returns that loss's terms (loss, pg_loss,
        kl, entropy, clip_frac) as global-batch token means."""
        normalizer = max(batch.num_tokens, 1)  # a batch without response tokens has loss 0, not NaN
        sums: dict[str, float] = defaultdict(float)
        for mb in split(batch, micro_batch_size or self._train_cfg.micro_batch_size):
            loss, terms = self._micro_loss(mb, normalizer)
            loss.backward()
            for k, v in terms.items():
                sums[k] += v
        return dict(sums)

    def _micro_loss(self, mb: TrainBatch, normalizer: float) -> tuple[Tensor, dict[str, float]]:
        with self._autocast():
            logits = self._model(input_ids=mb.tokens, attention_mask=mb.attention_mask).logits
        logprobs = logprobs_from_logits(logits, mb.tokens, self._temperature)
        pg, pg_metrics = self._policy_term(logprobs, mb, normalizer)
        kl, _ = self._kl_term(logprobs, mb, normalizer)
        with torch.set_grad_enabled(self._entropy_has_grad):
            entropy = token_mean(entropy_from_logits(logits, self._temperature), mb.loss_mask, normalizer=normalizer)
        loss = pg + self._kl_coef * kl - self._entropy_coef * entropy
        share = mb.num_tokens / normalizer  # pg_metrics are means over this micro-batch's tokens
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

    def _autocast(self):
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype,
                              enabled=self.compute_dtype != torch.float32)

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
        torch.save(self._optimizer.state_dict(), path / OPTIMIZER_FILE)
        torch.save(rng_state(), path / RNG_FILE)
        (path / STATE_FILE).write_text(json.dumps({"num_steps": self._num_steps}))

    def load(self, path: str | Path) -> None:
        """Restore what `save` wrote, so the next step is the one the saved trainer would have taken."""
        from safetensors.torch import load_file

        path = Path(path)
        missing = [f for f in (MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, STATE_FILE) if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"trainer checkpoint {path} lacks {', '.join(missing)}; "
                                    f"pass a folder written by Trainer.save")
        load_weights(self._live(), load_file(str(path / MODEL_FILE)))
        self._optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, map_location=self.device, weights_only=True))
        set_rng_state(torch.load(path / RNG_FILE, weights_only=True))
        self._num_steps = json.loads((path / STATE_FILE).read_text())["num_steps"]

    def export_hf(self, path: str | Path) -> None:
        """`save_pretrained` the model (float32) and the tokenizer: loadable by AutoModelForCausalLM."""
        self._live().save_pretrained(str(path))
        self._tokenizer.save_pretrained(str(path))

    def _live(self):
        if self._model is None:
            raise RuntimeError("the trainer was disposed; create a new Trainer")
        return self._model

    def dispose(self) -> None:
        """Free the model, the reference and the optimizer state (and the CUDA cache). Idempotent.
        The actor itself is the run's."""
        self._model = self._ref = self._optimizer = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
