"""miles' rollout hooks through the whole loop (local Ray, the embedded engine, the torch trainer, a
tiny model), given by file path: they reach the executor actor, run once per rollout in miles' order,
and their effects reach the trainer."""

from __future__ import annotations

import json

import pytest

from tests.conftest import base_flags, miles_actors
from tests.integration.test_main_job import run

pytestmark = pytest.mark.ray

HOOKS = '''
import json

def remove_first_group(ctx, groups):
    for s in groups[0]:
        s.remove_sample = True

def record(ctx, all_groups):
    with open(LOG, "a") as f:
        f.write(json.dumps({"rollout": ctx.rollout_id, "groups": [len(g) for g in all_groups],
                            "removed": [[s.remove_sample for s in g] for g in all_groups],
                            "kept_tokens": sum(s.response_length for g in all_groups for s in g
                                               if not s.remove_sample)}) + "\\n")

def constant(ctx, samples):
    return [s.reward for s in samples], [1.0] * len(samples)
'''


def test_hooks_by_file_path_run_each_rollout_and_reach_training(ray_cluster, tiny_task, tmp_path):
    hooks, log = tmp_path / "hooks.py", tmp_path / "hooks.jsonl"
    hooks.write_text(f"LOG = {str(log)!r}\n" + HOOKS)     # the executor actor appends to it
    result = run(base_flags(tiny_task, tmp_path / "run", num_rollout=2,
                            rollout_sample_filter_path=f"{hooks}:remove_first_group",
                            rollout_all_samples_process_path=f"{hooks}:record",
                            custom_reward_post_process_path=f"{hooks}:constant"))
    assert result.final_state == "shutdown"
    # the all-samples hook ran once per rollout, on 4 groups of 4, after the filter had removed the first
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(x["rollout"], x["groups"]) for x in lines] == [(0, [4, 4, 4, 4]), (1, [4, 4, 4, 4])]
    assert all(x["removed"] == [[True] * 4] + [[False] * 4] * 3 for x in lines)
    for x, row in zip(lines, result.metrics):
        # the trainer trained on the other groups' tokens only, each with the post-process's advantage 1.0
        assert row["train_tokens"] == x["kept_tokens"] > 0
        assert row["advantage_abs_mean"] == 1.0
        assert row["raw_reward_mean"] == row["reward_mean"]
    assert miles_actors() == []
