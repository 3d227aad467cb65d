"""The torch trainer: one HF causal LM, AdamW, policy-gradient / SFT steps over scored samples.

Precision: the parameters (the master weights) and the optimizer state are always float32. The
forward runs under autocast in the compute dtype: bfloat16 on CUDA ("auto"), float32 on CPU, or
what `dtype` says. Gradients land in float32 on the parameters. In float16 (--fp16) the backward
is loss-scaled and an overflow step skipped (the shell's `miles.training.torch.loss_scale`). With
--trainer-weight-shadows the decoder's Linear weights are cast once per micro-batch loop instead of
at every forward, and their gradients folded into the float32 ones by hooks: the same numbers
(`miles.training.torch.shadows`).

One rollout is trained in two calls. `prepare_rollout(samples, rollout_id, values)` packs the samples
(`make_train_batch`), computes the trainer's logprobs (current weights, no grad), the reference
model's when there is one, the OPD teacher's (--opd-type megatron: `--opd-teacher-load`, held like the
reference), the truncated importance-sampling weights (--use-tis), and the advantages:
the executor's per-sample ones for the sequence-level estimators, or token-level ones here, where
the reference and the critic's `values` are (REINFORCE++ returns, PPO's GAE, both with --kl-coef's
KL in the token rewards); for PPO it returns the critic's targets. `train(samples, rollout_id)` then
takes one optimizer step per global batch of `train.global_batch_size` samples, each accumulated
over micro-batches of `train.micro_batch_size` samples, or with --use-dynamic-batch-size of at most
`train.max_tokens_per_gpu` real tokens packed end to end into one row (`miles.training.packing`;
padded rows x longest with --no-pack-sequences); it prepares the rollout itself when nothing was
prepared. Metric `tokens_computed_per_real` is the padding's cost (1.0 packed). On CUDA without
--max-tokens-per-gpu, micro-batches are capped by a budget planned from the free memory
(`miles.training.torch.memory_plan`, metric `memory_token_budget`). Every micro-batch term is reduced
with the *global* batch's count (tokens, or sequences for the seq-mean reductions) as the
denominator, so the accumulated gradient equals the gradient of the reduction over the whole
global batch.

The loss: policy loss (PPO clip, or GSPO when the advantage estimator is gspo; or SFT's NLL for
--loss-type sft_loss) + kl_loss_coef * KL(policy || reference) - entropy_coef * entropy, each term
reduced by --loss-agg-mode. Which functions compute each term, the advantages and the reduction is
decided once, by `miles.training.terms.PolicyObjective` (shared with the megatron backend); the step
never looks at a name.

On CUDA (or when asked) the logprobs and entropies come from the last hidden states and the LM head,
chunk by chunk, never as [B, T, V] logits (`miles.training.torch.forward`). On every device, when a
rollout takes exactly one optimizer step and nothing but the PPO ratio and the built-in (per-token)
TIS weights read the trainer's pre-step logprobs (no --custom-tis-function-path, no
--use-rollout-logprobs, no KL in the reward, no OPD), the no-grad pass that computes them is skipped:
they are, by construction, the step's own logprobs before its update, so the step uses them detached,
each micro-batch computes its TIS weights from them, and the step reports the mismatch and TIS metrics
from the logprobs it recorded (metric `logprob_passes`). --skip-actor-forward-only skips the pass always: with
--use-rollout-logprobs the engine's stand in (any number of steps), else the one step's own (validation
refuses the rest). `--recompute-activations` checkpoints every layer's activations.

Memory for a colocated engine: `offload`/`onload` (the shell) move the optimizer state to host
memory and back; `weight_bucket*` hand the weights out as CUDA IPC buckets (miles.weights.transport).

LoRA (--lora-rank R, `miles.training.torch.lora`): the base model frozen, adapters on the selected Linear
layers, only the adapters in AdamW. Everything that leaves the trainer for the engines (`weights`, the
buckets, `weights_checksum`, the HF export) is the merged model, W + (alpha/R) B A, under the base's
names; a checkpoint holds the adapters (PEFT's layout) and their optimizer state, never the base (it is
--hf-checkpoint's). The initial-policy KL reference is the same model with its adapters off.

A plain class; the composition root makes it a Ray actor.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import structlog
import torch
from torch import Tensor, nn

from miles.algorithms.fused_logprobs import DEFAULT_CHUNK_ROWS
from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.training.batch import TrainBatch, make_train_batch, split
from miles.training.torch import lora
from miles.training.torch.forward import (compile_decoder_layers, compiled_graphs, enable_activation_checkpointing,
                                          pick_forward)
from miles.training.moe import TrainerMoe
from miles.training.torch.fsdp.checkpoint import is_sharded_checkpoint, load_sharded, rng_file
from miles.training.packing import use_packing
from miles.training.protocol import STEP_GRAD_NORMS
from miles.training.rng import rng_state, set_rng_state
from miles.training.torch.shell import OPTIMIZER_FILE, OptimizedModel
from miles.training.terms import PolicyObjective, TermSums
from miles.training.torch.threads import cpu_threads
from miles.training.torch.throughput import peak_tflops, throughput_metrics
from miles.types import Sample
from miles.weights import fp8 as fp8_weights
from miles.weights.checksum import state_dict_checksum, state_dict_to_cpu
from miles.weights.hf import load_causal_lm, load_tokenizer, load_weights, model_weights, pad_id
from miles.weights.transport import DEFAULT_BUCKET_BYTES, BucketSender, HostWeights, WeightBucket

log = structlog.get_logger().bind(role="trainer")

# files written by save(); load() needs all of them (REF_FILE only with --ref-update-interval)
MODEL_FILE, RNG_FILE, STATE_FILE = "model.safetensors", "rng.pt", "trainer_state.json"   # and OPTIMIZER_FILE
REF_FILE = "reference.safetensors"


def _export_hf(path: Path, model: nn.Module, weights: dict[str, Tensor] | None, tokenizer: Any) -> None:
    """`model`'s HF folder, its weights `weights` when given (a snapshot; tied aliases once, as
    save_pretrained itself writes them), else the live ones."""
    model.save_pretrained(str(path), **({} if weights is None else {"state_dict": dict(weights)}))
    tokenizer.save_pretrained(str(path))


LORA_EXPORT_DIR = "adapter"      # export_hf under LoRA: the adapter's PEFT folder inside the HF folder


def _export_lora_hf(path: Path, model: nn.Module, weights: dict[str, Tensor], tokenizer: Any,
                    adapter: dict[str, Tensor], adapter_cfg: dict) -> None:
    """The merged model's HF folder (`weights`: merged CPU copies), and the adapter in `adapter/`: a
    subfolder, since an adapter_config.json beside config.json makes transformers (with peft) load the
    folder as an adapter of another model."""
    _export_hf(path, model, weights, tokenizer)
    lora.save_adapter(path / LORA_EXPORT_DIR, adapter, adapter_cfg)


def save_train_data(template: str, rollout_id: int, batch: TrainBatch, rank: int = 0) -> Path:
    """--save-debug-train-data: one rollout's prepared batch (CPU tensors), atomically; PATH is a
    template with {rollout_id} and {rank} (miles'), else a folder of train_<id>.pt files."""
    path = Path(template.format(rollout_id=rollout_id, rank=rank)) if "{" in template else \
        Path(template) / f"train_{rollout_id}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f.name: getattr(batch, f.name).cpu() for f in dataclasses.fields(batch)
               if isinstance(getattr(batch, f.name), Tensor)}
    tmp = path.with_name(f"{path.name}.tmp{rank}")    # ranks writing one path do not share a temp file
    torch.save({"format": "miles-train-batch-v1", "rollout_id": rollout_id, "rank": rank, **tensors}, tmp)
    tmp.replace(path)
    return path


class Trainer(OptimizedModel):
    role, state_file, lr_hint = "trainer", STATE_FILE, "--lr"
    decouples_lr = True
    rank = 0            # its data-parallel rank (miles.training.torch.fsdp.rank.FSDPRank sets its own)
    world_size = 1      # ranks training together (the CPU ranks of one machine share its cores)

    def __init__(self, model_path: str, *, train: TrainConfig, algorithm: AlgorithmConfig, rollout: RolloutConfig,
                 device: str = "auto", dtype: str = "auto", hidden_forward: bool | None = None,
                 skip_old_logprobs: bool | None = None):
        """`rollout` says how the samples were drawn: its temperature divides the logits the trainer
        recomputes logprobs from, its max_response_len is seq_mean_token_sum_norm's constant.
        `hidden_forward` (chunked logprobs from hidden states): None = on CUDA only, so CPU runs
        compute as they did. `skip_old_logprobs` (no no-grad pass when it equals the step's own, which
        holds on every device: the model runs in eval mode, no dropout): None = yes."""
        super().__init__(train=train, device=device, dtype=dtype)
        self._objective = PolicyObjective(algorithm, rollout)
        self._ref_interval = algorithm.ref_update_interval
        self._model = load_causal_lm(model_path, device=self.device, dtype=torch.float32)
        self._model_path = model_path
        self._tokenizer = load_tokenizer(model_path)
        self.pad_id = pad_id(self._tokenizer)
        self._lora_spec = lora.LoraSpec.from_train(train)
        self._ref = self._make_reference(algorithm)
        self._teacher = self._make_teacher(algorithm)
        self._adapters = self._attach_lora(train.lora_adapter_path)
        self._num_params = sum(p.numel() for p in self._model.parameters())    # tied ones once; `tflops`
        self._peak_tflops = peak_tflops(self.device, self.compute_dtype, train.mfu_peak_tflops)
        self._start_optimizer(self._model)
        on_cuda = self.device.type == "cuda"
        self._packed = use_packing(train, self._model, self._ref, self._teacher, device=self.device)
        self._forward, forward_name = pick_forward(self._model, temperature=self._objective.temperature, autocast=self._autocast,
                                                   compute_dtype=self.compute_dtype,
                                                   hidden=on_cuda if hidden_forward is None else hidden_forward,
                                                   chunk_rows=train.log_probs_chunk_size, packed=self._packed)
        self._logits_path = not forward_name.startswith("hidden")
        # a mixture-of-experts model: routing replay, router losses and metrics (miles.training.moe)
        self._moe = TrainerMoe.of(self._model, train)
        if self._moe is not None:
            self._forward = self._moe.wrap(self._forward)
        # with --lora-dropout the step's own logprobs carry its dropout: the old ones need their own pass
        self._may_skip_old_pass = ((True if skip_old_logprobs is None else skip_old_logprobs)
                                   and self._objective.may_skip_old_pass
                                   and not (self._lora_spec and self._lora_spec.dropout))
        threads = cpu_threads(self.device, share=self.world_size)
        if train.recompute_activations:
            enable_activation_checkpointing(self._model)
        # an MoE model's layers stay eager unless --trainer-compile asks (the routing hooks' records and replay,
        # Python state per forward, trace into the compiled layers on the CPU's counting backend: tests/unit/
        # test_moe.py; not run compiled on a GPU yet)
        compile_layers = train.compile_layers is True or (train.compile_layers is None and self._moe is None)
        compiled = compile_decoder_layers(self._model) if on_cuda and compile_layers else 0
        self._compiled_layers = compiled > 0
        self._sender: BucketSender | None = None       # CUDA IPC weight buckets, made on the first sync
        self._prepared: tuple[int, TrainBatch, dict[str, float]] | None = None   # prepare_rollout's, for train
        log.info("trainer_ready", model=model_path, device=str(self.device), compute_dtype=str(self.compute_dtype),
                 kl=self._ref is not None, opd_teacher=algorithm.opd_teacher_load if self._teacher is not None else None,
                 forward=forward_name, compiled_layers=compiled,
                 weight_shadows=train.shadows and self.compute_dtype != torch.float32,
                 grad_accum_fusion=train.grad_accum_fusion and self.compute_dtype != torch.float32,
                 optimizer_state="host" if train.optimizer_cpu_offload else "device",
                 may_skip_old_logprobs=self._may_skip_old_pass, cpu_threads=threads,
                 lora=None if self._adapters is None else dict(
                     rank=self._lora_spec.rank, alpha=self._lora_spec.alpha, modules=len(self._adapters),
                     trained_params=sum(p.numel() for p in self._model.parameters() if p.requires_grad)))

    def _make_reference(self, algorithm: AlgorithmConfig):
        """The frozen KL reference (--use-kl-loss or --kl-coef): --ref-load, else the initial policy. Under
        LoRA (called before the adapters are attached) the initial policy is the base model: the policy
        itself with its adapters off (`_ref_is_policy`), unless --ref-update-interval refreshes it, which
        needs a copy of its own."""
        if not self._objective.uses_reference:
            return None
        if algorithm.ref_load:
            return self._frozen(algorithm.ref_load)
        if self._lora_spec is not None and not self._ref_interval:
            return self._model
        return copy.deepcopy(self._model).requires_grad_(False)

    def _make_teacher(self, algorithm: AlgorithmConfig):
        """The frozen OPD teacher (--use-opd --opd-type megatron), held like the reference: --opd-teacher-load.
        Its tokenizer is the policy's (validation compared them)."""
        return self._frozen(algorithm.opd_teacher_load) if algorithm.opd_in_trainer else None

    def _frozen(self, path: str) -> nn.Module:
        """A model of the trainer's that never trains (a reference or a teacher): float32, no gradients."""
        return load_causal_lm(path, device=self.device, dtype=torch.float32).requires_grad_(False)

    def _attach_lora(self, adapter_path: str | None) -> dict[str, lora.LoraLinear] | None:
        """The adapters (--lora-rank), from --lora-adapter-path's PEFT folder when given; None: no LoRA."""
        if self._lora_spec is None:
            return None
        adapters = lora.attach(self._model, self._lora_spec)
        if adapter_path is not None:
            path = Path(adapter_path)
            problems = lora.config_problems(lora.read_adapter_config(path), self._lora_spec, list(adapters),
                                            where=f"--lora-adapter-path {path}")
            if problems:
                raise ValueError("; ".join(problems))
            lora.load_adapter_tensors(path, adapters)
        return adapters

    @property
    def _ref_is_policy(self) -> bool:
        return self._ref is not None and self._ref is self._model

    @property
    def model(self):
        return self._live()

    # --- training ------------------------------------------------------------------------------
    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """Train on one rollout's samples (prepared by `prepare_rollout` for this rollout id, or here);
        returns metrics averaged over its optimizer steps, with the rollout's mismatch metrics and what
        the steps achieved (`tflops`, `mfu`: miles.training.torch.throughput)."""
        self._live()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self._prepared is None or self._prepared[0] != rollout_id:
            self.prepare_rollout(samples, rollout_id)
        _, batch, prepared_metrics = self._prepared
        self._prepared = None
        self._computed = [0, 0]
        compiled = compiled_graphs()
        if self._train_cfg.save_debug_train_data:
            save_train_data(self._train_cfg.save_debug_train_data, rollout_id, batch, self.rank)
        steps = [self._step(gb) for gb in split(batch, self._global_batch_size(batch))]
        metrics = self._step_averages(steps)
        if self._moe is not None:
            metrics.update(self._moe.metrics(self._sum_over_ranks))
        metrics.update(prepared_metrics, num_steps=len(steps), train_tokens=batch.num_tokens,
                       tokens_computed_per_real=self._computed[0] / max(self._computed[1], 1))   # 1.0: no padding
        # graphs compiled by its passes (the prepare's and the steps'): a step that compiled took longer for it
        metrics["layer_compiles"] = prepared_metrics.get("layer_compiles", 0.0) + compiled_graphs() - compiled
        metrics.update(throughput_metrics(self._num_params, self._computed[1], sum(s["step_time_s"] for s in steps),
                                          self._peak_tflops))
        if self._memory_budget is not None:
            metrics["memory_token_budget"] = float(self._memory_budget)
        if self.device.type == "cuda":   # peak of this rollout's training; what stays allocated after it
            metrics["gpu_mem_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2 ** 30
            metrics["gpu_mem_allocated_gib"] = torch.cuda.memory_allocated(self.device) / 2 ** 30
            # times the caching allocator found no free block, freed all it caches and synchronized to
            # retry (a step near the GPU's capacity): each is a stall; counted since the process began
            metrics["gpu_alloc_retries"] = float(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))
        if self._ref_interval and (rollout_id + 1) % self._ref_interval == 0:
            self._refresh_reference()
            metrics["ref_updated"] = 1.0
        log.info("train_done", rollout_id=rollout_id, **{k: round(v, 6) for k, v in metrics.items()})
        metrics[STEP_GRAD_NORMS] = [s["grad_norm"] for s in steps]
        return metrics

    def _sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Counts summed over the data-parallel ranks (one process: themselves)."""
        return values

    def _refresh_reference(self) -> None:
        load_weights(self._ref, self._engine_weights())    # in place: the reference stays frozen

    def _set_reference(self, weights: dict[str, Tensor]) -> None:
        """The reference's weights from a checkpoint's REF_FILE (whole tensors under HF names)."""
        load_weights(self._ref, weights)

    def prepare_rollout(self, samples: list[Sample], rollout_id: int, values: Tensor | None = None) -> Tensor | None:
        """Pack and prepare one rollout for `train(samples, rollout_id)` (see `prepare`); returns the
        critic's targets [B, T] on CPU for PPO (then `values` [B, T] are the critic's), else None."""
        self._live()
        compiled = compiled_graphs()
        batch, returns, metrics = self._prepare(make_train_batch(samples, self.pad_id), values, may_skip=True)
        metrics["layer_compiles"] = float(compiled_graphs() - compiled)
        self._prepared = (rollout_id, batch, metrics)
        return None if returns is None else returns.cpu()

    def prepare(self, batch: TrainBatch, values: Tensor | None = None) -> TrainBatch:
        """`batch` on the trainer's device with old_logprobs, ref_logprobs (with a reference),
        is_weights (--use-tis) and the advantages filled."""
        return self._prepare(batch, values)[0]

    def _global_batch_size(self, batch: TrainBatch) -> int:
        return self._train_cfg.global_batch(batch.size)

    def _prepare(self, batch: TrainBatch, values: Tensor | None,
                 may_skip: bool = False) -> tuple[TrainBatch, Tensor | None, dict[str, float]]:
        batch = batch.to(self.device)
        if self._objective.is_sft:
            return batch, None, {}
        skip = may_skip and self._skips_old_pass(batch)
        train_lp = None if skip else self._logprobs(self._model, batch)   # skipped: the step's own, detached
        if not skip and self._moe is not None:     # --use-routing-replay: the steps route as this pass did
            batch.old_routed_experts = self._old_routing
        ref_lp = None if self._ref is None else self._ref_logprobs(batch)
        if self._teacher is not None:      # --opd-type megatron: the teacher scores the sampled tokens here
            batch.teacher_logprobs = self._logprobs(self._teacher, batch)
        returns, metrics = self._objective.prepare(batch, train_lp, ref_lp, values)
        if self._teacher is not None:
            metrics["logprob_passes"] += 1.0
        return batch, returns, metrics

    def _skips_old_pass(self, batch: TrainBatch) -> bool:
        """No no-grad pass for the old logprobs: always with --skip-actor-forward-only, else when the
        rollout is one optimizer step and nothing but the PPO ratio reads them."""
        one_step = self._global_batch_size(batch) >= batch.size
        if not self._objective.skips_old_pass:
            return self._may_skip_old_pass and one_step
        if not (one_step or self._objective.uses_rollout_logprobs):
            raise ValueError(f"--skip-actor-forward-only: a rollout of {batch.size} samples makes several optimizer "
                             f"steps of {self._global_batch_size(batch)}, and without --use-rollout-logprobs the "
                             "old logprobs are the first step's own; add --use-rollout-logprobs")
        return True

    def _step(self, batch: TrainBatch) -> dict[str, float]:
        start = time.perf_counter()
        self._optimizer.zero_grad(set_to_none=True)
        seen = None
        # the skipped pass: the step records the logprobs for the mismatch metrics instead
        if (batch.old_logprobs is None or self._objective.skips_old_pass) and not self._objective.is_sft:
            seen = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=self.device)
        metrics = self.accumulate_gradients(batch, record=seen)
        if seen is not None:
            metrics.update(self._objective.mismatch(seen, batch))
        stepped = self._optimizer_step()
        return {**metrics, **stepped, **self._schedule_metrics(), "step_time_s": time.perf_counter() - start}

    def _memory_plan_args(self) -> dict:
        return dict(model=self._model, logits=self._logits_path, compiled=self._compiled_layers,
                    chunk_rows=self._train_cfg.log_probs_chunk_size or DEFAULT_CHUNK_ROWS)

    def accumulate_gradients(self, batch: TrainBatch, micro_batch_size: int | None = None, *,
                             record: Tensor | None = None) -> dict[str, float]:
        """Backward over the micro-batches of a prepared global batch; gradients add up in `.grad`
        to those of the global batch's loss under --loss-agg-mode. Returns that loss's terms (loss,
        pg_loss, kl, entropy) reduced the same way, and clip_frac over the global batch's tokens.
        `record` [B, T], when given, receives the logprobs the micro-batches computed (detached)."""
        normalizer, num_tokens = self._objective.normalizers(batch)
        return self._accumulate(self._micro_batches(batch, micro_batch_size), normalizer, num_tokens, record).floats()

    def _accumulate(self, pairs: list[tuple[Tensor, TrainBatch]], normalizer: float, num_tokens: int,
                    record: Tensor | None) -> TermSums:
        """The micro-batch loop: forward, loss, backward each of `pairs` (made beforehand by
        `_micro_batches`). It reads nothing from the device (tests/unit/test_step_syncs.py): the terms
        stay there until the step's end, so the host queues micro-batch after micro-batch."""
        sums = TermSums()
        with self._shadowed(self._model, grads=True):
            for rows, mb in pairs:
                loss, terms, logprobs = self._micro_loss(mb, normalizer, num_tokens)
                if self._moe is not None and (router := self._moe.router_loss(len(pairs))) is not None:
                    loss = loss + router
                self._backward(loss)
                if record is not None:
                    record[rows, :logprobs.shape[1]] = logprobs.detach()
                sums.add(terms)
        return sums

    def _micro_loss(self, mb: TrainBatch, normalizer: float,
                    num_tokens: int) -> tuple[Tensor, dict[str, Tensor | float], Tensor]:
        logprobs, token_entropy = self._forward(self._model, mb, True, self._objective.entropy_has_grad)
        loss, terms = self._objective.loss(logprobs, token_entropy, mb, normalizer, num_tokens)
        return loss, terms, logprobs

    def _ref_logprobs(self, batch: TrainBatch) -> Tensor:
        if not self._ref_is_policy:
            return self._logprobs(self._ref, batch)
        with lora.adapters_off(self._adapters):      # LoRA: the base model is the reference
            return self._logprobs(self._model, batch)

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch) -> Tensor:
        """[B, T] float32 logprobs of `batch.tokens` under `model`, computed micro-batch by micro-batch."""
        out = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=self.device)
        pairs = self._micro_batches(batch, forward_only=True)    # planned before the shadows take their memory
        self._old_routing = None
        with self._shadowed(model, grads=False):
            for rows, mb in pairs:
                out[rows, :mb.tokens.shape[1]] = self._forward(model, mb, False, False)[0]
                if self._moe is not None and model is self._model:
                    self._old_routing = self._moe.record_old(self._old_routing, rows, mb, batch)
        return out

    # --- weights and state ---------------------------------------------------------------------
    def _engine_weights(self) -> Mapping[str, Tensor]:
        """The weights the engines load, under HF names (tied aliases once): the live tensors, or under
        LoRA the merged ones, each computed when read (`miles.training.torch.lora.MergedWeights`)."""
        live = model_weights(self._live())
        return live if self._adapters is None else lora.MergedWeights(live, self._adapters)

    def weights(self, fp8_dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """CPU float32 copies of the weights under HF names (tied aliases once): what engines load. With
        `fp8_dtype` (FP8 engines of that dtype, --rollout-quantization fp8): the decoder's Linear weights
        quantized here (e4m3 + `_scale_inv`, `miles.weights.fp8`), so FP8 bytes cross the object store."""
        if fp8_dtype is not None:
            return HostWeights(state_dict_to_cpu(fp8_weights.Fp8Weights(self._engine_weights(), fp8_dtype).materialize()))
        return HostWeights(state_dict_to_cpu(self._engine_weights()))

    def weight_bucket_count(self, dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                            fp8: bool = False) -> int:
        """Buckets of the CUDA IPC transport (made once): the weights cast to `dtype` in flat buffers
        of at most `bucket_bytes` (`fp8`: the Linear weights quantized on this GPU as each bucket is
        filled, e4m3 + scales). Call before `weight_bucket`."""
        if self._sender is None:
            weights = (lambda: fp8_weights.Fp8Weights(self._engine_weights(), dtype)) if fp8 else self._engine_weights
            self._sender = BucketSender(weights, dtype=dtype, bucket_bytes=bucket_bytes, ipc=True)
        return self._sender.num_buckets

    def weight_bucket(self, index: int, version: int) -> WeightBucket:
        """Fill bucket `index` with the current weights and hand out its IPC handle; the buffer lives
        until `release_weight_buckets` (after every engine has loaded it)."""
        return self._sender.bucket(index, version)

    def release_weight_buckets(self, index: int | None = None) -> None:
        """Free bucket `index` (or all): every engine has copied it."""
        if self._sender is not None:
            self._sender.release(index)

    def weights_checksum(self, dtype: torch.dtype | None = None, fp8: bool = False) -> str:
        """Checksum of the weights; with `dtype`, of the weights cast to it (to compare with a bf16 engine);
        with `fp8` too, of what an FP8 engine of that dtype holds (the quantized buckets' contents)."""
        if fp8:
            return state_dict_checksum(fp8_weights.Fp8Weights(self._engine_weights(), dtype), dtype=dtype)
        return state_dict_checksum(self._engine_weights(), dtype=dtype)

    def save(self, path: str | Path, *, optimizer: bool = True, background: bool = False) -> None:
        """Write weights, optimizer state (unless `optimizer` is False: --no-save-optim), RNG states and
        the step count into the folder `path` (created if needed). Atomicity is the caller's: it hands
        in a temp dir and renames it. `background` (--async-save): take a CPU snapshot of all of it and
        return; the files are written on the writer thread (`wait_saved` says when). Under LoRA the
        weights are the adapters alone (lora.ADAPTER_WEIGHTS and lora.ADAPTER_CONFIG, PEFT's layout)."""
        if self._adapters is None:
            weights, adapter_cfg = self.weights(), None          # CPU copies either way
        else:
            weights, adapter_cfg = state_dict_to_cpu(lora.adapter_tensors(self._adapters)), self._adapter_config()
        state = self._optimizer_snapshot() if optimizer and background else None
        ref = state_dict_to_cpu(model_weights(self._ref)) if self._ref_interval else None   # refreshed: keep it
        self._write(background, self._write_checkpoint, Path(path), weights, optimizer, state,
                    self._counters(optimizer), rng_state(), ref, adapter_cfg)

    def _adapter_config(self) -> dict:
        return lora.adapter_config(self._lora_spec, list(self._adapters), self._model_path,
                                   list(lora.candidates(self._live())))

    def _write_checkpoint(self, path: Path, weights: dict[str, Tensor], optimizer: bool, state: dict | None,
                          counters: dict, rng: dict, ref: dict[str, Tensor] | None,
                          adapter_cfg: dict | None = None) -> None:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        if adapter_cfg is None:
            save_file(weights, str(path / MODEL_FILE))
        else:
            lora.save_adapter(path, weights, adapter_cfg)
        self._save_optimizer(path, optimizer=optimizer, state=state, counters=counters)
        torch.save(rng, path / RNG_FILE)
        if ref is not None:
            save_file(ref, str(path / REF_FILE))

    def load(self, path: str | Path, *, optimizer: bool = True, rng: bool = True, step: bool = True) -> None:
        """Restore what `save` wrote, so the next step is the one the saved trainer would have taken; or
        only some of it: without `optimizer` (--no-load-optim) the optimizer starts fresh, without `rng`
        (--no-load-rng) the RNG states stay this process's, without `step` the step count stays 0 and a
        refreshed reference (--ref-update-interval) is not read (--finetune: the weights alone)."""
        from safetensors.torch import load_file

        path = Path(path)
        self._check_lora_checkpoint(path)
        if is_sharded_checkpoint(path):      # saved by the torch trainer on several ranks
            self._load_sharded(path, optimizer=optimizer, rng=rng, step=step)
            return
        # saved with --no-save-optim: no optimizer state, and a fresh optimizer
        weights_file = MODEL_FILE if self._adapters is None else lora.ADAPTER_WEIGHTS
        needed = (weights_file, RNG_FILE, STATE_FILE) + ((OPTIMIZER_FILE,) if self._saved_with_optimizer(path) else ())
        missing = [f for f in needed if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"trainer checkpoint {path} lacks {', '.join(missing)}; "
                                    f"pass a folder written by Trainer.save")
        if self._adapters is None:
            load_weights(self._live(), load_file(str(path / MODEL_FILE)))
        else:
            lora.load_adapter_tensors(path, self._adapters)
        self._load_optimizer(path, optimizer=optimizer, step=step)
        if rng:
            set_rng_state(torch.load(path / RNG_FILE, weights_only=True))
        if step and self._ref_interval and (path / REF_FILE).is_file():
            self._set_reference(load_file(str(path / REF_FILE)))
        self._prepared = None

    def _check_lora_checkpoint(self, path: Path) -> None:
        """A checkpoint's LoRA must be this run's: the adapters of the same rank, alpha, dropout and
        modules, or none on both sides (a ValueError saying which flags to pass)."""
        has_adapter = (path / lora.ADAPTER_CONFIG).is_file()
        if self._adapters is None and has_adapter:
            saved = lora.read_adapter_config(path)
            raise ValueError(f"trainer checkpoint {path} holds LoRA adapters (r={saved.get('r')}, lora_alpha="
                             f"{saved.get('lora_alpha')}), not a whole model: resume with the LoRA flags it was "
                             f"trained with (--lora-rank {saved.get('r')} --lora-alpha {saved.get('lora_alpha')} ...)")
        if self._adapters is None:
            return
        if not has_adapter:
            raise ValueError(f"trainer checkpoint {path} holds a whole model, not LoRA adapters: a --lora-rank run "
                             "resumes adapters only; start LoRA from its weights with --hf-checkpoint <its hf folder>, "
                             "or resume it without --lora-rank")
        problems = lora.config_problems(lora.read_adapter_config(path), self._lora_spec, list(self._adapters),
                                        where=f"the checkpoint {path}")
        if problems:
            raise ValueError(f"cannot resume LoRA from {path}: " + "; ".join(problems) + "; pass the flags it was "
                             "saved with")

    def _load_sharded(self, path: Path, *, optimizer: bool = True, rng: bool = True, step: bool = True) -> None:
        """A sharded checkpoint (`miles.training.torch.fsdp.checkpoint`), resharded onto this trainer's ranks
        (one, without a process group, or any number); the parts as in `load`."""
        from safetensors.torch import load_file

        if not (path / STATE_FILE).is_file():
            raise FileNotFoundError(f"trainer checkpoint {path} lacks {STATE_FILE}; pass a folder written by "
                                    "the torch trainer's save")
        state = json.loads((path / STATE_FILE).read_text())
        with_optimizer = optimizer and state.get("optimizer", True)
        if with_optimizer and len(self._optimizer.param_groups) > 1:
            raise ValueError(f"{path} is a sharded checkpoint, its optimizer state saved as one AdamW group; the "
                             "groups of --decoupled-lr cannot load it yet: resume with --no-load-optim, or without "
                             "--decoupled-lr")
        load_sharded(self._live(), self._optimizer if with_optimizer else None, path)
        self._load_scaler_state(state, optimizer)
        if step:
            self._num_steps = state["num_steps"]
        own = rng_file(path, self.rank)
        if rng:
            set_rng_state(torch.load(own if own.is_file() else rng_file(path, 0), weights_only=True))
        if step and self._ref_interval and (path / REF_FILE).is_file():
            self._set_reference(load_file(str(path / REF_FILE)))
        self._prepared = None

    def export_hf(self, path: str | Path, *, background: bool = False) -> None:
        """`save_pretrained` the model (float32) and the tokenizer: loadable by AutoModelForCausalLM.
        `background` (--async-save): from a CPU snapshot of the weights, on the writer thread. Under
        LoRA: the merged model, and the adapter alone in PEFT's layout in its subfolder `adapter/`."""
        model = self._live()
        if self._adapters is not None:
            adapter = state_dict_to_cpu(lora.adapter_tensors(self._adapters))
            self._write(background, _export_lora_hf, Path(path), model, self.weights(), self._tokenizer, adapter,
                        self._adapter_config())
            return
        weights = self.weights() if background else None     # None: save_pretrained reads the live model
        self._write(background, _export_hf, Path(path), model, weights, self._tokenizer)

    def _release(self) -> None:
        if self._sender is not None:
            self._sender.dispose()
        self._ref = self._teacher = self._prepared = self._sender = None
