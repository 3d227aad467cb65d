"""miles' rollout logging flags in the executor with a recording engine: --log-reward-category's shares,
the rollout and eval log functions (metrics they add, the replace contract, bad metrics named), their
start-up checks, and --eval-min-new-tokens reaching the engines' sampling params."""

import asyncio

import pytest

from miles.config import ConfigError, EvalConfig, RolloutConfig
from miles.config.flags import parse_flags
from miles.rollout.engines.sglang.api import sampling_params
from miles.rollout.executor import category_shares
from miles.rollout.hooks import LOOP_METRICS, HookError, RolloutHooks, load_eval_log, load_rollout_log
from miles.types import Prompt, Sample, SamplingParams
from tests.unit.test_executor_eval_config import Recording, executor
from tests.unit.test_validate_algorithms import base  # noqa: F401  (the fixture: a minimal run's flags)

HERE = "tests.unit.test_rollout_logs"


def _sample(category=None):
    metadata = {} if category is None else {"why": category}
    return Sample(prompt=Prompt(index=0, text="", prompt_ids=(0,)), group=0, response_ids=[1], rollout_logprobs=[0.0],
                  finish_reason="stop", weight_version=0, metadata=metadata)


# -- the functions by path (what they saw is recorded where the tests read it back: the metrics) -------------


def label_why(ctx, groups):                       # --rollout-sample-filter-path: the reward's reason, per sample
    for g in groups:
        for s in g:
            s.metadata["why"] = "right" if s.reward > 0 else ("empty" if not s.response_text else "wrong")


def add_longest(ctx, samples, metrics, rollout_time_s):
    metrics.update({"my/rollout_id": ctx.rollout_id, "my/n": len(samples), "my/time_s": rollout_time_s,
                    "my/longest": max(s.response_length for s in samples)})


def replace_all(ctx, samples, metrics, rollout_time_s):
    metrics["my/count"] = len(samples)
    metrics["reward_std"] = 42.0          # a default it changed is its own
    del metrics["reward_mean"]            # a loop metric stays whatever the function does
    return True


def bad_metric(ctx, samples, metrics, rollout_time_s):
    metrics["my/text"] = "long"


def eval_per_set(ctx, data, metrics):
    metrics.update({f"my/{name}/n": len(samples) for name, samples in data.items()})
    return True


def two_arguments(ctx, samples):
    return None


# -- --log-reward-category ----------------------------------------------------------------------------------

def test_category_shares_count_each_metadata_value_and_the_missing_key():
    samples = [_sample("right"), _sample("wrong"), _sample("wrong"), _sample()]
    # 4 samples: 1 right, 2 wrong, 1 without the key
    assert category_shares(samples, "why", "rollout/") == {
        "rollout/error_cat/none": 0.25, "rollout/error_cat/right": 0.25, "rollout/error_cat/wrong": 0.5}


def test_log_reward_category_adds_the_shares_to_the_rollout_metrics():
    # labels "1": the 4 samples of each prompt answer 1, 2, 2, 2 -> 1 right, 3 wrong
    ex = executor(Recording([[1], [2], [2], [2]]), log_reward_category="why", sample_filter_path=f"{HERE}:label_why")
    metrics = asyncio.run(ex.generate(0)).metrics
    assert {k: v for k, v in metrics.items() if "error_cat" in k} == {
        "rollout/error_cat/right": 0.25, "rollout/error_cat/wrong": 0.75}
    plain = asyncio.run(executor(Recording([[1]])).generate(0)).metrics
    assert not any("error_cat" in k for k in plain)


def test_log_reward_category_reads_the_prompts_metadata_in_evals_too():
    prompts = [Prompt(index=i, text=str(i), prompt_ids=(i,), label="1", metadata={"level": "easy" if i else "hard"})
               for i in range(4)]
    ex = executor(Recording([[1]]), EvalConfig(prompt_data=(("arith", "x.jsonl"),)), {"arith": prompts},
                  log_reward_category="level")
    out = asyncio.run(ex.evaluate(0))
    assert (out["eval/arith/error_cat/hard"], out["eval/arith/error_cat/easy"]) == (0.25, 0.75)


# -- --custom-rollout-log-function-path ---------------------------------------------------------------------

def test_rollout_log_function_adds_metrics_and_keeps_the_defaults():
    m = asyncio.run(executor(Recording([[1], [2, 2]]), log_function_path=f"{HERE}:add_longest").generate(5)).metrics
    # samples answer 1 (right, 1 token) and 22 (wrong, 2 tokens) in turn: 8 samples, reward mean 0.5
    assert (m["my/rollout_id"], m["my/n"], m["my/longest"], m["reward_mean"]) == (5, 8, 2, 0.5)
    assert 0 < m["my/time_s"] < 60


def test_rollout_log_function_returning_true_replaces_the_defaults_but_not_the_loops():
    metrics = asyncio.run(executor(Recording([[1]]), log_function_path=f"{HERE}:replace_all").generate(0)).metrics
    assert set(metrics) == {*LOOP_METRICS, "my/count", "reward_std"}
    assert (metrics["my/count"], metrics["reward_std"], metrics["reward_mean"]) == (8, 42.0, 1.0)


def test_rollout_log_function_that_logs_a_non_number_is_named():
    ex = executor(Recording([[1]]), log_function_path=f"{HERE}:bad_metric")
    with pytest.raises(HookError, match=r"--custom-rollout-log-function-path .*bad_metric put 'my/text' = 'long'"):
        asyncio.run(ex.generate(0))


# -- --custom-eval-rollout-log-function-path ----------------------------------------------------------------

def test_eval_log_function_gets_each_sets_samples_and_may_replace_the_row():
    sets = {"a": [Prompt(index=0, text="0", prompt_ids=(0,), label="1")],
            "b": [Prompt(index=i, text=str(i), prompt_ids=(i,), label="1") for i in range(3)]}
    eval_cfg = EvalConfig(prompt_data=(("a", "a.jsonl"), ("b", "b.jsonl")), n_samples_per_prompt=2,
                          log_function_path=f"{HERE}:eval_per_set")
    out = asyncio.run(executor(Recording([[1]]), eval_cfg, sets).evaluate(0))
    assert out == {"my/a/n": 2, "my/b/n": 6}


# -- loading ------------------------------------------------------------------------------------------------

def test_log_functions_are_checked_when_loaded_with_the_flag_named():
    with pytest.raises(ConfigError, match=r"--custom-rollout-log-function-path .*two_arguments.*cannot be called as "
                                          r"fn\(ctx, samples, metrics"):
        load_rollout_log(f"{HERE}:two_arguments")
    with pytest.raises(ConfigError, match=r"--custom-eval-rollout-log-function-path 'no_such_module:f': cannot import"):
        load_eval_log("no_such_module:f")


def test_the_flags_parse_and_the_functions_are_shipped(base):
    cfg, _ = parse_flags(base + ["--log-reward-category", "why", "--custom-rollout-log-function-path", "a.py:f",
                                 "--custom-eval-rollout-log-function-path", "b.py:g", "--eval-min-new-tokens", "3"])
    assert (cfg.rollout.log_reward_category, cfg.rollout.log_function_path) == ("why", "a.py:f")
    assert (cfg.eval.log_function_path, cfg.eval.min_new_tokens) == ("b.py:g", 3)
    assert {"--custom-rollout-log-function-path": "a.py:f",
            "--custom-eval-rollout-log-function-path": "b.py:g"}.items() <= cfg.user_function_paths.items()


# -- --eval-min-new-tokens ----------------------------------------------------------------------------------

def test_eval_min_new_tokens_reaches_the_eval_calls_only():
    engine = Recording([[1]])
    ex = executor(engine, EvalConfig(prompt_data=(("a", "a.jsonl"),), min_new_tokens=3),
                  {"a": [Prompt(index=0, text="0", prompt_ids=(0,), label="1")]})
    asyncio.run(ex.generate(0))
    asyncio.run(ex.evaluate(0))
    assert [p.min_new_tokens for p in engine.params] == [0, 3]


def test_eval_min_new_tokens_below_zero_is_refused(base):
    with pytest.raises(ConfigError, match=r"--eval-min-new-tokens -1: must be >= 0"):
        parse_flags(base + ["--eval-min-new-tokens", "-1"])


def test_sglang_gets_min_new_tokens_when_set():
    assert sampling_params(SamplingParams(min_new_tokens=4), None)["min_new_tokens"] == 4
    assert "min_new_tokens" not in sampling_params(SamplingParams(), None)


def test_the_hooks_load_the_eval_log_function_too():
    RolloutHooks.from_config(RolloutConfig(batch_size=1, log_function_path=f"{HERE}:add_longest"), f"{HERE}:eval_per_set")
    with pytest.raises(ConfigError, match=r"--custom-eval-rollout-log-function-path 'no_such_module:f'"):
        RolloutHooks.from_config(RolloutConfig(batch_size=1), "no_such_module:f")
