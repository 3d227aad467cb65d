"""A launch script written in miles' style (flags only, grouped in arrays, no --config file) runs
here as a user coming from miles runs it: `bash run-tiny-grpo.sh` in a shell, its own local Ray
cluster, no terminal. Each of its flags is implemented, and each one's effect is checked; the same
script with miles flags this build refuses stops at once, one line per flag."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.config.flags import FLAGS
from miles.config.megatron_flags import SETS
from miles.config.miles_flags import fate
from miles.runtime import read_trace
from miles.metrics.jsonl import read_metrics
from miles.rollout.debug_data import load_rollout_data

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SCRIPTS = Path(__file__).resolve().parents[1] / "fixtures" / "miles_launch"
ROOT = Path(__file__).resolve().parents[2]


def script_flags() -> list[str]:
    return sorted(set(re.findall(r"^\s+(--[a-z0-9-]+)", (SCRIPTS / "run-tiny-grpo.sh").read_text(), re.M)))


def launch(folder: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(["bash", "run-tiny-grpo.sh", *extra], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=timeout)


def script_folder(tmp_path_factory, tiny_task) -> Path:
    root = tmp_path_factory.mktemp("miles_launch")
    for f in SCRIPTS.iterdir():
        shutil.copy(f, root / f.name)
    shutil.copytree(tiny_task["model"], root / "model")
    shutil.copy(tiny_task["train"], root / "train.jsonl")
    shutil.copy(tiny_task["eval"], root / "eval.jsonl")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_task):
    return script_folder(tmp_path_factory, tiny_task)


@pytest.fixture(scope="module")
def first_run(folder):
    done = launch(folder)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def test_every_flag_of_the_script_is_implemented():
    names = {f"--{f.name}" for f in FLAGS} | {f"--{name}" for name in SETS}   # miles' switches that set ours
    flags = script_flags()
    assert len(flags) > 45
    assert [f for f in flags if f not in names or fate(f[2:]) is not None] == []


def test_the_run_is_clean_on_stderr(first_run):
    err = first_run.stderr
    assert "\x1b[" not in err, "colour codes off a terminal"
    assert "Token authentication" not in err, "Ray's token-auth notice"
    assert "Traceback" not in err and "unrecognized" not in err
    assert "miles: starting fresh: no checkpoint there yet under --load ckpt" in err     # --save ckpt made it (its lock)
    assert "miles: starting at rollout 1 (--start-rollout-id)" in err


def test_checkpoint_flags(folder, first_run):
    # --save-interval 1 and --keep-last-checkpoints 1: only the last; --no-save-optim: no optimizer state
    assert sorted(p.name for p in (folder / "ckpt").glob("iter_*")) == ["iter_0000002"]
    trainer = folder / "ckpt" / "iter_0000002" / "trainer"
    assert not (trainer / "optimizer.pt").exists()
    assert json.loads((folder / "ckpt" / "iter_0000002" / "manifest.json").read_text())["optimizer"] is False
    # --save-hf hf/iter_{rollout_id}: an HF export at each save, outside the checkpoints
    for rid in (1, 2):
        assert (folder / "hf" / f"iter_{rid}" / "config.json").is_file()
        assert (folder / "hf" / f"iter_{rid}" / "model.safetensors").is_file()
    # --load ckpt --save ckpt before ckpt existed: a fresh start, traced
    trace = read_trace(folder / "run")
    assert trace.of("resume_skipped")[0].get("reason") == "no checkpoint there yet"


def test_rollout_and_training_flags(folder, first_run):
    trace = read_trace(folder / "run")
    assert trace.of("start_rollout_set")[0].get("next_rollout") == 1          # --start-rollout-id 1
    rows = read_metrics(folder / "run")
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["num_steps"] == 2                                  # --num-steps-per-rollout 2
        assert [f"pass@{k}" for k in range(1, 5)] == [k for k in r if k.startswith("pass@")]   # --log-passrate
        assert "custom/ratio_max" in r                              # --custom-loss-function-path's metrics
        assert r["custom_tis/capped"] == 1.0 and "tis_weight_mean" in r   # --use-tis --custom-tis-function-path
        assert r["kl"] >= 0                                         # --use-kl-loss low_var_kl --use-unbiased-kl
    # --ci-test: its checks ran on both rollouts, and each weight sync compared checksums
    assert [e.rollout_id for e in trace.of("ci_checked")] == [1, 2]
    assert all(e.get("checksum") for e in trace.of("weights_synced"))
    # --save-debug-train-data, with {rollout_id} and {rank}
    batch = torch.load(folder / "dump" / "train_2_0.pt", weights_only=True)
    assert batch["rollout_id"] == 2 and batch["tokens"].shape == batch["loss_mask"].shape


def test_sampling_and_template_flags(folder, first_run):
    sampling_checks(folder)


@pytest.mark.extended   # out of the default run (CI budget): the launch script runs in test_the_run_is_clean_on_stderr, the fast engine's run in test_main_job.py
def test_the_fast_engine_serves_the_same_sampling_flags(tmp_path_factory, tiny_task):
    # --rollout-stop and --rollout-max-context-len on FastEngine (the engine CUDA runs pick; eager here)
    fast = script_folder(tmp_path_factory, tiny_task)
    done = launch(fast, "--rollout-engine", "fast", "--num-rollout", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "engine: FastEngine" in done.stderr
    sampling_checks(fast)


def sampling_checks(folder: Path) -> None:
    saved = load_rollout_data(folder / "dump" / "rollout_1.pt")              # --save-debug-rollout-data
    assert len(saved.samples) == 16
    for s in saved.samples:
        assert s.prompt.text.startswith("a ")                     # --chat-template-path with its kwargs' prefix
        assert len(s.prompt.prompt_ids) + len(s.response_ids) <= 12       # --rollout-max-context-len 12
        assert "==" not in s.response_text                        # --rollout-stop: the reward read the text before it
        if s.finish_reason == "stop" and s.response_ids[-1] != 2:  # ended by the stop string, not EOS (id 2)
            assert s.response_text != ""
    assert any(len(s.prompt.prompt_ids) + len(s.response_ids) == 12 for s in saved.samples)


def test_eval_config_datasets(folder, first_run):
    evals = [r for r in read_metrics(folder / "run") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 3]                   # --eval-interval 2, and after the last
    for r in evals:
        assert [k for k in r if k.startswith("eval/arith/pass@")] == [f"eval/arith/pass@{k}" for k in range(1, 5)]
        assert [k for k in r if k.startswith("eval/arith_greedy/pass@")] == ["eval/arith_greedy/pass@1"]


def test_debug_train_only_replays_the_saved_rollouts_without_engines(folder, first_run):
    done = launch(folder, "--debug-train-only", "--load-debug-rollout-data", "dump/rollout_{rollout_id}.pt",
                  "--load", "ckpt-replay", "--save", "ckpt-replay", "--save-debug-rollout-data", "replay-dump",
                  "--run-dir", "replay")
    assert done.returncode == 0, done.stderr[-4000:]
    trace = read_trace(folder / "replay")
    assert trace.events[0].machine == "train_only" and not trace.of("weights_synced")
    assert [e.get("loaded_from") for e in trace.of("rollout_done")] == ["dump/rollout_1.pt", "dump/rollout_2.pt"]
    first = [r["loss"] for r in read_metrics(folder / "run") if r["kind"] == "train"]
    again = [r["loss"] for r in read_metrics(folder / "replay") if r["kind"] == "train"]
    assert again == pytest.approx(first, abs=1e-6)               # the same steps, without generating anything


def test_miles_flags_this_build_refuses_stop_the_script_at_once(folder):
    done = launch(folder, "--offload-train-target", "cpu", "--sglang-router-ip", "10.0.0.1",
                  "--moe-shared-expert-intermediate-size", "8", "--balance-by-flops",
                  "--use-rollout-indexer-replay", "--true-on-policy-mode",
                  "--run-dir", "refused", timeout=120)
    assert done.returncode == 2
    lines = [l.strip() for l in done.stderr.splitlines() if "miles flag this build does not take" in l
             or "miles flags this build does not take" in l]
    assert [l.split(" ")[1] for l in lines] == ["--offload-train-target", "--sglang-router-ip",
                                                "--moe-shared-expert-intermediate-size", "--balance-by-flops",
                                                "--use-rollout-indexer-replay", "--true-on-policy-mode"]
    assert all("not supported yet" in l or "drop it" in l or "drop the flag" in l for l in lines), lines
    assert not (folder / "refused").exists()                     # nothing started
