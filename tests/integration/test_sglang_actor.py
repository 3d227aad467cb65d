"""The SGLang engine as a Ray actor (the way a run makes it): the actor and its server share a fate."""

from __future__ import annotations

import os
import signal
import time

import pytest

from miles.rollout.engines.sglang.engine import EXIT_SERVER_DIED, SGLangEngine, SGLangEngineConfig
from miles.types import SamplingParams
from tests.fakes import FAKES_DIR, sglang_processes
from tests.tiny_model import make_tiny_model

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


def wait_gone(marker: str, timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sglang_processes(marker):
        time.sleep(0.2)
    return sglang_processes(marker)


@pytest.fixture
def actor_factory(ray_cluster, tmp_path):
    import ray

    model = make_tiny_model(tmp_path / "model")
    cfg = SGLangEngineConfig(startup_timeout_s=60,
                             env={"PYTHONPATH": os.pathsep.join([str(FAKES_DIR), os.environ.get("PYTHONPATH", "")])})

    def make(name: str):
        return ray.remote(SGLangEngine).options(name=name, namespace="miles-tests", max_restarts=0).remote(
            model, sglang=cfg, engine_name=name, work_dir=tmp_path / name, exit_with_server=True)

    yield make, model
    assert wait_gone(model) == []


def test_a_dead_server_takes_its_engine_actor_down(actor_factory):
    import ray

    make, model = actor_factory
    actor = make("sg-dies")
    gens = ray.get(actor.generate.remote([[5, 6]], SamplingParams(max_new_tokens=3)))
    assert len(gens) == 1
    os.kill(ray.get(actor.server_pid.remote()), signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError) as info:
        for _ in range(100):          # the watchdog ends the actor within a poll or two
            ray.get(actor.generate.remote([[5]], SamplingParams(max_new_tokens=2)))
            time.sleep(0.1)
    assert str(EXIT_SERVER_DIED) in str(info.value) or "died" in str(info.value).lower()
    assert wait_gone(model) == []     # the server's child went with its group


def test_an_engine_actor_killed_with_minus_nine_takes_its_server_along(actor_factory):
    import ray

    make, model = actor_factory
    actor = make("sg-killed")
    ray.get(actor.server_pid.remote())
    ray.kill(actor, no_restart=True)  # SIGKILL to the worker: no dispose runs
    # PR_SET_PDEATHSIG kills the server; its child is reaped by the raylet's subreaper or outlives it
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any("sglang.launch_server" in " ".join(_cmd(p)) for p in
                                               sglang_processes(model)):
        time.sleep(0.2)
    assert not any("sglang.launch_server" in " ".join(_cmd(p)) for p in sglang_processes(model))
    for pid in sglang_processes(model):      # a child left behind (no subreaper in tests): clean up after us
        os.kill(pid, signal.SIGKILL)


def _cmd(pid: int) -> list[str]:
    import psutil

    try:
        return psutil.Process(pid).cmdline()
    except psutil.NoSuchProcess:
        return []
