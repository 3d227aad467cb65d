"""The embedded engine's spec: transformers + torch sampling, on CPU or GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles.rollout.protocol import (EngineSpec, SupportsAbort, SupportsHealth, SupportsMemoryRelease,
                                    SupportsWeightBuckets)

if TYPE_CHECKING:
    from miles.config import RunConfig


def options(cfg: RunConfig) -> dict[str, Any]:
    """--rollout-max-batch-size when given (else the engine's own default)."""
    r = cfg.rollout
    return {} if r.max_batch_size is None else {"max_batch_size": r.max_batch_size}


# two threads: health and abort are answered while a generate call runs (the engine guards its model);
# memory release: a colocated run outside the fast path gives the trainer the GPU while it trains
SPEC = EngineSpec(engine="miles.rollout.engines.embedded.engine:EmbeddedEngine", options=options,
                  capabilities=(SupportsWeightBuckets, SupportsHealth, SupportsAbort, SupportsMemoryRelease),
                  actor_threads=2,
                  prefer_on_gpus="fast")      # our own forward, where it implements the model
