"""What makes a run unfit for the megatron backend, found on the driver before any actor starts:
megatron-core not installed, a model this backend cannot convert, parallel sizes that do not fit
the model, the batch or the trainer's GPUs, a GPU-memory flag of the torch trainer this backend does
not have. `run_problems` is the backend's `check` in `TRAIN_BACKENDS` (validate runs it, init again
with the placement plan's trainer GPUs); the group checks the same again with the ranks it was
given (`group_problems`).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.config.packages import install_line, installed
from miles.training.megatron.conversion import model_spec, spec_problems, tp_problems
from miles.training.megatron.layout import ParallelLayout, batch_problems, layout_problems

if TYPE_CHECKING:
    from miles.config import RunConfig, TrainConfig



def missing_megatron() -> list[str]:
    """The problem line when megatron-core is not installed (`installed` is looked up here at call time,
    so a test can stand in for it)."""
    return [] if installed("megatron.core") else [
        f"--train-backend megatron needs megatron-core, which is not installed: {install_line('megatron-core', 'megatron')}"]


def requested_layout(train: TrainConfig, world_size: int | None = None) -> ParallelLayout:
    """The layout of `world_size` trainer ranks; without it, one model replica (data parallel 1)."""
    tp, pp, cp = train.tensor_model_parallel_size, train.pipeline_model_parallel_size, train.context_parallel_size
    return ParallelLayout(world_size or tp * pp * cp, tp=tp, pp=pp, cp=cp, sequence_parallel=train.sequence_parallel,
                          first_stage_layers=train.first_pipeline_stage_layers,
                          last_stage_layers=train.last_pipeline_stage_layers)


def group_problems(hf_config: dict[str, Any], train: TrainConfig, layout: ParallelLayout,
                   rollout_samples: int) -> list[str]:
    """Everything wrong with training this HF config on this layout (empty: fine)."""
    if missing := missing_megatron():
        return missing
    problems = layout_problems(layout.world_size, layout.tp, layout.pp, layout.cp, layout.sequence_parallel,
                               hf_config.get("num_hidden_layers"), layout.first_stage_layers, layout.last_stage_layers)
    if layout.sequence_parallel and not (installed("transformer_engine") or installed("apex")):
        problems.append("--sequence-parallel needs Transformer Engine's or Apex's norms (megatron's torch norms do "
                        "not split the sequence); install one or drop --sequence-parallel")
    # --context-parallel-size needs no check of its own beyond the layout's: with Transformer Engine its
    # attention is TE's, without it miles' gathered-K/V attention (context_parallel.py)
    model = spec_problems(hf_config)
    problems += model
    if not model and not problems:
        problems += tp_problems(model_spec(hf_config), layout.tp)
    if not problems:
        problems += batch_problems(layout, rollout_samples, train.global_batch(rollout_samples), train.micro_batch_size)
    return problems


def read_hf_config(model_path: str | Path) -> dict[str, Any] | None:
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def unsupported_features(cfg: RunConfig) -> list[str]:
    """The torch trainer's GPU-memory features this backend does not have yet, each refused by its
    flag rather than silently ignored. --colocate is supported: the ranks take the trainer's shares
    of the plan's GPUs, the engines free their KV cache while the ranks train and the ranks return
    their cached CUDA blocks before the engines take it back; the weights go by the object store,
    and the optimizer state stays on the GPU."""
    c, t = cfg.cluster, cfg.train
    default_bucket = next(f.default for f in fields(cfg) if f.name == "update_weight_buffer_size")
    why = {
        "--offload": "its ranks cannot move their optimizer state to host memory yet (--offload-rollout alone "
                     "is fine: that is the engines')",
        "--offload-train": "its ranks cannot move their optimizer state to host memory yet",
        "--update-weight-buffer-size": "its weights reach the engines through Ray's object store, colocated or "
                                       "not, never as CUDA IPC buckets",
        "--use-dynamic-batch-size": "its micro-batches are --micro-batch-size rows (a pipeline needs equal "
                                    "micro-batch counts on every rank)",
        "--max-tokens-per-gpu": "its micro-batches are --micro-batch-size rows, not a token budget",
        "--no-save-optim": "its dist checkpoint holds the distributed optimizer's shards with the weights",
        "--save-debug-train-data": "its ranks do not write their prepared batches yet",
        "--dump-details": "its ranks do not write their prepared batches yet; --save-debug-rollout-data "
                          "DIR/rollout_data/{rollout_id}.pt dumps the rollouts alone",
        "--trainer-compile": "its layers are megatron-core's (Transformer Engine fuses them where installed)",
        "--trainer-weight-shadows": "its bf16 weights keep float32 main gradients already",
        "--gradient-accumulation-fusion": "megatron-core fuses it with Transformer Engine or APEX where installed",
        "--optimizer-cpu-offload": "its distributed optimizer keeps its state shards on the GPU",
        "--fp16": "its megatron-core model and optimizer are set up for bf16 or fp32, with no loss scaler: "
                  "--dtype bfloat16 trains there",
        "--decoupled-lr": "its distributed optimizer's groups are built without the embedding and output layer's "
                          "own rate (the torch trainer has it)",
    }
    used = [flag for flag, on in (
        ("--offload", c.offload), ("--offload-train", c.offload_train),
        ("--update-weight-buffer-size", cfg.update_weight_buffer_size != default_bucket),
        ("--use-dynamic-batch-size", t.use_dynamic_batch_size), ("--max-tokens-per-gpu", t.max_tokens_per_gpu is not None),
        ("--no-save-optim", not cfg.checkpoint.save_optimizer), ("--save-debug-train-data", bool(t.save_debug_train_data)),
        ("--dump-details", bool(cfg.dump_details) and not t.save_debug_train_data),
        ("--trainer-compile", t.compile_layers is True),     # None (auto) means the torch trainer's default
        ("--trainer-weight-shadows", t.weight_shadows), ("--optimizer-cpu-offload", t.optimizer_cpu_offload),
        ("--gradient-accumulation-fusion", t.grad_accum_fusion),
        ("--fp16", cfg.model.float16),
        ("--decoupled-lr", t.decoupled_lr is not None),
    ) if on]
    return [f"{flag}: not supported by --train-backend megatron yet ({why[flag]}); drop it or use "
            f"--train-backend torch" for flag in used]


def run_problems(cfg: RunConfig, trainer_gpus: int | None = None) -> list[str]:
    """The backend's check of a run (validate calls it, and init again with the placement plan):
    the model's config.json against the flags. The ranks are the trainer's GPUs (`trainer_gpus`:
    --actor-num-nodes x --actor-num-gpus-per-node) on GPUs, else TP x PP x CP (data parallel 1)."""
    problems = unsupported_features(cfg)
    hf_config = read_hf_config(cfg.model.hf_checkpoint)
    if hf_config is None:        # validate reports the missing config.json itself
        return problems + missing_megatron()
    layout = requested_layout(cfg.train, trainer_gpus)
    return problems + group_problems(hf_config, cfg.train, layout, cfg.rollout.num_samples)
