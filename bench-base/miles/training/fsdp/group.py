"""The torch trainer on more than one rank (--train-backend torch, or miles' fsdp, with --actor-num-nodes x
--actor-num-gpus-per-node > 1): one `FSDPRank` Ray actor per trainer GPU, joined over NCCL (over gloo
on the CPU, where --actor-num-gpus-per-node N gives N CPU ranks), driven as one trainer.

The composition root makes `FSDPTrainer` an actor like the one-process trainer; it starts its ranks
(`miles.training.ranks.RankGroup`) in the run's placement (`rank_options`: a placement group bundle and
a GPU share each) or, on the CPU, `world_size` ranks; every call goes to all ranks, and the answer is
rank 0's (the ranks agree on metrics). Weights leave bucket by bucket: the ranks gather one bucket of
whole tensors at a time (`DEFAULT_BUCKET_BYTES` of float32), rank 0 copies it to the host, so no rank
ever holds the whole model on its device; colocated on GPUs, the CUDA IPC buckets are gathered the
same way in the engines' dtype, one copy per rank's GPU (`miles.training.fsdp.buckets`). Checkpoints are sharded (`miles.training.fsdp.checkpoint`);
the HF export is the one-process trainer's format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import Tensor

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.training.fsdp.buckets import merge_rank_buckets
from miles.training.ranks import RankGroup, rank_actor_options
from miles.types import Sample
from miles.weights.checksum import state_dict_checksum
from miles.weights.transport import DEFAULT_BUCKET_BYTES, HostWeights, WeightBucket

log = structlog.get_logger().bind(role="trainer", backend="torch")

HF_WEIGHTS_FILE = "model.safetensors"


class FSDPTrainer:
    def __init__(self, model_path: str, *, train: TrainConfig, algorithm: AlgorithmConfig, rollout: RolloutConfig,
                 device: str = "auto", dtype: str = "auto", rank_options: Sequence[Mapping[str, Any]] | None = None,
                 world_size: int | None = None, namespace: str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        from miles.training.fsdp.rank import FSDPRank

        options = rank_actor_options(device, rank_options, world_size)
        self._model_path, self._bucket_bytes = model_path, bucket_bytes
        self._group = RankGroup(FSDPRank, options, model_path, train=train, algorithm=algorithm, rollout=rollout,
                                device=device, dtype=dtype, namespace=namespace)
        self._buckets: list[list[str]] | None = None
        log.info("trainer_ready", model=model_path, ranks=len(options), gpus=any(o.get("num_gpus") for o in options))

    # --- the trainer seam ------------------------------------------------------------------------
    def prepare_rollout(self, samples: list[Sample], rollout_id: int, values: Tensor | None = None) -> Tensor | None:
        import ray

        return self._group.all("prepare_rollout", ray.put(samples), rollout_id, values)[0]

    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        import ray

        return self._group.all("train", ray.put(samples), rollout_id)[0]

    def release_cached_memory(self) -> None:
        self._group.all("release_cached_memory")

    def weight_bucket_count(self, dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """The CUDA IPC transport's buckets (`miles.training.fsdp.buckets`): the weights cast to `dtype`
        in buffers of at most `bucket_bytes`, planned once on every rank."""
        return self._group.all("weight_bucket_count", dtype, bucket_bytes)[0]

    def weight_bucket(self, index: int, version: int) -> WeightBucket:
        """Bucket `index` of the current weights, gathered by every rank; its IPC copies (one per rank's
        GPU) stay alive until `release_weight_buckets`."""
        return merge_rank_buckets(self._group.all("weight_bucket", index, version))

    def release_weight_buckets(self, index: int | None = None) -> None:
        self._group.all("release_weight_buckets", index)

    def weights(self) -> dict[str, Tensor]:
        """The whole weights under HF names on the CPU (float32), gathered bucket by bucket; to the
        engines as `HostWeights` (numpy bytes, out of band), as the one-process trainer's."""
        if self._buckets is None:
            self._buckets = self._group.all("weight_buckets", self._bucket_bytes)[0]
        out: dict[str, Tensor] = HostWeights()
        for names in self._buckets:
            out.update(self._group.all("gathered_weights", names)[0])
        return out

    def weights_checksum(self, dtype: torch.dtype | None = None) -> str:
        return state_dict_checksum(self.weights(), dtype=dtype)

    def save(self, path: str | Path, *, optimizer: bool = True) -> None:
        """Every rank's shards into the folder `path`; the run's store commits it."""
        self._group.all("save", str(path), optimizer)

    def load(self, path: str | Path, **parts: bool) -> None:
        """Every rank's `load(path, **parts)` (the parts as in `Trainer.load`)."""
        self._group.all("load", str(path), **parts)

    def offload(self) -> int:
        """Every rank's optimizer state shards to its host memory, the gradients dropped (--offload-train);
        the bytes all ranks gave up. Each later step streams the shards (`miles.training.offload`)."""
        return sum(self._group.all("offload"))

    def onload(self) -> int:
        return sum(self._group.all("onload"))

    def export_hf(self, path: str | Path) -> None:
        """An HF folder (config, model.safetensors, tokenizer) that AutoModelForCausalLM loads, float32
        like the one-process trainer's `save_pretrained`."""
        from safetensors.torch import save_file
        from transformers import AutoConfig

        from miles.weights.hf import load_tokenizer

        weights = self.weights()
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = AutoConfig.from_pretrained(self._model_path)
        config.dtype = torch.float32
        config.save_pretrained(str(path))
        save_file({n: t.contiguous() for n, t in weights.items()}, str(path / HF_WEIGHTS_FILE), metadata={"format": "pt"})
        load_tokenizer(self._model_path).save_pretrained(str(path))

    def dispose(self) -> None:
        """Every rank frees its model, optimizer and process group, then is killed. Idempotent. This
        actor itself is the run's."""
        self._group.dispose()
