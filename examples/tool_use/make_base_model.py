"""Builds the tool-use example's base model: a small Llama warm-started with miles' own SFT on a
teacher that calls the calculator on 30% of the problems and guesses (wrongly) on the rest.

The SFT is `miles.training.torch.trainer.Trainer` with `loss_type="sft_loss"`, in this process (no Ray),
on multi-turn samples: the teacher's tool call (trained), the tool turn (`<tool_response>...`, not
trained: built by miles' `ToolKit.turn_ids` from the chat template, exactly what RL appends) and the
final answer (trained). So the base model can call the calculator and copy its answer, but at
temperature 1 it calls it about 30% of the time, and greedily it guesses.

Deterministic on one machine and torch build (one CPU thread, deterministic algorithms).

    python examples/tool_use/make_base_model.py [--out DIR] [--steps N] [--seed S]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from transformers import LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))
from evaluate import evaluate  # noqa: E402
from make_data import make_splits, teacher_rows  # noqa: E402
from make_tokenizer import ARGS_CLOSE, ARGS_OPEN, CALL_CLOSE, CALL_OPEN, build_tokenizer, save_tokenizer  # noqa: E402
from tools import calc, execute  # noqa: E402

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig  # noqa: E402
from miles.rollout.tools import ToolKit  # noqa: E402
from miles.training.torch.trainer import Trainer  # noqa: E402
from miles.types import Prompt, Sample  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    hidden_size: int = 128
    num_layers: int = 3
    intermediate_size: int = 384
    num_heads: int = 4
    max_positions: int = 64         # prompt (6) + response (<= 24); RoPE, so this costs no weights


@dataclass(frozen=True, kw_only=True)
class SftSpec:
    steps: int = 400
    batch_size: int = 64
    lr: float = 2e-3                # peak; linear warmup, then cosine decay to 0 at the last step
    warmup_steps: int = 50
    clip_grad: float = 1.0
    seed: int = 0


def build_model(spec: ModelSpec, tokenizer, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config)


def ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def to_sample(tokenizer, kit: ToolKit, row: dict, index: int) -> Sample:
    """The teacher's trajectory as a multi-turn sample (SFT reads its tokens and its loss mask)."""
    prompt_text = tokenizer.apply_chat_template([{"role": "user", "content": row["input"]}], tokenize=False,
                                                add_generation_prompt=True)
    prompt = Prompt(index=index, text=prompt_text, prompt_ids=tuple(ids(tokenizer, prompt_text)), label=row["label"])
    sample = Sample(prompt=prompt, group=index, response_ids=[], rollout_logprobs=[], finish_reason="stop",
                    weight_version=0)
    eos = tokenizer.eos_token_id
    if not row["tool"]:
        answer = ids(tokenizer, row["guess"]) + [eos]
        sample.append(answer, [0.0] * len(answer), trained=True)
        return sample
    call = ids(tokenizer, f"{CALL_OPEN}{ARGS_OPEN}{row['input']}{ARGS_CLOSE}{CALL_CLOSE}") + [eos]
    sample.append(call, [0.0] * len(call), trained=True)
    turn = kit.turn_ids(tokenizer, [{"role": "tool", "name": "calc", "content": calc(row["input"])}])
    sample.append(turn, trained=False)
    answer = ids(tokenizer, row["label"]) + [eos]
    sample.append(answer, [0.0] * len(answer), trained=True)
    return sample


def sft_trainer(model_dir: str | Path, spec: SftSpec) -> Trainer:
    warmup = min(spec.warmup_steps, spec.steps - 1)
    train = TrainConfig(lr=spec.lr, clip_grad=spec.clip_grad, global_batch_size=spec.batch_size,
                        micro_batch_size=spec.batch_size, seed=spec.seed, lr_decay_style="cosine",
                        lr_warmup_iters=warmup, lr_decay_iters=spec.steps, min_lr=0.0)
    return Trainer(str(model_dir), train=train, algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", loss_type="sft_loss"),
                   rollout=RolloutConfig(batch_size=spec.batch_size, n_samples_per_prompt=1), device="cpu")


def run_sft(trainer: Trainer, samples: list[Sample], spec: SftSpec, log_every: int = 100) -> None:
    rng = random.Random(spec.seed)
    start = time.perf_counter()
    for step in range(spec.steps):
        metrics = trainer.train(rng.sample(samples, spec.batch_size), rollout_id=step)
        if (step + 1) % log_every == 0:
            print(f"sft step {step + 1}/{spec.steps} loss {metrics['loss']:.3f} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)


def quiet_info_logs() -> None:
    def drop_info(_logger, method: str, event: dict) -> dict:
        if method in ("debug", "info"):
            raise structlog.DropEvent
        return event
    structlog.get_config()["processors"].insert(0, drop_info)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "base_model")
    parser.add_argument("--steps", type=int, default=SftSpec.steps)
    parser.add_argument("--seed", type=int, default=SftSpec.seed)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    quiet_info_logs()
    tokenizer, spec = build_tokenizer(), SftSpec(steps=args.steps, seed=args.seed)
    kit = ToolKit(execute=execute)
    samples = [to_sample(tokenizer, kit, row, i) for i, row in enumerate(teacher_rows(make_splits()["train"]))]
    with tempfile.TemporaryDirectory() as init_dir:     # the trainer starts from an HF folder
        build_model(ModelSpec(), tokenizer, seed=spec.seed).save_pretrained(init_dir)
        save_tokenizer(tokenizer, init_dir)
        trainer = sft_trainer(init_dir, spec)
    run_sft(trainer, samples, spec)
    trainer.export_hf(args.out)
    save_tokenizer(tokenizer, args.out)
    greedy = evaluate(args.out)
    sampled = evaluate(args.out, temperature=1.0, n=4)
    digest = hashlib.sha256((args.out / "model.safetensors").read_bytes()).hexdigest()
    print(f"saved {args.out}: greedy pass@1 {greedy['eval/tool/pass@1']:.3f} "
          f"(tool calls {greedy['eval/tool/tool_calls_mean']:.2f}); temperature 1: pass@1 "
          f"{sampled['eval/tool/pass@1']:.3f} (tool calls {sampled['eval/tool/tool_calls_mean']:.2f}); "
          f"model.safetensors sha256 {digest}")


if __name__ == "__main__":
    main(sys.argv[1:])
