"""Custom generation with fake engines: batching of concurrent requests, the concurrency limit, the
per-sample and per-rollout timeouts (leftovers aborted), failures recorded on their sample, engine
failures and timeouts failing the rollout, and loading / signature checks of the user's functions."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from miles.config import AlgorithmConfig, ConfigError, EvalConfig, GenerateConfig, RolloutConfig
from miles.rollout.executor import RolloutExecutor
from miles.rollout.generation import (EngineBatcher, GenerateContext, GenerateFunctionError, check_outcome,
                                      load_generate_function, load_rollout_function, new_sample, run_samples)
from miles.rollout.protocol import EngineUnresponsive
from miles.types import Generation, Prompt, SamplingParams

PROMPTS = [Prompt(index=i, text=str(i), prompt_ids=(i + 1,), label="1") for i in range(8)]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)


class Digits:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i % 10) for i in ids)


class FakeEngine:
    """Answers every prompt with `cap` copies of token 1 (logprob -0.5), after `delay` seconds; `hang`
    makes calls wait until aborted."""

    def __init__(self, delay: float = 0.0, hang: bool = False):
        self.delay, self.hang, self.calls, self.aborts = delay, hang, [], 0
        self._abort = asyncio.Event()

    async def generate(self, prompts, params, caps=None):
        caps = caps or [params.max_new_tokens] * len(prompts)
        self.calls.append((len(prompts), list(caps), params.seed))
        if self.hang:
            await self._abort.wait()
            return [Generation([1], [-0.5], "abort", 0) for _ in prompts]
        await asyncio.sleep(self.delay)
        return [Generation([1] * c, [-0.5] * c, "length", 0) for c in caps]

    async def abort(self):
        self.aborts += 1
        self._abort.set()


async def run(fn, engines, cfg=GenerateConfig(), n=1, prompts=PROMPTS):
    async def call(i, prompts_, params, caps):
        return await engines[i].generate(prompts_, params, caps)

    async def abort(i):
        await engines[i].abort()

    batcher = EngineBatcher(len(engines), call, max_batch=64, abort=abort)
    samples = [new_sample(p, i) for i, p in enumerate(prompts) for _ in range(n)]

    def make_ctx():
        return GenerateContext(batcher, tokenizer=Digits(), rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1), config=cfg,
                               tools=None, evaluation=False)

    return await run_samples(fn, make_ctx, samples, PARAMS, cfg, batcher, num_engines=len(engines),
                             decode=Digits().decode)


async def two_turns(ctx, sample, params):
    """Turn 1 (3 tokens), an untrained 'tool' token, turn 2 (2 tokens): caps differ per turn."""
    prompt = list(sample.prompt.prompt_ids)
    g = await ctx.generate(prompt, replace(params, max_new_tokens=3))
    sample.append(g.response_ids, g.logprobs, trained=True)
    sample.append([9], trained=False)
    g = await ctx.generate(prompt + sample.response_ids, replace(params, max_new_tokens=2))
    sample.append(g.response_ids, g.logprobs, trained=True)
    return sample


def test_concurrent_turns_go_to_the_engine_in_batches():
    engine = FakeEngine()
    out = asyncio.run(run(two_turns, [engine]))
    # all 8 first turns in one call, then all 8 second turns: every running sample was waiting
    assert [(size, caps) for size, caps, _ in engine.calls] == [(8, [3] * 8), (8, [2] * 8)]
    assert engine.calls[0][2] != engine.calls[1][2]          # each call has its own seed
    s = out[0]
    assert s.status == "completed" and s.response_ids == [1, 1, 1, 9, 1, 1] and s.loss_mask == [1, 1, 1, 0, 1, 1]
    assert s.rollout_logprobs == [-0.5, -0.5, -0.5, 0.0, -0.5, -0.5] and s.response_text == "111911"


def test_requests_are_spread_over_idle_engines():
    engines = [FakeEngine(), FakeEngine()]
    asyncio.run(run(two_turns, engines))
    assert [c[0] for c in engines[0].calls] == [4, 4] and [c[0] for c in engines[1].calls] == [4, 4]


def test_concurrency_limit_per_engine():
    in_flight, peak = 0, 0

    async def counted(ctx, sample, params):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await two_turns(ctx, sample, params)
        finally:
            in_flight -= 1

    engine = FakeEngine(delay=0.01)
    out = asyncio.run(run(counted, [engine], GenerateConfig(server_concurrency=3)))
    assert peak == 3 and all(s.status == "completed" for s in out)
    assert max(size for size, _, _ in engine.calls) <= 3


def test_a_sample_past_its_timeout_is_aborted_the_others_finish():
    async def slow_for_prompt_2(ctx, sample, params):
        if sample.prompt.index == 2:
            await asyncio.sleep(30)
        return await two_turns(ctx, sample, params)

    t0 = time.monotonic()
    out = asyncio.run(run(slow_for_prompt_2, [FakeEngine()], GenerateConfig(sample_timeout_s=0.3)))
    assert time.monotonic() - t0 < 5
    assert [s.status for s in out].count("completed") == 7
    assert out[2].status == "aborted" and "--rollout-sample-timeout 0.3s" in out[2].error
    assert not out[2].trainable and out[2].mask() == []


def test_the_rollout_timeout_aborts_the_leftovers_and_the_engines():
    engine = FakeEngine(hang=True)
    t0 = time.monotonic()
    out = asyncio.run(run(two_turns, [engine], GenerateConfig(rollout_timeout_s=0.3)))
    assert time.monotonic() - t0 < 5
    assert engine.aborts == 1
    assert {s.status for s in out} == {"aborted"}
    assert "--rollout-timeout 0.3s" in out[0].error


def test_a_raising_generate_function_fails_its_sample_only():
    async def bad_for_prompt_5(ctx, sample, params):
        if sample.prompt.index == 5:
            raise ValueError("the environment rejected the action")
        return await two_turns(ctx, sample, params)

    out = asyncio.run(run(bad_for_prompt_5, [FakeEngine()]))
    assert out[5].status == "failed" and out[5].error == "ValueError: the environment rejected the action"
    assert [s.status for s in out].count("completed") == 7
    check_outcome(out)                              # some succeeded: the rollout stands


def test_every_sample_failing_fails_the_rollout():
    async def broken(ctx, sample, params):
        raise KeyError("typo")

    out = asyncio.run(run(broken, [FakeEngine()]))
    with pytest.raises(GenerateFunctionError, match="all 8 samples.*KeyError"):
        check_outcome(out)


def test_misaligned_lists_fail_the_sample_and_are_trimmed():
    async def misaligned(ctx, sample, params):
        g = await ctx.generate(list(sample.prompt.prompt_ids), params)
        sample.response_ids += g.response_ids            # logprobs forgotten
        return sample

    out = asyncio.run(run(misaligned, [FakeEngine()], prompts=PROMPTS[:1]))
    assert out[0].status == "failed" and "equally long" in out[0].error
    assert out[0].response_ids == [] and out[0].rollout_logprobs == []


def test_an_engine_call_that_fails_fails_the_rollout():
    class Broken(FakeEngine):
        async def generate(self, prompts, params, caps=None):
            raise EngineUnresponsive("engine-0: no answer", engine=0)

    with pytest.raises(EngineUnresponsive, match="engine-0"):
        asyncio.run(run(two_turns, [Broken()]))


# --- through the executor -------------------------------------------------------------------------

def executor(engines, generate_cfg, **rollout):
    cfg = RolloutConfig(**{"batch_size": 2, "n_samples_per_prompt": 2, "max_response_len": 8,
                           "rm_type": "deterministic_random", **rollout})
    return RolloutExecutor(prompts=PROMPTS, eval_sets={}, rollout=cfg, algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"), eval=EvalConfig(temperature=0.0),
                           shuffle=False, tokenizer=Digits(), engines=engines, seed=0, generate=generate_cfg)


def test_executor_runs_the_custom_function_and_scores_trainable_samples(tmp_path, monkeypatch):
    (tmp_path / "gen.py").write_text(
        "from dataclasses import replace\n"
        "async def generate(ctx, sample, params):\n"
        "    if sample.prompt.index == 1 and sample.group == 1:\n"
        "        raise RuntimeError('tool down')\n"
        "    g = await ctx.generate(list(sample.prompt.prompt_ids), replace(params, max_new_tokens=2))\n"
        "    sample.append(g.response_ids, g.logprobs, trained=True)\n"
        "    sample.append([7], trained=False)\n"
        "    return sample\n")
    monkeypatch.chdir(tmp_path)
    batch = asyncio.run(executor([FakeEngine()], GenerateConfig(custom_generate_function_path="gen.py:generate"))
                        .generate(0))
    statuses = [s.status for s in batch.samples]
    assert statuses == ["completed", "completed", "failed", "failed"]    # prompt 1's group: both its samples
    assert batch.samples[0].loss_mask == [1, 1, 0]
    assert batch.metrics["failed_ratio"] == 0.5
    assert all(s.reward == 0.0 and s.advantage == 0.0 for s in batch.samples[2:])


def test_executor_engine_call_past_its_timeout_names_the_engine():
    engine = FakeEngine(hang=True)
    ex = executor([engine], GenerateConfig(), engine_generate_timeout_s=0.2)
    with pytest.raises(EngineUnresponsive, match="engine-0.*--engine-generate-timeout 0.2s") as info:
        asyncio.run(ex.generate(0))
    assert info.value.engine == 0


def test_rollout_function_replaces_the_rollout(tmp_path, monkeypatch):
    (tmp_path / "roll.py").write_text(
        "async def rollout(ctx, rollout_id):\n"
        "    samples = await ctx.generate_samples(ctx.prompts, ctx.n_samples_per_prompt)\n"
        "    await ctx.score(samples)\n"
        "    n = ctx.n_samples_per_prompt\n"
        "    return [samples[i:i + n] for i in range(0, len(samples), n)]\n")
    monkeypatch.chdir(tmp_path)
    batch = asyncio.run(executor([FakeEngine()], GenerateConfig(rollout_function_path="roll.py:rollout")).generate(0))
    assert [s.prompt.index for s in batch.samples] == [0, 0, 1, 1] and [s.group for s in batch.samples] == [0, 0, 1, 1]
    assert all(s.response_ids == [1] * 8 for s in batch.samples)


def test_rollout_function_returning_the_wrong_shape_is_named(tmp_path, monkeypatch):
    (tmp_path / "roll.py").write_text("async def rollout(ctx, rollout_id):\n    return [[]]\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(GenerateFunctionError, match="roll.py:rollout returned 1 groups of sizes \\[0\\]"):
        asyncio.run(executor([FakeEngine()], GenerateConfig(rollout_function_path="roll.py:rollout")).generate(0))


# --- loading ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("source, match", [
    ("def generate(ctx, sample, params):\n    return sample\n", "not an async function"),
    ("async def generate(ctx, sample):\n    return sample\n", r"generate\(ctx, sample\) cannot be called as async"),
    ("x = 1\n", "has no 'generate'"),
])
def test_bad_generate_functions_are_refused_naming_the_path(tmp_path, monkeypatch, source, match):
    (tmp_path / "gen.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"--custom-generate-function-path.*gen.py.*{match}"):
        load_generate_function("gen.py:generate")


def test_rollout_function_signature_is_checked(tmp_path, monkeypatch):
    (tmp_path / "roll.py").write_text("async def rollout(ctx):\n    return []\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="--rollout-function-path roll.py:rollout"):
        load_rollout_function("roll.py:rollout")
