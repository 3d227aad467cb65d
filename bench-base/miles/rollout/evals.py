"""Evals: what an eval measures (unbiased pass@k over each prompt's samples), a custom eval function
(--eval-function-path) and, on the async machine, how evals run in the background: each a traced
background job, while the loop goes on. (The `eval` phase of the sync machine is miles.phases.eval; the
executor generates and scores.)

--eval-function-path replaces the built-in eval, as miles' does (miles calls it as its rollout function,
with evaluation=True, and logs the data it returns per dataset). Here it mirrors --rollout-function-path:
`async fn(ctx: EvalContext, rollout_id) -> {dataset: groups}` or `({dataset: groups}, metrics)`, each
dataset's groups being lists of scored Samples (one group per prompt, all of one size). The executor scores
nothing more: it computes each returned dataset's eval metrics as the built-in eval does (`eval/NAME/reward_mean`,
pass@k over the groups, the truncated / aborted / failed ratios) and adds `metrics` (numbers) as
`eval/KEY`; --custom-eval-rollout-log-function-path then sees the samples, as after the built-in eval.

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
import math
from dataclasses import dataclass
from math import comb
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence

from miles.config import EvalConfig, RolloutConfig
from miles.rollout.background import Job, cancel_jobs, start_job
from miles.rollout.generation import number_groups
from miles.runtime.trace import Tracer
from miles.types import Generation, Prompt, Sample, SamplingParams
from miles.user_code import CustomArgsAccess, display_name, import_async_function

EVAL_FUNCTION_FLAG = "--eval-function-path"


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


# ---- --eval-function-path --------------------------------------------------------------------------

@dataclass(frozen=True)
class EvalDatasetInput:
    """One eval dataset as the built-in eval would run it: its prompts, samples per prompt and sampling
    (its --eval-config values, else the eval flags', else the rollout's)."""

    name: str
    prompts: list[Prompt]
    n_samples_per_prompt: int
    sampling_params: SamplingParams


@dataclass
class EvalContext(CustomArgsAccess):
    """What an --eval-function-path function gets as `ctx` (the eval's counterpart of RolloutContext).

    `ctx.datasets[name]` each eval dataset (EvalDatasetInput); `await ctx.generate(ids, params)` one engine
    request; `await ctx.generate_samples(prompts, n, params)` the run's own per-sample generation (one engine
    call, or the custom / multi-turn function, with evaluation=True), unscored; `await ctx.score(samples, n,
    dataset)` fills their rewards with the dataset's reward (its rm_type, else the run's); `ctx.new_sample(prompt,
    group)` a sample to fill; `ctx.my_key` a key of --custom-config-path.
    """

    rollout_id: int
    datasets: dict[str, EvalDatasetInput]
    tokenizer: Any
    rollout: RolloutConfig
    eval: EvalConfig
    generate: Callable[[Sequence[int], SamplingParams], Awaitable[Generation]]
    generate_samples: Callable[[list[Prompt], int, SamplingParams], Awaitable[list[Sample]]]
    score: Callable[..., Awaitable[None]]
    new_sample: Callable[[Prompt, int], Sample]


EvalFunction = Callable[[EvalContext, int], Awaitable[Any]]


class EvalFunctionError(RuntimeError):
    """The eval function returned something an eval row cannot be made of; the message names the flag and the fix."""


def load_eval_function(path: str) -> EvalFunction:
    """--eval-function-path: imported and checked to be `async fn(ctx, rollout_id)` (a ConfigError otherwise)."""
    return import_async_function(path, EVAL_FUNCTION_FLAG, 2,
                                 "async fn(ctx, rollout_id) -> {dataset: groups} or ({dataset: groups}, metrics)")


def check_eval_output(fn: EvalFunction, out: Any) -> tuple[dict[str, list[list[Sample]]], dict[str, float]]:
    """The eval function's result as ({dataset: groups}, metrics), checked; EvalFunctionError otherwise."""
    name = f"{EVAL_FUNCTION_FLAG} {display_name(fn)}"
    expected = ("expected {dataset name: groups}, each group a list of scored Samples (one per prompt), or "
                "({dataset name: groups}, {metric: number})")
    data, metrics = out if isinstance(out, tuple) and len(out) == 2 else (out, {})
    if not isinstance(data, Mapping) or not isinstance(metrics, Mapping):
        raise EvalFunctionError(f"{name} returned {type(out).__name__}; {expected}")
    for dataset, groups in data.items():
        if not isinstance(dataset, str) or not isinstance(groups, (list, tuple)) or not groups or \
                not all(isinstance(g, (list, tuple)) and g for g in groups):
            raise EvalFunctionError(f"{name} returned {dataset!r}: {type(groups).__name__} (empty or not a list "
                                    f"of non-empty groups); {expected}")
        sizes = sorted({len(g) for g in groups})
        if len(sizes) > 1:
            raise EvalFunctionError(f"{name}: dataset {dataset!r} has groups of sizes {sizes}; pass@k needs one "
                                    "size (the samples per prompt)")
        number_groups(groups, lambda index, item, dataset=dataset: EvalFunctionError(
            f"{name}: dataset {dataset!r} group {index} holds a {type(item).__name__}, not a Sample"))
    bad = [k for k, v in metrics.items() if not isinstance(k, str) or isinstance(v, bool)
           or not isinstance(v, (int, float)) or not math.isfinite(v)]
    if bad:
        raise EvalFunctionError(f"{name} returned metric {bad[0]!r} = {metrics[bad[0]]!r}; metrics are finite "
                                "numbers under string names")
    return {k: [list(g) for g in v] for k, v in data.items()}, {k: float(v) for k, v in metrics.items()}


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
