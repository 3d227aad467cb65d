"""Nothing lost when the user errs, on real parts: a second run into a busy run dir or --save folder
is refused at once naming the holder; a resume into the same run dir after a run that died holding
its lock takes the lock over (said), skips a corrupt newest checkpoint (said, with the one loaded
instead), and writes a trace segment of its own that `miles trace check` passes with the first; a
--load folder with nothing loadable is refused listing each checkpoint and why."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.cli.trace import main as trace_main
from miles.cli.train import main as train_main
from miles.runtime import read_trace
from miles.runtime.runlock import lock_folder
from miles.runtime.trace import segment_paths
from tests.conftest import base_flags, miles_actors
from tests.faults.test_reliability import flip_byte

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def flags(task, run_dir: Path, ckpt: Path, **kw) -> list[str]:
    return base_flags(task, run_dir, rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=3,
                      save=ckpt, load=ckpt, save_interval=1, no_save_hf=True, **kw)


@pytest.mark.parametrize("busy", ["--run-dir", "--save"])
def test_a_second_run_into_a_busy_folder_exits_2_at_once_naming_the_holder(tiny_task, tmp_path, busy):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    held = lock_folder(run_dir if busy == "--run-dir" else ckpt, what=busy, run_id="the-first-run")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/train.py"), *flags(tiny_task, run_dir, ckpt)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=ENV)
    took = time.monotonic() - t0
    held.release()
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"scripts/train.py: bad input: {busy} {run_dir if busy == '--run-dir' else ckpt} "
                           f"is in use by another run: pid {os.getpid()} on host ")
    assert "(run the-first-run," in line
    assert not (run_dir / "trace.jsonl").exists()          # nothing of the run started
    print(f'{{"case": "busy {busy}", "refused_after_s": {took:.2f}}}')      # python start-up included


def test_a_resume_takes_a_dead_runs_lock_skips_a_corrupt_checkpoint_loudly_and_is_a_second_segment(
        ray_cluster, tiny_task, tmp_path, capsys):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    assert train_main(flags(tiny_task, run_dir, ckpt, num_rollout=2)) == 0
    capsys.readouterr()
    code = ("import sys, os; from miles.runtime.runlock import lock_folder; "
            "lock_folder(sys.argv[1], what='--run-dir', run_id='killed'); os._exit(0)")   # dies holding it
    subprocess.run([sys.executable, "-c", code, str(run_dir)], check=True, env=ENV)
    flip_byte(ckpt / "iter_0000001" / "trainer" / "model.safetensors", -5)          # same size: sha256 only
    assert train_main(flags(tiny_task, run_dir, ckpt, num_rollout=3)) == 0
    err = capsys.readouterr().err
    assert f"--run-dir {run_dir} was locked by a run that is gone (pid " in err and "run killed" in err
    assert (f"miles: checkpoint iter_0000001 skipped: {ckpt / 'iter_0000001' / 'trainer' / 'model.safetensors'} "
            "does not match its sha256 in the manifest; trying iter_0000000 instead") in err
    assert f"resumed after rollout 0 from {ckpt / 'iter_0000000'}" in err
    assert segment_paths(run_dir) == [run_dir / "trace.jsonl", run_dir / "trace.2.jsonl"]
    second = read_trace(run_dir / "trace.2.jsonl")
    assert second.of("lock_taken_over")[0].get("holder")["run_id"] == "killed"
    assert [e.rollout_id for e in second.of("metrics")] == [1, 2]
    # resumed from checkpoint 0, the second run trains rollout 1 again, on the prompts the first one did
    first_prompts = {e.rollout_id: e.get("prompts") for e in read_trace(run_dir / "trace.jsonl").of("rollout_done")}
    again = {e.rollout_id: e.get("prompts") for e in second.of("rollout_done")}
    assert again[1] == first_prompts[1] and len(again[1]) == 2 and again[2] != again[1]
    assert trace_main(["check", str(run_dir)]) == 0
    assert capsys.readouterr().out.count("conforms to machine sync") == 2
    assert miles_actors() == []

    # every checkpoint now fails its sha256: refused (exit 2), each listed, nothing trained from scratch
    for i in (0, 1, 2):
        flip_byte(ckpt / f"iter_000000{i}" / "trainer" / "model.safetensors", -5)
    assert train_main(flags(tiny_task, run_dir, ckpt, num_rollout=3)) == 2
    err = capsys.readouterr().err
    assert f"--load {ckpt}: none of its 3 checkpoints can be loaded" in err and "--allow-fresh-start" in err
    for i in (2, 1, 0):
        assert f"  iter_000000{i}: {ckpt / f'iter_000000{i}' / 'trainer' / 'model.safetensors'} does not match" in err
    assert read_trace(run_dir).of("metrics") == [] and miles_actors() == []
    assert read_trace(run_dir).of("cluster_ready") == []      # hashed on the driver: refused before Ray started


def test_a_load_folder_of_files_but_no_checkpoint_exits_2_before_ray(tiny_task, tmp_path, capsys):
    ckpt = tmp_path / "weights"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"not a checkpoint")
    assert train_main(base_flags(tiny_task, tmp_path / "run", load=ckpt)) == 2
    err = capsys.readouterr().err
    assert f"--load {ckpt} holds files but no checkpoint (model.safetensors)" in err
    assert read_trace(tmp_path / "run").of("cluster_ready") == []              # refused before Ray
