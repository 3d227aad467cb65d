"""--custom-config-path, --train-env-vars and --eval-function-path through the whole loop (local Ray, the
embedded engine, the torch trainer on two FSDP ranks, a tiny model), the functions given by file path: each
trainer rank's process sees the variable (a custom loss reads os.environ, reports it as a metric and writes it
to a file per process), the custom keys reach the hooks (ctx.KEY), the eval function (ctx.KEY) and the loss
(custom_args().KEY), a flag's key sets the flag, and the eval function's datasets and metrics land in the
eval row. One run asserts all of it (each end-to-end run costs its actors' start-up)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import base_flags, miles_actors
from tests.integration.test_main_job import run

pytestmark = pytest.mark.ray

FUNCTIONS = '''
import os
from pathlib import Path

import torch

from miles.user_code import custom_args


def loss(logprobs, batch, reduce):                 # --custom-loss-function-path, in each trainer rank's process
    Path(custom_args().seen_dir, f"{os.getpid()}.txt").write_text(os.environ.get("MILES_TEST_VAR", "-"))
    ratio = torch.exp(logprobs - batch.old_logprobs)
    seen = {"env_seen": float(os.environ.get("MILES_TEST_VAR") == "x"), "tag": float(custom_args().tag)}
    return reduce(-batch.advantages * ratio, batch.loss_mask), seen


def rollout_log(ctx, samples, metrics, rollout_time_s):
    metrics["my/tag"] = ctx.tag


async def evaluate(ctx, rollout_id):               # --eval-function-path: the built-in eval, spelled out
    data = {}
    for name, d in ctx.datasets.items():
        n = d.n_samples_per_prompt
        samples = await ctx.generate_samples(d.prompts, n, d.sampling_params)
        await ctx.score(samples, n, name)
        data[name] = [samples[i:i + n] for i in range(0, len(samples), n)]
    return data, {"custom_ran": 1.0, "tag": ctx.tag, "driver_var": float("MILES_TEST_VAR" in os.environ)}
'''


def test_custom_config_train_env_vars_and_an_eval_function_in_a_two_rank_run(ray_cluster, tiny_task, tmp_path):
    """--actor-num-gpus-per-node 2 on the CPU: the trainer's two FSDP ranks are actors the trainer creates;
    they start with the variable too (Ray's runtime_env passes on to the actors an actor creates)."""
    fns, seen = tmp_path / "fns.py", tmp_path / "seen"
    fns.write_text(FUNCTIONS)
    seen.mkdir()
    custom = tmp_path / "custom.yaml"
    # custom keys, and a flag's (over its 4 below)
    custom.write_text(f"tag: 7\nseen_dir: {seen}\nn_samples_per_prompt: 2\n")
    result = run(base_flags(tiny_task, tmp_path / "run", num_rollout=2, custom_config_path=str(custom),
                            actor_num_gpus_per_node=2,
                            train_env_vars='{"MILES_TEST_VAR": "x"}', loss_type="custom_loss",
                            custom_loss_function_path=f"{fns}:loss",
                            custom_rollout_log_function_path=f"{fns}:rollout_log",
                            eval_prompt_data=["arith", tiny_task["eval"]], eval_interval=2, skip_eval_before_train=True,
                            eval_function_path=f"{fns}:evaluate"))
    assert result.final_state == "shutdown"
    written = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in written if r.get("kind") != "eval"]
    evals = [r for r in written if r.get("kind") == "eval"]
    assert len(train) == 2 and all(r["num_samples"] == 8 for r in train)     # 4 prompts x the YAML's 2
    assert all(r["my/tag"] == 7 for r in train)                              # ctx.tag in a hook
    # the trainer's process started with MILES_TEST_VAR=x and reads the custom key through custom_args()
    # (means over the micro-batches: 1 and 7 up to rounding)
    assert all(r["custom/env_seen"] == pytest.approx(1.0) and r["custom/tag"] == pytest.approx(7.0) for r in train)
    [e] = evals
    assert e["eval/custom_ran"] == 1.0 and e["eval/tag"] == 7.0
    assert e["eval/driver_var"] == 0.0             # the variable is the trainer's: the rollout executor lacks it
    assert 0.0 <= e["eval/arith/reward_mean"] <= 1.0 and "eval/arith/pass@1" in e
    files = sorted(seen.iterdir())
    assert len(files) == 2 and [f.read_text() for f in files] == ["x", "x"]      # two rank processes, each saw x
    assert miles_actors() == []
