"""`kill -9` of the driver mid-rollout: nothing the run started outlives it for long (and, before the
kill, nothing of its local cluster listened beyond loopback), its Ray session folder is removed with
the logs kept, and `--load` resumes from the last complete checkpoint with the per-step prompts and metrics of an
uninterrupted run."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from miles.config.flags import parse_flags
from miles.api.launch import train
from miles.runtime import read_trace, with_disposer
from miles.runtime.procs import pid_running
from miles.metrics.jsonl import untimed
from tests.conftest import base_flags
from tests.faults.test_fault_matrix import trained_steps

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
LINGER_BOUND_S = 10      # was ~62 s (Ray's agents) before the reaper


def exposed_sockets(pids: list[int]) -> list[str]:
    """Sockets of these processes listening (TCP) or bound (UDP) on an address other than loopback."""
    out = []
    for c in psutil.net_connections(kind="inet"):
        listening = c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr)
        if c.pid in pids and listening and not ipaddress.ip_address(c.laddr.ip.removeprefix("::ffff:")).is_loopback:
            out.append(f"{psutil.Process(c.pid).name()} pid {c.pid} on {c.laddr.ip}:{c.laddr.port}")
    return out


def flags(task, tmp_path, name, **kw):
    return base_flags(task, tmp_path / name, num_rollout=6, save=tmp_path / f"ck-{name}", save_interval=1, **kw)


def train_rows(result):
    return {r["step"]: untimed(r) for r in result.metrics if r.get("kind") == "train"}


def test_kill_9_mid_rollout_then_resume_matches_uninterrupted(ray_cluster, tiny_task, tmp_path):
    # the driver runs its own local cluster, as a user's would, and hangs at the start of rollout 3
    argv = [sys.executable, str(ROOT / "scripts/train.py"), *flags(tiny_task, tmp_path, "killed"),
            "--inject-fault", "rollout:hang:4", "--save", str(tmp_path / "ck")]
    driver = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    trace_path = tmp_path / "killed" / "trace.jsonl"
    deadline = time.monotonic() + 240
    while '"fault_injected"' not in (trace_path.read_text() if trace_path.exists() else ""):
        assert time.monotonic() < deadline and driver.poll() is None, "the driver never reached rollout 3"
        time.sleep(0.1)
    early = read_trace(trace_path)
    pids = early.of("components_ready")[0].get("pids")
    session = Path(early.of("cluster_ready")[0].get("session_dir"))
    spawned = psutil.Process(driver.pid).children(recursive=True)
    assert exposed_sockets([driver.pid, *(p.pid for p in spawned)]) == []   # the cluster listens on loopback only
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    # owner-bound actors die with their owner; the reaper ends Ray's agents (~60 s on their own)
    t0 = time.monotonic()
    while alive := [p.name() for p in spawned if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() - t0 < LINGER_BOUND_S, f"outlived the driver by {LINGER_BOUND_S} s: {alive}"
        time.sleep(0.2)
    assert not any(pid_running(p) for p in pids.values())
    while session.exists():                               # the reaper keeps the logs and deletes the folder
        assert time.monotonic() - t0 < LINGER_BOUND_S + 5, f"{session} was left behind"
        time.sleep(0.2)
    assert (tmp_path / "killed" / "logs" / "ray" / "raylet.out").is_file()
    trace = read_trace(trace_path)
    assert trace.events[-1].event != "run_end"           # cut short, as the tools report it

    def run(argv):
        cfg, _ = parse_flags(argv)
        return asyncio.run(with_disposer(train, cfg))

    resumed = run(flags(tiny_task, tmp_path, "resumed", load=tmp_path / "ck"))
    assert read_trace(resumed.run_dir).of("resumed")[0].rollout_id == 2
    full = run(flags(tiny_task, tmp_path, "full"))
    got, want = train_rows(resumed), train_rows(full)
    assert sorted(got) == [3, 4, 5]
    assert all(got[s] == want[s] for s in got)
    # each prompt trained exactly as often as in the uninterrupted run: the killed run's steps 0-2 (which
    # checkpoint 2 holds) and the resumed run's 3-5 are the full run's, prompt for prompt
    full_steps = trained_steps(full.run_dir)
    trained = {**{s: v for s, v in trained_steps(tmp_path / "killed").items() if s <= 2},
               **trained_steps(resumed.run_dir)}
    assert {s: p for s, (p, _) in trained.items()} == {s: p for s, (p, _) in full_steps.items()}
    assert all(len(p) == 4 for p, _ in full_steps.values())
