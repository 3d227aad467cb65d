"""The per-token loss mask of multi-turn samples through the batch, every loss reduction, the policy
losses and every advantage estimator, with numbers derived by hand.

The batch: three samples packed by `make_train_batch` (pad id 0).
- A: prompt [5, 6]; response = model [7, 8] (logprobs -0.1, -0.2), tool [9, 10], model [11] (-0.3).
  Positions 0..6, trained positions 2, 3, 6; the tool tokens 4, 5 are not trained.
- B: prompt [5]; single-turn response [12] (-0.5). Trained position 1.
- C: prompt [5]; response [13, 14], status failed: nothing trained.
Wherever a value sits at an untrained position (tool tokens, C, padding) the tests put garbage
(100, NaN) there, so a leak would show.
"""

from __future__ import annotations

import math

import pytest
import torch

from miles.algorithms import (
    NORMALIZER_COUNTS, broadcast_to_tokens, gae, get_kl_estimator, grpo_advantages, gspo_loss, last_token_rewards,
    normalize_advantages, ppo_clip_loss, reinforce_plus_plus_baseline_advantages, reinforce_plus_plus_returns,
    rloo_advantages, seq_mean_token_mean, seq_mean_token_sum_norm, sft_loss, token_mean,
)
from miles.training.batch import make_train_batch, split
from miles.types import Prompt, Sample

torch.set_num_threads(1)
NAN = float("nan")


def sample_a() -> Sample:
    s = Sample(prompt=Prompt(index=0, text="", prompt_ids=(5, 6)), group=0, response_ids=[], rollout_logprobs=[],
               finish_reason="stop", weight_version=0, reward=1.0, advantage=0.5)
    s.append([7, 8], [-0.1, -0.2], trained=True)
    s.append([9, 10], trained=False)
    s.append([11], [-0.3], trained=True)
    return s


def samples() -> list[Sample]:
    b = Sample(prompt=Prompt(index=1, text="", prompt_ids=(5,)), group=0, response_ids=[12], rollout_logprobs=[-0.5],
               finish_reason="stop", weight_version=0, reward=0.0, advantage=-0.5)
    c = Sample(prompt=Prompt(index=2, text="", prompt_ids=(5,)), group=0, response_ids=[13, 14],
               rollout_logprobs=[-0.7, -0.8], finish_reason="stop", weight_version=0, reward=0.0, advantage=0.0,
               status="failed", error="tool raised")
    return [sample_a(), b, c]


MASK = [[0, 0, 1, 1, 0, 0, 1], [0, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]]


def per_token(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# values 1, 2, 3 on A's trained tokens, 4 on B's; garbage everywhere else
LOSS = per_token([[100, 100, 1, 2, 100, 100, 3], [100, 4, 100, 100, 100, 100, 100],
                  [100, 100, 100, 100, 100, 100, 100]])


def test_sample_append_keeps_the_three_lists_aligned():
    a = sample_a()
    assert a.response_ids == [7, 8, 9, 10, 11]
    assert a.loss_mask == [1, 1, 0, 0, 1]
    assert a.rollout_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert a.num_model_tokens == 3 and a.tokens == [5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="logprobs"):
        a.append([1, 2], [-0.1], trained=True)


def test_batch_masks_tool_tokens_and_untrainable_samples():
    batch = make_train_batch(samples(), pad_id=0)
    assert batch.tokens.tolist() == [[5, 6, 7, 8, 9, 10, 11], [5, 12, 0, 0, 0, 0, 0], [5, 13, 14, 0, 0, 0, 0]]
    assert batch.loss_mask.int().tolist() == MASK
    assert batch.attention_mask.tolist() == [[1] * 7, [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0]]
    # the advantage on trained tokens only; the reward on the last trained token (A's is position 6)
    assert batch.advantages.tolist() == [[0, 0, .5, .5, 0, 0, .5], [0, -.5, 0, 0, 0, 0, 0], [0] * 7]
    assert batch.token_rewards.tolist() == [[0, 0, 0, 0, 0, 0, 1], [0] * 7, [0] * 7]
    lp = batch.rollout_logprobs
    assert torch.allclose(lp, torch.tensor([[0, 0, -.1, -.2, 0, 0, -.3], [0, -.5, 0, 0, 0, 0, 0], [0] * 7]))
    assert batch.num_tokens == 4


def test_batch_rejects_a_mask_of_the_wrong_length():
    a = sample_a()
    a.loss_mask = [1, 1]
    with pytest.raises(ValueError, match="loss mask of 2"):
        make_train_batch([a], pad_id=0)


def test_reward_of_a_trajectory_ending_in_tool_tokens_sits_on_the_last_model_token():
    a = sample_a()
    a.append([9], trained=False)              # max turns reached after a tool answer
    assert make_train_batch([a], pad_id=0).token_rewards.tolist() == [[0, 0, 0, 0, 0, 0, 1, 0]]


# --- reductions -----------------------------------------------------------------------------------

def test_token_mean_counts_only_trained_tokens():
    mask = make_train_batch(samples(), 0).loss_mask
    # (1 + 2 + 3 + 4) / 4 trained tokens
    assert token_mean(LOSS, mask).item() == 2.5
    assert NORMALIZER_COUNTS["token_mean"](mask) == 4


def test_seq_mean_token_mean_averages_each_sequence_over_its_trained_tokens():
    mask = make_train_batch(samples(), 0).loss_mask
    # A: (1 + 2 + 3) / 3 = 2 (not / 5 response tokens); B: 4; C has none and is not a sequence: (2 + 4) / 2
    assert seq_mean_token_mean(LOSS, mask).item() == 3.0
    assert NORMALIZER_COUNTS["seq_mean_token_mean"](mask) == 2


def test_seq_mean_token_sum_norm_sums_trained_tokens():
    mask = make_train_batch(samples(), 0).loss_mask
    # A: 6 / 5 = 1.2; B: 4 / 5 = 0.8; mean over the 2 sequences = 1.0
    assert seq_mean_token_sum_norm(LOSS, mask, max_len=5).item() == pytest.approx(1.0, abs=1e-12)
    assert NORMALIZER_COUNTS["seq_mean_token_sum_norm"](mask) == 2


def test_micro_batches_split_between_turns_sum_to_the_global_token_mean():
    batch = make_train_batch(samples(), 0)
    n = NORMALIZER_COUNTS["token_mean"](batch.loss_mask)
    pieces = split(batch, 1)
    assert [mb.tokens.shape[1] for mb in pieces] == [7, 2, 3]     # each piece drops its padding columns
    total = sum(token_mean(LOSS[i:i + 1, :mb.tokens.shape[1]], mb.loss_mask, normalizer=n).item()
                for i, mb in enumerate(pieces))
    assert total == 2.5     # 6 / 4 + 4 / 4 + 0


# --- policy losses ----------------------------------------------------------------------------------

def batch_with_logprobs(new_minus_old: list[list[float]]):
    """logprobs = old + delta on the batch; old = the rollout logprobs; NaN at every untrained position."""
    batch = make_train_batch(samples(), 0)
    mask = batch.loss_mask
    old = batch.rollout_logprobs.double()
    new = old + per_token(new_minus_old)
    new = torch.where(mask, new, torch.full_like(new, NAN))
    return batch, new, old, batch.advantages.double(), mask


def test_ppo_loss_over_a_multi_turn_batch():
    batch, new, old, adv, mask = batch_with_logprobs([[0] * 7] * 3)
    # ratio 1: loss -A per trained token: A's three -0.5, B's +0.5 -> (-1.5 + 0.5) / 4
    loss, metrics = ppo_clip_loss(new, old, adv, mask, eps_clip=0.2)
    assert loss.item() == pytest.approx(-0.25, abs=1e-12)
    assert metrics["clip_frac"].item() == 0.0 and math.isfinite(metrics["approx_kl"].item())


def test_ppo_gradient_reaches_trained_tokens_only():
    batch, new, old, adv, mask = batch_with_logprobs([[0] * 7] * 3)
    new = torch.where(mask, new, torch.zeros_like(new)).requires_grad_(True)
    loss, _ = ppo_clip_loss(new, old, adv, mask, eps_clip=0.2)
    loss.backward()
    # d/dlogp (-A e^{logp - old}) / 4 = -A / 4 at ratio 1
    assert new.grad.tolist() == [[0, 0, -.125, -.125, 0, 0, -.125], [0, .125, 0, 0, 0, 0, 0], [0] * 7]


def test_gspo_sequence_ratio_is_the_mean_over_trained_tokens():
    # A's log-ratios 0.1, 0.2, 0.3 on its trained tokens (and 5.0 on its tool tokens, which must not count)
    batch, new, old, adv, mask = batch_with_logprobs([[0, 0, .1, .2, 5, 5, .3], [0] * 7, [0] * 7])
    loss, _ = gspo_loss(new, old, adv, mask, eps_clip=0.5)
    # s_A = exp(0.2) = 1.2214027582 on A's 3 tokens with A = 0.5; s_B = 1 with A = -0.5:
    # (3 * -0.5 * 1.2214027582 + 0.5) / 4 = -0.3330260343
    assert loss.item() == pytest.approx((3 * -0.5 * math.exp(0.2) + 0.5) / 4, abs=1e-12)
    assert loss.item() == pytest.approx(-0.3330260343, abs=1e-9)


def test_sft_loss_and_kl_term_count_trained_tokens():
    batch = make_train_batch(samples(), 0)
    mask, lp = batch.loss_mask, batch.rollout_logprobs.double()
    lp = torch.where(mask, lp, torch.full_like(lp, NAN))
    # NLL (0.1 + 0.2 + 0.3 + 0.5) / 4
    assert sft_loss(lp, mask).item() == pytest.approx(0.275, abs=1e-6)   # logprobs are stored in float32
    ref = torch.where(mask, lp - 0.1, torch.full_like(lp, NAN))
    # k1 = logp - ref = 0.1 on each trained token
    assert token_mean(get_kl_estimator("k1")(lp, ref), mask).item() == pytest.approx(0.1, abs=1e-6)


# --- advantage estimators ----------------------------------------------------------------------------

def test_normalize_advantages_whitens_over_trained_tokens():
    batch = make_train_batch(samples(), 0)
    out = normalize_advantages(batch.advantages.double(), batch.loss_mask)
    # trained values .5 .5 .5 -.5: mean .25, population var (3 * .0625 + .5625) / 4 = .1875
    std = math.sqrt(0.1875)
    assert out[0].tolist() == pytest.approx([0, 0, .25 / std, .25 / std, 0, 0, .25 / std], abs=1e-6)
    assert out[1].tolist() == pytest.approx([0, -.75 / std, 0, 0, 0, 0, 0], abs=1e-6)
    assert out[2].tolist() == [0] * 7


def test_broadcast_and_last_token_rewards_follow_the_mask():
    mask = make_train_batch(samples(), 0).loss_mask
    assert broadcast_to_tokens(torch.tensor([2.0, 3.0, 4.0]), mask).tolist() == \
        [[0, 0, 2, 2, 0, 0, 2], [0, 3, 0, 0, 0, 0, 0], [0] * 7]
    assert last_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask).tolist() == \
        [[0, 0, 0, 0, 0, 0, 1], [0, 2, 0, 0, 0, 0, 0], [0] * 7]


def test_reinforce_plus_plus_returns_skip_tool_tokens_without_discounting():
    batch = make_train_batch(samples(), 0)
    out = reinforce_plus_plus_returns(batch.token_rewards.double(), batch.loss_mask, gamma=0.5)
    # A: G6 = 1; G3 = 0.5 * G6 = 0.5 (the tool tokens 4, 5 are skipped, not discounted); G2 = 0.25
    assert out.tolist() == [[0, 0, .25, .5, 0, 0, 1], [0] * 7, [0] * 7]


def test_gae_skips_tool_tokens_and_their_values():
    batch = make_train_batch(samples(), 0)
    values = per_token([[9.9, 9.9, .1, .2, 9.9, 9.9, .3], [9.9, 0.0, 9.9, 9.9, 9.9, 9.9, 9.9], [9.9] * 7])
    adv, ret = gae(batch.token_rewards.double(), values, batch.loss_mask, gamma=0.9, lambd=0.5)
    # A: d6 = 1 - .3 = .7, A6 = .7; d3 = .9 * .3 - .2 = .07, A3 = .07 + .45 * .7 = .385;
    #    d2 = .9 * .2 - .1 = .08, A2 = .08 + .45 * .385 = .25325
    assert adv[0].tolist() == pytest.approx([0, 0, .25325, .385, 0, 0, .7], abs=1e-12)
    assert ret[0].tolist() == pytest.approx([0, 0, .35325, .585, 0, 0, 1.0], abs=1e-12)
    assert adv[1].tolist() == [0] * 7 and adv[2].tolist() == [0] * 7   # B: reward 0, V 0; C: nothing


VALID = torch.tensor([True, True, False, True])   # the third sample of group [1, 0, x, 0] failed


def test_grpo_leaves_failed_samples_out_of_the_group():
    r = torch.tensor([1.0, 0.0, 7.0, 0.0], dtype=torch.float64)
    # valid [1, 0, 0]: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    s = math.sqrt(1 / 3)
    adv = grpo_advantages(r, 4, mask=VALID, eps=0.0)
    assert adv.tolist() == pytest.approx([(2 / 3) / s, (-1 / 3) / s, 0.0, (-1 / 3) / s], abs=1e-12)
    assert grpo_advantages(r, 4, std_norm=False, mask=VALID).tolist() == pytest.approx([2 / 3, -1 / 3, 0, -1 / 3])
    # every sample valid: exactly the unmasked numbers
    assert torch.equal(grpo_advantages(r, 4, mask=torch.ones(4, dtype=torch.bool)), grpo_advantages(r, 4))


def test_grpo_group_with_one_valid_sample_gets_zero():
    adv = grpo_advantages(torch.tensor([1.0, 5.0]), 2, mask=torch.tensor([True, False]))
    assert adv.tolist() == [0.0, 0.0]


def test_rloo_and_reinforce_baseline_leave_failed_samples_out():
    r = torch.tensor([1.0, 0.0, 7.0, 0.0], dtype=torch.float64)
    # rloo: sample 0: 1 - (0 + 0) / 2 = 1; samples 1, 3: 0 - (1 + 0) / 2 = -0.5
    assert rloo_advantages(r, 4, mask=VALID).tolist() == [1.0, -0.5, 0.0, -0.5]
    # baseline: r - 1/3
    assert reinforce_plus_plus_baseline_advantages(r, 4, mask=VALID).tolist() == \
        pytest.approx([2 / 3, -1 / 3, 0.0, -1 / 3])
    assert rloo_advantages(torch.tensor([1.0, 3.0]), 2, mask=torch.tensor([False, True])).tolist() == [0.0, 0.0]
