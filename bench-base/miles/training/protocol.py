"""The trainer seam: what the phases and the checkpoint code ask of a training backend (the policy
trainer and PPO's critic), and the registry `--train-backend` picks from.

The composition root (`miles/phases/init.py:pick_backends`) picks the classes once, by name, and
makes them Ray actors; nothing else names a backend. A new backend (Megatron) is a module of its own
implementing `TrainerBackend` (and `CriticBackend` if it trains PPO's critic), plus one
`TRAIN_BACKENDS` entry; its heavy imports stay in its module, which loads only when a run picks it.
Its optional abilities (`SupportsOffload`, `SupportsCachedMemoryRelease`, `SupportsWeightBuckets`,
`SupportsBackgroundSave`)
are declared on its spec; the phases ask the spec, never the class. The checks every backend shares
(a critic for PPO, model parallelism) and each backend's own (`check`) are registered with
`miles.config.checks` here, so they run before Ray starts.

Constructors, for every backend:
    Trainer(model_path, *, train: TrainConfig, algorithm: AlgorithmConfig, rollout: RolloutConfig, device, dtype)
        (+ rank_options: list of Ray actor options, one per rank, for a `ranked` backend on GPUs)
    Critic(model_path, *, train: TrainConfig, algorithm: AlgorithmConfig, init_from, device, dtype)
        (+ rank_options, or world_size on the CPU, as the trainer's for a `ranked` backend)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from miles.config import RunConfig
from miles.config.checks import check as register_check
from miles.config.schema import OPD_TYPES, TRAIN_BACKEND_NAMES
from miles.runtime.machine import import_object

if TYPE_CHECKING:
    import torch

    from miles.types import Sample


# the key of a train call's metrics holding each optimizer step's gradient norm, in order (a list, not a
# float: the driver pops it before the metrics row is written); the critic's is prefixed "critic/"
STEP_GRAD_NORMS = "step_grad_norms"


@runtime_checkable
class SupportsOffload(Protocol):
    """The optimizer state goes to host memory while the engines generate (--offload-train), and back."""

    def offload(self) -> int:
        """Bytes moved to the host."""
        ...

    def onload(self) -> int:
        """Bytes moved back to the GPU."""
        ...


@runtime_checkable
class SupportsCachedMemoryRelease(Protocol):
    """Returns the CUDA blocks the last step cached (its activations) before the engines take memory back."""

    def release_cached_memory(self) -> None: ...


@runtime_checkable
class SupportsWeightBuckets(Protocol):
    """Hands its weights out in CUDA IPC buckets of the engines' dtype (colocated on GPUs)."""

    def weight_bucket_count(self, dtype: torch.dtype, bucket_bytes: int) -> int: ...

    def weight_bucket(self, index: int, version: int) -> object: ...

    def release_weight_buckets(self, index: int | None = None) -> None: ...


@runtime_checkable
class SupportsBackgroundSave(Protocol):
    """Saves from a CPU snapshot and writes the files while it trains on (--async-save): `save` and
    `export_hf` take `background=True` and return once the snapshot is taken; `wait_saved` returns
    when the files are written (raising a write's error). The spec's critic class does the same."""

    def wait_saved(self) -> float:
        """Seconds waited for the background writes."""
        ...


@dataclass(frozen=True)
class TrainBackendSpec:
    trainer: str                    # "module:Class" of the policy trainer (a TrainerBackend)
    critic: str | None = None       # "module:Class" of PPO's critic (a CriticBackend); None: no PPO here
    # "module:function" (RunConfig, trainer GPUs or None when not known yet -> list of problems), run by
    # validate and again by init once the placement plan says how many GPUs the trainer has; before any actor
    check: str | None = None
    model_parallel: bool = False    # reads --tensor/--pipeline/--context-parallel-size and --sequence-parallel
    # the trainer actor starts one rank actor per trainer GPU itself: init gives it no GPU and passes
    # `rank_options`, the Ray options of each trainer placement of the run's plan (on GPUs); the critic
    # actor, when there is one, the same with the plan's critic placements
    ranked: bool = False
    capabilities: tuple[type, ...] = ()   # the Supports* Protocols above that the trainer class implements
    # the spec the backend runs under on more than one trainer rank (a `ranked` one); None: this spec's
    many_ranks: TrainBackendSpec | None = None
    # the --opd-type values it trains with (on-policy distillation: the teacher's logprobs in the advantages)
    opd_types: tuple[str, ...] = ()

    def supports(self, capability: type) -> bool:
        return capability in self.capabilities

    def for_ranks(self, ranks: int) -> TrainBackendSpec:
        """The spec of a run with `ranks` trainer ranks (--actor-num-nodes x --actor-num-gpus-per-node)."""
        return self.many_ranks if ranks > 1 and self.many_ranks is not None else self


# --train-backend NAME -> its classes, imported only when a run picks it
TRAIN_BACKENDS: dict[str, TrainBackendSpec] = {
    "torch": TrainBackendSpec(
        trainer="miles.training.trainer:Trainer", critic="miles.training.critic:Critic",
        check="miles.training.memory_plan:startup_problems",
        capabilities=(SupportsOffload, SupportsCachedMemoryRelease, SupportsWeightBuckets, SupportsBackgroundSave),
        opd_types=("megatron", "sglang"),
        # FSDP2 data parallel, the policy's ranks and PPO's critic's side by side on the trainer GPUs
        many_ranks=TrainBackendSpec(trainer="miles.training.fsdp.group:FSDPTrainer",
                                    critic="miles.training.fsdp.critic_group:FSDPCritic",
                                    check="miles.training.memory_plan:startup_problems",
                                    ranked=True, capabilities=(SupportsOffload, SupportsCachedMemoryRelease,
                                                                  SupportsWeightBuckets))),
    "megatron": TrainBackendSpec(trainer="miles.training.megatron.group:MegatronTrainer",
                                 check="miles.training.megatron.checks:run_problems", model_parallel=True,
                                 ranked=True, capabilities=(SupportsCachedMemoryRelease,)),
}
assert tuple(TRAIN_BACKENDS) == TRAIN_BACKEND_NAMES, "the flag's choices are the registry's names"


@register_check
def _train_backend(cfg: RunConfig, problems: list[str]) -> None:
    """What the picked backend can take: PPO's critic, model parallelism, more than one GPU; then its own
    checks (its package installed, the model fits it). An unknown name is config's own check."""
    spec, t, c = TRAIN_BACKENDS.get(cfg.train.backend), cfg.train, cfg.cluster
    if spec is None:
        return
    one, spec = spec, spec.for_ranks(c.trainer_ranks)
    if spec is not one and c.offloads_train and not spec.supports(SupportsOffload):
        problems.append(f"--offload-train (or --offload): the {t.backend} trainer on {c.trainer_ranks} ranks keeps its "
                        "optimizer state on the GPUs; drop it, or train on one GPU")
    if cfg.algorithm.use_opd and cfg.algorithm.opd_type in OPD_TYPES and cfg.algorithm.opd_type not in spec.opd_types:
        where = f"--train-backend {t.backend}" + (f" on {c.trainer_ranks} ranks" if spec is not one else "")
        problems.append(f"--use-opd --opd-type {cfg.algorithm.opd_type}: {where} does not take on-policy distillation "
                        f"yet; use --train-backend torch on one rank (--actor-num-nodes 1 --actor-num-gpus-per-node 1)")
    if spec.critic is None and cfg.algorithm.needs_critic:
        problems.append(f"--train-backend {t.backend} has no critic: --advantage-estimator ppo needs one; "
                        f"use {', '.join(n for n, s in TRAIN_BACKENDS.items() if s.critic)} or another estimator")
    parallel = [flag if isinstance(v, bool) else f"{flag} {v}" for flag, v, default in (
        ("--tensor-model-parallel-size", t.tensor_model_parallel_size, 1),
        ("--pipeline-model-parallel-size", t.pipeline_model_parallel_size, 1),
        ("--context-parallel-size", t.context_parallel_size, 1),
        ("--sequence-parallel", t.sequence_parallel, False),
        ("--decoder-first-pipeline-num-layers", t.first_pipeline_stage_layers, None),
        ("--decoder-last-pipeline-num-layers", t.last_pipeline_stage_layers, None)) if v != default]
    if parallel and not spec.model_parallel:
        problems.append(f"{', '.join(parallel)}: --train-backend {t.backend} does not split models; drop them or use "
                        f"--train-backend {' / '.join(n for n, s in TRAIN_BACKENDS.items() if s.model_parallel)}")
    if c.trainer_ranks > 1 and not spec.ranked:
        problems.append(f"--actor-num-nodes {c.actor_num_nodes} x --actor-num-gpus-per-node "
                        f"{c.actor_num_gpus_per_node}: the {t.backend} trainer runs on one GPU; use 1 x 1, or --train-backend "
                        f"{' / '.join(n for n, s in TRAIN_BACKENDS.items() if s.ranked)}")
    if spec.check:
        # the trainer's GPUs are known here only for --device cuda; init checks again with its placement plan
        gpus = c.actor_num_nodes * c.actor_num_gpus_per_node if cfg.model.on_gpus else None
        problems.extend(import_object(spec.check)(cfg, gpus))


class TrainerBackend(Protocol):
    """The policy trainer. Methods are called through a Ray actor handle (`.remote`) in a run."""

    def prepare_rollout(self, samples: list[Sample], rollout_id: int,
                        values: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logprobs, reference, advantages for `train(samples, rollout_id)`; PPO: returns the critic's targets."""
        ...

    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """Optimizer steps on one rollout; returns its metrics, and under `STEP_GRAD_NORMS` the list of
        each step's gradient norm (the driver takes it out of the row: miles.phases.ci_gates)."""
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

    def load(self, path: str | Path, *, optimizer: bool = True, rng: bool = True, step: bool = True) -> None:
        """Restore what `save` wrote; without `optimizer` a fresh optimizer (--no-load-optim), without `rng`
        this process's RNG states (--no-load-rng), without `step` the step count 0 and no refreshed
        reference (--finetune, with neither of the others: the weights alone)."""
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

    def load(self, path: str | Path, *, optimizer: bool = True, rng: bool = True, step: bool = True) -> None: ...

    def dispose(self) -> None: ...
