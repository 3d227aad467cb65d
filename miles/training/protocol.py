"""The trainer seam: what the phases and the checkpoint code ask of a training backend (the policy
trainer and PPO's critic), and the registry `--train-backend` picks from.

The composition root (`miles/phases/init.py:pick_backends`) picks the classes once, by name, and
makes them Ray actors; nothing else names a backend. A new backend (Megatron) is a module of its own
implementing `TrainerBackend` (and `CriticBackend` if it trains PPO's critic), plus one
`TRAIN_BACKENDS` entry; its heavy imports stay in its module, which loads only when a run picks it.

Constructors, for every backend:
    Trainer(model_path, *, train: TrainConfig, algorithm: AlgorithmConfig, rollout: RolloutConfig, device, dtype)
        (+ rank_options: list of Ray actor options, one per rank, for a `ranked` backend on GPUs)
    Critic(model_path, *, train: TrainConfig, algorithm: AlgorithmConfig, init_from, device, dtype)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from miles.types import Sample


@dataclass(frozen=True)
class TrainBackendSpec:
    trainer: str                    # "module:Class" of the policy trainer (a TrainerBackend)
    critic: str | None = None       # "module:Class" of PPO's critic (a CriticBackend); None: no PPO here
    # "module:function" (RunConfig, trainer GPUs or None when not known yet -> list of problems), run by
    # validate and again by init once the placement plan says how many GPUs the trainer has; before any actor
    check: str | None = None
    model_parallel: bool = False    # reads --tensor/--pipeline/--context-parallel-size and --sequence-parallel
    # the trainer actor starts one rank actor per trainer GPU itself: init gives it no GPU and passes
    # `rank_options`, the Ray options of each trainer placement of the run's plan (on GPUs)
    ranked: bool = False


# --train-backend NAME -> its classes, imported only when a run picks it
TRAIN_BACKENDS: dict[str, TrainBackendSpec] = {
    "torch": TrainBackendSpec(trainer="miles.training.trainer:Trainer", critic="miles.training.critic:Critic"),
    "megatron": TrainBackendSpec(trainer="miles.training.megatron.group:MegatronTrainer",
                                 check="miles.training.megatron.checks:run_problems", model_parallel=True,
                                 ranked=True),
}


class TrainerBackend(Protocol):
    """The policy trainer. Methods are called through a Ray actor handle (`.remote`) in a run."""

    def prepare_rollout(self, samples: list[Sample], rollout_id: int,
                        values: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logprobs, reference, advantages for `train(samples, rollout_id)`; PPO: returns the critic's targets."""
        ...

    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """Optimizer steps on one rollout; returns its metrics."""
        ...

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights under HF names, on the CPU: what engines load."""
        ...

    def weights_checksum(self, dtype: torch.dtype | None = None) -> str:
        """Checksum of the weights (cast to `dtype` when given, to compare with an engine's)."""
        ...

    def save(self, path: str | Path, *, optimizer: bool = True) -> None:
        """Everything a resume needs (weights, optimizer unless `optimizer` is False, RNG, step count)
        into the folder `path`."""
        ...

    def load(self, path: str | Path) -> None:
        """Restore what `save` wrote."""
        ...

    def export_hf(self, path: str | Path) -> None:
        """An HF-format folder (model and tokenizer) that AutoModelForCausalLM loads."""
        ...

    def dispose(self) -> None:
        """Free the model and optimizer state. Idempotent."""
        ...


class CriticBackend(Protocol):
    """PPO's critic (--advantage-estimator ppo)."""

    def values(self, samples: list[Sample]) -> torch.Tensor:
        """[B, T] values of the packed samples, before this rollout's critic step."""
        ...

    def train(self, samples: list[Sample], values: torch.Tensor, returns: torch.Tensor,
              rollout_id: int) -> dict[str, float]:
        """Value-loss steps on one rollout; metrics prefixed `critic/`."""
        ...

    def save(self, path: str | Path, *, optimizer: bool = True) -> None: ...

    def load(self, path: str | Path) -> None: ...

    def dispose(self) -> None: ...
