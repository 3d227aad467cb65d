"""--fp16 end to end on the CPU (local Ray, embedded engine, torch trainer and PPO's critic, tiny model):
the engines and the trainers compute in float16, the first step overflows at a scale past float16's
range and is skipped without failing the run, the policy still learns the task, and a resume takes
the loss scale back from the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from miles.checkpoint.store import CheckpointStore
from tests.conftest import base_flags
from tests.integration.test_algorithms_e2e import RECIPES, all_ones_logprob, ones_reward, run  # noqa: F401

pytestmark = pytest.mark.ray


@pytest.mark.extended   # out of the default run (CI budget): the loss scale's skips, growth and resume in tests/unit/test_fp16_training.py, fp16 on CUDA in tests/gpu
def test_fp16_ppo_skips_its_overflow_learns_and_resumes_its_scale(ray_cluster, tiny_task, ones_reward, tmp_path):
    torch.set_num_threads(1)
    prompts = [json.loads(x)["input"] for x in open(tiny_task["train"]).read().splitlines()[:8]]
    # 2^20 overflows the first steps; --hysteresis 1 halves the scale at each overflow until float16 holds it
    flags = dict(custom_rm_path=ones_reward, lr=1e-2, save=tmp_path / "ckpt", rollout_shuffle=False, fp16=True,
                 initial_loss_scale=2.0 ** 20, hysteresis=1, global_batch_size=4, **RECIPES["ppo"])
    result = run(base_flags(tiny_task, tmp_path / "run", num_rollout=3, **flags))
    assert result.final_state == "shutdown"
    rows = [r for r in result.metrics if r.get("kind") == "train"]      # 16 samples: 4 steps a rollout
    for role in ("", "critic/"):
        assert rows[0][f"{role}skipped_steps"] >= 1 and rows[0][f"{role}loss_scale"] < 2.0 ** 20
        assert sum(r[f"{role}skipped_steps"] for r in rows) < 4 * len(rows)      # most steps applied
    final = CheckpointStore(tmp_path / "ckpt").latest()[1]
    (state,) = final.rglob("trainer_state.json")
    saved = json.loads(state.read_text())["loss_scaler"]["scale"]
    assert saved == rows[-1]["loss_scale"]
    assert (all_ones_logprob(str(final / "hf"), prompts) - all_ones_logprob(tiny_task["model"], prompts)).mean() > 1.0
    resumed = run(base_flags(tiny_task, tmp_path / "resumed", num_rollout=4, load=tmp_path / "ckpt", **flags))
    (row,) = [r for r in resumed.metrics if r.get("kind") == "train"]
    # --hysteresis 1 halves at each overflow and 4 steps do not reach the growth window: from the saved scale
    assert row["loss_scale"] == saved / 2 ** row["skipped_steps"]
