"""Custom generation: a generate function per sample (the user's, or multi-turn with tools), run on
the run's engines by the rollout executor.

A generate function is `async fn(ctx, sample, sampling_params) -> Sample`. It gets a fresh sample
(the prompt, `metadata` copied from the prompt's, an empty response) and returns it finished: it may
call `await ctx.generate(token_ids, params)` as often as it likes (token ids in; ids, logprobs and
finish reason out, never text), append the model's tokens and any tool / environment tokens with
`sample.append(...)`, and set `status`, `metadata` and `response_text` (decoded from the ids when left
empty). The framework keeps, around every call of it:

- concurrency: at most `--sglang-server-concurrency` samples per engine in flight;
- batching: requests that are pending together go to an engine in one call (`EngineBatcher`), each
  with its own max_new_tokens, so many small turns still make large batches;
- timeouts: a sample past `--rollout-sample-timeout` is aborted; when `--rollout-timeout` passes, the
  unfinished samples are aborted, queued requests dropped and engines told to stop (`abort`);
- failures: a function (or a tool inside it) that raises fails its sample, with the error recorded
  (`Sample.error`); it does not fail the rollout, unless every sample failed. An engine call that
  fails or hangs (`--engine-generate-timeout`) fails the whole rollout, so that the run restarts
  the engine and retries it.

`--rollout-function-path` replaces the whole rollout instead: `async fn(ctx, rollout_id)` returns
the rollout's groups of scored samples; `RolloutContext` gives it the prompts, the engines and the
run's per-sample generation and rewards.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

from miles.config import ConfigError, GenerateConfig, RolloutConfig
from miles.config.user_functions import signature
from miles.types import Generation, Prompt, Sample, SamplingParams
from miles.user_code import CustomArgsAccess, import_async_function

if TYPE_CHECKING:
    from miles.rollout.tools import ToolKit

# (engine index, prompts, params, per-prompt max new tokens) -> one Generation per prompt
EngineCall = Callable[[int, list[list[int]], SamplingParams, list[int]], Awaitable[list[Generation]]]
GenerateFn = Callable[["GenerateContext", Sample, SamplingParams], Awaitable[Sample]]

# a queued request waits at most this long for batch mates while other samples are still busy
# (running a tool, say); when every running sample is waiting on the engines it goes at once
LINGER_S = 0.02
CALL_SEED_STEP = 7_919          # each engine call of a rollout gets its own seed (a prime apart)
SEED_RANGE = 2**31


class GenerateFunctionError(RuntimeError):
    """Every sample of a rollout failed: the generate function (not a tool) is likely broken."""


@dataclass
class _Request:
    ids: list[int]
    params: SamplingParams
    future: asyncio.Future


class EngineBatcher:
    """Turns concurrent `ctx.generate` requests into batched engine calls, one call per engine at a
    time. An engine call that raises sets `fatal` (and `fatal_event`): the rollout stops and the
    error reaches the phase, which restarts the engine."""

    def __init__(self, num_engines: int, call: EngineCall, *, max_batch: int,
                 abort: Callable[[int], Awaitable[None]] | None = None):
        self._num_engines, self._call, self._abort, self._max_batch = num_engines, call, abort, max_batch
        self._queue: list[_Request] = []
        self._busy: dict[int, int] = {}       # engine -> requests in its call
        self._running = 0                     # samples running (not waiting for the semaphore)
        self._calls = 0
        self._timer: asyncio.TimerHandle | None = None
        self._flush_soon = False
        self._tasks: set[asyncio.Task] = set()
        self.fatal: BaseException | None = None
        self.fatal_event = asyncio.Event()

    def sample_started(self) -> None:
        self._running += 1

    def sample_finished(self) -> None:
        self._running -= 1
        self._schedule_flush()

    async def request(self, ids: list[int], params: SamplingParams) -> Generation:
        if self.fatal is not None:
            raise self.fatal
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Request(list(ids), params, future))
        self._schedule_flush()
        return await future

    def _schedule_flush(self) -> None:
        # after the tasks that are ready now have run: samples started together request together
        if not self._flush_soon:
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush_now)

    def _flush_now(self) -> None:
        self._flush_soon = False
        self._maybe_flush()

    def _maybe_flush(self, force: bool = False) -> None:
        self._queue = [r for r in self._queue if not r.future.done()]     # cancelled by their sample
        idle = [i for i in range(self._num_engines) if i not in self._busy]
        if not self._queue or not idle or self.fatal is not None:
            return
        waiting = len(self._queue) + sum(self._busy.values())
        if not force and waiting < self._running:       # someone is still busy: give them a moment
            if self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(LINGER_S, self._linger_over)
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch = self._take_batch(len(idle))
        chunks = _split(batch, len(idle))
        for engine, chunk in zip(idle, chunks):
            self._busy[engine] = len(chunk)
            task = asyncio.ensure_future(self._run_call(engine, chunk))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _linger_over(self) -> None:
        self._timer = None
        self._maybe_flush(force=True)

    def _take_batch(self, engines: int) -> list[_Request]:
        """The oldest request and every queued one with the same sampling settings (max_new_tokens
        apart), up to max_batch per idle engine."""
        key = _batch_key(self._queue[0].params)
        batch = [r for r in self._queue if _batch_key(r.params) == key][:self._max_batch * engines]
        taken = {id(r) for r in batch}
        self._queue = [r for r in self._queue if id(r) not in taken]
        return batch

    async def _run_call(self, engine: int, chunk: list[_Request]) -> None:
        params = chunk[0].params
        seed = None if params.seed is None else (params.seed + self._calls * CALL_SEED_STEP) % SEED_RANGE
        self._calls += 1
        caps = [r.params.max_new_tokens for r in chunk]
        call_params = replace(params, max_new_tokens=max(caps), seed=seed)
        try:
            generations = await self._call(engine, [r.ids for r in chunk], call_params, caps)
        except Exception as exc:        # an engine failure: the rollout stops, the phase restarts the engine
            self._fail(exc)
            for r in chunk:
                if not r.future.done():
                    r.future.set_exception(exc)
            return
        finally:
            self._busy.pop(engine, None)
        for r, g in zip(chunk, generations):
            if not r.future.done():
                r.future.set_result(g)
        self._schedule_flush()

    def _fail(self, exc: BaseException) -> None:
        if self.fatal is None:
            self.fatal = exc
            self.fatal_event.set()

    async def abort(self) -> None:
        """Drop the queued requests and tell the busy engines to stop (the rollout's leftovers)."""
        for r in self._queue:
            r.future.cancel()
        self._queue.clear()
        if self._abort is not None:
            await asyncio.gather(*(self._abort(i) for i in list(self._busy)), return_exceptions=True)

    async def close(self) -> None:
        """Wait for the engine calls still running (after an abort they return at their next step)."""
        if self._timer is not None:
            self._timer.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _batch_key(params: SamplingParams) -> SamplingParams:
    return replace(params, max_new_tokens=1, seed=None)


def _split(batch: list[Any], parts: int) -> list[list[Any]]:
    size = -(-len(batch) // parts)
    return [c for c in (batch[i * size:(i + 1) * size] for i in range(parts)) if c]


# ---- one sample -------------------------------------------------------------------------------------

class GenerateContext(CustomArgsAccess):
    """What a generate function gets as `ctx`, one per sample.

    `await ctx.generate(token_ids, params)` is one engine request (token ids in, a `Generation` out:
    ids, per-token logprobs, finish reason, weight version); `ctx.tokenizer` is the run's (for the
    chat template and decoding); `ctx.rollout` and `ctx.config` are the run's rollout and generation
    settings; `ctx.tools` the multi-turn tool kit (None without a tool executor); `ctx.evaluation`
    says whether the sample is for an eval; `ctx.my_key` a key of --custom-config-path.
    """

    def __init__(self, batcher: EngineBatcher, *, tokenizer: Any, rollout: RolloutConfig, config: GenerateConfig,
                 tools: ToolKit | None, evaluation: bool):
        self._batcher = batcher
        self.tokenizer, self.rollout, self.config, self.tools, self.evaluation = \
            tokenizer, rollout, config, tools, evaluation
        self.engine_calls = 0
        self.weight_version: int | None = None      # the oldest weights that answered this sample

    async def generate(self, token_ids: Sequence[int], params: SamplingParams) -> Generation:
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        g = await self._batcher.request(list(token_ids), params)
        self.engine_calls += 1
        self.weight_version = g.weight_version if self.weight_version is None else \
            min(self.weight_version, g.weight_version)
        return g


def new_sample(prompt: Prompt, group: int) -> Sample:
    """A sample to generate into: the prompt, its metadata (copied), an empty response."""
    return Sample(prompt=prompt, group=group, response_ids=[], rollout_logprobs=[], finish_reason="stop",
                  weight_version=0, metadata=dict(prompt.metadata))


async def run_one(fn: GenerateFn, ctx: GenerateContext, sample: Sample, params: SamplingParams,
                  timeout_s: float | None, decode: Callable[[list[int]], str]) -> Sample:
    """`fn(ctx, sample, params)` with its failure or timeout recorded on the sample."""
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            result = await fn(ctx, sample, params)
    except TimeoutError as exc:
        if not deadline.expired():          # a TimeoutError of the function's own
            return settle(sample, "failed", f"TimeoutError: {exc}", decode)
        return settle(sample, "aborted", f"took longer than --rollout-sample-timeout {timeout_s:g}s", decode)
    except Exception as exc:  # noqa: BLE001 - the user's function (or a tool in it) failed: its sample fails
        return settle(sample, "failed", f"{type(exc).__name__}: {exc}", decode)
    if not isinstance(result, Sample):
        return settle(sample, "failed", f"the generate function returned {type(result).__name__}, not the "
                                        "finished Sample", decode)
    if ctx.weight_version is not None:
        result.weight_version = ctx.weight_version
    problem = _inconsistency(result)
    if problem:
        return settle(result, "failed", problem, decode)
    if not result.response_text:
        result.response_text = decode(result.response_ids)
    return result


def _inconsistency(s: Sample) -> str | None:
    n, lp, mask = len(s.response_ids), len(s.rollout_logprobs), s.loss_mask
    if lp != n or (mask is not None and len(mask) != n):
        return (f"the generate function returned {n} response ids, {lp} rollout logprobs and a loss mask of "
                f"{n if mask is None else len(mask)}; they must be equally long (use Sample.append)")
    if s.rollout_routed_experts is not None and len(s.rollout_routed_experts) != n:
        return (f"the generate function returned {n} response ids and the routing of {len(s.rollout_routed_experts)}; "
                "they must be equally long (use Sample.append with the Generation's routed_experts)")
    return None


def settle(sample: Sample, status: str, error: str, decode: Callable[[list[int]], str]) -> Sample:
    """Mark a sample aborted or failed, keeping the consistent part of what it generated."""
    n = min(len(sample.response_ids), len(sample.rollout_logprobs),
            len(sample.loss_mask) if sample.loss_mask is not None else len(sample.response_ids))
    del sample.response_ids[n:], sample.rollout_logprobs[n:]
    if sample.loss_mask is not None:
        del sample.loss_mask[n:]
    if sample.rollout_routed_experts is not None:
        sample.rollout_routed_experts = sample.rollout_routed_experts[:n]      # an array has no `del`
    sample.status, sample.error = status, error  # type: ignore[assignment]
    sample.response_text = sample.response_text or decode(sample.response_ids)
    return sample


async def run_samples(fn: GenerateFn, make_ctx: Callable[[], GenerateContext], samples: list[Sample],
                      params: SamplingParams, cfg: GenerateConfig, batcher: EngineBatcher, *, num_engines: int,
                      decode: Callable[[list[int]], str]) -> list[Sample]:
    """Run `fn` on every sample within the concurrency limit and the timeouts; return the finished
    samples in order. An engine failure cancels everything and is raised."""
    limit = asyncio.Semaphore(cfg.server_concurrency * num_engines)
    out: list[Sample | None] = [None] * len(samples)

    async def one(i: int) -> None:
        async with limit:
            batcher.sample_started()
            try:
                out[i] = await run_one(fn, make_ctx(), samples[i], params, cfg.sample_timeout_s, decode)
            finally:
                batcher.sample_finished()

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(samples))]
    try:
        await _wait(tasks, batcher, cfg.rollout_timeout_s)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await batcher.close()
    if batcher.fatal is not None:
        raise batcher.fatal
    why = f"unfinished when --rollout-timeout {cfg.rollout_timeout_s}s passed"
    return [s if s is not None else settle(samples[i], "aborted", why, decode) for i, s in enumerate(out)]


async def _wait(tasks: list[asyncio.Future], batcher: EngineBatcher, timeout_s: float | None) -> None:
    everything = asyncio.gather(*tasks)
    fatal = asyncio.ensure_future(batcher.fatal_event.wait())
    try:
        done, _ = await asyncio.wait({everything, fatal}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        fatal.cancel()
    if everything not in done and batcher.fatal is None:      # the rollout's deadline: abort the leftovers
        await batcher.abort()
    if everything.done():
        everything.result()
    else:
        everything.cancel()


def check_outcome(samples: list[Sample]) -> None:
    """Raise when every sample failed: the generate function itself is broken, not a tool."""
    failed = [s for s in samples if s.status == "failed"]
    if samples and len(failed) == len(samples):
        raise GenerateFunctionError(f"all {len(samples)} samples of the rollout failed; the first error: "
                                    f"{failed[0].error}")


# ---- loading the user's functions --------------------------------------------------------------------

def load_generate_function(path: str) -> GenerateFn:
    """--custom-generate-function-path: imported and checked to be `async fn(ctx, sample, sampling_params)`."""
    flag = "--custom-generate-function-path"
    return import_async_function(path, flag, 3, signature(flag))


def load_rollout_function(path: str) -> Callable[..., Awaitable[list[list[Sample]]]]:
    """--rollout-function-path: imported and checked to be `async fn(ctx, rollout_id)`."""
    flag = "--rollout-function-path"
    return import_async_function(path, flag, 2, signature(flag))


# ---- a whole rollout -------------------------------------------------------------------------------

@dataclass
class RolloutContext(CustomArgsAccess):
    """What a --rollout-function-path function gets as `ctx`: the rollout's prompts (drawn by the
    framework, so the data position is checkpointed) and the means to answer and score them.

    `await ctx.generate(ids, params)` is one engine request; `ctx.new_sample(prompt, group)` a sample
    to fill; `await ctx.generate_samples(prompts, n)` runs the run's own per-sample generation (one
    engine call, or the custom / multi-turn function) and returns the samples unscored;
    `await ctx.score(samples)` fills their rewards with the run's reward (groups of
    `n_samples_per_prompt`, in order). The function returns `len(prompts)` groups of
    `n_samples_per_prompt` scored samples. `ctx.my_key` reads a key of --custom-config-path.
    """

    rollout_id: int
    prompts: list[Prompt]
    n_samples_per_prompt: int
    sampling_params: SamplingParams
    tokenizer: Any
    rollout: RolloutConfig
    generate: Callable[[Sequence[int], SamplingParams], Awaitable[Generation]]
    generate_samples: Callable[[list[Prompt], int], Awaitable[list[Sample]]]
    score: Callable[[list[Sample]], Awaitable[None]]
    new_sample: Callable[[Prompt, int], Sample] = field(default=new_sample)


def check_groups(groups: Any, prompts: list[Prompt], n: int, path: str) -> list[Sample]:
    """The rollout function's groups, flattened and numbered; ConfigError-style message otherwise."""
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in groups):
        raise GenerateFunctionError(f"--rollout-function-path {path} returned {type(groups).__name__}; expected a "
                                    "list of groups, each a list of Samples")
    sizes = [len(g) for g in groups]
    if len(groups) != len(prompts) or any(size != n for size in sizes):
        raise GenerateFunctionError(f"--rollout-function-path {path} returned {len(groups)} groups of sizes "
                                    f"{sizes}; expected {len(prompts)} groups (--rollout-batch-size) of {n} "
                                    "(--n-samples-per-prompt)")
    return number_groups(groups, lambda index, item: GenerateFunctionError(
        f"--rollout-function-path {path}: group {index} holds a {type(item).__name__}, not a Sample"))


def number_groups(groups: Sequence[Sequence[Any]], not_a_sample: Callable[[int, Any], Exception]) -> list[Sample]:
    """A custom function's groups, flattened, each Sample's `group` set to its group's index; an item
    that is not a Sample raises `not_a_sample(group index, item)`."""
    flat = []
    for index, group in enumerate(groups):
        for s in group:
            if not isinstance(s, Sample):
                raise not_a_sample(index, s)
            s.group = index
            flat.append(s)
    return flat
