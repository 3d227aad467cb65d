"""miles' rollout hooks (miles.rollout.hooks) in the executor with a scripted engine: the sample filter
takes samples out of training, the all-samples hook sees every generated group, the reward post-process
replaces the group baseline; loading, signature and bad-return errors name the flag."""

import asyncio

import pytest

from miles.config import AlgorithmConfig, ConfigError
from miles.config.flags import parse_flags
from miles.rollout.hooks import HookError, RolloutHooks, load_reward_post_process, load_sample_filter
from tests.unit.test_executor_algorithms import ScriptedEngine, even_all_right_odd_mixed, executor
from tests.unit.test_validate_algorithms import base  # noqa: F401  (the fixture: a minimal run's flags)

HERE = "tests.unit.test_rollout_hooks"
FILTER = "miles.rollout.filters:check_reward_nonzero_std"


# -- hooks by path (their effects are recorded on the samples, which tests read back) -----------------------

def remove_wrong(ctx, groups):
    for g in groups:
        for s in g:
            s.remove_sample = s.reward == 0.0
            s.metadata["filtered_at"] = ctx.rollout_id


def drop_first_group(ctx, groups):
    del groups[0][:]


def count_all(ctx, all_groups):
    for g in all_groups:
        for s in g:
            s.metadata["all_groups"] = len(all_groups)
            s.metadata["filtered_first"] = "filtered_at" in s.metadata


def times_ten(ctx, samples):
    return [s.reward for s in samples], [10.0 * s.reward + ctx.rollout.n_samples_per_prompt for s in samples]


def too_few(ctx, samples):
    return [0.0], [0.0]


def one_list(ctx, samples):
    return [0.0] * len(samples)


def nan_rewards(ctx, samples):
    return [0.0] * len(samples), [float("nan")] * len(samples)


def one_argument(samples):
    return samples


def right_wrong(p, k):
    return [1] if k % 2 == 0 else [2]       # each group: a right answer (reward 1), a wrong one (0)


# -- --rollout-sample-filter-path ----------------------------------------------------------------------------

def test_sample_filter_takes_samples_out_of_training_but_not_out_of_their_groups():
    batch = asyncio.run(executor(ScriptedEngine(right_wrong), sample_filter_path=f"{HERE}:remove_wrong").generate(3))
    assert len(batch.samples) == 4 and [s.remove_sample for s in batch.samples] == [False, True, False, True]
    assert all(s.metadata["filtered_at"] == 3 for s in batch.samples)
    # the removed samples train on nothing ...
    assert [s.mask() for s in batch.samples] == [[1], [0], [1], [0]]
    # ... yet count in their group's GRPO statistics, as in miles: groups [1, 0] give ±1/sqrt(2)
    assert [round(s.advantage, 4) for s in batch.samples] == [0.7071, -0.7071, 0.7071, -0.7071]


def test_sample_filter_that_changes_the_groups_is_named_with_the_fix():
    ex = executor(ScriptedEngine(right_wrong), sample_filter_path=f"{HERE}:drop_first_group")
    with pytest.raises(HookError, match=r"--rollout-sample-filter-path .*drop_first_group changed the rollout's "
                                        r"groups \(4 samples in, 2 after\).*remove_sample = True"):
        asyncio.run(ex.generate(0))


# -- --rollout-all-samples-process-path ----------------------------------------------------------------------

def test_all_samples_hook_sees_the_groups_dynamic_sampling_dropped_after_the_filter():
    ex = executor(ScriptedEngine(even_all_right_odd_mixed), dynamic_sampling_filter_path=FILTER,
                  sample_filter_path=f"{HERE}:remove_wrong", all_samples_process_path=f"{HERE}:count_all")
    batch = asyncio.run(ex.generate(0))
    # two rounds of two prompts: 4 groups generated, 2 kept (prompts 1 and 3); the hook saw all 4
    assert [s.prompt.index for s in batch.samples] == [1, 1, 3, 3]
    assert all(s.metadata["all_groups"] == 4 for s in batch.samples)
    # the sample filter ran first, on the kept groups only (the dropped ones never reach training)
    assert all(s.metadata["filtered_first"] for s in batch.samples)


def test_all_samples_hook_without_dynamic_sampling_sees_the_rollouts_groups():
    batch = asyncio.run(executor(ScriptedEngine(right_wrong), all_samples_process_path=f"{HERE}:count_all").generate(0))
    assert [s.metadata["all_groups"] for s in batch.samples] == [2, 2, 2, 2]


# -- --custom-reward-post-process-path -----------------------------------------------------------------------

def test_reward_post_process_values_are_the_advantages():
    batch = asyncio.run(executor(ScriptedEngine(right_wrong),
                                 reward_post_process_path=f"{HERE}:times_ten").generate(0))
    # rewards [1, 0, 1, 0] -> 10 * r + n (n = 2): no group baseline subtracted
    assert [s.advantage for s in batch.samples] == [12.0, 2.0, 12.0, 2.0]
    assert [s.reward for s in batch.samples] == [1.0, 0.0, 1.0, 0.0]      # the samples keep their rewards
    assert batch.metrics["raw_reward_mean"] == 0.5


def test_reward_post_process_is_whitened_for_reinforce_plus_plus_baseline():
    algorithm = AlgorithmConfig(advantage_estimator="reinforce_plus_plus_baseline")
    batch = asyncio.run(executor(ScriptedEngine(right_wrong), algorithm=algorithm,
                                 reward_post_process_path=f"{HERE}:times_ten").generate(0))
    # [12, 2, 12, 2] whitened over the batch: mean 7, std 5 (over the batch, not unbiased) -> ±1
    assert [round(s.advantage, 4) for s in batch.samples] == [1.0, -1.0, 1.0, -1.0]


@pytest.mark.parametrize("fn, message", [
    ("too_few", r"returned 1 raw_rewards for the rollout's 4 samples"),
    ("one_list", r"returned list; expected \(raw_rewards, rewards\)"),
    ("nan_rewards", r"rewards\[0\] is nan; 4 of 4 are not finite"),
])
def test_reward_post_process_bad_returns_are_named(fn, message):
    ex = executor(ScriptedEngine(right_wrong), reward_post_process_path=f"{HERE}:{fn}")
    with pytest.raises(HookError, match=f"--custom-reward-post-process-path .*{fn}.*{message}"):
        asyncio.run(ex.generate(0))


# -- loading and start-up checks -----------------------------------------------------------------------------

def test_hooks_load_with_the_flag_named_in_every_error():
    with pytest.raises(ConfigError, match=r"--rollout-sample-filter-path .*one_argument.*cannot be called as "
                                          r"fn\(ctx, groups"):
        load_sample_filter(f"{HERE}:one_argument")
    with pytest.raises(ConfigError, match=r"--custom-reward-post-process-path 'no_such_module:f': cannot import"):
        load_reward_post_process("no_such_module:f")
    assert RolloutHooks.from_config(executor(ScriptedEngine(right_wrong))._cfg) == RolloutHooks()




@pytest.mark.parametrize("flags, message", [
    (["--rollout-function-path", "m:f", "--rollout-sample-filter-path", f"{HERE}:remove_wrong"],
     "miles calls --rollout-sample-filter-path only inside its own rollout function"),
    (["--custom-reward-post-process-path", f"{HERE}:times_ten", "--advantage-estimator", "ppo"],
     "--custom-reward-post-process-path with --advantage-estimator ppo: not supported yet"),
    (["--loss-type", "sft_loss", "--n-samples-per-prompt", "1", "--rollout-all-samples-process-path", "m:f"],
     "--rollout-all-samples-process-path do not apply"),
    (["--load-debug-rollout-data", "r_{rollout_id}.pt", "--custom-reward-post-process-path", "m:f"],
     "--load-debug-rollout-data trains on the saved rollouts as they were, advantages included: "
     "--custom-reward-post-process-path would not run"),
])
def test_hook_combinations_that_cannot_hold_are_refused(base, flags, message):
    with pytest.raises(ConfigError) as err:
        parse_flags(base + flags)
    assert message in "\n".join(err.value.problems)


def test_hook_flags_parse_into_the_rollout_config_and_are_shipped(base):
    cfg, _ = parse_flags(base + ["--rollout-sample-filter-path", "a.py:f", "--rollout-all-samples-process-path", "b.py:g",
                              "--custom-reward-post-process-path", "c.py:h"])
    r = cfg.rollout
    assert (r.sample_filter_path, r.all_samples_process_path, r.reward_post_process_path) == ("a.py:f", "b.py:g", "c.py:h")
    assert {"--rollout-sample-filter-path": "a.py:f", "--rollout-all-samples-process-path": "b.py:g",
            "--custom-reward-post-process-path": "c.py:h"}.items() <= cfg.user_function_paths.items()
