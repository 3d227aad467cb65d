"""Learning-rate schedules as a pure function of the optimizer step (Megatron's flag names:
--lr-decay-style, --lr-warmup-iters, --lr-decay-iters, --min-lr).

The rate depends on the step count alone, so a resumed trainer (which restores its step count)
continues on the same curve with nothing else to save.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

from miles.config import TrainConfig

LR_DECAY_STYLES = ("constant", "linear", "cosine")


def lr_at(step: int, *, lr: float, min_lr: float = 0.0, warmup_iters: int = 0, decay_iters: int | None = None,
          style: str = "constant") -> float:
    """The learning rate of optimizer step `step` (0-based).

    Warmup: lr * (step + 1) / warmup_iters for the first `warmup_iters` steps (the first step is
    not wasted at rate 0). Then `constant`: lr; `linear` / `cosine`: from lr down to `min_lr` at
    step `decay_iters` (counted from step 0, warmup included), min_lr after it:
        linear: min_lr + (lr - min_lr) * (1 - p),  cosine: min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2,
    with p = (step - warmup_iters) / (decay_iters - warmup_iters) clamped to [0, 1].
    """
    if step < warmup_iters:
        return lr * (step + 1) / warmup_iters
    if style == "constant":
        return lr
    if decay_iters is None or decay_iters <= warmup_iters:
        raise ValueError(f"--lr-decay-style {style} needs --lr-decay-iters > --lr-warmup-iters {warmup_iters}, "
                         f"got {decay_iters}")
    p = min(max((step - warmup_iters) / (decay_iters - warmup_iters), 0.0), 1.0)
    shape = 1.0 - p if style == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return min_lr + (lr - min_lr) * shape


def lr_schedule(cfg: TrainConfig) -> Callable[[int], float]:
    """`lr_at` bound to the run's flags; unknown styles fail here, at start-up."""
    if cfg.lr_decay_style not in LR_DECAY_STYLES:
        raise ValueError(f"--lr-decay-style must be one of {', '.join(LR_DECAY_STYLES)}, got {cfg.lr_decay_style!r}")
    schedule = partial(lr_at, lr=cfg.lr, min_lr=cfg.min_lr, warmup_iters=cfg.lr_warmup_iters,
                       decay_iters=cfg.lr_decay_iters, style=cfg.lr_decay_style)
    schedule(max(cfg.lr_warmup_iters, 0))   # a bad decay setting fails now, not at the warmup's end
    return schedule
