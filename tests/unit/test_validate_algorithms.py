"""Algorithm flags: exclusive or meaningless combinations are reported, naming the flags and the fix."""

import pytest

from miles.config.flags import parse_flags
from miles.config import ConfigError


@pytest.fixture
def base(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text('{"input": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(tmp_path / "train.jsonl"),
            "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--num-rollout", "1"]


def problems(argv):
    with pytest.raises(ConfigError) as err:
        parse_flags(argv)
    return "\n".join(err.value.problems)


@pytest.mark.parametrize("flags, message", [
    (["--kl-coef", "0.1", "--use-kl-loss", "--advantage-estimator", "ppo"], "mutually exclusive"),
    (["--kl-coef", "0.1"], "only ppo and reinforce_plus_plus use; with --advantage-estimator grpo use --use-kl-loss"),
    (["--use-tis", "--use-rollout-logprobs"], "keep one"),
    (["--critic-lr", "1e-5", "--num-critic-only-steps", "2"], "only PPO has a critic"),
    (["--ref-update-interval", "4"], "has no effect without a reference"),
    (["--over-sampling-batch-size", "8"], "no effect without --dynamic-sampling-filter-path"),
    (["--overlong-buffer-len", "100", "--rollout-max-response-len", "64"], "--overlong-buffer-len 100"),
    (["--loss-type", "sft_loss", "--use-tis"], "SFT reads one response per prompt"),
    (["--loss-type", "sft_loss", "--n-samples-per-prompt", "1", "--use-tis"], "--use-tis do not apply"),
    (["--gamma", "1.5"], "--gamma 1.5"),
    (["--loss-type", "sft_loss", "--n-samples-per-prompt", "1", "--use-opsm"], "--use-opsm masks sequences"),
    (["--use-opsm", "--opsm-delta", "-0.1"], "--opsm-delta -0.1: must be a finite threshold >= 0"),
])
def test_bad_algorithm_flags_are_named(base, flags, message):
    assert message in problems(base + flags)


def test_recipes_from_the_docs_validate(base):
    for flags in (["--advantage-estimator", "ppo", "--kl-coef", "0.05", "--critic-lr", "1e-5", "--value-clip", "0.2",
                   "--num-critic-only-steps", "1", "--normalize-advantages", "--lambd", "0.95"],
                  ["--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.01", "--gamma", "0.99"],
                  ["--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl", "--ref-update-interval", "2"],
                  ["--dynamic-sampling-filter-path", "miles.rollout.filters:check_reward_nonzero_std",
                   "--over-sampling-batch-size", "1", "--eps-clip-high", "0.28", "--overlong-buffer-len", "16"],
                  ["--use-tis", "--tis-clip", "2", "--tis-clip-low", "0.5", "--loss-agg-mode", "seq_mean_token_sum_norm"],
                  ["--loss-type", "sft_loss", "--n-samples-per-prompt", "1", "--response-key", "answer"]):
        parse_flags(base + flags)          # a documented recipe that stopped validating raises ConfigError here


def test_algorithm_names_have_one_list():
    from typing import get_type_hints

    from miles.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_REDUCTIONS, TOKEN_LEVEL_ESTIMATORS
    from miles.algorithms import names
    from miles.config import AlgorithmConfig
    from miles.config.flags import BY_DEST

    assert {*ADVANTAGE_ESTIMATORS, *TOKEN_LEVEL_ESTIMATORS} == set(names.ADVANTAGE_ESTIMATOR_NAMES)
    assert set(KL_ESTIMATORS) == set(names.KL_LOSS_TYPES) and set(LOSS_REDUCTIONS) == set(names.LOSS_AGG_MODES)
    hints = get_type_hints(AlgorithmConfig)
    for dest, field, literal in (("advantage_estimator", "advantage_estimator", names.AdvantageEstimator),
                                 ("loss_type", "loss_type", names.LossType),
                                 ("loss_agg_mode", "loss_agg_mode", names.LossAggMode),
                                 ("kl_loss_type", "kl_loss_type", names.KlLossType)):
        assert hints[field] == literal
        assert set(BY_DEST[dest].choices) == set(literal.__args__)


def test_a_config_built_in_code_gets_its_names_checked(base):
    from dataclasses import replace

    from miles.config.validate import validate

    cfg, _ = parse_flags(base)
    bad = replace(cfg, algorithm=replace(cfg.algorithm, loss_agg_mode="sum", kl_loss_type="k9"))
    with pytest.raises(ConfigError) as err:
        validate(bad)
    assert "--loss-agg-mode sum: not one of token_mean" in str(err.value)
    assert "--kl-loss-type k9: not one of k1, k2, k3, low_var_kl" in str(err.value)
