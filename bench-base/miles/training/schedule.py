"""Learning-rate and weight-decay schedules as pure functions of the optimizer step (Megatron's flag
names: --lr-decay-style, --lr-warmup-iters, --lr-warmup-init, --lr-decay-iters, --min-lr,
--lr-wsd-decay-iters, --lr-wsd-decay-style; --decoupled-lr, --decoupled-min-lr for the embedding and
output layer; --weight-decay-incr-style, --start-weight-decay, --end-weight-decay).

Both depend on the step count alone, so a resumed trainer (which restores its step count)
continues on the same curves with nothing else to save.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

from miles.config import TrainConfig

WD_INCR_STYLES = ("constant", "linear", "cosine")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
LR_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
NEEDS_DECAY_ITERS = ("linear", "cosine", "WSD")      # inverse-square-root: optional (min_lr after it)


def lr_at(step: int, *, lr: float, min_lr: float = 0.0, warmup_iters: int = 0, decay_iters: int | None = None,
          style: str = "constant", warmup_init: float = 0.0, wsd_decay_iters: int | None = None,
          wsd_style: str = "exponential") -> float:
    """The learning rate of optimizer step `step` (0-based), with Megatron-LM's decay styles.

    Warmup: from `warmup_init` to lr, warmup_init + (lr - warmup_init) * (step + 1) / warmup_iters for
    the first `warmup_iters` steps (the first step is not wasted at rate 0). Then `constant`: lr;
    `linear` / `cosine`: from lr down to `min_lr` at step `decay_iters` (counted from step 0, warmup
    included), min_lr after it:
        linear: min_lr + (lr - min_lr) * (1 - p),  cosine: min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2,
    with p = (step - warmup_iters) / (decay_iters - warmup_iters) clamped to [0, 1].
    `inverse-square-root`: lr * sqrt(max(warmup_iters, 1) / max(step, 1)), at least min_lr (and min_lr
    after `decay_iters` when given). `WSD` (warmup-stable-decay): lr until step decay_iters -
    wsd_decay_iters, then down to min_lr over the last `wsd_decay_iters` steps before `decay_iters`
    in `wsd_style` with r the share of them done: exponential 2 * 0.5^r - 1, linear 1 - r, cosine
    (1 + cos(pi r)) / 2, minus_sqrt 1 - sqrt(r). After warmup these are Megatron-LM's
    OptimizerParamScheduler at num_steps = step.
    """
    if step < warmup_iters:
        return warmup_init + (lr - warmup_init) * (step + 1) / warmup_iters
    if style == "constant":
        return lr
    if style == "inverse-square-root":
        if decay_iters is not None and step > decay_iters:
            return min_lr
        return max(min_lr, lr * math.sqrt(max(warmup_iters, 1) / max(step, 1)))
    if decay_iters is None or decay_iters <= warmup_iters:
        raise ValueError(f"--lr-decay-style {style} needs --lr-decay-iters > --lr-warmup-iters {warmup_iters}, "
                         f"got {decay_iters}")
    if style == "WSD":
        if wsd_decay_iters is None or not 0 < wsd_decay_iters <= decay_iters:
            raise ValueError(f"--lr-decay-style WSD needs --lr-wsd-decay-iters in 1..--lr-decay-iters {decay_iters}, "
                             f"got {wsd_decay_iters}")
        if step > decay_iters:
            return min_lr
        anneal_start = decay_iters - wsd_decay_iters
        r = max(step - anneal_start, 0) / wsd_decay_iters
        shape = {"exponential": lambda: 2.0 * 0.5 ** r - 1.0, "linear": lambda: 1.0 - r,
                 "cosine": lambda: 0.5 * (1.0 + math.cos(math.pi * r)), "minus_sqrt": lambda: 1.0 - math.sqrt(r)}
        return min_lr + (lr - min_lr) * shape[wsd_style]()
    p = min(max((step - warmup_iters) / (decay_iters - warmup_iters), 0.0), 1.0)
    shape = 1.0 - p if style == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return min_lr + (lr - min_lr) * shape


def lr_schedule(cfg: TrainConfig, *, decoupled: bool = False) -> Callable[[int], float]:
    """`lr_at` bound to the run's flags; unknown styles fail here, at start-up. `decoupled`: the
    embedding and output layer's rate, from --decoupled-lr down to --decoupled-min-lr (default
    --min-lr) on the same warmup and decay (Megatron-LM's max_lr / min_lr of their param group)."""
    if cfg.lr_decay_style not in LR_DECAY_STYLES:
        raise ValueError(f"--lr-decay-style must be one of {', '.join(LR_DECAY_STYLES)}, got {cfg.lr_decay_style!r}")
    if cfg.lr_wsd_decay_style not in LR_WSD_DECAY_STYLES:
        raise ValueError(f"--lr-wsd-decay-style must be one of {', '.join(LR_WSD_DECAY_STYLES)}, "
                         f"got {cfg.lr_wsd_decay_style!r}")
    top, bottom = cfg.lr, cfg.min_lr
    if decoupled:
        if cfg.decoupled_lr is None:
            raise ValueError("a decoupled learning rate needs --decoupled-lr")
        top, bottom = cfg.decoupled_lr, cfg.min_lr if cfg.decoupled_min_lr is None else cfg.decoupled_min_lr
    schedule = partial(lr_at, lr=top, min_lr=bottom, warmup_iters=cfg.warmup_steps,
                       decay_iters=cfg.lr_decay_iters, style=cfg.lr_decay_style, warmup_init=cfg.lr_warmup_init,
                       wsd_decay_iters=cfg.lr_wsd_decay_iters, wsd_style=cfg.lr_wsd_decay_style)
    schedule(max(cfg.warmup_steps, 0))      # a bad decay setting fails now, not at the warmup's end
    return schedule


def wd_at(step: int, *, start: float, end: float, incr_iters: int | None, style: str = "constant") -> float:
    """The weight decay of optimizer step `step` (0-based): Megatron-LM's OptimizerParamScheduler.get_wd
    at num_steps = step. `constant`: `end` (== start). After `incr_iters` steps: `end`. Else, with
    r = step / incr_iters, start + c (end - start) with c = r (`linear`) or (1 + cos(pi (1 - r))) / 2
    (`cosine`): the decay grows from start to end."""
    if style == "constant":
        return end
    if incr_iters is None or incr_iters <= 0:
        raise ValueError(f"--weight-decay-incr-style {style} needs its length in optimizer steps (--lr-decay-iters "
                         f"here) > 0, got {incr_iters}")
    if step > incr_iters:
        return end
    r = step / incr_iters
    coeff = r if style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - r)) + 1.0)
    return start + coeff * (end - start)


def wd_schedule(cfg: TrainConfig) -> Callable[[int], float]:
    """`wd_at` bound to the run's flags: --weight-decay throughout with the default constant style,
    else from --start-weight-decay to --end-weight-decay over --lr-decay-iters steps (Megatron-LM:
    over --train-iters, which --lr-decay-iters defaults to here as there)."""
    style = cfg.weight_decay_incr_style
    if style not in WD_INCR_STYLES:
        raise ValueError(f"--weight-decay-incr-style must be one of {', '.join(WD_INCR_STYLES)}, got {style!r}")
    if style == "constant":
        return partial(wd_at, start=cfg.weight_decay, end=cfg.weight_decay, incr_iters=None)
    if cfg.start_weight_decay is None or cfg.end_weight_decay is None:
        raise ValueError(f"--weight-decay-incr-style {style} needs --start-weight-decay and --end-weight-decay")
    schedule = partial(wd_at, start=cfg.start_weight_decay, end=cfg.end_weight_decay,
                       incr_iters=cfg.lr_decay_iters, style=style)
    schedule(0)     # a missing length fails now
    return schedule
