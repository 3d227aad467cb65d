"""The rollout executor's algorithm paths with a scripted engine: dynamic sampling, the overlong
penalty, SFT samples from the data, and the estimators it leaves to the trainer."""

import asyncio

import pytest

from miles.config import AlgorithmConfig, EvalConfig, RolloutConfig
from miles.rollout.executor import RolloutExecutor
from miles.rollout.filters import check_reward_nonzero_std, load_filter
from miles.types import Generation, Prompt


class Digits:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


class ScriptedEngine:
    """Prompt p's k-th sample in a call answers `script(p, k)` (a list of digit ids)."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompts, params):
        self.calls.append([p[0] for p in prompts])
        seen: dict[int, int] = {}
        out = []
        for p in prompts:
            k = seen[p[0]] = seen.get(p[0], -1) + 1
            ids = self.script(p[0], k)
            out.append(Generation(response_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", weight_version=0))
        return out


PROMPTS = [Prompt(index=i, text=str(i), prompt_ids=(i,), label="1") for i in range(8)]


def executor(engine, *, algorithm=None, sft_responses=None, **rollout):
    cfg = RolloutConfig(**{"batch_size": 2, "n_samples_per_prompt": 2, "max_response_len": 4, "rm_type": "exact_match",
                           **rollout})
    return RolloutExecutor(prompts=PROMPTS, eval_sets={}, rollout=cfg, algorithm=algorithm or AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"),
                           eval=EvalConfig(temperature=0.0), shuffle=False, tokenizer=Digits(), engines=[engine], seed=0,
                           sft_responses=sft_responses)


def even_all_right_odd_mixed(p, k):
    # even prompts: every sample right (rewards all 1: nothing to learn); odd prompts: right, wrong, ...
    return [1] if p % 2 == 0 or k % 2 == 0 else [2]


FILTER = "miles.rollout.filters:check_reward_nonzero_std"


def test_dynamic_sampling_keeps_sampling_until_enough_groups_pass():
    engine = ScriptedEngine(even_all_right_odd_mixed)
    batch = asyncio.run(executor(engine, dynamic_sampling_filter_path=FILTER).generate(0))
    # round 0 serves prompts 0, 1 (keeps 1), round 1 serves 2, 3 (keeps 3): two rounds, half the groups pass
    assert engine.calls == [[0, 0, 1, 1], [2, 2, 3, 3]]
    assert [s.prompt.index for s in batch.samples] == [1, 1, 3, 3] and [s.group for s in batch.samples] == [0, 0, 1, 1]
    assert batch.metrics["dynamic_sampling_rounds"] == 2 and batch.metrics["dynamic_sampling_pass_ratio"] == 0.5
    # GRPO on the kept groups [1, 0]: ±1/sqrt(2) (unbiased std), no zero-advantage group left
    assert all(abs(abs(s.advantage) - 0.7071) < 1e-3 for s in batch.samples)


def test_dynamic_sampling_fills_up_with_filtered_groups_after_its_last_round():
    engine = ScriptedEngine(even_all_right_odd_mixed)
    ex = executor(engine, dynamic_sampling_filter_path=FILTER, over_sampling_batch_size=1, dynamic_sampling_max_rounds=2)
    batch = asyncio.run(ex.generate(0))
    assert [s.prompt.index for s in batch.samples] == [1, 1, 0, 0]   # kept 1, then dropped 0 fills the batch
    assert batch.metrics["dynamic_sampling_filled_groups"] == 1


def test_overlong_penalty_grows_over_the_last_buffer_tokens():
    lengths = {0: 1, 1: 2, 2: 3, 3: 4}
    engine = ScriptedEngine(lambda p, k: [1] + [5] * (lengths[p * 2 + k] - 1))   # "1", "15", "155", "1555"
    batch = asyncio.run(executor(engine, overlong_buffer_len=2, overlong_penalty_factor=1.0,
                                 algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", advantage_estimator="rloo")).generate(0))
    # max 4, buffer 2: lengths 1, 2 -> 0; 3 -> (2 - 3) / 2 = -.5; 4 -> -1. Only "1" matches the label.
    assert [s.reward for s in batch.samples] == [1.0, 0.0, -0.5, -1.0]
    assert batch.metrics["overlong_penalty_mean"] == -0.375


def test_sft_serves_the_data_responses_without_any_engine():
    class NoEngine:
        def generate(self, prompts, params):
            raise AssertionError("SFT must not generate")

    responses = {p.index: (3, p.index, 2) for p in PROMPTS}
    ex = executor(NoEngine(), algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", loss_type="sft_loss"), sft_responses=responses,
                  n_samples_per_prompt=1)
    first, second = asyncio.run(ex.generate(0)), asyncio.run(ex.generate(1))
    assert [s.response_ids for s in first.samples] == [[3, 0, 2], [3, 1, 2]]
    assert [s.prompt.index for s in second.samples] == [2, 3]
    assert all(s.advantage == 0 and s.rollout_logprobs == [0.0] * 3 for s in first.samples)


@pytest.mark.parametrize("name", ["ppo", "reinforce_plus_plus"])
def test_token_level_estimators_leave_advantages_to_the_trainer(name):
    engine = ScriptedEngine(even_all_right_odd_mixed)
    batch = asyncio.run(executor(engine, algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", advantage_estimator=name)).generate(0))
    assert [s.reward for s in batch.samples] == [1.0, 1.0, 1.0, 0.0] and all(s.advantage == 0 for s in batch.samples)


@pytest.mark.parametrize("name", ["grpo", "gspo", "reinforce_plus_plus_baseline", "rloo"])
def test_disable_rewards_normalization_trains_on_the_raw_rewards(name):
    # rewards [1, 1] and [1, 0]: normalized per group the all-right group's advantages are 0; raw, they are 1
    def advantages(disable):
        algorithm = AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", advantage_estimator=name,
                                    disable_rewards_normalization=disable)
        batch = asyncio.run(executor(ScriptedEngine(even_all_right_odd_mixed), algorithm=algorithm).generate(0))
        return [s.advantage for s in batch.samples]
    normalized, raw = advantages(False), advantages(True)
    assert normalized[:2] == [0.0, 0.0]
    if name in ("grpo", "gspo"):
        assert raw == [1.0, 1.0, 1.0, 0.0]
    elif name == "reinforce_plus_plus_baseline":      # the raw rewards, whitened over the batch
        assert raw == pytest.approx([1 / 3 ** 0.5] * 3 + [-(3 ** 0.5)], rel=1e-5)
    else:                                             # no group normalization to turn off
        assert raw == normalized


def test_filters_load_by_path_and_name_their_flag(tmp_path):
    assert load_filter(FILTER) is check_reward_nonzero_std
    with pytest.raises(Exception, match="--dynamic-sampling-filter-path"):
        load_filter("miles.rollout.filters:no_such_filter")
