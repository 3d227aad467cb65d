"""Engine supervision: create engines, and restart dead ones within the run's restart budget.

A phase that talks to engines runs its call through `with_engine_restarts`: when the call fails
because an actor died, every engine is probed; each dead one is replaced by a new actor (registered
with the disposer where it is created, given the weights the others hold and the memory state they
are in, handed to the engine fleet and the executor) and the call is retried. When an engine call
ran past --engine-generate-timeout (`EngineUnresponsive`), that engine is hung: it is killed
(`engine_unresponsive` in the trace), restarted the same way, and the call retried. A dead actor
that is not an engine (the trainer) is not restartable: the failure goes on to the fail route. Past
the budget, RestartBudgetExceeded does the same. (An SGLang engine whose server dies ends its own
actor, so a dead server takes this path too.) Hung engines between calls are the health monitor's
(`miles.phases.health`).

A restarted engine is put in the memory state the others are in (`ctx.engines_released`, kept by
miles.phases.memory).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, TypeVar

import ray

from miles.cluster.ray_cluster import driver_path
from miles.phases.context import TrainingContext
from miles.rollout.protocol import EngineUnresponsive
from miles.runtime.supervisor import RestartBudget

T = TypeVar("T")
PROBE_TIMEOUT_S = 10.0


def make_engine(ctx: TrainingContext, index: int, *, name: str | None = None) -> Any:
    cfg, place, fleet, name = ctx.cfg, ctx.c.placement, ctx.c.engine_fleet, name or f"engine-{index}"
    # the GPUs come from the run's placement, for every engine kind; the options from the config (the
    # spec's), a fleet's wiring beside them
    options = {**ctx.backends.engine_options, **(fleet.engine_kwargs(index, name) if fleet is not None else {})}
    model = driver_path(cfg.model.hf_checkpoint)
    engine = ctx.c.cluster.actor(ctx.backends.engine, model, name=name, needs={"--hf-checkpoint": model},
                                 concurrency=ctx.backends.engine_spec.actor_threads,
                                 placement=place.options(place.plan.engines[index]) if place else None,
                                 device=cfg.model.device, dtype=cfg.model.dtype, seed=cfg.rollout_seed + index,
                                 **options)
    ctx.disposer.add(engine, force=engine.force, timeout=cfg.trace.teardown_timeout_s)
    return engine


async def with_engine_restarts(ctx: TrainingContext, call: Callable[[], Awaitable[T]]) -> T:
    while True:
        try:
            return await call()
        except EngineUnresponsive as exc:
            if not await restart_unresponsive(ctx, exc):
                raise
        except ray.exceptions.RayActorError as exc:
            dead = await dead_engines(ctx)
            if not dead:
                raise
            for i in dead:
                await restart_engine(ctx, i, cause=exc)


async def restart_unresponsive(ctx: TrainingContext, exc: EngineUnresponsive) -> bool:
    """Restart the engine an EngineUnresponsive names (traced `engine_unresponsive`); False when it
    names none of the run's engines."""
    index = _engine_index(exc, len(ctx.c.engines))
    if index is None:
        return False
    cause = getattr(exc, "cause", None) or exc      # Ray's wrapper prints the remote traceback
    ctx.tracer.emit("engine_unresponsive", engine=index, error={"type": type(cause).__name__,
                                                                "message": str(cause)[:500]})
    await restart_engine(ctx, index, cause=exc)
    return True


def _engine_index(exc: BaseException, num_engines: int) -> int | None:
    """The engine an EngineUnresponsive names (through Ray's wrapper: its `cause`), if it is one of ours."""
    index = getattr(exc, "engine", None)
    if index is None:
        index = getattr(getattr(exc, "cause", None), "engine", None)
    return index if isinstance(index, int) and 0 <= index < num_engines else None


async def dead_engines(ctx: TrainingContext) -> list[int]:
    async def alive(engine: Any) -> bool:
        try:
            await asyncio.wait_for(engine.handle.__ray_ready__.remote(), PROBE_TIMEOUT_S)
            return True
        except (ray.exceptions.RayActorError, asyncio.TimeoutError):
            return False

    states = await asyncio.gather(*(alive(e) for e in ctx.c.engines))
    return [i for i, ok in enumerate(states) if not ok]


async def restart_engine(ctx: TrainingContext, index: int, *, cause: BaseException) -> None:
    if ctx.engine_budget is None:
        r = ctx.cfg.rollout
        ctx.engine_budget = RestartBudget(r.engine_max_restarts, r.engine_restart_window_s)
    try:
        count = ctx.engine_budget.spend(f"engine-{index}")
    except Exception as exc:
        raise exc from cause
    ctx.engine_restarts += 1
    seq = ctx.tracer.emit("engine_restart", engine=index, restarts_in_window=count,
                          error={"type": type(cause).__name__, "message": str(cause)[:500]})
    ctx.c.engines[index].force()       # make sure the old one is gone (it may be a zombie, not dead)
    if ctx.c.engine_fleet is not None:
        await ctx.c.engine_fleet.left(index)
    engine = make_engine(ctx, index, name=f"engine-{index}-r{ctx.engine_restarts}")
    pid = await engine.wait_ready()
    if ctx.weight_version > 0:         # the others hold the trainer's weights, not the disk's
        await engine.handle.update_weights.remote(ctx.c.trainer.handle.weights.remote(), ctx.weight_version)
    if ctx.engines_released:           # and the others' memory state
        await engine.handle.release_memory.remote(ctx.engines_released)
    if ctx.c.engine_fleet is not None:
        await ctx.c.engine_fleet.joined(index, engine.handle)
    ctx.c.engines[index] = engine
    await ctx.c.executor.handle.set_engines.remote([e.handle for e in ctx.c.engines])
    ctx.tracer.emit("engine_restarted", engine=index, cause=seq, version=ctx.weight_version,
                    pids={engine.resource_name: pid})
