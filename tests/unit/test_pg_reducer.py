"""--custom-pg-loss-reducer-function-path (miles.training.pg_reducer): miles' reducer factory gets
miles' arguments cut out of the [B, T] rows, reduces the policy loss only, and its result is divided
by the global batch's normalizer; miles' default reducer reproduces --loss-agg-mode's reductions."""

from __future__ import annotations

import pytest
import torch

from miles.config import AlgorithmConfig, ConfigError, RolloutConfig
from miles.training.batch import make_train_batch
from miles.training.pg_reducer import load_reducer, response_spans
from miles.training.terms import PolicyObjective, TermSums
from tests.unit.test_trainer import SAMPLES, sample

HERE = "tests.unit.test_pg_reducer"
SEEN: list[tuple] = []
DIVISOR = 4.0


def sum_of_sample_mean(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    """miles' default reducer, written out: each sample's masked token mean (or token sum), summed."""
    SEEN.append((list(total_lengths), list(response_lengths), [m.tolist() for m in loss_masks],
                 calculate_per_token_loss))

    def reduce(x):
        parts = x.split(response_lengths)
        if calculate_per_token_loss:
            return sum((p * m).sum() for p, m in zip(parts, loss_masks))
        return sum((p * m).sum() / m.sum().clamp(min=1) for p, m in zip(parts, loss_masks))
    return reduce


def dr_grpo(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    """Dr. GRPO as miles' example writes it: each sample's masked token sum over a constant."""
    return lambda x: sum((p * m).sum() / DIVISOR for p, m in zip(x.split(response_lengths), loss_masks))


def a_list(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    return lambda x: [x.sum()]


def three_arguments(total_lengths, response_lengths, loss_masks):
    return None


def objective(**algorithm) -> PolicyObjective:
    return PolicyObjective(AlgorithmConfig(**{"kl_loss_type": "k3", **algorithm}),
                           RolloutConfig(n_samples_per_prompt=4, batch_size=1, max_response_len=8))


def loss_and_grad(obj: PolicyObjective, samples=SAMPLES):
    batch = make_train_batch(samples, 0)
    torch.manual_seed(0)
    lp = torch.where(batch.loss_mask, -torch.rand(batch.tokens.shape) - 0.1, 0.0).requires_grad_()
    obj.prepare(batch, lp.detach().clone(), None, None)
    normalizer, num_tokens = obj.normalizers(batch)
    loss, terms = obj.loss(lp, torch.ones_like(lp), batch, normalizer, num_tokens)
    loss.backward()
    sums = TermSums()
    sums.add(terms)
    return sums.floats(), lp.grad


def test_response_spans_start_at_the_first_trained_token_and_are_empty_without_one():
    # rows: prompt 2 + response 3; prompt 1 + response 2 (nothing trained: an aborted sample)
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 0, 1], [0, 0, 0, 0, 0]])
    assert response_spans(attention, mask) == ([5, 3], [2, 3])


@pytest.mark.parametrize("mode, per_token", [("seq_mean_token_mean", False), ("token_mean", True)])
def test_miles_default_reducer_gives_the_agg_modes_loss_and_gradient(mode, per_token):
    seen = load_reducer(f"{HERE}:sum_of_sample_mean").__globals__["SEEN"]   # the module as the trainer imports it
    seen.clear()
    default, default_grad = loss_and_grad(objective(loss_agg_mode=mode, entropy_coef=0.01))
    custom, custom_grad = loss_and_grad(objective(loss_agg_mode=mode, entropy_coef=0.01,
                                                  pg_loss_reducer_path=f"{HERE}:sum_of_sample_mean"))
    assert custom == pytest.approx(default)
    torch.testing.assert_close(custom_grad, default_grad)
    # miles' arguments: SAMPLES' prompts 3, 1, 4, 2 tokens and responses 5, 2, 7, 1, every response token trained
    (totals, lengths, masks, flag), = seen
    assert (totals, lengths, flag) == ([8, 3, 11, 3], [5, 2, 7, 1], per_token)
    assert masks == [[1.0] * n for n in (5, 2, 7, 1)]


def test_dr_grpo_reducer_divides_each_samples_token_sum_by_its_constant():
    samples = [sample([1], [2, 3], 1.0), sample([1, 1], [4], -1.0)]
    batch = make_train_batch(samples, 0)
    # the policy loss at ratio 1 is -advantage per token: sample 1 sums -1 * 2 tokens, sample 2 +1 * 1;
    # over DIVISOR 4 each: -0.5 + 0.25, then over the global batch's 2 sequences: -0.125
    terms, _ = loss_and_grad(objective(loss_agg_mode="seq_mean_token_mean", pg_loss_reducer_path=f"{HERE}:dr_grpo"),
                             samples)
    assert batch.size == 2 and terms["pg_loss"] == pytest.approx(-0.125)


def test_the_reducer_reduces_the_policy_loss_only():
    plain, _ = loss_and_grad(objective(loss_agg_mode="seq_mean_token_mean", entropy_coef=0.01))
    custom, _ = loss_and_grad(objective(loss_agg_mode="seq_mean_token_mean", entropy_coef=0.01,
                                        pg_loss_reducer_path=f"{HERE}:dr_grpo"))
    assert custom["pg_loss"] != pytest.approx(plain["pg_loss"])
    assert custom["entropy"] == pytest.approx(plain["entropy"]) and custom["clip_frac"] == plain["clip_frac"]


def test_bad_reducers_are_named():
    with pytest.raises(ConfigError, match=r"--custom-pg-loss-reducer-function-path .*three_arguments.*cannot be "
                                          r"called as get_reducer\(total_lengths"):
        load_reducer(f"{HERE}:three_arguments")
    with pytest.raises(TypeError, match=r"--custom-pg-loss-reducer-function-path .*a_list: its reducer returned "
                                        r"list; expected a scalar tensor"):
        loss_and_grad(objective(loss_agg_mode="token_mean", pg_loss_reducer_path=f"{HERE}:a_list"))


def test_the_reducer_needs_the_policy_loss(tmp_path):
    from miles.config.flags import parse_flags

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text('{"input": "1+1=", "label": "2"}\n')
    argv = ["--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(tmp_path / "train.jsonl"),
            "--rollout-batch-size", "1", "--n-samples-per-prompt", "1", "--num-rollout", "1",
            "--loss-type", "sft_loss", "--custom-pg-loss-reducer-function-path", f"{HERE}:dr_grpo"]
    with pytest.raises(ConfigError, match="--loss-type sft_loss has none"):
        parse_flags(argv)
