"""Embedding: two runs in one host process; one stopped mid-rollout, one run to its end."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

import miles
from miles.runtime import read_trace
from miles.user_code import import_user_function
from tests.conftest import base_flags, miles_actors

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


def train_rows(run_dir: Path) -> list[dict]:
    from miles.metrics.jsonl import read_metrics, untimed
    return [untimed(r) for r in read_metrics(run_dir) if r.get("kind") == "train"]


@pytest.mark.extended   # out of the default test run (CI budget); bash scripts/test.sh -m extended
def test_the_host_example_stops_one_run_and_finishes_the_other(tiny_task, tmp_path, ray_cluster):
    out = tmp_path / "embed"
    proc = subprocess.run([sys.executable, str(ROOT / "examples/embed/host.py"), "--model", tiny_task["model"],
                           "--data", tiny_task["train"], "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "host signal handlers untouched: True" in proc.stdout
    stopped, finished = read_trace(out / "stopped"), read_trace(out / "finished")
    assert stopped.events[-1].state == "shutdown" and stopped.events[-1].get("outcome") == "stopped"
    assert [(t.src, t.dst) for t in stopped.of("transition") if t.trigger == "stop"][0][1] == "draining"
    assert finished.events[-1].get("outcome") == "ok"
    for trace in (stopped, finished):
        registered = [e.get("position") for e in trace.of("registered")]
        assert [e.get("position") for e in trace.of("disposed")] == sorted(registered, reverse=True)
    # the finished run's results equal a solo run's with the same config (the example's, seed 2)
    config = import_user_function(f"{ROOT / 'examples/embed/host.py'}:config", "examples/embed/host.py")
    solo_dir = tmp_path / "solo"
    cfg = config(tiny_task["model"], tiny_task["train"], solo_dir, seed=2, num_rollout=3)
    result = miles.run_sync(cfg)
    assert result.outcome == "ok"
    assert train_rows(solo_dir) == train_rows(out / "finished")
    assert miles_actors() == []


def test_cancelling_the_waiting_task_tears_the_run_down_and_reraises(tiny_task, tmp_path, ray_cluster):
    cfg = miles.config_from_flags(base_flags(tiny_task, tmp_path / "run", num_rollout=100))
    seen: list[str] = []

    async def host():
        run = miles.Run(cfg)
        await run.start()
        run.on_state("train", seen.append)
        waiter = asyncio.create_task(run.wait())
        while "train" not in seen:
            await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return run

    run = asyncio.run(host())
    trace = read_trace(run.run_dir)
    assert trace.events[-1].state == "shutdown" and trace.events[-1].get("outcome") == "cancelled"
    assert miles_actors() == []


def test_request_save_saves_without_a_sentinel_file(tiny_task, tmp_path, ray_cluster):
    cfg = miles.config_from_flags(base_flags(tiny_task, tmp_path / "run", num_rollout=3, save=tmp_path / "ck"))

    async def host():
        async with miles.Run(cfg) as run:
            run.on_state("rollout", lambda s: run.request_save())
            async for _ in run.events():
                pass
        return run.result

    result = asyncio.run(host())
    saves = read_trace(result.run_dir).of("checkpoint_saved")
    assert [e.rollout_id for e in saves] == [0, 1, 2]
