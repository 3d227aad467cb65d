"""Builds the arithmetic example's tiny base models: a 4-layer Llama warm-started on a sloppy teacher,
and its Qwen3, Llama 3 and Qwen3-MoE siblings.

The model is a ~1M-parameter causal LM over the character tokenizer of `make_tokenizer.py`, of one
family (`--family`): `llama` (`base_model/`: tied embeddings, plain RoPE), `qwen3`
(`base_model_qwen3/`: `Qwen3ForCausalLM`, per-head q/k RMSNorm, head_dim 64 != hidden 128 / 4 heads,
2 KV heads, tied) or `llama3` (`base_model_llama3/`: `LlamaForCausalLM` with Llama 3's `llama3` RoPE
scaling over an original context of 16 positions, 2 KV heads, untied embeddings) or `qwen3_moe`
(`base_model_qwen3_moe/`: `Qwen3MoeForCausalLM`, Qwen3's attention, layer 0 a dense MLP
(`mlp_only_layers`), layers 1-3 four experts of `moe_intermediate_size` 128 each, top-2 with
`norm_topk_prob`; docs/moe.md). Supervised fine-tuning on `data/sft.jsonl` (loss on response tokens only)
teaches it addition the way the teacher does it, dropping most carries, so its greedy accuracy is
low but not zero and the right answer stays among its samples: the start GRPO needs.

The SFT is the project's own trainer, `miles.training.Trainer` with `loss_type="sft_loss"`, run in
this process (no Ray): each `train(samples, rollout_id=step)` call gets one batch of SFT rows as
`Sample` records and takes one optimizer step.

Deterministic: same seed, same machine, same torch build -> byte-identical model.safetensors. It runs
on one CPU thread because the thread count changes the order of floating-point sums. `--device cuda`
runs the same SFT on a GPU in float32 with deterministic kernels where torch has them (a minute
instead of half an hour on a busy CPU; not the bytes the CPU makes). The committed models were all
made on the CPU.

    python examples/arithmetic/make_base_model.py [--family llama|qwen3|llama3|qwen3_moe] [--out DIR] [--steps N] [--seed S]
        [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.training.torch.trainer import Trainer
from miles.types import Prompt, Sample

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from make_tokenizer import build_tokenizer, save_tokenizer  # noqa: E402
from task import greedy_accuracy, load_jsonl  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    hidden_size: int = 128
    num_layers: int = 4
    intermediate_size: int = 512
    num_heads: int = 4
    max_positions: int = 64         # prompt (<= 6) + response; RoPE, so this costs no weights
    family: str = "llama"


FAMILIES = ("llama", "qwen3", "llama3", "qwen3_moe")
OUT_DIRS = {"llama": "base_model", "qwen3": "base_model_qwen3", "llama3": "base_model_llama3",
            "qwen3_moe": "base_model_qwen3_moe"}
# SFT steps each committed model was made with
DEFAULT_STEPS = {"llama": 2500, "qwen3": 2500, "llama3": 1200, "qwen3_moe": 2000}
# the Qwen3-MoE sibling's experts: few and small, so that its SFT stays a few minutes per 100 steps on
# a shared 2-core CPU (transformers' expert loop runs one matmul pair per expert hit)
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "norm_topk_prob": True,
       "decoder_sparse_step": 1, "mlp_only_layers": [0]}
# Llama 3's RoPE scaling (Llama 3.1's factors) over a short original context, so that the scaled
# low frequencies matter within the example's 64 positions
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


@dataclass(frozen=True, kw_only=True)
class SftSpec:
    steps: int = 2500
    batch_size: int = 128           # examples per optimizer step
    lr: float = 1e-3                # peak; linear warmup, then cosine decay to 0 at the last step
    warmup_steps: int = 100
    clip_grad: float = 1.0
    seed: int = 0


def model_config(spec: ModelSpec, tokenizer):
    """The HF config of `spec.family` (see the module docstring)."""
    common = dict(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads, max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    if spec.family == "llama":
        return LlamaConfig(**common)
    if spec.family == "qwen3":
        return Qwen3Config(**{**common, "num_key_value_heads": spec.num_heads // 2,
                              "head_dim": 2 * spec.hidden_size // spec.num_heads})
    if spec.family == "llama3":
        return LlamaConfig(**{**common, "num_key_value_heads": spec.num_heads // 2, "tie_word_embeddings": False,
                              "rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_ROPE)})
    if spec.family == "qwen3_moe":
        return Qwen3MoeConfig(**{**common, "num_key_value_heads": spec.num_heads // 2,
                                 "head_dim": 2 * spec.hidden_size // spec.num_heads, **MOE})
    raise ValueError(f"--family {spec.family!r}: use one of {', '.join(FAMILIES)}")


def build_model(spec: ModelSpec, tokenizer, seed: int):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(model_config(spec, tokenizer))


def to_sample(tokenizer, row: dict[str, str], index: int) -> Sample:
    """An SFT row as the trainer's input: the loss covers the response ids and <eos>.

    SFT reads only the tokens and the loss mask, so the advantage, the reward and the rollout
    logprobs (zeros here) are placeholders the record requires.
    """
    prompt = tokenizer(row["input"], add_special_tokens=False)["input_ids"]
    response = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Sample(prompt=Prompt(index=index, text=row["input"], prompt_ids=tuple(prompt)), group=index,
                  response_ids=response, rollout_logprobs=[0.0] * len(response), finish_reason="stop",
                  weight_version=0, response_text=row["response"])


def sft_trainer(model_dir: str | Path, spec: SftSpec, device: str = "cpu") -> Trainer:
    """The trainer over the HF folder `model_dir`: AdamW without weight decay, token-mean NLL, one
    optimizer step (one micro-batch) per call of `spec.batch_size` samples, warmup then cosine to 0."""
    warmup = min(spec.warmup_steps, spec.steps - 1)     # the schedule needs decay steps after the warmup
    train = TrainConfig(lr=spec.lr, clip_grad=spec.clip_grad, global_batch_size=spec.batch_size,
                        micro_batch_size=spec.batch_size, seed=spec.seed, lr_decay_style="cosine",
                        lr_warmup_iters=warmup, lr_decay_iters=spec.steps, min_lr=0.0,
                        compile_layers=False)   # the CPU never compiles; on CUDA, eager keeps it deterministic
    # SFT's samples come from the data, not from sampling: the rollout slice's temperature 1 leaves the logits alone
    return Trainer(str(model_dir), train=train, algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3",
                                                                          loss_type="sft_loss"),
                   rollout=RolloutConfig(batch_size=spec.batch_size, n_samples_per_prompt=1), device=device,
                   dtype="float32")


def run_sft(trainer: Trainer, tokenizer, rows: list[dict[str, str]], spec: SftSpec, log_every: int = 250) -> None:
    samples = [to_sample(tokenizer, r, i) for i, r in enumerate(rows)]
    rng = random.Random(spec.seed)
    start = time.perf_counter()
    for step in range(spec.steps):
        metrics = trainer.train(rng.sample(samples, spec.batch_size), rollout_id=step)
        if (step + 1) % log_every == 0:
            print(f"sft step {step + 1}/{spec.steps} loss {metrics['loss']:.3f} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)


def quiet_info_logs() -> None:
    """The trainer logs every step at info level; keep only its warnings and errors on the console.
    In place, because the trainer's module-level logger already holds the processor list."""
    def drop_info(_logger, method: str, event: dict) -> dict:
        if method in ("debug", "info"):
            raise structlog.DropEvent
        return event
    structlog.get_config()["processors"].insert(0, drop_info)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=HERE / "data")
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="default: base_model/ (llama), "
                        "base_model_qwen3/, base_model_llama3/, base_model_qwen3_moe/ here")
    parser.add_argument("--steps", type=int, default=None, help=f"default: {DEFAULT_STEPS}")
    parser.add_argument("--seed", type=int, default=SftSpec.seed)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.device == "cuda":       # deterministic cuBLAS needs a fixed workspace, set before CUDA starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # on CUDA an op without a deterministic kernel warns (and the run says so) instead of stopping it
    torch.use_deterministic_algorithms(True, warn_only=args.device == "cuda")
    quiet_info_logs()
    tokenizer = build_tokenizer()
    spec = SftSpec(steps=args.steps or DEFAULT_STEPS[args.family], seed=args.seed)
    out = args.out or HERE / OUT_DIRS[args.family]
    with tempfile.TemporaryDirectory() as init_dir:     # the trainer starts from an HF folder
        build_model(ModelSpec(family=args.family), tokenizer, seed=spec.seed).save_pretrained(init_dir)
        save_tokenizer(tokenizer, init_dir)
        trainer = sft_trainer(init_dir, spec, args.device)
    run_sft(trainer, tokenizer, load_jsonl(args.data / "sft.jsonl"), spec)
    trainer.export_hf(out)
    save_tokenizer(tokenizer, out)     # over export_hf's copy: keeps the class name transformers 4.x reads
    accuracy = greedy_accuracy(AutoModelForCausalLM.from_pretrained(out), tokenizer,   # the export, on the CPU
                               load_jsonl(args.data / "eval.jsonl"))
    print(f"saved {out}: greedy eval accuracy {accuracy:.3f}, "
          f"model.safetensors sha256 {file_sha256(out / 'model.safetensors')}")


if __name__ == "__main__":
    main(sys.argv[1:])
