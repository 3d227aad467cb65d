"""The megatron trainer the phases talk to (`--train-backend megatron`): one Ray actor per GPU, each
a `MegatronWorker` rank, joined in one torch.distributed group (NCCL on GPUs, gloo on the CPU).

The composition root makes `MegatronTrainer` an actor like any trainer; it starts its ranks,
fans every call out to all of them, and answers with rank 0's result (the ranks agree on metrics)
or the merge of their weight shards. Where the ranks run: `rank_options`, one dict of Ray actor
options per rank, as the run's placement gives them (a placement group bundle and a GPU share
each); without it, `world_size` ranks (default TP x PP x CP) asking Ray for one GPU each (none on
the CPU). The ranks (`miles.training.ranks.RankGroup`) are owned by this actor: if it dies, Ray
reaps them; a call that fails on one rank fails here at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import Tensor

from miles.config import AlgorithmConfig, ConfigError, RolloutConfig, TrainConfig
from miles.training.megatron.checks import group_problems, read_hf_config, requested_layout
from miles.training.megatron.conversion import mcore_to_hf, model_spec
from miles.training.ranks import RankGroup, ranks_use_gpus
from miles.types import Sample
from miles.weights.checksum import state_dict_checksum

log = structlog.get_logger().bind(role="trainer", backend="megatron")

HF_WEIGHTS_FILE = "model.safetensors"


class MegatronTrainer:
    def __init__(self, model_path: str, *, train: TrainConfig, algorithm: AlgorithmConfig, rollout: RolloutConfig,
                 device: str = "auto", dtype: str = "auto", rank_options: Sequence[Mapping[str, Any]] | None = None,
                 world_size: int | None = None, namespace: str | None = None):
        from miles.training.megatron.worker import MegatronWorker

        on_gpu = ranks_use_gpus(device)
        options = [dict(o) for o in rank_options] if rank_options else None
        layout = requested_layout(train, len(options) if options else world_size)
        hf_config = read_hf_config(model_path)
        if hf_config is None:
            raise ConfigError(f"--hf-checkpoint {model_path}: no config.json there; pass an HF-format model folder")
        problems = group_problems(hf_config, train, layout, rollout.num_samples)
        if problems:
            raise ConfigError(problems)
        self._model_path, self._spec = model_path, model_spec(hf_config)
        options = options or [{"num_gpus": 1 if on_gpu else 0}] * layout.world_size
        self._group = RankGroup(MegatronWorker, options, model_path, train=train, algorithm=algorithm,
                                rollout=rollout, device_type="cuda" if on_gpu else "cpu", dtype=dtype,
                                namespace=namespace)
        log.info("trainer_ready", model=model_path, ranks=layout.world_size, tp=layout.tp, pp=layout.pp,
                 cp=layout.cp, dp=layout.dp, gpus=on_gpu)

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._group.all(method, *args, **kwargs)

    # --- the trainer seam ------------------------------------------------------------------------
    def prepare_rollout(self, samples: list[Sample], rollout_id: int, values: Tensor | None = None) -> None:
        if values is not None:
            raise ValueError("the megatron backend has no critic (PPO): use --train-backend torch for ppo")
        import ray

        self._all("prepare_rollout", ray.put(samples), rollout_id)

    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        import ray

        return self._all("train", ray.put(samples), rollout_id)[0]

    def release_cached_memory(self) -> None:
        """Every rank returns its cached CUDA blocks (before colocated engines take their KV cache back)."""
        self._all("release_cached_memory")

    def weights(self) -> dict[str, Tensor]:
        """The weights under HF names on the CPU, in the parameters' dtype (bf16 on GPUs)."""
        merged: dict[str, Tensor] = {}
        for stage in self._all("stage_weights"):
            merged.update(stage)
        return mcore_to_hf(merged, self._spec)

    def weights_checksum(self, dtype: torch.dtype | None = None) -> str:
        return state_dict_checksum(self.weights(), dtype=dtype)

    def save(self, path: str | Path, *, optimizer: bool = True) -> None:
        """Every rank's part of a megatron dist checkpoint into the folder `path`; the run's store commits
        it. `optimizer` False (--no-save-optim) is refused at start-up (checks.unsupported_features)."""
        if not optimizer:
            raise ValueError("--no-save-optim: the megatron backend's checkpoint always holds its optimizer state")
        self._all("save", str(path))

    def load(self, path: str | Path, **parts: bool) -> None:
        """Every rank's `load(path, **parts)` (the parts as in `Trainer.load`)."""
        self._all("load", str(path), **parts)

    def export_hf(self, path: str | Path) -> None:
        """An HF folder (config, safetensors, tokenizer) that AutoModelForCausalLM loads."""
        from safetensors.torch import save_file
        from transformers import AutoConfig

        from miles.weights.hf import load_tokenizer

        weights = self.weights()
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = AutoConfig.from_pretrained(self._model_path)
        config.dtype = next(iter(weights.values())).dtype
        config.save_pretrained(str(path))
        save_file({n: t.contiguous() for n, t in weights.items()}, str(path / HF_WEIGHTS_FILE), metadata={"format": "pt"})
        load_tokenizer(self._model_path).save_pretrained(str(path))

    def dispose(self) -> None:
        """Each rank frees its model, optimizer, parallel state and process group, then every rank is
        killed (`RankGroup.dispose`). Idempotent. This actor itself is the run's."""
        self._group.dispose()
