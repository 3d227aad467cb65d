"""`init`: the composition root. Creates every component and registers each with the disposer
where it is created, so whatever `init` made before failing is torn down too.

Order: metrics sinks → what an attached cluster gets shipped (miles.cluster.shipping) → Ray → how
checkpoint folders reach the driver (miles.phases.checkpoint_io) → the backends (picked once the
cluster's GPUs are known: they decide --device auto) → placement (the GPU plan and its placement
group) → the engine fleet (if the engine's spec has one: SGLang's router) → engines → trainer →
critic (ppo) → executor → weight transport → checkpoint resume. Input is checked on the driver
(tokenizer, prompt or SFT files, reward and filter imports, the GPU plan against the cluster) before
any actor starts; the config itself was checked before Ray started (miles.config.checks).
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

from miles.checkpoint.checkpointer import CRITIC_DIR, ROLLOUT_FILE, TRAINER_DIR, read_data_position
from miles.checkpoint.megatron_format import megatron_checkpoint_info
from miles.checkpoint.resume import (LoadFolder, check_load_folder, classify_load_folder, pick_step,
                                     refuse_fresh_start, skipped_line)
from miles.checkpoint.store import CheckpointStore, manifest_files, verify_files
from miles.cluster.auto_layout import AUTO_COLOCATE_REASON, AUTO_ENGINES_REASON, auto_colocate, auto_num_engines
from miles.cluster.placement import (Placement, PlacementGroupResource, RunPlacement, check_actor_resources,
                                     check_cluster, cluster_gpus, placement_request, plan_placement)
from miles.cluster.ray_cluster import RayCluster, driver_path
from miles.cluster.shipping import SHIPPED_DIR, Shipment, miles_package, stage
from miles.config import ConfigError, EvalDataset, RunConfig, as_dict
from miles.config.schema import parse_opd_teachers
from miles.data.prompts import load_prompts
from miles.data.sft import load_sft_data
from miles.phases.background_save import BackgroundSave
from miles.phases.checkpoint_io import SAVE_GROUP, pick_folders
from miles.phases.ci_gates import CICheckFailed
from miles.phases.context import Backends, IpcWeights, TrainingContext
from miles.phases.debug import check_debug_flags
from miles.phases.engines import make_engine
from miles.phases.engine_reason import engine_reason
from miles.phases.health import start_health_monitor
from miles.phases.megatron_resume import resume_from_megatron
from miles.phases.memory import trainer_offloads
from miles.phases.input_checks import (check_checkpoint_fits, check_context_len, check_user_functions,
                                       first_row_keys, label_warnings, model_shapes)
from miles.phases.watch import ci_check_model_hash
from miles.rollout.executor import RolloutExecutor
from miles.rollout.filters import load_filter
from miles.rollout.hooks import check_hooks
from miles.rollout.partial import check_engines, check_partial_rollout
from miles.rollout.generation import load_generate_function, load_rollout_function
from miles.rollout.evals import load_eval_function
from miles.rollout.engines.registry import ENGINES
from miles.rollout.protocol import SupportsWeightBuckets
from miles.rollout.remote_reward import check_reachable
from miles.rollout.rewards import REMOTE_RM, load_reward_fn
from miles.rollout.scoring import Rewards
from miles.rollout.tools import load_tool_kit, load_tool_specs
from miles.runtime.machine import import_object
from miles.runtime.procs import usable_cores
from miles.tracking.sinks import Tracker, open_sinks
from miles.training.protocol import TRAIN_BACKENDS, SupportsBackgroundSave
from miles.training.protocol import SupportsWeightBuckets as TrainerWeightBuckets
from miles.weights.hf import load_tokenizer


MAX_TRACED_PROBLEMS = 10       # a checkpoint_skipped event names at most this many bad files


def pick_backends(cfg: RunConfig, *, cluster_gpus: int = 0) -> Backends:
    """--rollout-engine and --train-backend → their specs and classes, imported now (validate checked the
    names, and that --rollout-engine fast can run the model). `cluster_gpus`: the GPUs of the run's
    cluster, which decide --device auto (`ModelConfig.uses_gpus`)."""
    train_spec = TRAIN_BACKENDS[cfg.train.backend].for_ranks(cfg.cluster.trainer_ranks)
    name, refused = pick_engine(cfg, on_gpus=cfg.model.uses_gpus(cluster_gpus))
    engine_spec = ENGINES[name]
    backends = Backends(engine=import_object(engine_spec.engine), trainer=import_object(train_spec.trainer),
                        critic=import_object(train_spec.critic) if cfg.algorithm.needs_critic and train_spec.critic
                        else None, engine_spec=engine_spec, train_spec=train_spec, engine_name=name,
                        engine_options=engine_spec.options(cfg), fast_path_refused=refused)
    _check_declared(backends)
    return backends


def pick_engine(cfg: RunConfig, *, on_gpus: bool) -> tuple[str, str | None]:
    """The ENGINES name the run uses, and why the preferred one was refused (None: taken, or none).

    On GPUs an engine whose spec prefers another gives way to it for the models it implements
    (`embedded` becomes FastEngine; else it stays EmbeddedEngine, as on CPU). `fast` asked outright is
    FastEngine anywhere (CPU too: eager, what CI tests).
    """
    asked = cfg.rollout.engine
    preferred = ENGINES[asked].prefer_on_gpus
    if preferred is None or not on_gpus:
        return asked, None
    refuses = ENGINES[preferred].refuses
    refused = refuses(cfg.model.hf_checkpoint) if refuses is not None else None
    return (asked, refused) if refused else (preferred, None)


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
    check_debug_flags(cfg, ctx.tracer.machine)
    tokenizer, prompts, eval_sets, sft_responses = await _check_inputs(ctx)
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
    cfg = ctx.cfg                       # with --colocate when the one-GPU default layout chose it
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
        await _resume(ctx)
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
        check_engines(cfg.rollout, plan.num_engines)
    check = ctx.backends.train_spec.check
    if check and plan.bundles and plan.trainers:     # validate could not know the trainer's GPUs with --device auto
        problems = import_object(check)(cfg, len(plan.trainers))
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
    ctx.tracer.emit("placement", gpus=use_gpus, bundles=plan.bundles, bundle_gpus=list(plan.bundle_gpus),
                    colocate=cfg.cluster.colocate, auto_colocate=AUTO_COLOCATE_REASON if auto else None,
                    auto_engines=AUTO_ENGINES_REASON.format(cores=cores) if auto_engines and plan.engines else None,
                    trainer=[p.num_gpus for p in plan.trainers], engines=[p.num_gpus for p in plan.engines])
    return place


async def _weight_transport(ctx: TrainingContext, add: Any) -> None:
    """CUDA IPC buckets when the engines share the trainer's GPUs and both specs declare buckets; else
    the object store (`ctx.c.ipc_weights` stays None)."""
    cfg, b = ctx.cfg, ctx.backends
    if not (ctx.c.placement.gpus and cfg.cluster.colocate and ctx.c.engines and ctx.c.trainer is not None
            and b.engine_spec.supports(SupportsWeightBuckets) and b.train_spec.supports(TrainerWeightBuckets)):
        ctx.tracer.emit("weight_transport", transport="object_store")
        return
    dtype = await ctx.c.engines[0].handle.weights_dtype.remote()
    count = await ctx.c.trainer.handle.weight_bucket_count.remote(dtype, cfg.update_weight_buffer_size)
    ctx.c.ipc_weights = IpcWeights(ctx.c.trainer.handle, count)
    add(ctx.c.ipc_weights)
    ctx.tracer.emit("weight_transport", transport="cuda_ipc", buckets=count, dtype=str(dtype),
                    bucket_bytes=cfg.update_weight_buffer_size)


def trainer_options(cfg: RunConfig) -> dict[str, Any]:
    """The trainer's slices: its own, and the rollout's, which says how the samples it trains on were drawn.
    Its --save-debug-train-data path is the run's (--dump-details' when only that is given), made absolute:
    the trainer writes it from its own working directory."""
    train, dump = cfg.train, cfg.debug_train_data_path
    if dump:
        train = replace(train, save_debug_train_data=os.path.abspath(dump))
    return dict(train=train, algorithm=cfg.algorithm, rollout=cfg.rollout, device=cfg.model.device,
                dtype=cfg.model.dtype)


async def _check_generation_and_rewards(cfg: RunConfig, prompts: list) -> None:
    """The user's generate / rollout / tool functions import and have the right signatures; the
    rewards exist (the per-sample types the data names too) and their services answer, as do the OPD
    teacher servers (--opd-type sglang)."""
    g = cfg.generate
    if g.generate_function_path:
        load_generate_function(g.generate_function_path)
    if g.rollout_function_path:
        load_rollout_function(g.rollout_function_path)
    if cfg.eval.function_path:
        load_eval_function(cfg.eval.function_path)
    if g.execute_tool_function_path:
        load_tool_kit(g.execute_tool_function_path, specs_path=g.tool_specs_path, parser=g.tool_call_parser,
                      timeout_s=g.tool_timeout_s)
    rewards = Rewards(cfg.rollout)
    rewards.check_prompts(prompts)
    try:
        await rewards.check_services()
    finally:
        await rewards.close()
    if cfg.algorithm.opd_from_servers:       # --opd-type sglang: every teacher server answers before anything starts
        for name, url in parse_opd_teachers(cfg.algorithm.opd_teacher_urls).items():
            await check_reachable(url, timeout_s=10.0, attempts=cfg.rollout.rm_max_retries + 1,
                                  backoff_s=cfg.rollout.rm_retry_backoff_s, flag="--opd-teacher-urls",
                                  what=f"the server of teacher {name!r}",
                                  why_needed="--opd-type sglang asks it for every trained sample's logprobs")


async def _check_inputs(ctx: TrainingContext) -> tuple[Any, list, dict[str, list], dict[int, tuple[int, ...]] | None]:
    """Everything that can be wrong with the input, found before any actor exists."""
    cfg = ctx.cfg
    folder = check_load_folder(cfg.checkpoint.load, allow_fresh_start=cfg.checkpoint.allow_fresh_start,
                               step=cfg.checkpoint.ckpt_step, exit_on_missing=cfg.checkpoint.exit_on_missing)
    _hash_before_start(ctx, folder)
    check_checkpoint_fits(cfg, model_shapes(cfg.model.hf_checkpoint, "--hf-checkpoint"))
    try:
        tokenizer = load_tokenizer(cfg.model.hf_checkpoint)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--hf-checkpoint {cfg.model.hf_checkpoint}: cannot load its tokenizer: {exc}") from exc
    sft_responses = None
    tools = load_tool_specs(cfg.generate.tool_specs_path) if cfg.generate.tool_specs_path else None
    if cfg.algorithm.loss_type == "sft_loss":      # rollouts read the data's responses instead of generating
        prompts, sft_responses = load_sft_data(cfg.data, tokenizer)
    else:
        prompts = load_prompts(cfg.data, tokenizer, tools=tools)
    check_context_len(cfg, prompts, f"--prompt-data {cfg.data.prompt_data}")
    eval_sets = {d.name: _eval_prompts(cfg, d, tokenizer, tools) for d in cfg.eval.sets()}
    r = cfg.rollout
    # what label_warnings reads (a reward service, remote_rm, gets the label as it is, or None)
    reward_fn = load_reward_fn(r.rm_type, r.custom_rm_path) if r.custom_rm_path or r.rm_type != REMOTE_RM else None
    await _check_generation_and_rewards(cfg, [*prompts, *(p for ps in eval_sets.values() for p in ps)])
    if cfg.rollout.dynamic_sampling_filter_path:
        load_filter(cfg.rollout.dynamic_sampling_filter_path)
    check_hooks(cfg.rollout, cfg.eval.log_function_path)
    check_partial_rollout(cfg.rollout)
    check_user_functions(cfg)
    for flag, size in (("--rollout-batch-size", cfg.rollout.batch_size),
                       ("--over-sampling-batch-size", cfg.rollout.over_sampling_batch_size)):
        if size is not None and size > len(prompts):
            raise ConfigError(f"{flag} {size} is larger than the {len(prompts)} prompts of {cfg.data.prompt_data}")
    warnings = label_warnings(cfg, reward_fn, first_row_keys(cfg.data.prompt_data)) if reward_fn else []
    for warning in warnings:
        ctx.tracer.emit("warning", code="label_key", message=warning)
    ctx.tracer.emit("inputs_checked", prompts=len(prompts), eval_sets={k: len(v) for k, v in eval_sets.items()})
    return tokenizer, prompts, eval_sets, sft_responses


def _eval_prompts(cfg: RunConfig, d: EvalDataset, tokenizer: Any, tools: list | None) -> list:
    """An eval dataset's prompts, read with its own keys (--eval-config) or the run's, long ones dropped by
    --eval-max-prompt-len (else --max-prompt-len)."""
    keys = {k: getattr(d, k) for k in ("input_key", "label_key", "metadata_key") if getattr(d, k) is not None}
    if cfg.eval.max_prompt_len is not None:            # --eval-max-prompt-len: the evals' own limit
        keys["max_prompt_len"] = cfg.eval.max_prompt_len
    prompts = load_prompts(replace(cfg.data, prompt_data=d.path, **keys), tokenizer, tools=tools)
    check_context_len(cfg, prompts, f"eval dataset {d.name} ({d.path})", evaluation=True)
    return prompts


async def _plan_rollouts(ctx: TrainingContext) -> None:
    if ctx.cfg.num_rollout is not None:
        ctx.num_rollout = ctx.cfg.num_rollout
    else:
        per_epoch = await ctx.c.executor.handle.num_batches_per_epoch.remote()
        ctx.num_rollout = per_epoch * (ctx.cfg.num_epoch or 1)
    ctx.tracer.emit("plan", num_rollout=ctx.num_rollout)


async def _resume(ctx: TrainingContext) -> None:
    """Restore trainer (weights, optimizer, RNG), data position and counters from the newest checkpoint
    under --load that checks out: complete (manifest, sizes) and, unless --no-verify-load, every file
    the load reads matching its sha256, checked where it is read. Each one passed over is traced and
    said (`checkpoint_skipped`: which, why, which is tried instead); with none left the run is refused
    (miles.checkpoint.resume) unless the folder had nothing yet or --allow-fresh-start. --ckpt-step N
    takes rollout N's checkpoint only (no fallback, no fresh start)."""
    step = ctx.cfg.checkpoint.ckpt_step
    root, allow = ctx.cfg.checkpoint.load, ctx.cfg.checkpoint.allow_fresh_start and step is None
    if (megatron := megatron_checkpoint_info(root)) is not None:    # miles' saves / converter (megatron backend)
        return await resume_from_megatron(ctx, megatron)     # --ckpt-step was checked against it at start-up
    folder = pick_step(classify_load_folder(root), step)
    found: dict[Path, list[str]] = {}
    for i, c in enumerate(folder.candidates):
        problems = list(c.problems)
        verified = not problems and ctx.cfg.reliability.verify_load
        if verified:                        # hashed before Ray started (`_hash_before_start`), else where read
            problems = (list(ctx.load_checked[c.path]) if c.path in ctx.load_checked
                        else await _verify_where_read(ctx, c.path))
        if problems:
            found[c.path] = problems
            ctx.tracer.emit("checkpoint_skipped", rollout_id=c.rollout_id, path=str(c.path), check="sha256" if verified
                            else "manifest and sizes", problems=problems[:MAX_TRACED_PROBLEMS],
                            message=skipped_line(c, problems, list(folder.candidates[i + 1:])))
            continue
        await _load_checkpoint(ctx, c.path)
        await ci_check_model_hash(ctx, c.path)
        finetune = ctx.cfg.checkpoint.finetune      # the weights alone: the run starts over from them
        ctx.start_rollout = ctx.next_rollout = 0 if finetune else c.rollout_id + 1
        ctx.resumed = True
        ctx.weight_version = 0              # the engines hold the disk weights until the first sync
        ctx.tracer.emit("resumed", rollout_id=c.rollout_id, path=str(c.path), next_rollout=ctx.next_rollout,
                        verified=verified, **_fresh_parts(ctx.cfg.checkpoint.load_parts()))
        return
    if not (folder.starts_fresh or allow):
        raise refuse_fresh_start(folder, found)
    if ctx.ci.model_hash_checked:
        raise CICheckFailed(f"--ci-check-model-hash: --load {root} held no checkpoint to load, so there are no "
                            "loaded weights to check; point --load at a run saved with --ci-save-model-hash")
    # --load X --save X before X holds anything: the auto-resume launch script's first run
    reason = folder.reason or "nothing loadable, and --allow-fresh-start"
    ctx.tracer.emit("resume_skipped", reason=reason, root=root)


async def _load_checkpoint(ctx: TrainingContext, path: Path) -> None:
    """The trainer's (and critic's) folder, the parts --no-load-optim / --no-load-rng / --finetune leave
    (`CheckpointConfig.load_parts`), and the data position unless --finetune."""
    parts = ctx.cfg.checkpoint.load_parts()
    if trainer_offloads(ctx):
        # offloaded first (a fresh optimizer: nothing moves), so the load puts the optimizer state
        # straight into host memory instead of whole on a GPU the colocated engines already share
        await ctx.c.trainer.handle.offload.remote()
    await ctx.c.folders.load(ctx.c.trainer, "load", path / TRAINER_DIR, **parts)
    if not ctx.cfg.checkpoint.finetune:
        await ctx.c.executor.handle.load_state_dict.remote(read_data_position(path))
    # a critic kept under --critic-save comes back through --critic-load instead
    if ctx.c.critic is not None and (path / CRITIC_DIR).is_dir():
        await ctx.c.folders.load(ctx.c.critic, "load", path / CRITIC_DIR, **parts)


def _fresh_parts(parts: dict[str, bool]) -> dict:
    """The `resumed` event's `fresh`: what the resume did not take from the checkpoint (none: no field)."""
    names = {"optimizer": "optimizer", "rng": "rng", "step": "step_count_and_data_position"}
    fresh = [names[k] for k, taken in parts.items() if not taken]
    return {"fresh": fresh} if fresh else {}


def _hash_before_start(ctx: TrainingContext, folder: LoadFolder | None) -> None:
    """--load's checkpoints that pass the cheap check, hashed here before anything starts, newest first
    until one checks out (the sha256 of every file the load reads against its manifest): when none
    does, the run is refused now (exit 2), not after Ray and the actors have started. What each one
    hashed to is kept (`ctx.load_checked`): `_resume` reads it instead of hashing again. The driver
    reads what the actors load: the same path on a shared filesystem, or the copy it sends them."""
    cfg = ctx.cfg
    if folder is None or folder.kind != "miles" or folder.starts_fresh or not cfg.reliability.verify_load:
        return
    for c in folder.candidates:
        if c.problems:
            continue
        files = {**manifest_files(c.path, f"{TRAINER_DIR}/"), **manifest_files(c.path, ROLLOUT_FILE)}
        if cfg.algorithm.needs_critic and (c.path / CRITIC_DIR).is_dir():
            files.update(manifest_files(c.path, f"{CRITIC_DIR}/"))
        ctx.load_checked[c.path] = verify_files(c.path, files)
        if not ctx.load_checked[c.path]:
            return
    if not (cfg.checkpoint.allow_fresh_start and cfg.checkpoint.ckpt_step is None):
        raise refuse_fresh_start(folder, ctx.load_checked)


async def _verify_where_read(ctx: TrainingContext, path: Path) -> list[str]:
    """The sha256 of every file the load reads, each checked where it is read: `trainer/` (and
    `critic/`) in their actors, or here when the folders travel through Ray (checkpoint_io);
    `rollout.json` here."""
    readers = [(ctx.c.trainer, TRAINER_DIR)]
    if ctx.c.critic is not None and (path / CRITIC_DIR).is_dir():
        readers.append((ctx.c.critic, CRITIC_DIR))
    found = await asyncio.gather(*(ctx.c.folders.verify(actor, path, manifest_files(path, f"{folder}/"))
                                   for actor, folder in readers))
    return [p for problems in found for p in problems] + verify_files(path, manifest_files(path, ROLLOUT_FILE))
