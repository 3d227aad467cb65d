"""`init`: the composition root. Creates every component and registers each with the disposer
where it is created, so whatever `init` made before failing is torn down too.

Order: metrics sinks → what an attached cluster gets shipped (miles.cluster.shipping) → Ray → how
checkpoint folders reach the driver (miles.checkpoint.folders) → the backends (picked once the
cluster's GPUs are known: they decide --device auto) → placement (the GPU plan and its placement
group) → the engine fleet (if the engine's spec has one: SGLang's router) → engines → trainer →
critic (ppo) → executor → weight transport → checkpoint resume (miles.checkpoint.restore). Input is
checked on the driver (miles.data.input_checks: tokenizer, prompt or SFT files, reward and filter
imports) and the GPU plan against the cluster before any actor starts; the config itself was checked
before Ray started (miles.config.checks). The one change to `ctx.cfg` after that is `_place`'s, before
any component exists: on a one-GPU cluster a run that named no layout gets --colocate
(miles.cluster.auto_layout), which needs the cluster's GPUs, known only once Ray is up.
`pick_backends` is the one place an implementation is chosen: the engine's spec from
`--rollout-engine` (miles.rollout.engines.registry) and the trainer's from `--train-backend`
(miles.training.protocol); the phases then ask the specs what the backends can do.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import ray

from miles.checkpoint.background_save import BackgroundSave
from miles.checkpoint.folders import SAVE_GROUP, pick_folders
from miles.checkpoint.restore import resume
from miles.checkpoint.store import CheckpointStore
from miles.cluster.auto_layout import AUTO_ENGINES_REASON, auto_colocate, auto_num_engines, auto_reason
from miles.cluster.placement import (Placement, PlacementGroupResource, RunPlacement, check_actor_resources,
                                     check_cluster, cluster_gpus, cpu_thread_budget, placement_request,
                                     plan_placement)
from miles.cluster.ray_cluster import RayCluster, driver_path
from miles.cluster.shipping import SHIPPED_DIR, Shipment, miles_package, stage
from miles.config import ConfigError, RunConfig, as_dict
from miles.config.validate import validate
from miles.data.input_checks import check_inputs
from miles.phases.context import Backends, IpcWeights, TrainingContext
from miles.rollout.engines.reason import engine_reason
from miles.rollout.engines.registry import ENGINES, engine_to_run
from miles.rollout.executor import RolloutExecutor
from miles.rollout.health import start_health_monitor
from miles.rollout.protocol import SupportsWeightBucketLoad
from miles.rollout.supervision import make_engine
from miles.runtime.machine import import_object
from miles.runtime.procs import CPU_THREADS_ENV, usable_cores
from miles.metrics.sinks import Tracker, open_sinks
from miles.training.protocol import TRAIN_BACKENDS, SupportsBackgroundSave, SupportsWeightBucketExport


def pick_backends(cfg: RunConfig, *, cluster_gpus: int = 0) -> Backends:
    """--rollout-engine and --train-backend → their specs and classes, imported now (validate checked the
    names, and that --rollout-engine fast can run the model). `cluster_gpus`: the GPUs of the run's
    cluster, which decide --device auto (`ModelConfig.uses_gpus`)."""
    train_spec = TRAIN_BACKENDS[cfg.train.backend].for_ranks(cfg.cluster.trainer_ranks)
    name, refused = engine_to_run(cfg, on_gpus=cfg.model.uses_gpus(cluster_gpus))
    engine_spec = ENGINES[name]
    backends = Backends(engine=import_object(engine_spec.engine), trainer=import_object(train_spec.trainer),
                        critic=import_object(train_spec.critic) if cfg.algorithm.needs_critic and train_spec.critic
                        else None, engine_spec=engine_spec, train_spec=train_spec, engine_name=name,
                        engine_options=engine_spec.options(cfg), fast_path_refused=refused)
    _check_declared(backends)
    return backends


def _check_declared(b: Backends) -> None:
    """Each capability a spec declares is one its class implements (a spec that lies fails here, at start-up)."""
    for spec_name, cls, capabilities in (("engine", b.engine, b.engine_spec.capabilities),
                                         ("trainer", b.trainer, b.train_spec.capabilities)):
        missing = [c.__name__ for c in capabilities if not issubclass(cls, c)]
        if missing:
            raise TypeError(f"the {spec_name} spec of {cls.__name__} declares {', '.join(missing)}, which the class "
                            "does not implement")


async def init(ctx: TrainingContext) -> str:
    cfg = ctx.cfg
    tokenizer, prompts, eval_sets, sft_responses = await check_inputs(ctx)
    if cfg.dump_details:        # as miles: the tokenizer beside the dumps, to read their token ids
        tokenizer.save_pretrained(Path(cfg.dump_details) / "tokenizer")
    add = partial(ctx.disposer.add, timeout=cfg.trace.teardown_timeout_s)

    ctx.c.metrics = Tracker()
    for sink in open_sinks(cfg.tracking, run_dir=ctx.run_dir, run_id=ctx.run_id, run_config=as_dict(cfg)):
        add(sink)                # as each opens: a W&B login that fails leaves the others to the teardown
        ctx.c.metrics.add(sink)
    ctx.c.cluster = RayCluster(cfg.cluster, ctx.run_id, log_dir=ctx.run_dir / "logs",
                               log_level=cfg.tracking.worker_log_level, node_ip=cfg.reliability.ray_node_ip,
                               allow_no_auth=cfg.reliability.ray_allow_no_auth, shipment=_shipment(ctx),
                               on_lost=lambda lost: ctx.tracer.note_lost(**lost))
    add(ctx.c.cluster)
    _cluster_ready(ctx)
    gpus = cluster_gpus()           # with --device auto, the cluster's GPUs decide where everything runs
    _pick(ctx, gpus)
    ctx.c.placement = _place(ctx, add, gpus)
    if ctx.cfg is not cfg:              # --colocate, chosen by the one-GPU default layout: the engine's options
        cfg = ctx.cfg                   # follow it (SGLang's memory saver reads it), as its actors will
        ctx.backends = replace(ctx.backends, engine_options=ctx.backends.engine_spec.options(cfg))
        ctx.tracer.emit("engine_options", options=dict(ctx.backends.engine_options), reason="auto_colocate")
    # the debug half runs (miles/phases/debug.py): train_only reads rollouts from disk, rollout_only trains nothing
    _make_fleet(ctx, add)
    ctx.c.engines = [make_engine(ctx, i) for i in range(ctx.c.placement.plan.num_engines)]
    if not cfg.debug_rollout_only:
        _make_models(ctx, add)
    ctx.c.executor = ctx.c.cluster.actor(
        RolloutExecutor, name="rollout-executor", concurrency=8, prompts=prompts, eval_sets=eval_sets,
        rollout=cfg.rollout, algorithm=cfg.algorithm, eval=cfg.eval, shuffle=cfg.data.rollout_shuffle,
        tokenizer=tokenizer, engines=[e.handle for e in ctx.c.engines], seed=cfg.rollout_seed,
        sft_responses=sft_responses, reward_timeout_s=cfg.reliability.reward_limit_s, generate=cfg.generate)
    add(ctx.c.executor, force=ctx.c.executor.force)
    actors = [a for a in (*ctx.c.engines, ctx.c.trainer, ctx.c.critic, ctx.c.executor) if a is not None]
    pids = await asyncio.gather(*(a.wait_ready() for a in actors))
    if ctx.c.engine_fleet is not None:
        for i, engine in enumerate(ctx.c.engines):
            await ctx.c.engine_fleet.joined(i, engine.handle)
    ctx.tracer.emit("components_ready", engines=len(ctx.c.engines),
                    pids={a.resource_name: pid for a, pid in zip(actors, pids)},
                    nodes={a.resource_name: a.node_id for a in actors})
    if ctx.c.engines:
        start_health_monitor(ctx)

    await _weight_transport(ctx, add)
    await _plan_rollouts(ctx)
    if cfg.checkpoint.save:
        ctx.c.store = CheckpointStore(cfg.checkpoint.save, keep_last=cfg.checkpoint.keep_last,
                                      retain_interval=cfg.checkpoint.retain_interval)
        removed = ctx.c.store.cleanup_partial()
        if removed:
            ctx.tracer.emit("partial_checkpoints_removed", paths=[str(p) for p in removed])
    _async_save(ctx, add)
    critic_save = cfg.checkpoint.critic_save
    if ctx.c.critic is not None and critic_save and critic_save != cfg.checkpoint.save:
        ctx.c.critic_store = CheckpointStore(critic_save, keep_last=cfg.checkpoint.keep_last)
        ctx.c.critic_store.cleanup_partial()
    if cfg.checkpoint.load:
        await resume(ctx)
    if cfg.start_rollout_id is not None:            # miles' --start-rollout-id wins over the checkpoint's
        ctx.start_rollout = ctx.next_rollout = cfg.start_rollout_id
        ctx.tracer.emit("start_rollout_set", next_rollout=ctx.next_rollout)
    return "ready"


def _pick(ctx: TrainingContext, gpus: int) -> None:
    cfg = ctx.cfg
    ctx.backends = pick_backends(cfg, cluster_gpus=gpus)
    ctx.tracer.emit("engine_picked", flag=cfg.rollout.engine, engine=ctx.backends.engine_name,
                    cls=ctx.backends.engine.__name__, options=dict(ctx.backends.engine_options),
                    fast_path_refused=ctx.backends.fast_path_refused, **engine_reason(cfg, ctx.backends))


def _make_fleet(ctx: TrainingContext, add: Any) -> None:
    """The engine spec's fleet, when it has one and the run has engines; registered before the engines,
    so it is torn down after them."""
    fleet, num_engines = ctx.backends.engine_spec.fleet, ctx.c.placement.plan.num_engines
    if fleet is not None and num_engines:
        ctx.c.engine_fleet = import_object(fleet)(ctx.cfg, run_dir=ctx.run_dir, num_engines=num_engines)
        add(ctx.c.engine_fleet)
        ctx.tracer.emit("engine_fleet_ready", **ctx.c.engine_fleet.describe())


def _shipment(ctx: TrainingContext) -> Shipment | None:
    """What a run attaching to a cluster through --ray-address sends to its nodes (None: nothing, on a
    local cluster, a host's connection, or with --ray-no-ship-code)."""
    c = ctx.cfg.cluster
    if not (c.ray_address and c.ship_code) or ray.is_initialized():
        return None
    return stage(ctx.cfg.user_function_paths, (ctx.run_dir / SHIPPED_DIR).absolute(), code=[miles_package()])


def _cluster_ready(ctx: TrainingContext) -> None:
    """Trace the cluster, what was shipped to it, and how checkpoint folders will reach the driver."""
    cluster, cfg = ctx.c.cluster, ctx.cfg
    local, nodes = cluster.local, cluster.nodes()
    ctx.tracer.emit("cluster_ready", namespace=cluster.namespace, started=cluster.started, nodes=nodes,
                    token_auth=cluster.token_auth(),
                    **({"node_ip": cfg.reliability.ray_node_ip, "session_dir": str(local.session_dir),
                        "reaper_pid": local.reaper_pid} if local is not None else {}))
    if cluster.shipment is not None:
        ctx.tracer.emit("code_shipped", **cluster.shipment.describe())
    ctx.c.folders, why = pick_folders(cfg.cluster.shared_fs, started=cluster.started, node_ips=[n["ip"] for n in nodes],
                                      driver_ip=ray.util.get_node_ip_address())
    ctx.tracer.emit("checkpoint_folders", shared=ctx.c.folders.shared, why=why)


def _make_models(ctx: TrainingContext, add: Any) -> None:
    """The trainer, and PPO's critic; each registered as it is created."""
    cfg, place = ctx.cfg, ctx.c.placement
    path = driver_path(cfg.model.hf_checkpoint)                   # read by the actor, on its node
    groups = _concurrency_groups(ctx)
    env = cfg.cluster.train_env_vars       # --train-env-vars: the trainer's and critic's processes, their ranks' too
    if place.threads is not None:          # a CPU run's thread budget (cpu_thread_budget), per rank
        env = {CPU_THREADS_ENV: str(place.threads.trainer), **(env or {})}
    ctx.c.trainer = ctx.c.cluster.actor(ctx.backends.trainer, path, name="trainer", needs={"--hf-checkpoint": path},
                                        concurrency_groups=groups, env_vars=env, **_trainer_placement(ctx),
                                        **trainer_options(cfg))
    add(ctx.c.trainer, force=ctx.c.trainer.force)
    if ctx.backends.critic is not None:
        init_from = driver_path(cfg.checkpoint.critic_load) if cfg.checkpoint.critic_load else None
        needs = {"--hf-checkpoint": path, **({"--critic-load": init_from} if init_from else {})}
        ctx.c.critic = ctx.c.cluster.actor(
            ctx.backends.critic, path, name="critic", concurrency_groups=groups, env_vars=env, **_critic_placement(ctx),
            needs=needs, train=replace(cfg.train, lr=cfg.train.critic_lr or cfg.train.lr),
            algorithm=cfg.algorithm, init_from=init_from, device=cfg.model.device, dtype=cfg.model.dtype)
        add(ctx.c.critic, force=ctx.c.critic.force)


def _background_saves(ctx: TrainingContext) -> bool:
    """--async-save with a trainer that can save in the background (`SupportsBackgroundSave`)."""
    return ctx.cfg.checkpoint.async_save and ctx.backends.train_spec.supports(SupportsBackgroundSave)


def _concurrency_groups(ctx: TrainingContext) -> dict[str, int] | None:
    """The trainer's and the critic's: with background saves, a thread for `wait_saved` beside their calls."""
    return {SAVE_GROUP: 1} if _background_saves(ctx) else None


def _async_save(ctx: TrainingContext, add: Any) -> None:
    """--async-save: the run's pending background save, registered after the trainer and the critic (so
    the teardown settles it before they go); or a warning that this trainer saves synchronously."""
    if not ctx.cfg.checkpoint.async_save or ctx.c.store is None or ctx.c.trainer is None:
        return
    if _background_saves(ctx):
        ctx.c.background_save = BackgroundSave()
        add(ctx.c.background_save)
        return
    ranks = ctx.cfg.cluster.trainer_ranks
    ctx.tracer.emit("warning", code="async_save_sync", message=(
        f"--async-save: the {ctx.cfg.train.backend} trainer on {ranks} rank{'s' * (ranks > 1)} cannot write a "
        "checkpoint in the background; its saves are synchronous (the torch trainer on one GPU or the CPU can)"))


def _trainer_placement(ctx: TrainingContext) -> dict[str, Any]:
    return _ranked_placement(ctx, ctx.c.placement.plan.trainers)


def _critic_placement(ctx: TrainingContext) -> dict[str, Any]:
    """PPO's critic's: the plan has one critic placement beside each trainer placement."""
    return _ranked_placement(ctx, ctx.c.placement.plan.critics)


def _ranked_placement(ctx: TrainingContext, placements: tuple[Placement, ...]) -> dict[str, Any]:
    """Where the trainer (or the critic) runs, given its `placements` in the plan: the first one; a
    `ranked` backend (megatron, torch on several ranks) on GPUs gets no GPU itself and hands each of
    its ranks one of them; on the CPU it starts --actor-num-nodes x --actor-num-gpus-per-node ranks,
    when more than one."""
    place, ranks = ctx.c.placement, ctx.cfg.cluster.trainer_ranks
    if not ctx.backends.train_spec.ranked:
        return {"placement": place.options(placements[0])}
    namespace = {"namespace": ctx.c.cluster.namespace}       # the ranks' names live in the run's namespace
    if place.gpus:
        return {"placement": {"num_gpus": 0}, "rank_options": [place.options(p) for p in placements], **namespace}
    return {"placement": place.options(placements[0]), **namespace, **({"world_size": ranks} if ranks > 1 else {})}


def _place(ctx: TrainingContext, add: Any, gpus: int) -> RunPlacement:
    """The GPU plan (miles.cluster.placement): checked against the cluster (of `gpus` GPUs), and its
    placement group made and registered, before any actor starts. A CPU run (--device cpu, or auto
    without GPUs in the cluster) asks for no GPU, as before."""
    cfg = ctx.cfg
    use_gpus = cfg.model.uses_gpus(gpus)
    cores = usable_cores()
    plan = plan_placement(placement_request(cfg, use_gpus=use_gpus, cores=cores))
    auto_engines = auto_num_engines(cfg, use_gpus=use_gpus, cores=cores) is not None
    auto = auto_colocate(cfg, use_gpus=use_gpus, cluster_gpus=gpus, started=ctx.c.cluster.started,
                         needed_gpus=plan.gpus, machine=ctx.tracer.machine)
    if auto is not None:
        ctx.cfg = cfg = auto
        plan = plan_placement(placement_request(cfg, use_gpus=use_gpus, cores=cores))
    if plan.engines:
        validate(cfg, num_engines=plan.num_engines)     # the checks that wait for the engine count
    check = ctx.backends.train_spec.check
    if check and plan.bundles and plan.trainers:     # validate could not know the trainer's GPUs with --device auto
        problems: list[str] = []
        check(replace(cfg, model=replace(cfg.model, device="cuda")), problems)   # the GPUs the plan gave it
        if problems:
            raise ConfigError(problems)
    place = RunPlacement(plan)
    resources = cfg.cluster.actor_resources
    if resources:                # the executor too: every actor asks for them
        check_actor_resources(resources, plan.num_actors + 1, ray.cluster_resources())
    if plan.bundles:
        check_cluster(plan, gpus)
        place.group = PlacementGroupResource(plan, name=f"{ctx.c.cluster.namespace}-gpus", actor_resources=resources)
        add(place.group)
    if not plan.bundles and _on_this_machine():
        place.threads = cpu_thread_budget(plan, cores=cores, overlapped=ctx.overlapped, ranks=cfg.cluster.trainer_ranks)
    ctx.tracer.emit("placement", gpus=use_gpus, bundles=plan.bundles, bundle_gpus=list(plan.bundle_gpus),
                    cpu_threads=None if place.threads is None else place.threads.describe(),
                    colocate=cfg.cluster.colocate, auto_colocate=auto_reason(cfg) if auto else None,
                    auto_engines=AUTO_ENGINES_REASON.format(cores=cores) if auto_engines and plan.engines else None,
                    trainer=[p.num_gpus for p in plan.trainers], engines=[p.num_gpus for p in plan.engines])
    return place


async def _weight_transport(ctx: TrainingContext, add: Any) -> None:
    """CUDA IPC buckets when the engines share the trainer's GPUs and both specs declare buckets; else
    the object store (`ctx.c.ipc_weights` stays None). A fully-async push swaps through the object store
    (`swap_weights`), so no buckets are made for it."""
    cfg, b = ctx.cfg, ctx.backends
    if not (ctx.c.placement.gpus and cfg.cluster.colocate and not cfg.fully_async and ctx.c.engines
            and ctx.c.trainer is not None
            and b.engine_spec.supports(SupportsWeightBucketLoad) and b.train_spec.supports(SupportsWeightBucketExport)):
        ctx.tracer.emit("weight_transport", transport="object_store")
        return
    dtype = await ctx.c.engines[0].handle.weights_dtype.remote()
    from miles.rollout.trainer_weights import fp8_engines

    fp8 = fp8_engines(ctx)          # FP8 engines: the buckets carry e4m3 Linear weights and their scales
    count = await (ctx.c.trainer.handle.weight_bucket_count.remote(dtype, cfg.update_weight_buffer_size, True) if fp8
                   else ctx.c.trainer.handle.weight_bucket_count.remote(dtype, cfg.update_weight_buffer_size))
    ctx.c.ipc_weights = IpcWeights(ctx.c.trainer.handle, count)
    add(ctx.c.ipc_weights)
    ctx.tracer.emit("weight_transport", transport="cuda_ipc", buckets=count, dtype=str(dtype), fp8=fp8,
                    bucket_bytes=cfg.update_weight_buffer_size)


def _on_this_machine() -> bool:
    """Whether the cluster is this machine alone (its one node is the driver's): then a CPU run's actors
    share this machine's cores, and the placement splits them (cpu_thread_budget); else each actor
    takes its own node's (miles.training.torch.threads)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return len(nodes) == 1 and nodes[0].get("NodeManagerAddress") == ray.util.get_node_ip_address()


def trainer_options(cfg: RunConfig) -> dict[str, Any]:
    """The trainer's slices: its own, and the rollout's, which says how the samples it trains on were drawn.
    Its --save-debug-train-data path is the run's (--dump-details' when only that is given), made absolute:
    the trainer writes it from its own working directory."""
    train, dump = cfg.train, cfg.debug_train_data_path
    if dump:
        train = replace(train, save_debug_train_data=os.path.abspath(dump))
    return dict(train=train, algorithm=cfg.algorithm, rollout=cfg.rollout, device=cfg.model.device,
                dtype=cfg.model.dtype)


async def _plan_rollouts(ctx: TrainingContext) -> None:
    if ctx.cfg.num_rollout is not None:
        ctx.num_rollout = ctx.cfg.num_rollout
    else:
        per_epoch = await ctx.c.executor.handle.num_batches_per_epoch.remote()
        ctx.num_rollout = per_epoch * (ctx.cfg.num_epoch or 1)
    ctx.tracer.emit("plan", num_rollout=ctx.num_rollout)

