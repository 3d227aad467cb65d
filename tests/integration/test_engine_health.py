"""A hung engine (its worker process SIGSTOPped by `--inject-fault rollout:hang_engine`) is found,
killed and restarted within the restart budget, and the run finishes: once by the periodic health
probe, once by the timeout on every generate call. Each event is in the trace, the trace conforms
to the machine, and no process of the run is left (the stopped one included)."""

from __future__ import annotations

import asyncio
import time

import pytest

from miles.api.launch import train
from miles.config.flags import parse_flags
from miles.runtime import load_machine, read_trace, with_disposer
from miles.runtime.procs import pid_running
from miles.traceview.check import check_trace
from tests.conftest import base_flags, miles_actors

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HOW = {
    # the probe every 0.5 s finds engine-0 silent for 2 s; calls themselves would wait 10 minutes
    "probe": dict(rollout_health_check_interval=0.5, rollout_health_check_timeout=2, engine_generate_timeout=600),
    # the same with FastEngine (eager on the CPU), whose actor answers the probe on its second thread
    "probe_fast": dict(rollout_health_check_interval=0.5, rollout_health_check_timeout=2, engine_generate_timeout=600,
                       rollout_engine="fast"),
    # no probe; the rollout's generate call gives up after 3 s
    "generate_timeout": dict(rollout_health_check_interval=0, engine_generate_timeout=3),
}


def leftover_processes(trace) -> list[str]:
    pids = {}
    for e in trace.of("components_ready", "engine_restarted"):
        pids.update(e.get("pids") or {})
    deadline = time.monotonic() + 15          # ray.kill is asynchronous
    while True:
        alive = [f"{name} pid {pid}" for name, pid in pids.items() if pid_running(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


# probe_fast is extended (CI budget): the probe's path is [probe]'s; that the fast engine's actor answers it
# beside a running call, tests/unit/test_engine_health.py (its two actor threads) and, on CUDA,
# tests/gpu/test_fast_engine_gpu.py
@pytest.mark.parametrize("how", [h if h != "probe_fast" else pytest.param(h, marks=pytest.mark.extended)
                                 for h in sorted(HOW)])
def test_a_hung_engine_is_found_killed_and_restarted(ray_cluster, tiny_task, tmp_path, how):
    flags = base_flags(tiny_task, tmp_path / "run", num_rollout=3, rollout_batch_size=2, n_samples_per_prompt=2,
                       rollout_max_response_len=3, teardown_timeout=20, inject_fault=["rollout:hang_engine:2"],
                       **HOW[how])
    cfg, _ = parse_flags(flags)
    t0 = time.monotonic()
    result = asyncio.run(with_disposer(train, cfg))
    elapsed = time.monotonic() - t0
    trace = read_trace(result.run_dir)
    assert trace.events[-1].get("outcome") == "ok", trace.events[-1].error
    report = check_trace(trace, load_machine("sync"))
    assert report.ok, [v.message for v in report.violations]
    assert [r["step"] for r in result.metrics if r.get("kind") != "eval"][-1] == 2     # all 3 rollouts trained
    fault = trace.of("fault_injected")[0]
    if how.startswith("probe"):
        [unhealthy] = trace.of("engine_unhealthy")
        assert unhealthy.get("engine") == 0 and "no answer to a health probe" in unhealthy.get("reason")
        [killed] = trace.of("engine_killed")
        assert killed.cause == unhealthy.seq and killed.seq > fault.seq
        assert trace.of("engine_health_monitor_started")
    else:
        [unresponsive] = trace.of("engine_unresponsive")
        assert unresponsive.get("engine") == 0 and "--engine-generate-timeout 3s" in unresponsive.error["message"]
        assert not trace.of("engine_health_monitor_started")
    [restart] = trace.of("engine_restart")
    [restarted] = trace.of("engine_restarted")
    assert restart.get("engine") == 0 and restarted.cause == restart.seq and restart.seq > fault.seq
    assert elapsed < 240
    assert miles_actors(trace.of("cluster_ready")[0].get("namespace")) == []
    assert leftover_processes(trace) == []
