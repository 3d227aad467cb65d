"""Loss scaling for float16 training (--fp16): Megatron-LM's rule, with its flags and defaults.

float16 has 5 exponent bits: gradients below ~6e-8 flush to zero in the backward's float16
activations. So the loss is multiplied by a scale S before the backward, and the float32 gradients
divided by S before they are clipped and stepped. When S is too large, some gradient overflows to
inf/nan: that optimizer step is skipped (the weights and AdamW's moments stay as they were) and S
may be lowered. Megatron-LM's `DynamicGradScaler`, reproduced here:

- an overflow step resets the growth tracker and takes one from the hysteresis tracker; once that
  is at 0 or below, S = max(S x 0.5, --min-loss-scale), at this and every further overflow;
- a clean step adds one to the growth tracker; at --loss-scale-window clean steps since the last
  growth or overflow, S doubles, and the growth tracker and the hysteresis tracker (--hysteresis)
  are reset.

The hysteresis tracker is refilled only by a growth, not by every clean step (Megatron-LM's rule):
it counts the overflows since the last growth. With --loss-scale S the scale is fixed (Megatron-LM's
`ConstantGradScaler`); an overflow step is skipped all the same.

One departure from Megatron-LM, which skips every overflow step: an overflow with the dynamic scale
already at --min-loss-scale (`at_floor`) cannot be the scale's fault (a nan in the forward, a bad
sample), so the shell stops the step there as it does under bf16, instead of skipping steps forever.

bf16 and fp32 need none of this: the trainer holds `NO_SCALING` there, whose steps are what they
were (an overflow there is a bad step, refused by the shell's finite-gradient guard).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.config import TrainConfig

GROWTH, BACKOFF = 2.0, 0.5      # Megatron-LM's growth and backoff factors (fixed there too)


@dataclass(kw_only=True)
class LossScaler:
    scale: float                # what the next backward's loss is multiplied by
    min_scale: float = 1.0      # --min-loss-scale
    window: int = 1000          # --loss-scale-window: clean steps before the scale doubles
    hysteresis: int = 2         # --hysteresis: overflows (since the last growth) before the scale is cut
    dynamic: bool = True        # False: --loss-scale's fixed scale
    growth_tracker: int = 0     # clean steps since the last growth or overflow
    hysteresis_tracker: int | None = None  # overflows left before a cut (None: `hysteresis`)

    skips_overflow = True       # an overflow is expected, its step skipped (not a field)

    def __post_init__(self):
        if self.hysteresis_tracker is None:
            self.hysteresis_tracker = self.hysteresis

    @property
    def at_floor(self) -> bool:
        """The dynamic scale is at --min-loss-scale: an overflow now is not one a smaller scale avoids."""
        return self.dynamic and self.scale <= self.min_scale

    def update(self, overflow: bool) -> None:
        """The rule after one optimizer step, `overflow` when its gradients held an inf or a nan."""
        if not self.dynamic:
            return
        if overflow:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * BACKOFF, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.window:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= GROWTH

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale(self, grads: list[torch.Tensor]) -> None:
        """Divide the gradients by the scale of the backward that made them, in place."""
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def state_dict(self) -> dict:
        """What a checkpoint keeps (JSON-safe; a float survives json's round trip bit for bit)."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        """A saved scaler's state; a fixed --loss-scale stays the one given now."""
        if self.dynamic:
            self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


class NoScaling:
    """bf16 and fp32: the loss as it is, and an overflow is not expected (the shell stops the step)."""

    skips_overflow = False
    at_floor = False
    scale = 1.0

    def update(self, overflow: bool) -> None:
        pass

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale(self, grads: list[torch.Tensor]) -> None:
        pass

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict) -> None:
        pass


NO_SCALING = NoScaling()


def loss_scaler(train: TrainConfig, compute_dtype: torch.dtype) -> LossScaler | NoScaling:
    """The scaler of a model computing in `compute_dtype`: float16 scales (--loss-scale fixed, else
    dynamic from --initial-loss-scale), every other dtype does not."""
    if compute_dtype != torch.float16:
        return NO_SCALING
    if train.loss_scale is not None:
        return LossScaler(scale=float(train.loss_scale), dynamic=False)
    return LossScaler(scale=float(train.initial_loss_scale), min_scale=float(train.min_loss_scale),
                      window=train.loss_scale_window, hysteresis=train.hysteresis)
