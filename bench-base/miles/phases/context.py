"""The training run's context: its config, components, the backends `init` picked, counters, and the
guards the machines name. The types every phase shares live here, in a module that imports no phase.

Counters follow one convention: `next_rollout` is the id of the rollout the next `rollout` phase
produces, so `next_rollout - 1` is the last rollout trained; weights synced after training rollout
r carry version r + 1 (= `next_rollout`), the weights loaded from disk version 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping

import ray

from miles.config import RunConfig
from miles.phases.checkpoint_io import Folders, SharedFolders
from miles.phases.ci_gates import CIGates
from miles.runtime import Disposer, PhaseContext, Tracer

if TYPE_CHECKING:
    from miles.checkpoint.store import CheckpointStore
    from miles.cluster.placement import RunPlacement
    from miles.cluster.ray_cluster import ActorResource, RayCluster
    from miles.phases.background_save import BackgroundSave
    from miles.rollout.evals import EvalDispatcher
    from miles.rollout.prefetch import Prefetcher
    from miles.rollout.protocol import Engine, EngineFleet, EngineSpec
    from miles.runtime.supervisor import RestartBudget
    from miles.tracking.sinks import Tracker
    from miles.training.protocol import CriticBackend, TrainBackendSpec, TrainerBackend


# what each state's phase waits on, in the words of its progress line (`waiting_for`)
WAITS = {"init": "the run's actors to start", "weight_sync": "the weights to reach the engines",
         "rollout": "the engines' samples and their rewards", "eval": "the engines' samples and their rewards",
         "train": "the trainer's step", "save": "the checkpoint's files", "draining": "in-flight work to settle"}


@dataclass(frozen=True)
class Backends:
    """The implementation classes a run uses and the specs they come with (`miles.phases.init.pick_backends`);
    the composition root makes the classes actors, the phases ask the specs what they can do."""

    engine: type[Engine]
    trainer: type[TrainerBackend]
    critic: type[CriticBackend] | None      # PPO's (--advantage-estimator ppo), else None
    engine_spec: EngineSpec
    train_spec: TrainBackendSpec
    engine_name: str = "embedded"           # the ENGINES entry `engine_spec` is
    engine_options: Mapping[str, Any] = field(default_factory=dict)  # constructor options past device/dtype/seed
    fast_path_refused: str | None = None    # why --rollout-engine embedded on GPUs stayed on transformers


class IpcWeights:
    """The CUDA IPC transport of a run, driver side: how many buckets the trainer's weights make, and
    the release of whatever bucket is still alive when the run ends (registered after the trainer,
    so it runs before the trainer's own teardown)."""

    resource_name = "ipc_weight_buckets"

    def __init__(self, trainer: Any, count: int):
        self.trainer, self.count = trainer, count

    async def dispose(self) -> None:
        """Free the trainer's live buckets. The trainer itself is the run's."""
        try:
            await self.trainer.release_weight_buckets.remote()
        except ray.exceptions.RayActorError:
            pass                      # a dead trainer holds no GPU memory


@dataclass
class Components:
    """What `init` creates; every one of them is registered with the disposer where it is created."""

    cluster: RayCluster | None = None
    placement: RunPlacement | None = None         # which GPUs each actor asks for (none on CPU)
    ipc_weights: IpcWeights | None = None         # weight sync by CUDA IPC buckets; None: the object store
    engine_fleet: EngineFleet | None = None       # what the engine kind needs around its actors (SGLang: router)
    engines: list[ActorResource] | None = None    # each an engine actor (miles.rollout.protocol.Engine)
    executor: ActorResource | None = None         # the RolloutExecutor actor
    trainer: ActorResource | None = None          # the trainer actor (miles.training.protocol.TrainerBackend)
    metrics: Tracker | None = None
    store: CheckpointStore | None = None          # under --save
    critic: ActorResource | None = None           # PPO's critic actor (miles.training.protocol.CriticBackend)
    critic_store: CheckpointStore | None = None   # the critic's own (--critic-save elsewhere than --save)
    background_save: BackgroundSave | None = None  # --async-save: the save still being written (at most one)
    folders: Folders = field(default_factory=SharedFolders)   # how actors' checkpoint folders reach the driver
    prefetch: Prefetcher | None = None            # async machine
    evals: EvalDispatcher | None = None           # async machine


class TrainingContext(PhaseContext):
    def __init__(self, cfg: RunConfig, *, run_id: str, run_dir: Path, tracer: Tracer, disposer: Disposer):
        super().__init__(tracer=tracer, disposer=disposer)
        self.cfg, self.run_id, self.run_dir = cfg, run_id, run_dir
        self.c = Components()
        self.backends: Backends | None = None          # the implementation classes, picked by init
        self.start_rollout = 0
        self.next_rollout = 0
        self.num_rollout = cfg.num_rollout or 0       # set by init from --num-epoch when needed
        self.weight_version = 0
        self.engine_weights_checksum: str | None = None   # what the last sync gave the engines (--check-weight-update-equal)
        self.training: int | None = None               # the rollout the trainer is stepping on (None between steps)
        self.saved_rollout: int | None = None          # the newest rollout this run saved
        self.save_duration_s: float | None = None      # how long that save took (a stop's save is budgeted by it)
        self.saves_failed = 0                          # saves the disk had no room for (--save-retries)
        self.evaluated_version: int | None = None      # the eval_key() of the last eval (none twice on one key)
        self.batch_ref: ray.ObjectRef | None = None    # the current rollout's samples, for the trainer
        self.save_requested = False                    # a host asked for a save now
        self.engine_budget: RestartBudget | None = None  # made at the first restart
        self.engine_restarts = 0
        self.engines_released: tuple[str, ...] = ()    # memory tags the engines hold released (--offload-rollout)
        self.last_metrics: dict[str, Any] = {}
        self.metrics_history: list[dict[str, Any]] = []
        # work running between phases: `draining` awaits each of these settlers, in order
        self.in_flight: list[Callable[[TrainingContext], Awaitable[None]]] = []
        # the data position right after rollout r's prompts, for the last trained rollout and any rolled out since
        self.data_states: dict[int, dict[str, Any]] = {}
        self.resumed = False                           # init restored a checkpoint (--load)
        self.load_checked: dict[Path, list[str]] = {}  # --load checkpoints hashed before Ray started -> problems
        self.zero_variance_streak = 0                  # rollouts in a row whose every group had one reward
        self.ci = CIGates.of(cfg)                      # miles' CI gates the flags ask for (miles.phases.ci_gates)

    def rollout_of(self, state: str) -> int | None:
        """A rollout phase makes the next rollout; every other phase works on the last one."""
        return self.next_rollout if state == "rollout" else self.rollout_id

    async def waiting_for(self) -> dict[str, Any]:
        """For the heartbeat of a phase that runs long: what the phase waits on, and what the rollout
        executor is doing (each running rollout and eval: samples made and scored, the calls still
        running and the oldest's age), asked of the executor in every state but init (an eval runs in
        the background of the async machine; in init the executor may still be starting, and a question
        queued behind its constructor would read as a hang)."""
        out: dict[str, Any] = {"waiting_for": WAITS.get(self.state or "", f"the {self.state} phase")}
        if self.c.executor is not None and self.state != "init":
            out["activities"] = await self.c.executor.handle.progress.remote()
        return out

    # -- guards ---------------------------------------------------------------------------------
    def rollouts_left(self) -> bool:
        return self.will_run(self.next_rollout)

    def will_run(self, rollout_id: int) -> bool:
        """Whether this invocation produces rollout `rollout_id` (the async machine asks ahead)."""
        exit_after = self.cfg.debug_exit_after_rollout
        if exit_after is not None and rollout_id - self.start_rollout >= exit_after:
            return False
        return rollout_id < self.num_rollout

    def weights_due(self) -> bool:
        """Async: push weights every --update-weights-interval rollouts, and after the last one."""
        return self.next_rollout % self.cfg.update_weights_interval == 0 or not self.rollouts_left()

    def eval_key(self) -> int:
        """What an eval reads: the engines' weight version, evaluated once. With
        --debug-skip-weight-update the engines never move, so the key is the rollout position and the
        evals keep their schedule (as miles runs them), not only the first."""
        return self.next_rollout if self.cfg.debug_skip_weight_update else self.weight_version

    def eval_due(self) -> bool:
        """Before the first rollout, every --eval-interval rollouts, and after the last one."""
        e = self.cfg.eval
        if not e.sets() or self.evaluated_version == self.eval_key():
            return False
        done = self.next_rollout
        if done == self.start_rollout:
            return not e.skip_before_train and (done == 0 or e.interval is None or done % e.interval == 0)
        return (e.interval is not None and done % e.interval == 0) or not self.rollouts_left()

    def save_due(self) -> bool:
        """Every --save-interval rollouts, after the last one, or when asked (sentinel file or host)."""
        c = self.cfg.checkpoint
        if not c.saves:
            return False
        done = self.next_rollout
        if self.save_requested or (c.save_trigger_sentinel and os.path.exists(c.save_trigger_sentinel)):
            return True
        return (c.save_interval is not None and done % c.save_interval == 0) or not self.rollouts_left()

    # -- helpers for phases ---------------------------------------------------------------------
    def note_data_position(self, rollout_id: int, state: dict[str, Any]) -> None:
        """Keep the executor's position right after rollout `rollout_id`'s prompts (what a checkpoint of
        that rollout holds). The position of the last trained rollout is kept until a later one is
        trained: a stop that lets the next rollout finish before it drains saves the last *trained*
        rollout, whose position the executor has moved past."""
        self.data_states[rollout_id] = state
        for r in [r for r in self.data_states if r < self.next_rollout - 1]:
            del self.data_states[r]

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        """Merge metrics into the rollout's row; the row is written when the rollout is trained."""
        self.last_metrics.update(metrics)
        self.last_metrics["step"] = step
