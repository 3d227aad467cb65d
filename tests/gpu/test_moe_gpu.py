"""Qwen3-MoE on one GPU as a user runs it (docs/moe.md): the CLI, no layout flags (the run colocates), the
tiny MoE arithmetic model on the embedded engine (the fast engine does not serve MoE yet) and the torch
trainer in bf16, with R3: every response token replayed, the router losses on, the weights synced and
checked, and the recipe's bar met in 10 rollouts. Skipped without CUDA.

    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_moe_gpu.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]


def test_qwen3_moe_learns_on_one_gpu_with_rollout_routing_replay(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "miles.cli", "train", "--config", str(ROOT / "examples/arithmetic/grpo.yaml"),
           "--hf-checkpoint", str(ROOT / "examples/arithmetic/base_model_qwen3_moe"), "--device", "cuda",
           "--run-dir", str(run), "--trace-console", "off", "--progress", "plain", "--num-rollout", "10",
           "--eval-interval", "10", "--check-weight-update-equal", "--use-rollout-routing-replay",
           "--moe-aux-loss-coeff", "1e-3", "--moe-z-loss-coeff", "1e-4", "--moe-router-dtype", "fp32"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stderr[-3000:]
    trace = [json.loads(line) for line in (run / "trace.jsonl").read_text().splitlines() if line.strip()]
    picked, = [e for e in trace if e.get("event") == "engine_picked"]
    assert picked.get("family") == "qwen3_moe", picked
    synced = [e for e in trace if e.get("event") == "weights_synced"]
    assert len(synced) == 11 and all(e.get("checksum") for e in synced)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trains = [r for r in rows if "moe/routing_replayed" in r]
    assert len(trains) == 10
    assert all(r["moe/routing_replayed"] == 1.0 and r["moe/moe_aux_loss"] > 0 and r["moe/moe_z_loss"] > 0
               and 0.0 <= r["moe/routing_mismatch"] <= 1.0 for r in trains), trains[0]
    evals = [r for r in rows if r.get("kind") == "eval"]
    before, after = evals[0]["eval/arith/pass@1"], evals[-1]["eval/arith/pass@1"]
    assert after - before >= 0.15, (before, after)
