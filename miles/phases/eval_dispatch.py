"""Eval dispatch for the async machine: an eval runs in the background while the loop goes on.

The seed's rule: the dispatcher is registered with the disposer where it is created, after the
executor and the models, so on every way out its drain runs before they are torn down and an eval
in flight still finds the engines and the executor it reads. Normally `draining` settles it first;
the disposer's entry is the guarantee when draining fails or is cut short (a second Ctrl-C).

An eval is dispatched right after a weight sync and reads the weights the engines hold; the next
weight sync awaits it first, so an eval never straddles two weight versions. Its row reaches
metrics.jsonl when it finishes (`eval_start` / `eval_end` in the trace show its span).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import ray

from miles.phases.context import TrainingContext
from miles.phases.engines import with_engine_restarts
from miles.phases.prefetch import elapsed_since, await_span
from miles.runtime.trace import Tracer

Evaluate = Callable[[int], Awaitable[dict[str, float]]]    # step -> eval metrics (a Ray ObjectRef is one)
CANCEL_GRACE_S = 5.0


@dataclass
class EvalJob:
    step: int                   # rollouts trained when it was dispatched: its metrics row's step
    weight_version: int         # the weights it reads
    pending: Awaitable[Any]     # what the task awaits (a Ray ObjectRef in a run: cancelled through Ray)
    task: asyncio.Task
    error: BaseException | None = None


class EvalDispatcher:
    """Evals in flight. `on_result(step, weight_version, metrics)` records a finished one."""

    resource_name = "eval_dispatcher"

    def __init__(self, evaluate: Evaluate, on_result: Callable[[int, int, dict[str, float]], None], tracer: Tracer):
        self._evaluate, self._on_result, self._tracer = evaluate, on_result, tracer
        self.jobs: list[EvalJob] = []

    @property
    def in_flight(self) -> list[int]:
        return [j.step for j in self.jobs if not j.task.done()]

    def submit(self, step: int, weight_version: int, *, evaluate: Evaluate | None = None, redo: bool = False) -> None:
        pending = (evaluate or self._evaluate)(step)
        seq = self._tracer.emit("eval_start", rollout_id=step, weight_version=weight_version, redo=redo or None)
        span, t0 = {"rollout_id": step, "weight_version": weight_version, "cause": seq}, time.monotonic()
        task = asyncio.ensure_future(self._run(step, weight_version, pending, span, t0))
        # a task cancelled before it ever ran skips its body: its end is traced here
        task.add_done_callback(lambda t: t.cancelled() and self._tracer.emit(
            "eval_end", outcome="cancelled", duration_s=elapsed_since(t0), **span))
        self.jobs.append(EvalJob(step, weight_version, pending, task))

    async def _run(self, step: int, version: int, pending: Awaitable[Any], span: dict[str, Any], t0: float) -> None:
        metrics = await await_span(self._tracer, "eval_end", pending, span, t0)
        self._on_result(step, version, metrics)
        self._tracer.emit("eval_end", outcome="ok", duration_s=elapsed_since(t0), **span,
                          **{k: v for k, v in metrics.items() if k.endswith("pass@1")})

    async def wait(self) -> list[EvalJob]:
        """Await every eval in flight; return (and forget) those that failed, their error set."""
        jobs, self.jobs = self.jobs, []
        if jobs:
            await asyncio.wait({j.task for j in jobs})
        failed = []
        for j in jobs:
            j.error = asyncio.CancelledError() if j.task.cancelled() else j.task.exception()
            if j.error is not None:
                failed.append(j)
        return failed

    async def cancel(self) -> None:
        """Cancel every eval in flight (through Ray first, so the executor stops too)."""
        through_ray = {j.task for j in self.jobs if not j.task.done() and isinstance(j.pending, ray.ObjectRef)}
        for j in self.jobs:
            if j.task in through_ray:
                ray.cancel(j.pending)
        if through_ray:
            await asyncio.wait(through_ray, timeout=CANCEL_GRACE_S)
        await self.force()
        await self.wait()

    async def dispose(self) -> None:
        """Await the evals in flight (the disposer's timeout bounds it; `force` cancels them). A
        failed one is raised as this teardown's error. The executor and engines are the run's."""
        failed = await self.wait()
        if failed:
            raise failed[0].error

    async def force(self) -> None:
        """Cancel the tasks (async: the disposer runs a plain callable in a thread, tasks are the loop's)."""
        for j in self.jobs:
            j.task.cancel()


# -- the composition root's part, the phase, and settling -------------------------------------------


def make_eval_dispatcher(ctx: TrainingContext) -> EvalDispatcher:
    """Called by the async init after the executor and models exist; registered right here."""
    def on_result(step: int, version: int, metrics: dict[str, float]) -> None:
        row = {**metrics, "kind": "eval", "weight_version": version}
        ctx.c.metrics.log(step, row)
        ctx.metrics_history.append({"step": step, **row})

    dispatcher = EvalDispatcher(lambda step: ctx.c.executor.handle.evaluate.remote(step), on_result, ctx.tracer)
    ctx.disposer.add(dispatcher, timeout=ctx.cfg.trace.teardown_timeout_s, force=dispatcher.force)
    return dispatcher


async def dispatch_eval(ctx: TrainingContext) -> str:
    """`eval` in the async machine: start every eval dataset on the weights just synced; no waiting."""
    ctx.c.evals.submit(ctx.next_rollout, ctx.weight_version)
    ctx.evaluated_version = ctx.weight_version
    return "next"


async def settle_evals(ctx: TrainingContext) -> None:
    """Await the evals in flight. One an engine died under is run again (the dead engine restarted,
    within the budget, with the weights it read); any other failure fails the run."""
    for job in await ctx.c.evals.wait():
        if not isinstance(job.error, ray.exceptions.RayActorError):
            raise job.error
        ctx.c.evals.submit(job.step, job.weight_version, redo=True, evaluate=lambda step: with_engine_restarts(
            ctx, lambda: ctx.c.executor.handle.evaluate.remote(step)))
    for job in await ctx.c.evals.wait():
        raise job.error


async def drain_evals(ctx: TrainingContext) -> None:
    """`draining`: evals finish (their rows are the run's last word on quality), unless the run was
    cancelled; after a failure their own failures are traced, not raised over the first one."""
    if isinstance(ctx.failure, (asyncio.CancelledError, KeyboardInterrupt)):
        await ctx.c.evals.cancel()
    elif ctx.failure is not None:
        await ctx.c.evals.wait()
    else:
        await settle_evals(ctx)
