"""A whole run (the CLI, its own local cluster) with its run dir on a real 112 KiB tmpfs: the trace and
metrics fit, Ray's logs do not. The run trained everything, so it exits 0 and says, in one warning line
and a `lost` trace event, that Ray's logs were lost (naming where, why and the space left); the Ray
session folder and its private temp folder are gone. Mounting needs root: skipped with the reason
elsewhere; tests/unit/test_run_dir_disk_full.py covers the same logic with an injected ENOSPC."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.runtime import load_machine, read_trace
from miles.traceview.check import check_trace
from miles.metrics.jsonl import read_metrics
from tests.conftest import base_flags, small_tmpfs

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.extended]   # a whole run more: out of CI's budget
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_disk(tmp_path):
    """A 112 KiB tmpfs: this run writes ~56 KiB of its own and Ray ~170 KiB of logs, so the logs cannot fit
    whatever the load (at 200 KiB they sometimes did, and the test failed)."""
    with small_tmpfs(tmp_path / "disk", "112k", "tests/unit/test_run_dir_disk_full.py") as mnt:
        yield mnt


def test_a_finished_run_whose_disk_had_no_room_for_rays_logs_exits_0_saying_so(tiny_task, small_disk):
    run_dir = small_disk / "run"
    argv = [sys.executable, str(ROOT / "scripts/train.py"),
            *base_flags(tiny_task, run_dir, num_rollout=2, rollout_batch_size=2, n_samples_per_prompt=2)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning = [line for line in proc.stderr.splitlines() if line.startswith("  warning: lost Ray's logs")]
    assert len(warning) == 1, proc.stderr[-3000:]
    assert f"({run_dir / 'logs' / 'ray'}): No space left on device" in warning[0] and " free there" in warning[0]

    trace = read_trace(run_dir)
    assert not trace.truncated and trace.bad_lines == [] and check_trace(trace, load_machine("sync")).ok
    assert trace.events[-1].event == "run_end" and trace.events[-1].get("outcome") == "ok"
    lost = trace.of("lost")
    assert [e.get("what") for e in lost] == ["Ray's logs"] and lost[0].get("free_bytes") >= 0
    assert [r["step"] for r in read_metrics(run_dir) if r.get("kind") == "train"] == [0, 1]
    assert not (run_dir / "logs" / "ray").exists()                     # not half of them
    session = Path(trace.of("cluster_ready")[0].get("session_dir"))
    assert not session.exists() and not session.parent.parent.exists()  # the session and its private folder
