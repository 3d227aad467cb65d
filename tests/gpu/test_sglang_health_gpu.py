"""The SGLang engine's health() and abort() against a real SGLang server on a GPU (not the fake of
tests/fakes); skipped without CUDA or without SGLang installed. Written on a CPU machine, not yet run.

What it checks that the fake cannot: how long SGLang's /health_generate takes, idle and under a full
batch (the engine asks it when no request came back lately); that an aborted request comes back with
its tokens and finish reason "abort"; that a stopped scheduler leaves the probe unanswered.
MILES_SGLANG_TEST_MODEL names a model folder to serve (default: the tiny random Qwen2 of
tests/tiny_model.py); the timings are printed (-s) for docs/sglang.md.
"""

from __future__ import annotations

import asyncio
import os
import time

import psutil
import pytest
import torch

from miles.rollout.engines.sglang.engine import ABORT_GRACE_S, SGLangEngine, SGLangEngineConfig
from miles.types import SamplingParams
from tests.fakes import real_sglang_installed
from tests.tiny_model import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not real_sglang_installed(), reason="needs SGLang (pip install sglang)")]
PROMPT = [5, 6, 7]


@pytest.fixture
def engine(tmp_path):
    model = os.environ.get("MILES_SGLANG_TEST_MODEL") or make_tiny_model(tmp_path / "m")
    cfg = SGLangEngineConfig(startup_timeout_s=900, server_args=("--mem-fraction-static", "0.3"))
    e = SGLangEngine(model, device="cuda", sglang=cfg, engine_name="gpu", work_dir=tmp_path / "w")
    yield e
    for p in psutil.Process(e.server_pid()).children(recursive=True):
        p.resume()                         # in case a test stopped it and failed before resuming
    asyncio.run(e.dispose())


async def timed_health(e: SGLangEngine) -> tuple[dict, float]:
    t0 = time.monotonic()
    state = await asyncio.wait_for(e.health(), 30)
    return state, time.monotonic() - t0


def test_health_answers_idle_and_under_a_full_batch_well_within_the_default_timeout(engine):
    async def main():
        idle = await timed_health(engine)
        call = asyncio.ensure_future(engine.generate([PROMPT] * 256, SamplingParams(max_new_tokens=200)))
        busy = []
        while not call.done():
            busy.append(await timed_health(engine))
            await asyncio.sleep(0.2)
        await call
        return idle, busy

    (idle_state, idle_s), busy = asyncio.run(main())
    print(f"\nidle /health_generate: {idle_s:.2f}s; busy probes (state, seconds): {busy}")
    assert idle_state == {"busy": False, "since_progress_s": 0.0} and idle_s < 5
    assert busy and all(s < 5 and state["since_progress_s"] < 2 for state, s in busy)


def test_abort_returns_the_running_requests_with_their_tokens(engine):
    async def main():
        call = asyncio.ensure_future(engine.generate([PROMPT] * 256, SamplingParams(max_new_tokens=200)))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        await engine.abort()
        gens = await call
        return gens, time.monotonic() - t0

    gens, took = asyncio.run(main())
    aborted = [g for g in gens if g.finish_reason == "abort"]
    print(f"\nabort: {len(aborted)} of {len(gens)} aborted, back in {took:.2f}s, "
          f"{sum(bool(g.response_ids) for g in aborted)} with tokens")
    assert took < ABORT_GRACE_S                    # SGLang gave them back: none had to be cut
    assert aborted and any(g.response_ids for g in aborted)
    assert all(len(g.response_ids) == len(g.logprobs) for g in gens)


def test_a_stopped_scheduler_leaves_the_probe_unanswered(engine):
    children = psutil.Process(engine.server_pid()).children(recursive=True)   # scheduler, detokenizer
    for p in children:
        p.suspend()
    try:
        with pytest.raises(TimeoutError):
            asyncio.run(asyncio.wait_for(engine.health(), 10))
    finally:
        for p in children:
            p.resume()
    assert asyncio.run(asyncio.wait_for(engine.health(), 60)) == {"busy": False, "since_progress_s": 0.0}
