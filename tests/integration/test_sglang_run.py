"""Whole runs with --rollout-engine sglang: local Ray, the torch trainer, the tiny model, fake SGLang
servers (tests/fakes, started by the real command line inside the engine actors) and the real
sglang-router. What the servers were asked is read back from their logs (`FAKE_CALL` lines). A server
killed mid-rollout, and one that hangs mid-rollout (found by the health monitor), are replaced."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from miles.api.launch import train
from miles.config.flags import parse_flags
from miles.runtime import load_machine, read_trace, with_disposer
from miles.traceview.check import check_trace
from tests.conftest import base_flags, miles_actors
from tests.fakes import fake_state, sglang_processes

pytest.importorskip("sglang_router")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
# top-level keys sglang-router 0.3 adds to a /generate body it forwards (SGLang ignores those it does not know)
ROUTER_ADDED = {"model", "background", "return_bytes", "return_entropy", "return_text_in_logprobs", "log_metrics",
                "return_hidden_states", "no_logs"}


def run(argv):
    cfg, machine = parse_flags([*argv, "--device", "cpu"])    # engines ask Ray for no GPU, wherever this runs
    return asyncio.run(with_disposer(train, cfg, machine=machine or "sync"))


def server_calls(run_dir: Path) -> dict[str, list[dict]]:
    """engine folder name → the calls its server(s) recorded, in order (a restarted engine has its own)."""
    out = {}
    for log in sorted((run_dir / "sglang").glob("*/server.log")):
        out[log.parent.name] = [json.loads(line[len("FAKE_CALL "):]) for line in log.read_text().splitlines()
                                if line.startswith("FAKE_CALL ")]
    return out


def control(calls: list[dict]) -> list[tuple]:
    """The weight and memory calls, with the field that matters for each."""
    keys = {"/update_weights_from_disk": "weight_version", "/release_memory_occupation": "tags",
            "/resume_memory_occupation": "tags", "/pause_generation": "mode"}
    out = []
    for c in calls:
        if c["endpoint"] in keys:
            value = c["body"].get(keys[c["endpoint"]])
            out.append((c["endpoint"].strip("/"), tuple(value) if isinstance(value, list) else value))
        elif c["endpoint"] in ("/flush_cache", "/continue_generation"):
            out.append((c["endpoint"].strip("/"),))
    return out


def assert_nothing_left(result, model: str) -> None:
    trace = read_trace(result.run_dir)
    fleet = trace.of("engine_fleet_ready")[0]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and sglang_processes(model):
        time.sleep(0.2)
    assert sglang_processes(model) == []                   # servers and their children
    if fleet.get("router_pid"):
        assert not psutil.pid_exists(fleet.get("router_pid"))
    assert miles_actors(trace.of("cluster_ready")[0].get("namespace")) == []
    registered = [e.get("resource") for e in trace.of("registered")]
    disposed = [e.get("resource") for e in trace.of("disposed")]
    assert disposed == list(reversed(registered)) and all(e.get("outcome") == "ok" for e in trace.of("disposed"))


def test_a_sync_run_with_two_engines_behind_the_router(ray_cluster, tiny_task, tmp_path):
    result = run(base_flags(tiny_task, tmp_path / "run", rollout_engine="sglang", rollout_num_engines=2,
                            sglang_router_policy="round_robin", check_weight_update_equal=True,
                            eval_prompt_data=["arith", tiny_task["eval"]], eval_interval=2))
    trace = read_trace(result.run_dir)
    assert trace.events[-1].get("outcome") == "ok"
    assert [e.state for e in trace.of("phase_start")].count("train") == 3
    synced = trace.of("weights_synced")
    assert [e.get("version") for e in synced] == [0, 1, 2, 3] and all(e.get("checksum") for e in synced)
    assert trace.of("engine_fleet_ready")[0].get("router_url").startswith("http://127.0.0.1:")
    registered = [e.get("resource") for e in trace.of("registered")]
    assert registered.index("sglang-fleet") < registered.index("engine-0")       # the router goes after the engines

    calls = server_calls(result.run_dir)
    assert sorted(calls) == ["engine-0", "engine-1"]
    for name, cs in calls.items():
        # every weight sync: pause (requests kept), flush, load from disk with the version, continue
        assert control(cs) == [step for v in "0123" for step in (
            ("pause_generation", "retract"), ("flush_cache",), ("update_weights_from_disk", v),
            ("continue_generation",))], name
        generate = [c for c in cs if c["endpoint"] == "/generate"]
        assert generate and all(c["status"] == 200 for c in generate)           # both servers served
        assert all(set(c["ignored"]) <= ROUTER_ADDED for c in generate)
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["weight_version_min"] for r in train_rows] == [0.0, 1.0, 2.0]      # on-policy, versions from SGLang
    assert_nothing_left(result, tiny_task["model"])


def test_offload_rollout_releases_after_each_rollout_and_resumes_around_the_sync(ray_cluster, tiny_task, tmp_path):
    result = run(base_flags(tiny_task, tmp_path / "run", rollout_engine="sglang", offload_rollout=True,
                            num_rollout=2))
    assert read_trace(result.run_dir).events[-1].get("outcome") == "ok"
    (cs,) = server_calls(result.run_dir).values()
    sync = [("pause_generation", "retract"), ("flush_cache",)]
    every = ("weights", "kv_cache", "cuda_graph")
    assert control(cs) == [
        *sync, ("update_weights_from_disk", "0"), ("continue_generation",),
        ("release_memory_occupation", every),                                    # rollout 0 done: train
        ("resume_memory_occupation", ("weights",)), *sync, ("update_weights_from_disk", "1"), ("continue_generation",),
        ("resume_memory_occupation", ("kv_cache", "cuda_graph")),
        ("release_memory_occupation", every),                                    # rollout 1 done
        ("resume_memory_occupation", ("weights",)), *sync, ("update_weights_from_disk", "2"), ("continue_generation",),
        ("resume_memory_occupation", ("kv_cache", "cuda_graph"))]
    # the fake refuses to generate while memory is released: every request succeeded
    assert all(c["status"] == 200 for c in cs if c["endpoint"] == "/generate")
    assert_nothing_left(result, tiny_task["model"])


def rollout_started(run_dir: Path, rollout_id: int) -> bool:
    trace_file = run_dir / "trace.jsonl"
    lines = trace_file.read_text().splitlines() if trace_file.exists() else []
    return any('"phase_start"' in x and '"rollout"' in x and f'"rollout_id": {rollout_id}' in x for x in lines)


def servers(model: str) -> list[psutil.Process]:
    out = []
    for pid in sglang_processes(model):
        try:
            if "sglang.launch_server" in " ".join(psutil.Process(pid).cmdline()):
                out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


def kill_a_server_during(run_dir: Path, model: str, rollout_id: int, killed: list[int]) -> threading.Thread:
    """Once rollout `rollout_id` has started and requests are in flight, SIGKILL one SGLang server."""
    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            pids = [p.pid for p in servers(model)]
            if rollout_started(run_dir, rollout_id) and pids:
                time.sleep(0.5)
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
                return
            time.sleep(0.1)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_a_server_killed_mid_rollout_is_restarted_and_the_rollout_completes(ray_cluster, tiny_task, tmp_path):
    killed: list[int] = []
    watcher = kill_a_server_during(tmp_path / "run", tiny_task["model"], 1, killed)
    result = run(base_flags(tiny_task, tmp_path / "run", rollout_engine="sglang", rollout_num_engines=2,
                            rollout_max_response_len=16, sglang_fake_token_delay=0.05, sglang_fake_never_stop=True))
    watcher.join(timeout=5)
    trace = read_trace(result.run_dir)
    assert killed and trace.events[-1].get("outcome") == "ok"
    restarts = trace.of("engine_restarted")
    assert len(restarts) == 1 and "ActorDiedError" in trace.of("engine_restart")[0].get("error")["type"]
    assert [e.state for e in trace.of("phase_start")].count("train") == 3      # every rollout completed
    calls = server_calls(result.run_dir)
    restarted = [n for n in calls if "-r" in n]
    assert len(restarted) == 1
    # the new server got the run's weights before it served: the current version, then the later ones
    versions = [v for step, *v in control(calls[restarted[0]]) if step == "update_weights_from_disk"]
    assert versions and versions[0][0] in ("1", "2") and versions[-1][0] == "3"
    assert_nothing_left(result, tiny_task["model"])


def hang_a_server_with_requests(model: str, hung: list[int]) -> threading.Thread:
    """Once a server holds requests (a rollout's: the run has no evals), make it hang as a stuck scheduler
    does: its requests make no more progress and its health checks get no answer (the fake's /fake/hang)."""
    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not hung:
            for server in servers(model):
                cmd = server.cmdline()
                url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
                try:
                    if fake_state(url)["running"]:
                        fake_state(url, {"generate": True, "health": True})
                        hung.append(server.pid)
                except (OSError, psutil.NoSuchProcess):
                    pass                            # not listening yet, or gone
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_a_server_that_hangs_mid_rollout_is_found_by_the_health_probe_and_replaced(ray_cluster, tiny_task, tmp_path):
    hung: list[int] = []
    watcher = hang_a_server_with_requests(tiny_task["model"], hung)
    result = run(base_flags(tiny_task, tmp_path / "run", rollout_engine="sglang", num_rollout=1,
                            rollout_max_response_len=8, sglang_fake_token_delay=0.05, sglang_fake_never_stop=True,
                            rollout_health_check_interval=0.5, rollout_health_check_timeout=2))
    watcher.join(timeout=5)
    trace = read_trace(result.run_dir)
    assert hung and trace.events[-1].get("outcome") == "ok", trace.events[-1].error
    report = check_trace(trace, load_machine("sync"))
    assert report.ok, [v.message for v in report.violations]
    assert trace.of("engine_health_monitor_started") and not trace.of("engine_health_monitor_skipped")
    [unhealthy] = trace.of("engine_unhealthy")
    assert unhealthy.get("engine") == 0
    assert "no answer to a health probe within --rollout-health-check-timeout 2s" in unhealthy.get("reason")
    [killed] = trace.of("engine_killed")
    [restart] = trace.of("engine_restart")
    [restarted] = trace.of("engine_restarted")
    assert killed.cause == unhealthy.seq < killed.seq < restart.seq and restarted.cause == restart.seq
    assert [e.state for e in trace.of("phase_start")].count("train") == 1      # the rollout completed
    calls = server_calls(result.run_dir)
    assert sorted(calls) == ["engine-0", "engine-0-r1"]
    assert any(c["endpoint"] == "/generate" for c in calls["engine-0-r1"])   # the new server served the rollout
    assert_nothing_left(result, tiny_task["model"])
