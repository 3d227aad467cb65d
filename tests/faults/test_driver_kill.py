"""`kill -9` of the driver mid-rollout: the run's actors do not outlive it for long, and `--load`
resumes from the last complete checkpoint with the per-step metrics of an uninterrupted run."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.config.flags import parse_flags
from miles.api.launch import train
from miles.runtime import read_trace, with_disposer
from miles.runtime.procs import pid_running
from tests.conftest import base_flags

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
TIME_KEYS = ("time", "_s", "tokens_per_s")


def flags(task, tmp_path, name, **kw):
    return base_flags(task, tmp_path / name, num_rollout=6, save=tmp_path / f"ck-{name}", save_interval=1, **kw)


def train_rows(result):
    return {r["step"]: {k: v for k, v in r.items() if not any(t in k for t in TIME_KEYS)}
            for r in result.metrics if r.get("kind") == "train"}


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
    pids = read_trace(trace_path).of("components_ready")[0].get("pids")
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    # owner-bound actors die with their owner: bounded, not forever
    t0 = time.monotonic()
    while any(pid_running(p) for p in pids.values()):
        assert time.monotonic() - t0 < 30, f"actors outlived the driver by 30 s: {pids}"
        time.sleep(0.2)
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
