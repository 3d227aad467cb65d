"""Evals: what an eval measures (unbiased pass@k over each prompt's samples) and, on the async
machine, how evals run in the background: each a traced background job, while the loop goes on.
(The `eval` phase of the sync machine is miles.phases.eval; the executor generates and scores.)

The dispatcher is registered with the disposer where it is created, after the executor and the
models, so on every way out its drain runs before they are torn down and an eval in flight still
finds the engines and the executor it reads. Normally `draining` settles it first; the disposer's
entry is the guarantee when draining fails or is cut short (a second Ctrl-C).

An eval is dispatched right after a weight sync and reads the weights the engines hold; the next
weight sync awaits it first, so an eval never straddles two weight versions. Its row reaches
metrics.jsonl when it finishes (`eval_start` / `eval_end` in the trace show its span).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from math import comb
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable

from miles.rollout.background import Job, cancel_jobs, start_job
from miles.runtime.trace import Tracer

if TYPE_CHECKING:
    from miles.types import Sample


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): P(at least one of k draws from n samples, c correct, is correct)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_rates(samples: list[Sample], n: int, ks: Iterable[int]) -> dict[str, float]:
    """Mean unbiased pass@k over the groups of n samples (a sample passes when its reward is > 0)."""
    correct = [sum(s.reward > 0 for s in samples[i:i + n]) for i in range(0, len(samples), n)]
    return {f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / len(correct) for k in ks}


Evaluate = Callable[[int], Awaitable[dict[str, float]]]    # step -> eval metrics (a Ray ObjectRef is one)


@dataclass
class EvalJob:
    step: int                   # rollouts trained when it was dispatched: its metrics row's step
    weight_version: int         # the weights it reads
    job: Job
    error: BaseException | None = None

    @property
    def task(self) -> asyncio.Task:
        return self.job.task


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
        def record(metrics: dict[str, float]) -> dict[str, float]:
            self._on_result(step, weight_version, metrics)
            return {k: v for k, v in metrics.items() if k.endswith("pass@1")}

        pending = (evaluate or self._evaluate)(step)
        job = start_job(self._tracer, "eval", pending,
                        {"rollout_id": step, "weight_version": weight_version, "redo": redo or None}, on_ok=record)
        self.jobs.append(EvalJob(step, weight_version, job))

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
        await cancel_jobs([j.job for j in self.jobs])
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
