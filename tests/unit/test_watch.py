"""The driver's checks on each trained rollout: a run that learns nothing is warned about, --ci-test fails."""

from __future__ import annotations

import types

import pytest

from miles.config import AlgorithmConfig, DataConfig, ModelConfig, RolloutConfig, RunConfig
from miles.metrics.watch import ZERO_VARIANCE_ROLLOUTS, CICheckFailed, ci_checks, watch_reward_variance


class Events:
    def __init__(self):
        self.events = []

    def emit(self, event, **fields):
        self.events.append((event, fields))


def ctx(overlapped=False, **run):
    cfg = RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(rollout_shuffle=True, prompt_data="p.jsonl"),
                    rollout=RolloutConfig(batch_size=2, n_samples_per_prompt=4), num_rollout=10, **run)
    return types.SimpleNamespace(cfg=cfg, tracer=Events(), zero_variance_streak=0, start_rollout=0, resumed=False,
                                 overlapped=overlapped)


def test_equal_rewards_in_every_group_for_several_rollouts_is_a_warning_until_signal_returns():
    c = ctx()
    flat = {"zero_std_group_ratio": 1.0, "reward_mean": 0.0}
    fields = [watch_reward_variance(c, flat) for _ in range(ZERO_VARIANCE_ROLLOUTS + 1)]
    assert fields[:ZERO_VARIANCE_ROLLOUTS - 1] == [{}] * (ZERO_VARIANCE_ROLLOUTS - 1)
    assert fields[-2:] == [{"zero_variance_rollouts": 3}, {"zero_variance_rollouts": 4}]
    warnings = [f for e, f in c.tracer.events if e == "warning"]
    assert len(warnings) == 1 and warnings[0]["code"] == "zero_reward_variance"      # once per streak
    assert "check the reward function and --label-key" in warnings[0]["message"]
    assert watch_reward_variance(c, {"zero_std_group_ratio": 0.5}) == {} and c.zero_variance_streak == 0


def test_sft_has_no_reward_variance_to_watch():
    c = ctx(algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", loss_type="sft_loss"))
    assert [watch_reward_variance(c, {"zero_std_group_ratio": 1.0}) for _ in range(5)] == [{}] * 5


def test_ci_checks_fail_on_a_logprob_gap_and_on_a_reference_that_is_not_the_start():
    c = ctx(ci_test=True)
    ci_checks(c, 0, {"logprob_diff_rollout": 1e-6, "ref_logprob_diff_max": 0.0})
    assert c.tracer.events[-1] == ("ci_checked", {"rollout_id": 0, "logprob_diff": 1e-6, "ref_diff": 0.0})
    with pytest.raises(CICheckFailed, match="engine and trainer logprobs differ by 0.3"):
        ci_checks(c, 1, {"logprob_diff_rollout": 0.3})
    with pytest.raises(CICheckFailed, match="the reference differs from the initial policy"):
        ci_checks(c, 0, {"logprob_diff_rollout": 0.0, "ref_logprob_diff_max": 0.1})
    ci_checks(c, 3, {"logprob_diff_rollout": 0.0, "ref_logprob_diff_max": 0.1})     # later: the policy moved
    c.resumed = True
    ci_checks(c, 0, {"logprob_diff_rollout": 0.0, "ref_logprob_diff_max": 0.1})     # resumed: it moved before
    quiet = ctx()
    ci_checks(quiet, 0, {"logprob_diff_rollout": 5.0})                               # without --ci-test: nothing
    assert quiet.tracer.events == []


@pytest.mark.parametrize("machine", [{"fully_async": True}, {}])      # fully_async, and the one-step-off async
def test_on_overlapped_machines_ci_test_compares_logprobs_only_at_steps_the_trainers_weights_generated(machine):
    c = ctx(overlapped=True, ci_test=True, **machine)
    with pytest.raises(CICheckFailed, match="engine and trainer logprobs differ by 0.3"):
        ci_checks(c, 0, {"logprob_diff_rollout": 0.3, "staleness_max": 0.0})      # fresh groups: checked
    ci_checks(c, 2, {"logprob_diff_rollout": 0.3, "staleness_max": 1.0})          # older weights sampled them
    assert c.tracer.events[-1] == ("ci_checked", {"rollout_id": 2, "logprob_diff": None, "ref_diff": None,
                                                  "logprob_check": "skipped: groups up to 1 weight version(s) "
                                                                   "older than the trainer's"})
    with pytest.raises(CICheckFailed):        # sync (partial rollouts masked to their fresh tokens): checked
        ci_checks(ctx(ci_test=True), 2, {"logprob_diff_rollout": 0.3, "staleness_max": 1.0})
