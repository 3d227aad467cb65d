"""Why the run's engine is the one it is: the `engine_picked` event's family and reason, and its
start-up line
(miles.tracking.progress). Read on the driver from the checkpoint's config (no weights loaded)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.config import RunConfig
    from miles.phases.context import Backends


def model_family(hf_checkpoint: str) -> tuple[str | None, str | None]:
    """(model_type, architecture) of the checkpoint's HF config; (None, None) when it does not load here
    (a path only the engines' nodes have: the engine itself then says what it cannot load)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(hf_checkpoint)
    except (OSError, ValueError):
        return None, None
    return getattr(config, "model_type", None), next(iter(getattr(config, "architectures", None) or ()), None)


def engine_reason(cfg: RunConfig, backends: Backends) -> dict[str, Any]:
    """The fields `engine_picked` adds: family, architecture and why (one sentence)."""
    family, arch = model_family(cfg.model.hf_checkpoint)
    asked, name = cfg.rollout.engine, backends.engine_name
    if backends.fast_path_refused:
        why = (f"--rollout-engine {asked} on CUDA: FastEngine refused the model ({backends.fast_path_refused}); "
               "transformers' generate serves it, much slower")
    elif asked != name:
        why = f"--rollout-engine {asked} on CUDA: FastEngine implements {family}"
    elif backends.engine_spec.prefer_on_gpus:
        why = (f"--rollout-engine {asked} off CUDA: {backends.engine.__name__} (the fast path, "
               f"{backends.engine_spec.prefer_on_gpus}, runs on GPUs)")
    else:
        why = f"--rollout-engine {asked}"
    return {"family": family, "architecture": arch, "why": why}

