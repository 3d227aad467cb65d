"""`init`: the composition root. Creates every component and registers each with the disposer
where it is created, so whatever `init` made before failing is torn down too.

Order: metrics sinks → Ray → engines → trainer → critic (ppo) → executor → checkpoint resume. Input
is checked on the driver (tokenizer, prompt or SFT files, reward and filter imports) before any actor
starts. `pick_backends` is the one place an implementation is chosen: the engine class from
`--rollout-engine` and the trainer's and critic's from `--train-backend`, through the registries of
`miles.rollout.protocol` and `miles.training.protocol`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from miles.checkpoint.checkpointer import CRITIC_DIR, TRAINER_DIR, read_data_position
from miles.checkpoint.store import CheckpointStore
from miles.cluster.ray_cluster import RayCluster
from miles.config import ConfigError, RunConfig, as_dict
from miles.data.prompts import load_prompts
from miles.data.sft import load_sft_data
from miles.phases.context import TrainingContext
from miles.phases.debug import check_debug_flags
from miles.phases.engines import make_engine
from miles.phases.health import start_health_monitor
from miles.rollout.executor import RolloutExecutor
from miles.rollout.filters import load_filter
from miles.rollout.generation import load_generate_function, load_rollout_function
from miles.rollout.protocol import ENGINES, Engine
from miles.rollout.scoring import Rewards
from miles.rollout.tools import load_tool_kit, load_tool_specs
from miles.runtime.machine import import_object
from miles.tracking.sinks import Tracker, open_sinks
from miles.training.protocol import TRAIN_BACKENDS, CriticBackend, TrainerBackend
from miles.weights.hf import load_tokenizer


@dataclass(frozen=True)
class Backends:
    """The implementation classes a run uses; the composition root makes them actors."""

    engine: type[Engine]
    trainer: type[TrainerBackend]
    critic: type[CriticBackend] | None      # PPO's (--advantage-estimator ppo), else None


def pick_backends(cfg: RunConfig) -> Backends:
    """--rollout-engine and --train-backend → classes, imported now (validate checked the names)."""
    spec = TRAIN_BACKENDS[cfg.train.backend]
    ppo = cfg.algorithm.advantage_estimator == "ppo"
    return Backends(engine=import_object(ENGINES[cfg.rollout.engine]), trainer=import_object(spec.trainer),
                    critic=import_object(spec.critic) if ppo and spec.critic else None)


async def init(ctx: TrainingContext) -> str:
    cfg = ctx.cfg
    check_debug_flags(cfg, ctx.tracer.machine)
    ctx.backends = pick_backends(cfg)
    tokenizer, prompts, eval_sets, sft_responses = await _check_inputs(ctx)
    add = partial(ctx.disposer.add, timeout=cfg.trace.teardown_timeout_s)

    ctx.c.metrics = Tracker()
    for sink in open_sinks(cfg.tracking, run_dir=ctx.run_dir, run_id=ctx.run_id, run_config=as_dict(cfg)):
        add(sink)                # as each opens: a W&B login that fails leaves the others to the teardown
        ctx.c.metrics.add(sink)
    ctx.c.cluster = RayCluster(cfg.cluster, ctx.run_id, log_dir=ctx.run_dir / "logs",
                               log_level=cfg.tracking.worker_log_level)
    add(ctx.c.cluster)
    ctx.tracer.emit("cluster_ready", namespace=ctx.c.cluster.namespace, started=ctx.c.cluster.started)

    # the debug half runs (miles/phases/debug.py): train_only reads rollouts from disk, rollout_only trains nothing
    ctx.c.engines = [] if cfg.load_debug_rollout_data else [make_engine(ctx, i) for i in range(cfg.rollout.num_engines)]
    if not cfg.debug_rollout_only:
        _make_models(ctx, add)
    ctx.c.executor = ctx.c.cluster.actor(
        RolloutExecutor, name="rollout-executor", concurrency=8, prompts=prompts, eval_sets=eval_sets,
        rollout=cfg.rollout, algorithm=cfg.algorithm, eval=cfg.eval, shuffle=cfg.data.rollout_shuffle,
        tokenizer=tokenizer, engines=[e.handle for e in ctx.c.engines], seed=cfg.rollout_seed,
        sft_responses=sft_responses, generate=cfg.generate)
    add(ctx.c.executor, force=ctx.c.executor.force)
    actors = [a for a in (*ctx.c.engines, ctx.c.trainer, ctx.c.critic, ctx.c.executor) if a is not None]
    pids = await asyncio.gather(*(a.wait_ready() for a in actors))
    ctx.tracer.emit("components_ready", engines=len(ctx.c.engines),
                    pids={a.resource_name: pid for a, pid in zip(actors, pids)})
    if ctx.c.engines:
        start_health_monitor(ctx)

    await _plan_rollouts(ctx)
    if cfg.checkpoint.save:
        ctx.c.store = CheckpointStore(cfg.checkpoint.save)
        removed = ctx.c.store.cleanup_partial()
        if removed:
            ctx.tracer.emit("partial_checkpoints_removed", paths=[str(p) for p in removed])
    critic_save = cfg.checkpoint.critic_save
    if ctx.c.critic is not None and critic_save and critic_save != cfg.checkpoint.save:
        ctx.c.critic_store = CheckpointStore(critic_save)
        ctx.c.critic_store.cleanup_partial()
    if cfg.checkpoint.load:
        await _resume(ctx)
    return "ready"


def _make_models(ctx: TrainingContext, add: Any) -> None:
    """The trainer, and PPO's critic; each registered as it is created."""
    cfg = ctx.cfg
    ctx.c.trainer = ctx.c.cluster.actor(ctx.backends.trainer, cfg.model.hf_checkpoint, name="trainer",
                                        **trainer_options(cfg))
    add(ctx.c.trainer, force=ctx.c.trainer.force)
    if ctx.backends.critic is not None:
        ctx.c.critic = ctx.c.cluster.actor(
            ctx.backends.critic, cfg.model.hf_checkpoint, name="critic", train=replace(cfg.train, lr=cfg.train.critic_lr or cfg.train.lr),
            algorithm=cfg.algorithm, init_from=cfg.checkpoint.critic_load, device=cfg.model.device, dtype=cfg.model.dtype)
        add(ctx.c.critic, force=ctx.c.critic.force)


def trainer_options(cfg: RunConfig) -> dict[str, Any]:
    """The trainer's slices: its own, and the rollout's, which says how the samples it trains on were drawn."""
    return dict(train=cfg.train, algorithm=cfg.algorithm, rollout=cfg.rollout, device=cfg.model.device,
                dtype=cfg.model.dtype)


async def _check_generation_and_rewards(cfg: RunConfig, prompts: list) -> None:
    """The user's generate / rollout / tool functions import and have the right signatures; the
    rewards exist (the per-sample types the data names too) and their services answer."""
    g = cfg.generate
    if g.generate_function_path:
        load_generate_function(g.generate_function_path)
    if g.rollout_function_path:
        load_rollout_function(g.rollout_function_path)
    if g.execute_tool_function_path:
        load_tool_kit(g.execute_tool_function_path, specs_path=g.tool_specs_path, parser=g.tool_call_parser,
                      timeout_s=g.tool_timeout_s)
    rewards = Rewards(cfg.rollout)
    rewards.check_prompts(prompts)
    try:
        await rewards.check_services()
    finally:
        await rewards.close()


async def _check_inputs(ctx: TrainingContext) -> tuple[Any, list, dict[str, list], dict[int, tuple[int, ...]] | None]:
    """Everything that can be wrong with the input, found before any actor exists."""
    cfg = ctx.cfg
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
    eval_sets = {name: load_prompts(replace(cfg.data, prompt_data=path), tokenizer, tools=tools)
                 for name, path in cfg.eval.prompt_data}
    await _check_generation_and_rewards(cfg, [*prompts, *(p for ps in eval_sets.values() for p in ps)])
    if cfg.rollout.dynamic_sampling_filter_path:
        load_filter(cfg.rollout.dynamic_sampling_filter_path)
    for flag, size in (("--rollout-batch-size", cfg.rollout.batch_size),
                       ("--over-sampling-batch-size", cfg.rollout.over_sampling_batch_size)):
        if size is not None and size > len(prompts):
            raise ConfigError(f"{flag} {size} is larger than the {len(prompts)} prompts of {cfg.data.prompt_data}")
    ctx.tracer.emit("inputs_checked", prompts=len(prompts), eval_sets={k: len(v) for k, v in eval_sets.items()})
    return tokenizer, prompts, eval_sets, sft_responses


async def _plan_rollouts(ctx: TrainingContext) -> None:
    if ctx.cfg.num_rollout is not None:
        ctx.num_rollout = ctx.cfg.num_rollout
    else:
        per_epoch = await ctx.c.executor.handle.num_batches_per_epoch.remote()
        ctx.num_rollout = per_epoch * (ctx.cfg.num_epoch or 1)
    ctx.tracer.emit("plan", num_rollout=ctx.num_rollout)


async def _resume(ctx: TrainingContext) -> None:
    """Restore trainer (weights, optimizer, RNG), data position and counters from the newest
    complete checkpoint under --load; with none there, start from --hf-checkpoint."""
    found = CheckpointStore(ctx.cfg.checkpoint.load).latest()
    if found is None:
        ctx.tracer.emit("resume_skipped", reason="no complete checkpoint", root=ctx.cfg.checkpoint.load)
        return
    rollout_id, path = found
    await ctx.c.trainer.handle.load.remote(str(path / TRAINER_DIR))
    await ctx.c.executor.handle.load_state_dict.remote(read_data_position(path))
    # a critic kept under --critic-save comes back through --critic-load instead
    if ctx.c.critic is not None and (path / CRITIC_DIR).is_dir():
        await ctx.c.critic.handle.load.remote(str(path / CRITIC_DIR))
    ctx.start_rollout = ctx.next_rollout = rollout_id + 1
    ctx.weight_version = 0              # the engines hold the disk weights until the first sync
    ctx.tracer.emit("resumed", rollout_id=rollout_id, path=str(path), next_rollout=ctx.next_rollout)
