"""Builds the arithmetic example's tiny base model: a 4-layer Llama warm-started on a sloppy teacher.

The model is a ~1M-parameter `LlamaForCausalLM` with tied embeddings over the character tokenizer
of `make_tokenizer.py`. Supervised fine-tuning on `data/sft.jsonl` (loss on response tokens only)
teaches it addition the way the teacher does it, dropping most carries, so its greedy accuracy is
low but not zero and the right answer stays among its samples: the start GRPO needs.

Deterministic: same seed, same machine, same torch build -> byte-identical model.safetensors. It runs
on one CPU thread because the thread count changes the order of floating-point sums.

    python examples/arithmetic/make_base_model.py [--out DIR] [--steps N] [--seed S]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

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


@dataclass(frozen=True, kw_only=True)
class SftSpec:
    steps: int = 2500
    batch_size: int = 128           # examples per optimizer step
    lr: float = 1e-3                # peak; linear warmup, then cosine decay to 0
    warmup_steps: int = 100
    clip_grad: float = 1.0
    seed: int = 0


@dataclass
class SftBatch:
    tokens: Tensor                  # [B, T] int64, right-padded prompt + response + <eos>
    attention_mask: Tensor          # [B, T] int64, 1 on real tokens
    loss_mask: Tensor               # [B, T] bool, True on response tokens (and <eos>)


def build_model(spec: ModelSpec, tokenizer, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads, max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def encode(tokenizer, row: dict[str, str]) -> tuple[list[int], list[bool]]:
    """Token ids of prompt + response + <eos>, and which of them the loss covers."""
    prompt = tokenizer(row["input"], add_special_tokens=False)["input_ids"]
    response = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + response, [False] * len(prompt) + [True] * len(response)


def collate(examples: list[tuple[list[int], list[bool]]], pad_id: int) -> SftBatch:
    width = max(len(ids) for ids, _ in examples)
    tokens = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.bool)
    for i, (ids, mask) in enumerate(examples):
        tokens[i, :len(ids)] = torch.tensor(ids)
        attention[i, :len(ids)] = 1
        loss_mask[i, :len(ids)] = torch.tensor(mask)
    return SftBatch(tokens=tokens, attention_mask=attention, loss_mask=loss_mask)


def sft_step(model, optimizer: torch.optim.Optimizer, batch: SftBatch, clip_grad: float) -> float:
    """One optimizer step of token-mean NLL over response tokens; returns the loss.

    This is the piece `miles.training.Trainer` with `loss_type="sft_loss"` replaces.
    """
    model.train()
    logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2).float(), batch.tokens[:, 1:], reduction="none")     # [B, T-1]
    mask = batch.loss_mask[:, 1:].float()     # position t predicts token t+1
    loss = (nll * mask).sum() / mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
    optimizer.step()
    return loss.item()


def lr_at(step: int, spec: SftSpec) -> float:
    warm = min(1.0, (step + 1) / spec.warmup_steps)
    return spec.lr * warm * 0.5 * (1.0 + math.cos(math.pi * step / spec.steps))


def run_sft(model, tokenizer, rows: list[dict[str, str]], spec: SftSpec, log_every: int = 250) -> None:
    examples = [encode(tokenizer, r) for r in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    rng = random.Random(spec.seed)
    start = time.perf_counter()
    for step in range(spec.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        loss = sft_step(model, optimizer, collate(rng.sample(examples, spec.batch_size),
                                                  tokenizer.pad_token_id), spec.clip_grad)
        if (step + 1) % log_every == 0:
            print(f"sft step {step + 1}/{spec.steps} loss {loss:.3f} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=HERE / "data")
    parser.add_argument("--out", type=Path, default=HERE / "base_model")
    parser.add_argument("--steps", type=int, default=SftSpec.steps)
    parser.add_argument("--seed", type=int, default=SftSpec.seed)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tokenizer = build_tokenizer()
    spec = SftSpec(steps=args.steps, seed=args.seed)
    model = build_model(ModelSpec(), tokenizer, seed=spec.seed)
    run_sft(model, tokenizer, load_jsonl(args.data / "sft.jsonl"), spec)
    model.save_pretrained(args.out)
    save_tokenizer(tokenizer, args.out)
    accuracy = greedy_accuracy(model, tokenizer, load_jsonl(args.data / "eval.jsonl"))
    print(f"saved {args.out}: greedy eval accuracy {accuracy:.3f}, "
          f"model.safetensors sha256 {file_sha256(args.out / 'model.safetensors')}")


if __name__ == "__main__":
    main(sys.argv[1:])
