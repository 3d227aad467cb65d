"""miles: RL post-training whose lifecycle is an explicit state machine with one disposer.

The embedding API (`miles.Run`, `miles.run_sync`, configs) loads lazily, so `import miles` and the
trace tools do not import torch or Ray.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "Run": "miles.api", "run_sync": "miles.api", "Result": "miles.api", "RunEvent": "miles.api",
    "Transition": "miles.api", "Metrics": "miles.api", "Teardown": "miles.api", "RunEnded": "miles.api",
    "config_from_yaml": "miles.config.flags", "config_from_flags": "miles.config.flags",
    "RunConfig": "miles.config", "ModelConfig": "miles.config", "DataConfig": "miles.config",
    "RolloutConfig": "miles.config", "AlgorithmConfig": "miles.config", "TrainConfig": "miles.config",
    "CheckpointConfig": "miles.config", "EvalConfig": "miles.config", "ClusterConfig": "miles.config",
    "TraceConfig": "miles.config", "ConfigError": "miles.config",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'miles' has no attribute {name!r}")
