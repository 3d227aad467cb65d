"""What an engine loads from the trainer, and the trainer's checksum of what the engine then holds.

Shared by the weight push (miles.phases.weights) and an engine's restart (miles.rollout.supervision,
which the push imports: these helpers live beside it so that neither imports the other). Each returns
the trainer's ObjectRef at once: two of them sent with no await between are served by the trainer one
after the other, on the same weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray

from miles.phases.context import TrainingContext

if TYPE_CHECKING:
    import torch


def fp8_engines(ctx: TrainingContext) -> bool:
    """Whether the engines hold FP8 weights that the trainer quantizes for them (--rollout-quantization fp8 or
    an FP8 checkpoint, on our engines; SGLang's servers load the plain weights and quantize them themselves)."""
    from miles.weights.fp8 import engine_quantization

    from miles.rollout.engines.registry import ENGINES

    cfg = ctx.cfg
    spec = ctx.backends.engine_spec if ctx.backends is not None else ENGINES[cfg.rollout.engine]
    return not spec.quantizes_own_weights and \
        engine_quantization(cfg.rollout.quantization, cfg.model.hf_checkpoint) == "fp8"


def trainer_weights(ctx: TrainingContext, dtype: torch.dtype | None) -> ray.ObjectRef:
    """The trainer's weights as the engines load them: FP8 engines get them quantized by the trainer for
    their `dtype` (the engines' `weights_dtype`; unused otherwise)."""
    trainer: Any = ctx.c.trainer.handle
    return trainer.weights.remote(dtype) if fp8_engines(ctx) else trainer.weights.remote()


def trainer_checksum(ctx: TrainingContext, dtype: torch.dtype) -> ray.ObjectRef:
    """The trainer's checksum of what an engine holding `dtype` holds once it loaded the trainer's weights
    (bf16 on GPU; FP8 engines: the weights quantized as their loads carry them)."""
    trainer: Any = ctx.c.trainer.handle
    return trainer.weights_checksum.remote(dtype, True) if fp8_engines(ctx) else trainer.weights_checksum.remote(dtype)
