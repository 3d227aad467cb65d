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
decided once, by `miles.training.terms.PolicyObjective` (shared with the megatron backend); the step
never looks at a name.

A plain class; the composition root makes it a Ray actor.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from pathlib import Path

import structlog
import torch
from torch import Tensor

from miles.config import AlgorithmConfig, ConfigError, RolloutConfig, TrainConfig
from miles.training.batch import TrainBatch, make_train_batch, split
from miles.training.rng import rng_state, set_rng_state
from miles.training.shell import OPTIMIZER_FILE, OptimizedModel
from miles.training.terms import PolicyObjective, config_problems
from miles.types import Sample
from miles.weights.checksum import state_dict_checksum, state_dict_to_cpu
from miles.weights.hf import load_causal_lm, load_tokenizer, load_weights, model_weights

log = structlog.get_logger().bind(role="trainer")

# files written by save(); load() needs all of them (REF_FILE only with --ref-update-interval)
MODEL_FILE, RNG_FILE, STATE_FILE = "model.safetensors", "rng.pt", "trainer_state.json"   # and OPTIMIZER_FILE
REF_FILE = "reference.safetensors"

class Trainer(OptimizedModel):
    role, state_file, lr_hint = "trainer", STATE_FILE, "--lr"

    def __init__(self, model_path: str, *, train: TrainConfig, algorithm: AlgorithmConfig, rollout: RolloutConfig,
                 device: str = "auto", dtype: str = "auto"):
        """`rollout` says how the samples were drawn: its temperature divides the logits the trainer
        recomputes logprobs from, its max_response_len is seq_mean_token_sum_norm's constant."""
        problems = config_problems(train, algorithm, rollout)
        if problems:
            raise ConfigError(problems)
        super().__init__(train=train, device=device, dtype=dtype)
        self._objective = PolicyObjective(algorithm, rollout)
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
        if not self._objective.uses_reference:
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
        if self._objective.is_sft:
            return batch, None, {}
        train_lp = self._logprobs(self._model, batch)
        ref_lp = None if self._ref is None else self._logprobs(self._ref, batch)
        returns, metrics = self._objective.prepare(batch, train_lp, ref_lp, values)
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
        normalizer, num_tokens = self._objective.normalizers(batch)
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
        return self._objective.micro_loss(logits, mb, normalizer, num_tokens)

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch) -> Tensor:
        """[B, T] float32 logprobs of `batch.tokens` under `model`, computed micro-batch by micro-batch."""
        out = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=self.device)
        start = 0
        for mb in split(batch, self._train_cfg.micro_batch_size):
            with self._autocast():
                logits = model(input_ids=mb.tokens, attention_mask=mb.attention_mask).logits
            out[start:start + mb.size, :mb.tokens.shape[1]] = self._objective.logprobs(logits, mb.tokens)
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
