"""Reliability faults, on real parts (the session's Ray cluster, the tiny model): corrupted checkpoints
are skipped on --load, a phase past its deadline drains the run, a corrupted engine fails the run
naming it, a hung reward fails its sample (with --reward-timeout), a local cluster without token
authentication is refused before it starts, and a SIGTERM while a reward never returns ends a run
that started its own cluster within --stop-timeout, saving its last trained rollout, with nothing
listening beyond loopback before, nothing writable by other users (the Ray session folder while it
runs, the run dir and the checkpoints after), and nothing left after."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from miles.api.launch import train
from miles.checkpoint.store import CheckpointStore
from miles.config.flags import parse_flags
from miles.runtime import read_trace, with_disposer
from miles.cluster import reaper
from tests.conftest import base_flags, world_writable
from tests.faults.test_driver_kill import exposed_sockets
from tests.faults.test_fault_matrix import assert_clean_end

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_DEFAULT_S = 20.0


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


@pytest.mark.extended   # out of the default test run (CI budget); bash scripts/test.sh -m extended
def test_a_phase_past_its_deadline_drains_the_run_and_corrupted_checkpoints_are_skipped(ray_cluster, tiny_task,
                                                                                        tmp_path):
    # run 1: three checkpoints, then rollout 3 hangs past its --phase-timeout: cancelled, the run drains
    ckpt = tmp_path / "ckpt"
    data = {"rollout_shuffle": False, "no_save_hf": True}     # the file order (miles' default)
    raised = run(small(tiny_task, tmp_path, "first", num_rollout=4, save=ckpt, save_interval=1, **data,
                       inject_fault=["rollout:hang:4"], phase_timeout=["rollout=5"]))
    assert type(raised).__name__ == "PhaseTimeout" and "'rollout' ran past its 5 s deadline" in str(raised)
    trace = assert_clean_end(tmp_path / "first", outcome="failed", error_type="PhaseTimeout", ckpt=tmp_path / "none")
    cut = trace.of("phase_timeout")[0]
    assert (cut.state, cut.get("reason"), cut.get("abandoned")) == ("rollout", "deadline", False)
    assert 5.0 <= cut.get("after_s") < 7.0
    assert [e.rollout_id for e in trace.of("checkpoint_saved")] == [0, 1, 2]

    # run 2: iter 2 has a flip inside the safetensors header (its JSON starts at byte 8), iter 1 one in
    # the weights, both the same size: --load skips them and resumes from iter 0. Its rollout 1 meets a
    # reward that never returns on prompt 3: with --reward-timeout those samples score 0, the run goes on
    flip_byte(ckpt / "iter_0000002" / "trainer" / "model.safetensors", 20)
    flip_byte(ckpt / "iter_0000001" / "trainer" / "model.safetensors", -5)
    rm = tmp_path / "stuck_rm.py"
    rm.write_text("import threading\n"
                  "def stuck(prompt, response, label):\n"
                  "    if prompt.index == 3:\n"
                  "        threading.Event().wait()      # never returns\n"
                  "    return 1.0\n")
    assert run(small(tiny_task, tmp_path, "resumed", num_rollout=2, load=ckpt, **data, custom_rm_path=f"{rm}:stuck",
                     reward_timeout=1)) is None
    trace = read_trace(tmp_path / "resumed")
    skipped = trace.of("checkpoint_skipped")
    assert [e.rollout_id for e in skipped] == [2, 1]
    for e in skipped:
        assert e.get("check") == "sha256"
        assert e.get("problems") == [f"{ckpt / f'iter_000000{e.rollout_id}' / 'trainer' / 'model.safetensors'} "
                                     "does not match its sha256 in the manifest"]
    resumed = trace.of("resumed")[0]
    assert resumed.rollout_id == 0 and resumed.get("verified") is True
    rows = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if r.get("kind") == "train")
    assert row["step"] == 1 and row["reward_timeouts"] == 2.0     # prompt 3's two samples ...
    assert row["reward_mean"] == pytest.approx(0.5)               # ... scored 0, prompt 2's two 1


@pytest.mark.extended   # out of the default test run (CI budget); bash scripts/test.sh -m extended
@pytest.mark.parametrize("machine", ["sync", "fully_async"])   # fully-async: found at the next in-flight swap
def test_an_engine_corrupted_after_a_sync_fails_the_run_naming_it(ray_cluster, tiny_task, tmp_path, machine):
    extra = {"fully_async": True, "use_tis": True} if machine == "fully_async" else {}
    flags = small(tiny_task, tmp_path, "run", num_rollout=2, check_weight_update_equal=True,
                  inject_fault=["weight_sync:corrupt_weights"], **extra)
    raised = run(flags, machine)
    assert type(raised).__name__ == "WeightSyncMismatch", raised
    assert "engine-0 holds weights with checksum" in str(raised)      # (one engine of several: unit-tested)
    trace = assert_clean_end(tmp_path / "run", outcome="failed", error_type="WeightSyncMismatch",
                             ckpt=tmp_path / "none", machine=machine)
    synced = trace.of("weights_synced" if machine == "sync" else "weights_pushed")
    assert [e.get("version") for e in synced] == [0]          # the second sync found it (sync: before pushing)
    err = trace.of("error")[0]
    assert err.state == "weight_sync" and "before the next update to v0" in err.error["message"]


def test_a_local_cluster_without_authentication_is_refused_before_it_starts(tiny_task, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(tmp_path / "ray")}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/train.py"), *small(tiny_task, tmp_path, "run",
                                                                                  num_rollout=1)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "RAY_AUTH_MODE=disabled turns Ray's token authentication off" in proc.stderr
    assert "--ray-allow-no-auth" in proc.stderr
    assert not (tmp_path / "ray").exists()                     # no Ray process started, no session folder


def test_sigterm_while_a_reward_never_returns_saves_and_exits_within_the_stop_timeout(tiny_task, tmp_path):
    # a stuck reward, in a run that starts its own local cluster as a user's does: rollout 0 trains,
    # rollout 1's reward never returns; the first SIGTERM must end the process within --stop-timeout
    # (default 20 s), saving rollout 0 on the way, and leave nothing behind
    rm = tmp_path / "stuck_rm.py"
    rm.write_text("import threading\n"
                  "def stuck(prompt, response, label):\n"
                  "    if prompt.index >= 2:                # rollout 1's prompts (no shuffle, 2 per rollout)\n"
                  "        threading.Event().wait()\n"
                  "    return 1.0\n")
    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    argv = [sys.executable, str(ROOT / "scripts/train.py"),
            *small(tiny_task, tmp_path, "run", num_rollout=3, save=ckpt, rollout_shuffle=False,
                   custom_rm_path=f"{rm}:stuck")]
    # started with umask 0: what the run and Ray create is not writable by others because the run says so
    driver = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, umask=0)
    trace_path = run_dir / "trace.jsonl"
    deadline = time.monotonic() + 240
    while not rollout_after_training(trace_path):
        assert time.monotonic() < deadline and driver.poll() is None, "the run never reached rollout 1"
        time.sleep(0.2)
    time.sleep(1.0)                                            # the executor is inside the reward now
    spawned = psutil.Process(driver.pid).children(recursive=True)
    assert exposed_sockets([driver.pid, *(p.pid for p in spawned)]) == []
    assert not [p.pid for p in spawned if any("dashboard/dashboard.py" in a for a in p.cmdline())]   # none started
    session = Path(read_trace(trace_path).of("cluster_ready")[0].get("session_dir"))
    private = session.parent.parent              # the cluster's own temp folder: no other user gets in
    assert private.name.startswith("miles-ray-") and stat.S_IMODE(private.stat().st_mode) == 0o700
    assert private.stat().st_uid == os.getuid()
    assert settled_world_writable(session) == []  # Ray's 0777 folders lose their write as the reaper sees them
    t0 = time.monotonic()
    driver.send_signal(signal.SIGTERM)
    _, err = driver.communicate(timeout=60)
    exit_s = time.monotonic() - t0
    assert driver.returncode == 143, err[-3000:]
    assert f"stopped (SIGTERM): {run_dir}" in err
    assert exit_s < STOP_TIMEOUT_DEFAULT_S, exit_s
    trace = read_trace(trace_path)
    assert trace.events[-1].event == "run_end" and trace.events[-1].get("outcome") == "stopped"
    assert [(e.get("saved"), e.rollout_id) for e in trace.of("stop_save")] == [(True, 0)]
    assert CheckpointStore(ckpt).latest() == (0, ckpt / "iter_0000000")
    cut = trace.of("phase_timeout")[0]
    assert (cut.state, cut.get("reason")) == ("rollout", "stop")
    assert trace.of("stop_requested")[0].get("why") == "SIGTERM"     # `miles trace show` says which signal
    assert not session.exists() and (run_dir / "logs" / "ray" / "raylet.out").is_file()
    assert not private.exists() and world_writable(run_dir) == [] and world_writable(ckpt) == []
    time.sleep(1.0)                                            # the reaper's last kills land
    assert [p.name() for p in spawned if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    print(json.dumps({"case": "sigterm_stuck_reward_own_cluster", "signal_to_exit_s": round(exit_s, 2),
                      "signal_to_run_end_s": round(trace.events[-1].mono - trace.of("stop_requested")[0].mono, 2)}))


def settled_world_writable(root: Path) -> list[str]:
    """What stays writable by any user under `root` for longer than the reaper's poll (Ray makes some
    folders 0777 again as each worker starts; the reaper takes that off within a second)."""
    deadline = time.monotonic() + 2 * reaper.POLL_S + 1.0
    while (found := world_writable(root)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def rollout_after_training(trace_path: Path) -> bool:
    """Whether a rollout phase started after rollout 0 was trained."""
    if not trace_path.exists():
        return False
    trace = read_trace(trace_path)
    trained = [e.seq for e in trace.of("metrics") if e.rollout_id == 0]
    return bool(trained) and any(e.seq > trained[0] and e.state == "rollout" for e in trace.of("phase_start"))
