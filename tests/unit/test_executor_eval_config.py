"""The executor's share of miles' flags: --eval-config datasets (own n, sampling, reward), --log-passrate,
--rollout-stop (the reward reads the text before the stop string), and the rollout's sampling params."""

import asyncio

import pytest

from miles.config import AlgorithmConfig, EvalConfig, EvalDataset, RolloutConfig
from miles.rollout.executor import RolloutExecutor
from miles.types import Generation, Prompt
from tests.unit.test_executor_algorithms import PROMPTS, Digits


class Recording:
    """Answers each prompt's k-th sample with `answers[k % len]`; records the params of each call."""

    def __init__(self, answers):
        self.answers, self.params = answers, []

    def generate(self, prompts, params):
        self.params.append(params)
        seen = {}
        out = []
        for p in prompts:
            k = seen[p[0]] = seen.get(p[0], -1) + 1
            ids = self.answers[k % len(self.answers)]
            out.append(Generation(response_ids=list(ids), logprobs=[-0.5] * len(ids), finish_reason="stop",
                                  weight_version=0))
        return out


def executor(engine, eval_cfg=EvalConfig(), eval_sets=None, **rollout):
    cfg = RolloutConfig(**{"batch_size": 2, "n_samples_per_prompt": 4, "max_response_len": 4, "rm_type": "exact_match",
                           **rollout})
    return RolloutExecutor(prompts=PROMPTS, eval_sets=eval_sets or {}, rollout=cfg, algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"),
                           eval=eval_cfg, shuffle=False, tokenizer=Digits(), engines=[engine], seed=0)


def test_log_passrate_gives_every_k_up_to_n_for_rollouts():
    # labels "1": per prompt the 4 samples answer 1, 2, 2, 2 -> c = 1 of n = 4
    batch = asyncio.run(executor(Recording([[1], [2], [2], [2]]), EvalConfig(temperature=0.0, log_passrate=True)).generate(0))
    # pass@k = 1 - C(3, k) / C(4, k): 1/4, 1/2, 3/4, 1
    assert [batch.metrics[f"pass@{k}"] for k in (1, 2, 3, 4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    plain = asyncio.run(executor(Recording([[1]])).generate(0))
    assert not any(k.startswith("pass@") for k in plain.metrics)


def test_rollout_sampling_params_carry_stop_strings_tokens_and_context():
    engine = Recording([[1, 2]])
    asyncio.run(executor(engine, stop=("##",), stop_token_ids=(7,), max_context_len=32).generate(0))
    p = engine.params[0]
    assert (p.stop, p.stop_token_ids, p.max_context_len) == (("##",), (7,), 32)


def test_the_reward_reads_the_response_before_the_stop_string():
    # digits "1" then "33" then "4": with stop "33" the reward sees "1" (exact_match with label "1": reward 1)
    batch = asyncio.run(executor(Recording([[1, 3, 3, 4]]), stop=("33",)).generate(0))
    assert {s.response_text for s in batch.samples} == {"1"} and batch.metrics["reward_mean"] == 1.0
    assert all(s.response_ids == [1, 3, 3, 4] for s in batch.samples)      # the trainer gets every token


def test_eval_config_datasets_have_their_own_n_sampling_and_reward():
    sets = {"a": PROMPTS[:2], "b": [Prompt(index=0, text="0", prompt_ids=(0,), label="2")]}
    eval_cfg = EvalConfig(log_passrate=True, temperature=0.0, n_samples_per_prompt=1, datasets=(
        EvalDataset(name="a", path="a.jsonl", n_samples_per_prompt=4, temperature=0.7, top_p=0.9,
                    max_response_len=3, stop=("9",)),
        EvalDataset(name="b", path="b.jsonl", rm_type="math")))
    engine = Recording([[1], [2], [2], [2]])
    out = asyncio.run(executor(engine, eval_cfg, sets, top_p=0.5).evaluate(0))
    a, b = engine.params
    assert (a.temperature, a.top_p, a.max_new_tokens, a.stop) == (0.7, 0.9, 3, ("9",))
    assert (b.temperature, b.top_p, b.top_k, b.max_new_tokens, b.stop) == (0.0, 1.0, -1, 4, ())   # greedy: the run's eval
    assert [out[f"eval/a/pass@{k}"] for k in (1, 2, 3, 4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    # b: one sample, "1" vs label "2" under its own reward (math): wrong
    assert out["eval/b/pass@1"] == 0.0 and "eval/b/pass@2" not in out


def test_evals_cap_their_context_by_eval_max_context_len_else_the_rollouts():
    sets = {"a": PROMPTS[:2]}
    for eval_cfg, want in ((EvalConfig(prompt_data=(("a", "a.jsonl"),)), 32),
                           (EvalConfig(prompt_data=(("a", "a.jsonl"),), max_context_len=48), 48)):
        engine = Recording([[1]])
        asyncio.run(executor(engine, eval_cfg, sets, max_context_len=32).evaluate(0))
        assert engine.params[0].max_context_len == want
