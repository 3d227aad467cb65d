"""The embedded engine's spec: transformers + torch sampling, on CPU or GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles.rollout.protocol import (EngineSpec, SupportsAbort, SupportsHealth, SupportsInFlightWeightSwap,
                                    SupportsMemoryRelease, SupportsWeightBucketLoad)

if TYPE_CHECKING:
    from miles.config import RunConfig


# sequences it decodes at once when --rollout-max-batch-size is not given (the CPU path's batch)
MAX_BATCH_SIZE = 64


def options(cfg: RunConfig) -> dict[str, Any]:
    """--rollout-max-batch-size when given (else the engine's own default); --rollout-quantization and
    --kv-cache-dtype when given (the embedded engine emulates FP8 weights and refuses an FP8 KV cache)."""
    r = cfg.rollout
    out: dict[str, Any] = {} if r.max_batch_size is None else {"max_batch_size": r.max_batch_size}
    if r.quantization is not None:
        out["quantization"] = r.quantization
    if r.kv_cache_dtype != "auto":
        out["kv_cache_dtype"] = r.kv_cache_dtype
    return out


# three threads: health, abort and an in-flight weight swap (--fully-async) are answered while a generate
# call runs (the engine guards its model);
# memory release: a colocated run outside the fast path gives the trainer the GPU while it trains
SPEC = EngineSpec(engine="miles.rollout.engines.embedded.engine:EmbeddedEngine", options=options,
                  capabilities=(SupportsWeightBucketLoad, SupportsHealth, SupportsAbort, SupportsMemoryRelease,
                                SupportsInFlightWeightSwap),
                  actor_threads=3,
                  prefer_on_gpus="fast",      # our own forward, where it implements the model
                  defaults={"max_batch_size": MAX_BATCH_SIZE},
                  weights_on_release="host")  # release_memory moves the model to host memory
