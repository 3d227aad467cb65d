"""The real sglang-router in front of two SGLang engines (fake servers): requests spread over both, a
server killed mid-request is retried on the other, workers are swapped, an engine's abort reaches its
requests on either server, and nothing outlives teardown."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import psutil
import pytest

from miles.rollout.engines.sglang.engine import SGLangEngine, SGLangEngineConfig
from miles.rollout.engines.sglang.router import SGLangRouter
from miles.types import SamplingParams
from tests.fakes import FAKES_DIR, fake_calls, sglang_processes
from tests.tiny_model import make_tiny_model

pytest.importorskip("sglang_router")
pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKES_DIR), os.environ.get("PYTHONPATH", "")]))
    return make_tiny_model(tmp_path / "model")


def test_two_engines_behind_the_router_survive_a_killed_server_and_leave_nothing(model, tmp_path):
    router = SGLangRouter(log_path=tmp_path / "router.log", policy="round_robin")
    cfg = SGLangEngineConfig(startup_timeout_s=30, server_args=("--fake-token-delay", "0.02"))
    engines = [SGLangEngine(model, sglang=cfg, engine_name=f"e{i}", seed=i, router_url=router.url,
                            work_dir=tmp_path / f"e{i}") for i in range(2)]
    router_pid = router.process.pid

    async def main():
        for e in engines:
            await router.add_worker(e.server_url())
        assert sorted(w["url"] for w in await router.workers()) == sorted(e.server_url() for e in engines)
        gens = await engines[0].generate([[5, 6]] * 8, SamplingParams(max_new_tokens=4, seed=7))
        assert len(gens) == 8 and all(len(g.response_ids) == len(g.logprobs) >= 1 for g in gens)
        served = [len(fake_calls(e.server_url(), "/generate")) for e in engines]
        assert sum(served) == 8 and min(served) >= 1          # one engine's call reached both servers

        # kill the second server while the first engine's requests are in flight
        call = asyncio.ensure_future(engines[0].generate([[7]] * 8, SamplingParams(max_new_tokens=40, seed=1)))
        await asyncio.sleep(0.3)
        os.kill(engines[1].server_pid(), signal.SIGKILL)
        gens = await call
        assert len(gens) == 8 and all(g.response_ids for g in gens)

        # the run replaces the dead engine: out of the router, a new server in
        await router.remove_worker(engines[1].server_url())
        await engines[1].dispose()
        engines[1] = SGLangEngine(model, sglang=cfg, engine_name="e1-r1", seed=1, router_url=router.url,
                                  work_dir=tmp_path / "r1")
        await router.add_worker(engines[1].server_url())
        assert len(await router.workers()) == 2
        assert len(await engines[1].generate([[5]] * 4, SamplingParams(max_new_tokens=2))) == 4
        for e in engines:
            await e.dispose()
        await router.dispose()

    asyncio.run(main())
    assert sglang_processes(model) == [] and not psutil.pid_exists(router_pid)


def test_abort_behind_the_router_reaches_the_requests_on_every_server(model, tmp_path):
    router = SGLangRouter(log_path=tmp_path / "router.log", policy="round_robin")
    cfg = SGLangEngineConfig(startup_timeout_s=30, server_args=("--fake-token-delay", "0.05", "--fake-never-stop"))
    engines = [SGLangEngine(model, sglang=cfg, engine_name=f"a{i}", seed=i, router_url=router.url,
                            work_dir=tmp_path / f"a{i}") for i in range(2)]

    async def main():
        try:
            for e in engines:
                await router.add_worker(e.server_url())
            call = asyncio.ensure_future(engines[0].generate([[5]] * 4, SamplingParams(max_new_tokens=10_000)))
            await asyncio.sleep(1.0)
            await engines[0].abort()           # the router does not forward /abort_request: each server is told
            return await asyncio.wait_for(call, 1.5)     # back with their tokens, before the grace would cut them
        finally:
            for e in engines:
                await e.dispose()
            await router.dispose()

    gens = asyncio.run(main())
    assert [g.finish_reason for g in gens] == ["abort"] * 4 and all(g.response_ids for g in gens)
    for e in engines:                          # both servers held some of the requests, and were told to abort them
        held = sorted(c["body"]["rid"] for c in fake_calls_of(tmp_path / e.name) if c["endpoint"] == "/generate")
        told = sorted(c["body"]["rid"] for c in fake_calls_of(tmp_path / e.name) if c["endpoint"] == "/abort_request")
        assert held and set(held) <= set(told), e.name
    assert sglang_processes(model) == []


def fake_calls_of(work_dir) -> list[dict]:
    """The calls a (gone) fake server recorded in its log."""
    return [json.loads(line[len("FAKE_CALL "):]) for line in (work_dir / "server.log").read_text().splitlines()
            if line.startswith("FAKE_CALL ")]
