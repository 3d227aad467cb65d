"""The run's configuration: typed slices (`schema`), miles' flat flags (`flags`), cross-field checks (`validate`).

`from miles.config import RunConfig, RolloutConfig, ConfigError, ...` gives the dataclasses; the flag
table and the checks load only when asked for (`miles.config.flags`, `miles.config.validate`).
"""

from .schema import (
    AlgorithmConfig, CheckpointConfig, ClusterConfig, ConfigError, DataConfig, EvalConfig, EvalDataset, GenerateConfig,
    MULTI_TURN_GENERATE, ModelConfig, RolloutConfig, RunConfig, SGLangConfig, TraceConfig, TrackingConfig, TrainConfig,
    as_dict, replace,
)

__all__ = [
    "AlgorithmConfig", "CheckpointConfig", "ClusterConfig", "ConfigError", "DataConfig", "EvalConfig", "EvalDataset",
    "GenerateConfig", "MULTI_TURN_GENERATE", "ModelConfig", "RolloutConfig", "RunConfig", "SGLangConfig",
    "TraceConfig", "TrackingConfig", "TrainConfig", "as_dict", "replace",
]
