"""`make_train_batch` against the layout spelled out row by row (the module docstring's rules), on
samples of every kind: empty and long responses, multi-turn loss masks, aborted samples (nothing
trained), NaN logprobs off the mask, ints and bools as mask values."""

from __future__ import annotations

import math
import random

import torch

from miles.training.batch import make_train_batch
from miles.types import Prompt, Sample


def by_rows(samples: list[Sample], pad_id: int) -> dict[str, list[list]]:
    width = max(len(s.prompt.prompt_ids) + len(s.response_ids) for s in samples)
    out = {k: [] for k in ("tokens", "loss_mask", "advantages", "token_rewards", "rollout_logprobs", "attention_mask")}
    for s in samples:
        p, r = len(s.prompt.prompt_ids), len(s.response_ids)
        pad = width - p - r
        mask = [bool(m) for m in s.mask()]
        out["tokens"].append(list(s.prompt.prompt_ids) + list(s.response_ids) + [pad_id] * pad)
        out["loss_mask"].append([False] * p + mask + [False] * pad)
        out["advantages"].append([0.0] * p + [s.advantage if m else 0.0 for m in mask] + [0.0] * pad)
        rewards = [0.0] * width
        if any(mask):
            rewards[p + max(j for j, m in enumerate(mask) if m)] = s.reward
        out["token_rewards"].append(rewards)
        out["rollout_logprobs"].append([0.0] * p + [lp if m else 0.0 for lp, m in zip(s.rollout_logprobs, mask)]
                                       + [0.0] * pad)
        out["attention_mask"].append([1] * (p + r) + [0] * pad)
    return out


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
    for seed in range(5):
        batch_samples = samples(seed)
        batch, want = make_train_batch(batch_samples, pad_id=2), by_rows(batch_samples, pad_id=2)
        for name, rows in want.items():
            got = getattr(batch, name)
            expected = torch.tensor(rows, dtype=got.dtype)
            assert got.dtype == {"tokens": torch.long, "attention_mask": torch.long,
                                 "loss_mask": torch.bool}.get(name, torch.float32)
            assert torch.equal(got, expected), name
        assert batch.weight_version == 3
        assert not batch.rollout_logprobs.isnan().any()
        aborted = [i for i, s in enumerate(batch_samples) if s.status == "aborted"]
        assert aborted and not batch.loss_mask[aborted].any() and not batch.token_rewards[aborted].any()
