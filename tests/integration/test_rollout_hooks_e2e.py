"""miles' rollout hooks and policy-loss reducer through the whole loop (local Ray, the embedded engine,
the torch trainer, a tiny model), given by file path: they reach the executor and trainer actors, the
hooks run once per rollout in miles' order, and their effects reach the trainer."""

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

def sum_of_sample_mean(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    with open(REDUCER_LOG, "a") as f:
        f.write(json.dumps({"lengths": response_lengths}) + "\\n")
    return lambda x: sum((p * m).sum() / m.sum().clamp(min=1) for p, m in zip(x.split(response_lengths), loss_masks))
'''


def test_hooks_by_file_path_run_each_rollout_and_reach_training(ray_cluster, tiny_task, tmp_path):
    hooks, log, reducer_log = tmp_path / "hooks.py", tmp_path / "hooks.jsonl", tmp_path / "reducer.jsonl"
    # the executor and trainer actors append to these
    hooks.write_text(f"LOG = {str(log)!r}\nREDUCER_LOG = {str(reducer_log)!r}\n" + HOOKS)
    result = run(base_flags(tiny_task, tmp_path / "run", num_rollout=2,
                            rollout_sample_filter_path=f"{hooks}:remove_first_group",
                            rollout_all_samples_process_path=f"{hooks}:record",
                            custom_reward_post_process_path=f"{hooks}:constant",
                            loss_agg_mode="seq_mean_token_mean",
                            custom_pg_loss_reducer_function_path=f"{hooks}:sum_of_sample_mean"))
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
    # the trainer reduced the policy loss of every rollout's 16 samples with the reducer; the 4 removed
    # samples of each rollout came with response length 0
    lengths = [n for line in reducer_log.read_text().splitlines() for n in json.loads(line)["lengths"]]
    assert len(lengths) == 2 * 16 and lengths.count(0) == 2 * 4
    assert miles_actors() == []
