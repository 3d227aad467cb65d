"""Where each actor runs: the GPU plan of a run, made before any actor starts.

The flags keep miles' meanings:
- `--actor-num-nodes` x `--actor-num-gpus-per-node`: the trainer's GPUs (the critic shares them);
- `--rollout-num-gpus`: the engines' GPUs in all (default: `--rollout-num-engines` x
  `--rollout-num-gpus-per-engine`), each engine taking `--rollout-num-gpus-per-engine` of them;
- `--num-gpus-per-node`: GPUs on each node, which an engine may not span;
- `--colocate`: the engines run on the trainer's GPUs.

A GPU run gets one placement group: one {"GPU": 1} bundle per trainer GPU, then (unless colocated)
one {"GPU": k} bundle per engine of k = --rollout-num-gpus-per-engine GPUs (an actor lives in one
bundle, and an SGLang server of tensor parallel size k sees the k GPUs its engine actor got). Each
actor asks for a share of one bundle:

    not colocated   trainer 0.4 (+ critic 0.4) of each trainer bundle; an engine all k GPUs of its bundle
    colocated       trainer 0.4 + critic 0.4 + engine 0.2 = 1.0 of the same bundle (k = 1: validate.py)

Ray's fractions are bookkeeping, not memory limits: they only have to sum to at most 1 per GPU so
that Ray places the colocated actors together. 0.4 / 0.4 / 0.2 (miles' numbers) fits PPO's three
roles on one GPU; memory is shared by handing it back and forth (engine release/resume, optimizer
offload). Colocated engines fill the trainer's GPUs from the first; more engine GPUs than the
trainer has is an error, not a silent spill. (miles' colocated default is one engine GPU per
trainer GPU; here the engine count stays what --rollout-num-engines / --rollout-num-gpus say, so a
flag is never silently overridden.)

A CPU run has no placement group and every actor asks for 0 GPUs: today's layout, unchanged.
`--ray-actor-resources` (custom Ray resources every actor asks for, to put the run on the nodes that
have them) goes into the bundles too, once per actor living in each: an actor in a bundle can only
use what its bundle holds.
`plan_placement` is pure; `PlacementGroupResource` is the thin Ray layer (create, wait, remove).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from miles.cluster.auto_layout import auto_num_engines
from miles.config import ConfigError
from miles.config.checks import check

if TYPE_CHECKING:
    from miles.config import RunConfig

TRAINER_SHARE, CRITIC_SHARE, COLOCATED_ENGINE_SHARE = 0.4, 0.4, 0.2
PLACEMENT_READY_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class PlacementRequest:
    """What the run asks for (the flags above, and the cluster it found)."""
    use_gpus: bool                      # --device cuda (or auto on a cluster with GPUs)
    colocate: bool = False
    num_engines: int = 1                # --rollout-num-engines (when --rollout-num-gpus is not given)
    rollout_num_gpus: int | None = None
    rollout_num_gpus_per_engine: int = 1
    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 1
    num_gpus_per_node: int = 8
    has_trainer: bool = True            # False with --debug-rollout-only
    has_critic: bool = False            # --advantage-estimator ppo
    has_engines: bool = True            # False with --load-debug-rollout-data


@dataclass(frozen=True)
class Placement:
    """One actor's place: the bundle it lives in (None: anywhere) and the GPUs it asks Ray for."""
    bundle: int | None
    num_gpus: float


@dataclass(frozen=True)
class PlacementPlan:
    bundle_gpus: tuple[int, ...]        # the GPUs of each bundle of the run's placement group (empty: none)
    trainers: tuple[Placement, ...]     # one per trainer rank
    critics: tuple[Placement, ...]
    engines: tuple[Placement, ...]      # one per engine

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    @property
    def bundles(self) -> int:
        return len(self.bundle_gpus)

    @property
    def gpus(self) -> int:
        return sum(self.bundle_gpus)

    @property
    def num_actors(self) -> int:
        """Trainers, critics and engines (the executor is not part of the plan)."""
        return len(self.trainers) + len(self.critics) + len(self.engines)

    def actors_in_bundle(self) -> list[int]:
        """How many actors live in each bundle (the colocated ones share theirs)."""
        counts = [0] * self.bundles
        for p in (*self.trainers, *self.critics, *self.engines):
            if p.bundle is not None:
                counts[p.bundle] += 1
        return counts

    def bundle_specs(self, actor_resources: Mapping[str, float] | None = None) -> list[dict[str, float]]:
        """The placement group's bundles: each one's GPUs and, per actor in it, `actor_resources`."""
        extra = actor_resources or {}
        return [{"GPU": g, **{k: v * n for k, v in extra.items()}}
                for g, n in zip(self.bundle_gpus, self.actors_in_bundle())]


CPU_ACTOR = Placement(bundle=None, num_gpus=0)


def placement_request(cfg: "RunConfig", *, use_gpus: bool, cores: int = 1) -> PlacementRequest:
    """The request a run's config makes (the debug halves drop the trainer or the engines); a run
    that gave no engine count gets `auto_num_engines`' for a machine of `cores` cores, else one."""
    c = cfg.cluster
    engines = cfg.rollout.num_engines or auto_num_engines(cfg, use_gpus=use_gpus, cores=cores) or 1
    return PlacementRequest(
        use_gpus=use_gpus, colocate=c.colocate, num_engines=engines,
        rollout_num_gpus=c.rollout_num_gpus, rollout_num_gpus_per_engine=c.rollout_num_gpus_per_engine,
        actor_num_nodes=c.actor_num_nodes, actor_num_gpus_per_node=c.actor_num_gpus_per_node,
        num_gpus_per_node=c.num_gpus_per_node, has_trainer=not cfg.debug_rollout_only,
        has_critic=cfg.has_critic,
        has_engines=cfg.load_debug_rollout_data is None)


def _problems(r: PlacementRequest) -> list[str]:
    problems = [f"--{flag} must be >= 1, got {v}" for flag, v in (
        ("actor-num-nodes", r.actor_num_nodes), ("actor-num-gpus-per-node", r.actor_num_gpus_per_node),
        ("rollout-num-gpus-per-engine", r.rollout_num_gpus_per_engine), ("num-gpus-per-node", r.num_gpus_per_node),
        ("rollout-num-engines", r.num_engines)) if v < 1]
    if r.rollout_num_gpus is not None and r.rollout_num_gpus < 1:
        problems.append(f"--rollout-num-gpus must be >= 1, got {r.rollout_num_gpus}")
    if problems:
        return problems
    if r.actor_num_gpus_per_node > r.num_gpus_per_node:
        problems.append(f"--actor-num-gpus-per-node {r.actor_num_gpus_per_node} is more than the "
                        f"--num-gpus-per-node {r.num_gpus_per_node} of a node")
    if r.rollout_num_gpus_per_engine > r.num_gpus_per_node:
        problems.append(f"--rollout-num-gpus-per-engine {r.rollout_num_gpus_per_engine} is more than the "
                        f"--num-gpus-per-node {r.num_gpus_per_node}: an engine cannot span nodes")
    gpus = rollout_gpus(r)
    if gpus % r.rollout_num_gpus_per_engine:
        problems.append(f"--rollout-num-gpus {gpus} is not a multiple of --rollout-num-gpus-per-engine "
                        f"{r.rollout_num_gpus_per_engine}")
    trainer_gpus = r.actor_num_nodes * r.actor_num_gpus_per_node
    if r.colocate and r.has_trainer and gpus > trainer_gpus:
        problems.append(f"--colocate puts the engines on the trainer's {trainer_gpus} GPU(s) "
                        f"(--actor-num-nodes x --actor-num-gpus-per-node), but the rollout asks for {gpus}; "
                        f"lower --rollout-num-gpus / --rollout-num-engines or give the trainer more GPUs")
    return problems


def rollout_gpus(r: PlacementRequest) -> int:
    """The engines' GPUs: --rollout-num-gpus, else engines x GPUs per engine."""
    if r.rollout_num_gpus is not None:
        return r.rollout_num_gpus
    return r.num_engines * r.rollout_num_gpus_per_engine


def plan_placement(r: PlacementRequest) -> PlacementPlan:
    """The run's placement; ConfigError (every problem at once) when the request is inconsistent."""
    if not r.use_gpus:
        return PlacementPlan((), (CPU_ACTOR,) if r.has_trainer else (), (CPU_ACTOR,) if r.has_critic else (),
                             (CPU_ACTOR,) * r.num_engines if r.has_engines else ())
    problems = _problems(r)
    if problems:
        raise ConfigError(problems)
    trainer_gpus = r.actor_num_nodes * r.actor_num_gpus_per_node if r.has_trainer else 0
    per_engine = r.rollout_num_gpus_per_engine
    num_engines = rollout_gpus(r) // per_engine if r.has_engines else 0
    colocated = r.colocate and r.has_trainer
    trainers = tuple(Placement(b, TRAINER_SHARE) for b in range(trainer_gpus))
    critics = tuple(Placement(b, CRITIC_SHARE) for b in range(trainer_gpus)) if r.has_critic else ()
    if colocated:                                  # colocated engines reuse the trainer's bundles
        engines = tuple(Placement(e * per_engine, COLOCATED_ENGINE_SHARE) for e in range(num_engines))
        return PlacementPlan((1,) * trainer_gpus, trainers, critics, engines)
    engines = tuple(Placement(trainer_gpus + e, float(per_engine)) for e in range(num_engines))   # a bundle each
    return PlacementPlan((1,) * trainer_gpus + (per_engine,) * num_engines, trainers, critics, engines)


def check_cluster(plan: PlacementPlan, cluster_gpus: float, *, what: str = "the Ray cluster") -> None:
    """ConfigError when the plan needs more GPUs than the cluster has: said before any actor starts,
    instead of an actor that waits forever for a GPU."""
    if plan.gpus > cluster_gpus:
        raise ConfigError(f"the run needs {plan.gpus} GPU(s) (trainer {len(plan.trainers)}, engines "
                          f"{len(plan.engines)} x their GPUs, colocated or not), but {what} has "
                          f"{cluster_gpus:g}; lower --actor-num-gpus-per-node / --rollout-num-gpus / "
                          f"--rollout-num-engines, use --colocate, or run with --device cpu")


def check_actor_resources(resources: Mapping[str, float], num_actors: int, cluster: Mapping[str, float]) -> None:
    """ConfigError when `num_actors` actors each asking for `resources` (--ray-actor-resources) need more
    than the cluster has in all: said before any actor starts, instead of actors pending forever."""
    short = [f"{name}: {amount * num_actors:g} needed, the cluster has {cluster.get(name, 0):g}"
             for name, amount in resources.items() if amount * num_actors > cluster.get(name, 0)]
    if short:
        raise ConfigError(f"--ray-actor-resources {dict(resources)}: the run's {num_actors} actors each ask for "
                          f"that, more than the cluster's nodes offer ({'; '.join(short)}); start nodes with "
                          "the resource (ray start --resources '{\"NAME\": N}') or ask for less per actor")


class PlacementGroupResource:
    """The run's placement group (thin Ray layer). Created before the actors that live in it and
    registered with the run's disposer where it is created, so it is removed after them."""

    resource_name = "placement_group"

    def __init__(self, plan: PlacementPlan, *, name: str, timeout_s: float = PLACEMENT_READY_TIMEOUT_S,
                 actor_resources: Mapping[str, float] | None = None):
        import ray
        from ray.util.placement_group import placement_group

        self.actor_resources = dict(actor_resources or {})
        self.pg = placement_group(plan.bundle_specs(self.actor_resources), strategy="PACK", name=name)
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.dispose()
            also = f" (each with --ray-actor-resources {self.actor_resources})" if self.actor_resources else ""
            raise ConfigError(f"the run's {plan.bundles} GPU bundle(s){also} were not granted within {timeout_s:g} s: "
                              f"the cluster's GPUs are held by other actors or jobs, or spread so that no "
                              f"node fits a bundle") from None

    def options(self, placement: Placement) -> dict:
        """Ray actor options for an actor with this placement."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if placement.bundle is None:
            return {"num_gpus": placement.num_gpus}
        return {"num_gpus": placement.num_gpus, "resources": dict(self.actor_resources),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=placement.bundle)}

    def dispose(self) -> None:
        """Remove the group (Ray frees its bundles). Its actors are the run's, removed before this."""
        from ray.util import remove_placement_group

        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def cluster_gpus() -> float:
    """GPUs of the connected Ray cluster, all nodes together."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0))


@dataclass
class RunPlacement:
    """The run's plan and its placement group (None on CPU): what each actor asks Ray for."""
    plan: PlacementPlan
    group: PlacementGroupResource | None = None

    @property
    def gpus(self) -> bool:
        return self.plan.bundles > 0

    def options(self, placement: Placement) -> dict:
        return {"num_gpus": placement.num_gpus} if self.group is None else self.group.options(placement)


@check
def _plan(cfg: "RunConfig", problems: list[str]) -> None:
    """The GPU plan, checked now when the run is on GPUs for sure (--device cuda); with --device auto
    `init` checks it once it has seen the cluster, still before any actor starts."""
    if cfg.model.on_gpus:
        try:
            plan_placement(placement_request(cfg, use_gpus=True))
        except ConfigError as exc:
            problems.extend(exc.problems)
