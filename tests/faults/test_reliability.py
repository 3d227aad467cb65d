"""Issue 20's faults, on real parts (the session's Ray cluster, the tiny model): corrupted checkpoints
are skipped on --load, a corrupted engine fails the run naming it, a hung reward fails its sample,
not the run, and a local cluster without token authentication is refused before it starts."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.api.launch import train
from miles.config.flags import parse_flags
from miles.runtime import read_trace, with_disposer
from tests.conftest import base_flags
from tests.faults.test_fault_matrix import assert_clean_end

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def run(flags: list[str], machine: str = "sync") -> BaseException | None:
    cfg, _ = parse_flags(flags)
    try:
        asyncio.run(with_disposer(train, cfg, machine=machine))
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


def small(task, tmp_path, name, **kw) -> list[str]:
    return base_flags(task, tmp_path / name, **{"rollout_batch_size": 2, "n_samples_per_prompt": 2,
                                                "rollout_max_response_len": 3, **kw})


def flip_byte(path: Path, offset: int) -> None:
    """A same-size corruption: one bit of one byte (offset < 0 counts from the end)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_corrupted_newest_checkpoints_are_skipped_and_the_previous_one_loads(ray_cluster, tiny_task, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert run(small(tiny_task, tmp_path, "first", num_rollout=3, save=ckpt, save_interval=1, no_save_hf=True)) is None
    # iter 2: a flip inside the safetensors header (its JSON starts at byte 8); iter 1: in the weights
    flip_byte(ckpt / "iter_0000002" / "trainer" / "model.safetensors", 20)
    flip_byte(ckpt / "iter_0000001" / "trainer" / "model.safetensors", -5)
    assert run(small(tiny_task, tmp_path, "resumed", num_rollout=2, load=ckpt)) is None
    trace = read_trace(tmp_path / "resumed")
    skipped = trace.of("checkpoint_skipped")
    assert [e.rollout_id for e in skipped] == [2, 1]
    for e in skipped:
        assert e.get("check") == "sha256"
        assert e.get("problems") == [f"{ckpt / f'iter_000000{e.rollout_id}' / 'trainer' / 'model.safetensors'} "
                                     "does not match its sha256 in the manifest"]
    resumed = trace.of("resumed")[0]
    assert resumed.rollout_id == 0 and resumed.get("verified") is True
    assert [e.rollout_id for e in trace.of("rollout_done")] == [1]


def test_an_engine_corrupted_after_a_sync_fails_the_run_naming_it(ray_cluster, tiny_task, tmp_path):
    flags = small(tiny_task, tmp_path, "run", num_rollout=2, rollout_num_engines=2, check_weight_update_equal=True,
                  inject_fault=["weight_sync:corrupt_weights"])
    raised = run(flags)
    assert type(raised).__name__ == "WeightSyncMismatch", raised
    assert "engine-0 holds weights with checksum" in str(raised) and "engine-1" not in str(raised)
    trace = assert_clean_end(tmp_path / "run", outcome="failed", error_type="WeightSyncMismatch",
                             ckpt=tmp_path / "none")
    synced = trace.of("weights_synced")
    assert [e.get("version") for e in synced] == [0]          # the second sync found it before pushing
    err = trace.of("error")[0]
    assert err.state == "weight_sync" and "before the next update to v0" in err.error["message"]


def test_a_reward_past_its_timeout_fails_its_sample_not_the_run(ray_cluster, tiny_task, tmp_path):
    rm = tmp_path / "stuck_rm.py"
    rm.write_text("import threading\n"
                  "def stuck(prompt, response, label):\n"
                  "    if prompt.index == 3:\n"
                  "        threading.Event().wait()      # never returns\n"
                  "    return 1.0\n")
    flags = small(tiny_task, tmp_path, "run", num_rollout=1, rollout_batch_size=4, no_rollout_shuffle=True,
                  custom_rm_path=f"{rm}:stuck", reward_timeout=1)
    assert run(flags) is None
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if r.get("kind") == "train")
    assert row["reward_timeouts"] == 2.0                       # prompt 3's two samples
    assert row["reward_mean"] == pytest.approx(6 / 8)          # they scored 0, the other six 1


def test_a_local_cluster_without_authentication_is_refused_before_it_starts(tiny_task, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(tmp_path / "ray")}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/train.py"), *small(tiny_task, tmp_path, "run",
                                                                                  num_rollout=1)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "RAY_AUTH_MODE=disabled turns Ray's token authentication off" in proc.stderr
    assert "--ray-allow-no-auth" in proc.stderr
    assert not (tmp_path / "ray").exists()                     # no Ray process started, no session folder
