"""Benchmark (CPU, not a test): `make_train_batch`, the trainer's first work on a rollout, at scale shapes.

The train phase begins by packing the rollout's samples into [B, T] tensors on the host; at the
4b-4k workload (256 samples of 64 + 4,096 tokens) that is 1.06 M tokens per field. Times, in one run
on the same samples: `make_train_batch` (the trainer's) and `rows`, the layout built the way it was
before tree c568829 (a Python list per row and field, made tensors once per field: the peer), and
checks both give the same tensors. Medians of --repeats calls; JSON on stdout (and --out).

Usage: PYTHONPATH=$PWD python3 scripts/bench/train_batch_cpu.py [--samples 256] [--prompt-len 64]
  [--response-len 4096] [--repeats 5] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from miles.training.batch import TrainBatch, make_train_batch  # noqa: E402
from miles.types import Prompt, Sample  # noqa: E402


def rows(samples: list[Sample], pad_id: int) -> TrainBatch:
    """The row-by-row build: one list per row and field, one tensor per field."""
    width = max(len(s.prompt.prompt_ids) + len(s.response_ids) for s in samples)
    fields = {k: [] for k in ("tokens", "loss_mask", "advantages", "token_rewards", "rollout_logprobs",
                              "attention_mask")}
    for s in samples:
        p, r = len(s.prompt.prompt_ids), len(s.response_ids)
        pad, mask = width - p - r, s.mask()
        fields["tokens"].append([*s.tokens, *[pad_id] * pad])
        fields["loss_mask"].append([False] * p + list(mask) + [False] * pad)
        fields["advantages"].append([0.0] * p + [s.advantage if m else 0.0 for m in mask] + [0.0] * pad)
        rewards = [0.0] * width
        trained = [j for j, m in enumerate(mask) if m]
        if trained:
            rewards[p + trained[-1]] = s.reward
        fields["token_rewards"].append(rewards)
        fields["rollout_logprobs"].append([0.0] * p + [lp if m else 0.0 for lp, m in zip(s.rollout_logprobs, mask)]
                                          + [0.0] * pad)
        fields["attention_mask"].append([1] * (p + r) + [0] * pad)
    dtypes = {"tokens": torch.long, "attention_mask": torch.long, "loss_mask": torch.bool}
    return TrainBatch(**{k: torch.tensor(v, dtype=dtypes.get(k, torch.float32)) for k, v in fields.items()},
                      weight_version=min(s.weight_version for s in samples))


def make_samples(n: int, prompt_len: int, response_len: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(prompt=Prompt(index=i, text="", prompt_ids=tuple(rng.randrange(100, 150_000) for _ in range(prompt_len))),
                   group=i // 8, response_ids=[rng.randrange(100, 150_000) for _ in range(response_len)],
                   rollout_logprobs=[-rng.random() for _ in range(response_len)], finish_reason="length",
                   weight_version=0, reward=rng.uniform(-1, 1), advantage=rng.uniform(-1, 1)) for i in range(n)]


def timed(fn, samples, repeats: int) -> tuple[float, TrainBatch]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        batch = fn(samples, 0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    samples = make_samples(args.samples, args.prompt_len, args.response_len)
    ours_s, ours = timed(make_train_batch, samples, args.repeats)
    rows_s, peer = timed(rows, samples, args.repeats)
    same = all(torch.equal(getattr(ours, k), getattr(peer, k)) for k in
               ("tokens", "loss_mask", "advantages", "token_rewards", "rollout_logprobs", "attention_mask"))
    result = {"samples": args.samples, "tokens": args.samples * (args.prompt_len + args.response_len),
              "make_train_batch_s": round(ours_s, 4), "rows_s": round(rows_s, 4),
              "rows_over_make_train_batch": round(rows_s / ours_s, 2), "same_tensors": same,
              "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
              "torch": torch.__version__}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if not same:
        raise SystemExit("make_train_batch and the row-by-row build disagree")


if __name__ == "__main__":
    main()
