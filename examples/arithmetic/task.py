"""The arithmetic task's scoring and greedy evaluation, shared by the scripts and tests here.

The reward is the one the recipe trains with: 1.0 when the last integer in the response equals the
label, else 0.0 (what `--rm-type math` computes on this task).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

_INTEGER = re.compile(r"-?\d+")


def load_jsonl(path: str | Path) -> list[dict[str, str]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def final_number(text: str) -> str | None:
    """The last integer in `text` as written ("-3", "120"), or None when there is none."""
    found = _INTEGER.findall(text)
    return found[-1] if found else None


def reward(response: str, label: str) -> float:
    return 1.0 if final_number(response) == label else 0.0


@torch.no_grad()
def greedy_responses(model, tokenizer, prompts: list[str], max_new_tokens: int = 8,
                     batch_size: int = 256) -> list[str]:
    """Greedy completions (special tokens dropped), batched with left padding."""
    model.eval()
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True,
                        padding_side="left", add_special_tokens=False)
        ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        out += tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def greedy_accuracy(model, tokenizer, rows: list[dict[str, str]], max_new_tokens: int = 8) -> float:
    """Fraction of `rows` whose greedy response earns reward 1."""
    responses = greedy_responses(model, tokenizer, [r["input"] for r in rows], max_new_tokens)
    return sum(reward(resp, r["label"]) for resp, r in zip(responses, rows)) / len(rows)
