"""PPO's critic on more than one rank (--train-backend torch with --advantage-estimator ppo and
--actor-num-nodes x --actor-num-gpus-per-node > 1): one `FSDPCriticRank` Ray actor per trainer GPU
(the plan's critic placement in each trainer bundle, beside the policy's rank), joined over NCCL
(gloo on the CPU, where --actor-num-gpus-per-node N gives N CPU ranks), driven as one critic.

The composition root makes `FSDPCritic` an actor like the one-process critic; it starts its ranks
(`miles.training.ranks.RankGroup`, named `critic-rank-<r>` beside the policy's `trainer-rank-<r>`) in
the run's placement (`rank_options`) or, on the CPU, `world_size` ranks; every call goes to all
ranks, and the answer is rank 0's (the ranks agree on values and metrics). Its checkpoints are the
one-process critic's folder (see `miles.training.fsdp.critic_rank`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
from torch import Tensor

from miles.config import AlgorithmConfig, TrainConfig
from miles.training.ranks import CRITIC_RANK_ACTOR_PREFIX, RankGroup, rank_actor_options
from miles.types import Sample

log = structlog.get_logger().bind(role="critic", backend="torch")


class FSDPCritic:
    def __init__(self, model_path: str, *, train: TrainConfig, algorithm: AlgorithmConfig, init_from: str | None = None,
                 device: str = "auto", dtype: str = "auto", rank_options: Sequence[Mapping[str, Any]] | None = None,
                 world_size: int | None = None, namespace: str | None = None):
        """`train` is the run's with lr = --critic-lr, as for the one-process critic; `rank_options` one
        dict of Ray actor options per rank (on GPUs), else `world_size` ranks."""
        from miles.training.fsdp.critic_rank import FSDPCriticRank

        options = rank_actor_options(device, rank_options, world_size)
        self._group = RankGroup(FSDPCriticRank, options, model_path, train=train, algorithm=algorithm,
                                init_from=init_from, device=device, dtype=dtype, namespace=namespace,
                                prefix=CRITIC_RANK_ACTOR_PREFIX)
        log.info("critic_ready", model=model_path, ranks=len(options), gpus=any(o.get("num_gpus") for o in options))

    def values(self, samples: list[Sample]) -> Tensor:
        import ray

        return self._group.all("values", ray.put(samples))[0]

    def train(self, samples: list[Sample], values: Tensor, returns: Tensor, rollout_id: int) -> dict[str, float]:
        import ray

        return self._group.all("train", ray.put(samples), ray.put(values), ray.put(returns), rollout_id)[0]

    def save(self, path: str | Path, *, optimizer: bool = True) -> None:
        """The one-process critic's folder at `path`, written by rank 0; the run's store commits it."""
        self._group.all("save", str(path), optimizer)

    def load(self, path: str | Path, **parts: bool) -> None:
        """Every rank's `load(path, **parts)` (the parts as in `Trainer.load`)."""
        self._group.all("load", str(path), **parts)

    def dispose(self) -> None:
        """Every rank frees its model, optimizer and process group, then is killed. Idempotent. This
        actor itself is the run's."""
        self._group.dispose()
