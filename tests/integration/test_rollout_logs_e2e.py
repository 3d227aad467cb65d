"""--log-reward-category and miles' log functions through the whole loop (local Ray, the embedded engine,
the torch trainer, a tiny model), the functions given by file path: the category shares and the functions'
metrics reach the run's metrics (its result and metrics.jsonl) for rollouts and evals."""

from __future__ import annotations

import json

import pytest

from tests.conftest import base_flags, miles_actors
from tests.integration.test_main_job import run

pytestmark = pytest.mark.ray

LOGS = '''
def label(ctx, groups):
    for g in groups:
        for s in g:
            s.metadata["why"] = "right" if s.reward > 0 else "wrong"

def rollout_log(ctx, samples, metrics, rollout_time_s):
    metrics["my/samples"] = len(samples)
    metrics["my/rollout_id"] = ctx.rollout_id

def eval_log(ctx, data, metrics):
    metrics.update({f"my/{name}/samples": len(samples) for name, samples in data.items()})
'''


def test_reward_categories_and_log_functions_reach_the_metrics(ray_cluster, tiny_task, tmp_path):
    logs = tmp_path / "logs.py"
    logs.write_text(LOGS)
    result = run(base_flags(tiny_task, tmp_path / "run", num_rollout=2, log_reward_category="why",
                            rollout_sample_filter_path=f"{logs}:label",
                            custom_rollout_log_function_path=f"{logs}:rollout_log",
                            eval_prompt_data=["arith", tiny_task["eval"]], eval_interval=2, skip_eval_before_train=True,
                            custom_eval_rollout_log_function_path=f"{logs}:eval_log"))
    assert result.final_state == "shutdown"
    written = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in written if r.get("kind") != "eval"]
    evals = [r for r in written if r.get("kind") == "eval"]
    assert [r["my/rollout_id"] for r in train] == [0, 1] and all(r["my/samples"] == 16 for r in train)
    for r in train:
        shares = {k: v for k, v in r.items() if k.startswith("rollout/error_cat/")}
        # 16 samples, each right (reward 1) or wrong (0): the right share is the reward mean
        assert set(shares) <= {"rollout/error_cat/right", "rollout/error_cat/wrong"}
        assert sum(shares.values()) == pytest.approx(1.0)
        assert shares.get("rollout/error_cat/right", 0.0) == pytest.approx(r["reward_mean"])
    assert len(evals) == 1 and evals[0]["my/arith/samples"] > 0
    # the sample filter labels rollouts only: no eval sample has the key
    assert evals[0]["eval/arith/error_cat/none"] == 1.0
    assert miles_actors() == []
