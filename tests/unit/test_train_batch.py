"""`make_train_batch` against the layout built row by row (the module docstring's rules), on
samples of every kind: empty and long responses, multi-turn loss masks, aborted samples (nothing
trained), NaN logprobs off the mask, ints and bools as mask values."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

import torch

from miles.training.batch import make_train_batch
from miles.types import Prompt, Sample

ROOT = Path(__file__).resolve().parents[2]


def row_by_row():
    """The row-by-row build (`scripts/bench/train_batch_cpu.py`'s peer: a Python list per row and field,
    the layout as the module docstring states it)."""
    spec = importlib.util.spec_from_file_location("train_batch_cpu", ROOT / "scripts" / "bench" / "train_batch_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rows


def samples(seed: int, n: int = 40) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = 0 if i % 9 == 3 else rng.randrange(1, 40)
        logprobs = [-rng.random() for _ in range(r)]
        mask = None if i % 3 else [rng.choice([0, 1, True, False]) for _ in range(r)]
        if mask is not None and r:
            logprobs = [lp if m else math.nan for lp, m in zip(logprobs, mask)]    # nothing reads them
        out.append(Sample(prompt=Prompt(index=i, text="", prompt_ids=tuple(rng.randrange(4, 99)
                                                                            for _ in range(rng.randrange(1, 12)))),
                          group=i // 8, response_ids=[rng.randrange(4, 99) for _ in range(r)],
                          rollout_logprobs=logprobs, loss_mask=mask, finish_reason="length",
                          status="aborted" if i % 11 == 5 else "completed", weight_version=3 + i % 4,
                          reward=rng.uniform(-2, 2), advantage=rng.uniform(-1, 1)))
    return out


def test_the_batch_is_the_row_by_row_layout():
    rows = row_by_row()
    for seed in range(5):
        batch_samples = samples(seed)
        batch, want = make_train_batch(batch_samples, pad_id=2), rows(batch_samples, pad_id=2)
        for name in ("tokens", "loss_mask", "advantages", "token_rewards", "rollout_logprobs", "attention_mask"):
            got, expected = getattr(batch, name), getattr(want, name)
            assert got.dtype == {"tokens": torch.long, "attention_mask": torch.long,
                                 "loss_mask": torch.bool}.get(name, torch.float32) == expected.dtype
            assert torch.equal(got, expected), name
        assert batch.weight_version == want.weight_version == 3
        assert not batch.rollout_logprobs.isnan().any()
        aborted = [i for i, s in enumerate(batch_samples) if s.status == "aborted"]
        assert aborted and not batch.loss_mask[aborted].any() and not batch.token_rewards[aborted].any()
