"""One rank of the megatron trainer: its shard of the policy (and of the frozen reference), prepared
and trained on every rollout exactly as the torch trainer would (`miles.training.terms`), its
shard of the weights out, its part of a checkpoint in and out, and its teardown.

Every rank receives the whole rollout and packs the same [B, T] batch. A data-parallel rank runs
its rows (`ParallelLayout.dp_rows`) through its pipeline (`steps.py`); the results that must be
whole on every rank (old and reference logprobs, which the advantages may normalise over the
rollout; the loss terms for the metrics) are summed over the ranks that own them. With context
parallelism a rank feeds its 2 of the 2 * CP chunks of every row; its logits give the whole rows'
logprobs and entropies gathered over the CP group (`context_parallel.token_terms`), from which every
CP rank computes the whole micro-batch's loss and backpropagates through its own positions, and
megatron's DDP sums the gradients over data x context parallel ranks. Precision:
bf16 parameters on the GPU with float32 main weights and Adam state in megatron's distributed
optimizer (sharded over the data-parallel ranks); float32 everywhere on the CPU.

A checkpoint folder (written into the run's CheckpointStore temp directory, which commits it):

    dist/                 megatron dist checkpoint (torch_dist): model, optimizer, reference (when refreshed)
    rng/rank_<r>.pt       each rank's RNG states
    trainer_state.json    optimizer steps taken, and the layout (TP / PP / DP) it was saved with

A plain class; `miles.training.megatron.group` makes one Ray actor of it per GPU.
"""

from __future__ import annotations

import gc
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import structlog
import torch
from torch import Tensor

from miles.checkpoint.megatron_format import megatron_checkpoint_info
from miles.config import AlgorithmConfig, ConfigError, RolloutConfig, TrainConfig
from miles.training.batch import TrainBatch, make_train_batch, split
from miles.training.megatron import steps
from miles.training.megatron.checks import requested_layout
from miles.training.megatron.context_parallel import ContextSplit, token_terms
from miles.training.megatron.conversion import (TE_RENAMES, hf_to_mcore, is_tp_split, merge_tensor, model_spec,
                                                shard_tp, stage_weights, te_names, unstage_weights)
from miles.training.megatron.model import RankModel
from miles.training.protocol import STEP_GRAD_NORMS
from miles.training.rng import rng_state, seed_everything, set_rng_state
from miles.training.schedule import lr_schedule, wd_schedule
from miles.training.terms import PolicyObjective, TermSums
from miles.types import Sample
from miles.weights.hf import load_tokenizer, resolve_dtype

log = structlog.get_logger().bind(role="megatron-rank")

DIST_DIR, RNG_DIR, STATE_FILE = "dist", "rng", "trainer_state.json"
LOSS_KEYS = ("loss", "pg_loss", "kl", "entropy", "clip_frac")
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}   # resumable on another DP size


def load_hf_weights(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of an HF folder's *.safetensors files (one file or shards)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights; the megatron backend reads HF "
                                "safetensors checkpoints (save_pretrained writes them)")
    out: dict[str, Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


class MegatronWorker:
    def __init__(self, model_path: str, *, train: TrainConfig, algorithm: AlgorithmConfig, rollout: RolloutConfig,
                 rank: int, world_size: int, device_type: str = "cuda", dtype: str = "auto"):
        """Remembers the configuration (validated before Ray started); `setup` joins the group and builds the model."""
        self._model_path, self._train_cfg, self._ref_load = model_path, train, algorithm.ref_load
        self._ref_interval = algorithm.ref_update_interval
        self._objective = PolicyObjective(algorithm, rollout)
        self._lr_at, self._wd_at = lr_schedule(train), wd_schedule(train)
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")  # Ray's GPU
        self.dtype = resolve_dtype(dtype, self.device)
        if self.dtype == torch.float16:
            raise ConfigError("--dtype float16 is not supported by the megatron backend (it has no loss scaling); "
                              "use bfloat16 or float32")
        self.layout = requested_layout(train, world_size)
        self.coords = self.layout.coords(rank)
        # the last stage's first TP / CP rank of each data-parallel replica contributes results to sums
        self.owner = self.coords.pp == self.layout.pp - 1 and self.coords.tp == 0 and self.coords.cp == 0
        self._policy: RankModel | None = None
        self._ref: RankModel | None = None
        self._prepared: tuple[int, TrainBatch, dict[str, float]] | None = None
        self._num_steps = 0
        self._distributed = False
        self._split: ContextSplit | None = None      # this rank's CP place, with CP > 1

    # --- setup -----------------------------------------------------------------------------------
    def setup(self, master_addr: str, master_port: int) -> None:
        """Join the group (all ranks at once), then build this rank's shard of the model from the checkpoint."""
        self._init_distributed(master_addr, master_port)
        self.spec = model_spec(json.loads((Path(self._model_path) / "config.json").read_text()))
        self.layers = self.layout.stage_layers(self.coords.pp, self.spec.num_layers)
        tokenizer = load_tokenizer(self._model_path)
        self.pad_id = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        self._policy = self._build(self._model_path, train=self._train_cfg)
        if self._objective.uses_reference:
            self._ref = self._build(self._ref_load or self._model_path, train=None)
        log.info("rank_ready", rank=self.rank, coords=vars(self.coords), layers=[self.layers.start, self.layers.stop],
                 device=str(self.device), dtype=str(self.dtype), transformer_engine=self._policy.use_te)

    def _init_distributed(self, master_addr: str, master_port: int) -> None:
        import torch.distributed as dist

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            from miles.training.megatron import cpu_shim
            cpu_shim.apply()
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                world_size=self.world_size)
        self._distributed = True
        from megatron.core import parallel_state, tensor_parallel

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.layout.tp,
                                                 pipeline_model_parallel_size=self.layout.pp,
                                                 context_parallel_size=self.layout.cp)
        if self.layout.cp > 1:
            group = parallel_state.get_context_parallel_group()
            if group.rank() != self.coords.cp:      # the layout's arithmetic and megatron's groups must agree
                raise RuntimeError(f"rank {self.rank}: megatron's CP rank {group.rank()} is not the layout's "
                                   f"{self.coords.cp}")
            self._split = ContextSplit(rank=self.coords.cp, size=self.layout.cp, group=group)
        seed_everything(self._train_cfg.seed)
        if self.device.type == "cuda":
            tensor_parallel.model_parallel_cuda_manual_seed(self._train_cfg.seed)

    def _build(self, path: str, *, train: TrainConfig | None) -> RankModel:
        from miles.training.megatron.model import build_gpt, transformer_config, wrap

        config = transformer_config(self.spec, self.layout, dtype=self.dtype, on_cpu=self.device.type == "cpu",
                                    recompute=train is not None and train.recompute_activations)
        gpt, use_te = build_gpt(self.spec, self.layout, config, pp_rank=self.coords.pp)
        # megatron makes its linear layers on the GPU but the local spec's norms (torch.nn.RMSNorm) on
        # the CPU; DDP's buffers move a policy's, nothing moves a frozen reference's
        gpt.to(self.device)
        megatron = megatron_checkpoint_info(path)
        if megatron is not None:          # miles' --load / --ref-load: a Megatron torch_dist checkpoint
            self._load_dist_weights(gpt, megatron.dist_dir)
        else:
            self._load_shard(gpt, hf_to_mcore(load_hf_weights(path), self.spec), use_te)
        module, optimizer = wrap(gpt, config, train=train, distributed_optimizer=True)
        return RankModel(gpt=gpt, module=module, optimizer=optimizer, use_te=use_te)

    def _load_shard(self, gpt: torch.nn.Module, full: dict[str, Tensor], use_te: bool) -> None:
        """This rank's stage and TP shard of full megatron weights into `gpt`, strictly."""
        stage = stage_weights(full, self.spec, self.layers, first=self.coords.pp == 0,
                              last=self.coords.pp == self.layout.pp - 1)
        shard = shard_tp(stage, self.spec, self.layout.tp, self.coords.tp)
        result = gpt.load_state_dict(te_names(shard, to_te=True) if use_te else shard, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise ValueError(f"rank {self.rank}: converted weights do not fit the megatron model: missing {missing[:3]}, "
                             f"unexpected {result.unexpected_keys[:3]}")

    # --- training --------------------------------------------------------------------------------
    def prepare_rollout(self, samples: list[Sample], rollout_id: int, values: Tensor | None = None) -> None:
        """Pack the rollout and compute what its steps need (see `PolicyObjective.prepare`)."""
        if values is not None:
            raise ValueError("the megatron backend has no critic: PPO's values cannot be used here")
        batch = make_train_batch(samples, self.pad_id).to(self.device)
        metrics: dict[str, float] = {}
        if not self._objective.is_sft:
            train_lp = self._logprobs(self._live(), batch)
            ref_lp = None if self._ref is None else self._logprobs(self._ref, batch)
            _, metrics = self._objective.prepare(batch, train_lp, ref_lp, None)
        self._prepared = (rollout_id, batch, metrics)

    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """One optimizer step per global batch of the rollout; metrics averaged over the steps (equal on every rank)."""
        if self._prepared is None or self._prepared[0] != rollout_id:
            self.prepare_rollout(samples, rollout_id)
        _, batch, prepared_metrics = self._prepared
        self._prepared = None
        results = [self._step(gb) for gb in split(batch, self._train_cfg.global_batch(batch.size))]
        metrics = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
        metrics.update(prepared_metrics, num_steps=len(results), train_tokens=batch.num_tokens)
        if self._ref_interval and (rollout_id + 1) % self._ref_interval == 0:
            self._refresh_reference()
            metrics["ref_updated"] = 1.0
        if self.rank == 0:
            log.info("train_done", rollout_id=rollout_id, **{k: round(v, 6) for k, v in metrics.items()})
        metrics[STEP_GRAD_NORMS] = [r["grad_norm"] for r in results]
        return metrics

    def _local_rows(self, batch: TrainBatch) -> tuple[range, TrainBatch]:
        """This data-parallel rank's rows of `batch`, and those rows."""
        rows = self.layout.dp_rows(self.coords.dp, batch.size)
        return rows, _take(batch, rows)

    @torch.no_grad()
    def _logprobs(self, model: RankModel, batch: TrainBatch) -> Tensor:
        """[B, T] float32 logprobs of the whole batch on every rank (each DP replica computes its rows)."""
        rows, local = self._local_rows(batch)
        size = self._train_cfg.micro_batch_size
        pieces: list[tuple[range, Tensor]] = []
        if len(rows):
            micro = steps.micro_batches(local, self.layout, size, self.pad_id)
            starts = iter(range(rows.start, rows.stop, size))

            def collect(mb: TrainBatch, logits: Tensor) -> Tensor:
                start = next(starts)
                logits = logits[..., :self.spec.vocab_size]
                lp = (self._objective.logprobs(logits, mb.tokens) if self._split is None
                      else token_terms(self._split, self._objective, logits, mb.tokens, with_entropy=False)[0])
                pieces.append((range(start, min(start + size, rows.stop)), lp))
                return lp.sum() * 0.0
            steps.run_schedule(model.module, micro, collect, forward_only=True, bf16=self.dtype == torch.bfloat16,
                               split=self._split)
        return steps.gather_rows(pieces, tuple(batch.tokens.shape), self.owner, self.device)

    def _step(self, batch: TrainBatch) -> dict[str, float]:
        start = time.perf_counter()
        model = self._live()
        model.module.zero_grad_buffer()
        model.optimizer.zero_grad()
        normalizer, num_tokens = self._objective.normalizers(batch)       # the global batch's, on every rank
        sums = TermSums()

        def loss_fn(mb: TrainBatch, logits: Tensor) -> Tensor:
            logits = logits[..., :self.spec.vocab_size]
            if self._split is None:
                loss, terms = self._objective.micro_loss(logits, mb, normalizer, num_tokens)
            else:     # every CP rank: the whole rows' loss, from its positions' logits and the others'
                lp, entropy = token_terms(self._split, self._objective, logits, mb.tokens, with_entropy=True)
                loss, terms = self._objective.loss(lp, entropy, mb, normalizer, num_tokens)
            sums.add(terms)
            return loss
        _, local = self._local_rows(batch)
        micro = steps.micro_batches(local, self.layout, self._train_cfg.micro_batch_size, self.pad_id)
        steps.run_schedule(model.module, micro, loss_fn, forward_only=False, bf16=self.dtype == torch.bfloat16,
                           split=self._split)
        from megatron.core.distributed import finalize_model_grads
        finalize_model_grads([model.module])          # sums over DP x CP; tied embeddings across stages
        grad_norm, lr, wd = self._optimizer_step(model.optimizer)
        terms = steps.sum_over_owners(sums.floats(), LOSS_KEYS + self._objective.metric_keys, self.owner, self.device)
        scheduled = {"weight_decay": wd} if self._train_cfg.weight_decay_incr_style != "constant" else {}
        return {**terms, "grad_norm": grad_norm, "lr": lr, **scheduled, "step_time_s": time.perf_counter() - start}

    def _optimizer_step(self, optimizer) -> tuple[float, float, float]:
        """Set the step's rate and weight decay, step; (gradient norm, rate, weight decay). As megatron-core's
        OptimizerParamScheduler does, each group's decay is the schedule's times its wd_mult (0 for
        biases and norms: megatron's convention)."""
        lr, wd = self._lr_at(self._num_steps), self._wd_at(self._num_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)
        optimizer.prepare_grads()
        grad_norm = float(optimizer.get_grad_norm())       # over every rank's shard
        if not math.isfinite(grad_norm):
            # stepping would write NaN/inf into every weight; stop with the weights still good
            raise FloatingPointError(f"gradient norm is {grad_norm} at optimizer step {self._num_steps}; "
                                     f"lower --lr, set --clip-grad, or look for bad samples")
        optimizer.step()                                  # clips to --clip-grad, steps, gathers the new weights
        self._num_steps += 1
        return grad_norm, lr, wd

    @torch.no_grad()
    def _refresh_reference(self) -> None:
        """reference := policy, shard by shard (same layout on both)."""
        ref = dict(self._ref.gpt.named_parameters())
        for name, p in self._live().gpt.named_parameters():
            ref[name].copy_(p)

    def release_cached_memory(self) -> None:
        """Return the CUDA blocks the allocator keeps cached (the last step's activations) to the
        device, for a colocated engine to take (miles.phases.memory)."""
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def _live(self) -> RankModel:
        if self._policy is None:
            raise RuntimeError(f"megatron rank {self.rank} was disposed (or never set up); create a new trainer")
        return self._policy

    # --- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def stage_weights(self) -> dict[str, Tensor]:
        """This pipeline stage's full (TP-gathered) megatron weights, global layer indices, on the CPU,
        from data-parallel rank 0's TP rank 0; {} from every other rank. Every rank must call it."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        model = self._live()
        local = {n: t for n, t in model.gpt.state_dict().items() if not n.endswith("_extra_state")}
        local = te_names(local, to_te=False) if model.use_te else local
        if self.coords.dp != 0 or self.coords.cp != 0:
            return {}
        if self.layout.tp > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            for name, t in local.items():
                if is_tp_split(name):
                    shards = [torch.empty_like(t) for _ in range(self.layout.tp)]
                    dist.all_gather(shards, t.contiguous(), group=group)
                    local[name] = merge_tensor(name, shards, self.spec)
        if self.coords.tp != 0:
            return {}
        return {n: t.detach().to("cpu", copy=True) for n, t in unstage_weights(local, self.spec, self.layers).items()}

    # --- checkpoints -----------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """This rank's part of the checkpoint folder `path` (see the module docstring); collective."""
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        path = Path(path)
        if self.rank == 0:
            (path / DIST_DIR).mkdir(parents=True, exist_ok=True)
            (path / RNG_DIR).mkdir(exist_ok=True)
            (path / STATE_FILE).write_text(json.dumps({"num_steps": self._num_steps, "tp": self.layout.tp,
                                                       "pp": self.layout.pp, "dp": self.layout.dp}))
        dist.barrier()
        dist_checkpointing.save(self._sharded_state(loading=False), str(path / DIST_DIR))
        torch.save(self._rng_state(), path / RNG_DIR / f"rank_{self.rank:05d}.pt")
        dist.barrier()

    def load(self, path: str | Path, *, optimizer: bool = True, rng: bool = True, step: bool = True) -> None:
        """Restore what `save` wrote (same TP and PP; DP may differ), so the next step is the saved trainer's,
        or only some of it (the parts as in `Trainer.load`); or the weights of a Megatron-LM torch_dist
        checkpoint (miles' saves and converter), whatever its layout, with a fresh optimizer."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        megatron = megatron_checkpoint_info(path) if not (path / STATE_FILE).is_file() else None
        if megatron is not None:
            model = self._live()
            self._load_dist_weights(model.gpt, megatron.dist_dir)
            model.optimizer.reload_model_params()     # main weights := the loaded ones (bf16 on GPUs)
            self._prepared = None
            return
        if not (path / STATE_FILE).is_file() or not (path / DIST_DIR).is_dir():
            raise FileNotFoundError(f"megatron checkpoint {path} lacks {STATE_FILE} or {DIST_DIR}/; pass a folder "
                                    "written by the megatron backend's save")
        state = json.loads((path / STATE_FILE).read_text())
        if (state["tp"], state["pp"]) != (self.layout.tp, self.layout.pp):
            raise ConfigError(f"checkpoint {path} was saved with TP {state['tp']} x PP {state['pp']}; resume with "
                              f"--tensor-model-parallel-size {state['tp']} --pipeline-model-parallel-size {state['pp']}")
        loaded = dist_checkpointing.load(self._sharded_state(loading=True, optimizer=optimizer, reference=step),
                                         str(path / DIST_DIR))
        model = self._live()
        _load_strict(model.gpt, loaded["model"], self.rank)
        if optimizer:
            with torch.no_grad():        # fp32 main weights can be views of the parameters
                model.optimizer.load_state_dict(loaded["optimizer"])
            _set_adam_steps(model.optimizer, state["num_steps"])
        else:
            model.optimizer.reload_model_params()     # main weights := the loaded ones; Adam's state fresh
        if "reference" in loaded:
            _load_strict(self._ref.gpt, {k.removeprefix("reference."): v for k, v in loaded["reference"].items()},
                         self.rank)
        rng_path = path / RNG_DIR / f"rank_{self.rank:05d}.pt"
        if rng and rng_path.is_file():      # a different DP size has other ranks: they keep their seeds
            self._set_rng_state(torch.load(rng_path, weights_only=False))
        if step:
            self._num_steps = state["num_steps"]
        self._prepared = None

    def _load_dist_weights(self, gpt: torch.nn.Module, dist_dir: Path) -> None:
        """This rank's part of the model of a Megatron-LM dist checkpoint (any TP / PP it was saved with:
        megatron-core reshards), read by megatron-core's dist_checkpointing. Its layers may carry the
        Transformer Engine names of the norms (miles' converter) or the local spec's."""
        from megatron.core import dist_checkpointing

        # the layers' _extra_state (FP8 metadata objects) is not read: this build trains in bf16 / fp32
        sharded = {n: e for n, e in gpt.sharded_state_dict().items() if not n.endswith("_extra_state")}
        saved = set(dist_checkpointing.load_tensors_metadata(str(dist_dir)))
        renames = {**TE_RENAMES, **{te: local for local, te in TE_RENAMES.items()}}
        for name, entry in sharded.items():
            key = getattr(entry, "key", None)
            if key is None or key in saved:
                continue
            other = next((key[: -len(a)] + b for a, b in renames.items() if key.endswith("." + a)), None)
            if other is None or other not in saved:
                raise ConfigError(f"{dist_dir}: the checkpoint has no {key} for this model (layers "
                                  f"{self.spec.num_layers}, from --hf-checkpoint {self._model_path}); it was saved "
                                  "from another model")
            sharded[name] = replace(entry, key=other)
        loaded = dist_checkpointing.load({"model": sharded}, str(dist_dir))
        _load_strict(gpt, loaded["model"], self.rank)
        # Megatron-LM's optimizer state is in its own gradient-bucket layout: not read (miles.phases.megatron_resume)
        log.info("megatron_checkpoint_loaded", rank=self.rank, path=str(dist_dir), tensors=len(loaded["model"]),
                 optimizer="fresh", optimizer_state_in_checkpoint=any(k.startswith("optimizer.") for k in saved))

    def _sharded_state(self, *, loading: bool, optimizer: bool = True, reference: bool = True) -> dict:
        model = self._live()
        if loading and optimizer:
            _create_adam_state(model.optimizer)
        state = {"model": model.gpt.sharded_state_dict()}
        if optimizer:
            state["optimizer"] = model.optimizer.sharded_state_dict(state["model"], is_loading=loading,
                                                                    metadata=OPTIMIZER_METADATA)
        if reference and self._ref is not None and self._ref_interval:   # a refreshed reference is no longer the initial policy
            state["reference"] = self._ref.gpt.sharded_state_dict(prefix="reference.")
        return state

    def _rng_state(self) -> dict:
        from megatron.core import tensor_parallel

        return {"process": rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}

    def _set_rng_state(self, state: dict) -> None:
        from megatron.core import tensor_parallel

        set_rng_state(state["process"])
        if state["tracker"]:
            tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])

    # --- teardown --------------------------------------------------------------------------------
    def dispose(self) -> None:
        """Free the model, the reference and the optimizer, megatron's caches that hold them, the
        parallel state and the process group. Idempotent. The actor itself is the group's."""
        self._policy = self._ref = self._prepared = None
        if self._distributed:
            _release_megatron()
            self._distributed = False
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _take(batch: TrainBatch, rows: range) -> TrainBatch:
    from dataclasses import fields, replace

    return replace(batch, **{f.name: getattr(batch, f.name)[rows.start:rows.stop] for f in fields(batch)
                             if isinstance(getattr(batch, f.name), Tensor)})


@torch.no_grad()
def _create_adam_state(optimizer) -> None:
    """Give a never-stepped optimizer its Adam state (zeros, step 1) for a checkpoint to load into:
    without Apex or Transformer Engine, megatron's distributed optimizer reads every parameter's
    `step` when it describes its state. A zero-gradient Adam step leaves the parameters as they are
    (no weight decay here) and the load then replaces all of it."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        if torch_optimizer.state:
            continue
        saved = [(g, g["weight_decay"]) for g in torch_optimizer.param_groups]
        for group, _ in saved:
            group["weight_decay"] = 0.0
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        torch_optimizer.step()
        for group, decay in saved:
            group["weight_decay"] = decay
        torch_optimizer.zero_grad(set_to_none=True)


def _set_adam_steps(optimizer, steps: int) -> None:
    """Every parameter's torch Adam `step` := the optimizer steps taken, each its own tensor. megatron-core
    0.19 without Apex or Transformer Engine restores that count as one tensor shared by every parameter
    and, when the state existed before the load, with the pre-load value; torch's multi-tensor Adam
    would then add 1 to it once per parameter, and every bias correction after a resume would be off."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            if isinstance(state.get("step"), Tensor):
                state["step"] = torch.tensor(float(steps), dtype=state["step"].dtype, device=state["step"].device)


def _load_strict(gpt: torch.nn.Module, state: dict, rank: int) -> None:
    result = gpt.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"rank {rank}: checkpoint does not fit the model: missing {missing[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]}")


def _release_megatron() -> None:
    """What megatron keeps in module globals: the rotary embedding's cache (it holds the model), the
    dist checkpoint's writer queue (a manager process), the parallel state; then the process group."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    getattr(RotaryEmbedding.forward, "cache_clear", lambda: None)()
    if getattr(filesystem_async, "_results_queue", None) is not None:
        filesystem_async._results_queue = None
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
