"""Advantage estimators: hand-derived numbers, padding and degenerate groups, properties."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from miles.algorithms import (
    broadcast_to_tokens,
    gae,
    get_advantage_estimator,
    grpo_advantages,
    last_token_rewards,
    normalize_advantages,
    reinforce_plus_plus_baseline_advantages,
    reinforce_plus_plus_returns,
    rloo_advantages,
)

torch.set_num_threads(1)
F64 = torch.float64


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def close(a, b, tol=1e-9):
    return torch.allclose(a, t(b) if not isinstance(b, torch.Tensor) else b, atol=tol, rtol=0)


# --- sequence-level ------------------------------------------------------------------------------

def test_grpo_centers_and_divides_by_unbiased_std():
    # group [1, 0]: mean .5, centered [.5, -.5], unbiased std sqrt((.25 + .25) / 1) = sqrt(.5) -> ±1/sqrt(2)
    # group [3, 3]: centered 0, std 0 -> 0 / eps = 0
    adv = grpo_advantages(t([1.0, 0.0, 3.0, 3.0]), 2, eps=1e-12)
    s = 1 / math.sqrt(2)
    assert close(adv, [s, -s, 0.0, 0.0], 1e-9)


def test_grpo_group_of_four():
    # [1, 0, 0, 0]: mean .25, centered [.75, -.25, -.25, -.25], unbiased var (.5625 + 3 * .0625) / 3 = .25,
    # std .5 -> [1.5, -.5, -.5, -.5]
    assert close(grpo_advantages(t([1.0, 0, 0, 0]), 4, eps=1e-12), [1.5, -0.5, -0.5, -0.5])


def test_grpo_without_std_norm_only_centers():
    # groups [1, 0] and [3, 5]: means .5 and 4
    assert grpo_advantages(t([1.0, 0.0, 3.0, 5.0]), 2, std_norm=False).tolist() == [0.5, -0.5, -1.0, 1.0]


def test_grpo_all_equal_rewards_give_zero_not_nan():
    adv = grpo_advantages(torch.full((8,), 0.7), 4)
    assert torch.isfinite(adv).all() and (adv == 0).all()


def test_rloo_leave_one_out_baseline():
    # [1, 0, 0, 0]: 1 - mean(0, 0, 0) = 1; 0 - mean(1, 0, 0) = -1/3
    assert close(rloo_advantages(t([1.0, 0, 0, 0]), 4), [1.0, -1 / 3, -1 / 3, -1 / 3])


def test_reinforce_plus_plus_baseline_subtracts_group_mean():
    # groups [2, 4] (mean 3) and [1, 1] (mean 1)
    assert reinforce_plus_plus_baseline_advantages(t([2.0, 4.0, 1.0, 1.0]), 2).tolist() == [-1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("call", [
    lambda: grpo_advantages(torch.zeros(6), 4),                   # 6 rewards, groups of 4
    lambda: grpo_advantages(torch.zeros(3), 1),                   # unbiased std of one sample
    lambda: rloo_advantages(torch.zeros(3), 1),                   # no other sample
    lambda: grpo_advantages(torch.zeros(2, 2), 2),                # not 1-D
])
def test_bad_shapes_and_group_sizes_raise(call):
    with pytest.raises(ValueError):
        call()


def test_grpo_group_size_one_without_std_norm_is_zero():
    assert grpo_advantages(t([1.0, 2.0]), 1, std_norm=False).tolist() == [0.0, 0.0]


def test_normalize_advantages_whitens_with_population_std():
    # [1, 2, 3, 4]: mean 2.5, population var (2.25 + .25 + .25 + 2.25) / 4 = 1.25
    adv = normalize_advantages(t([1.0, 2.0, 3.0, 4.0]), eps=0.0)
    assert close(adv, [x / math.sqrt(1.25) for x in (-1.5, -0.5, 0.5, 1.5)])


def test_normalize_advantages_uses_masked_entries_only():
    # kept 1, 3, 2: mean 2, var (1 + 1 + 0) / 3 = 2/3; the 100, NaN and 7 are padding
    x = t([[1.0, 3.0, 100.0], [2.0, float("nan"), 7.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    s = math.sqrt(2 / 3)
    assert close(normalize_advantages(x, mask, eps=0.0), [[-1 / s, 1 / s, 0.0], [0.0, 0.0, 0.0]])


def test_normalize_advantages_empty_mask_is_zero():
    out = normalize_advantages(t([[1.0, 2.0]]), torch.zeros(1, 2, dtype=torch.bool))
    assert out.tolist() == [[0.0, 0.0]]


def test_broadcast_to_tokens_fills_response_tokens_only():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert broadcast_to_tokens(t([2.0, -1.0]), mask).tolist() == [[0, 2, 2, 0], [0, 0, -1, -1]]
    with pytest.raises(ValueError):
        broadcast_to_tokens(t([2.0]), mask)


def test_last_token_rewards_skips_padding_and_empty_rows():
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    out = last_token_rewards(t([1.0, 2.0, 3.0]), mask)
    assert out.tolist() == [[0, 0, 1, 0], [0, 0, 0, 2], [0, 0, 0, 0]]


def test_registry_binds_options_and_rejects_token_level_and_unknown():
    r = t([1.0, 0.0, 3.0, 5.0])
    assert get_advantage_estimator("grpo", std_norm=False)(r, 2).tolist() == [0.5, -0.5, -1.0, 1.0]
    assert torch.equal(get_advantage_estimator("gspo")(r, 2), grpo_advantages(r, 2))
    with pytest.raises(TypeError, match="std_norm"):
        get_advantage_estimator("rloo", std_norm=False)
    with pytest.raises(ValueError, match="token-level"):
        get_advantage_estimator("ppo")
    with pytest.raises(ValueError, match="grpo, gspo, reinforce_plus_plus_baseline, rloo"):
        get_advantage_estimator("grpoo")


# --- token-level ---------------------------------------------------------------------------------

def test_reinforce_plus_plus_returns_discounts_back_from_last_token():
    # prompt token, 3 response tokens, 1 pad; reward 1 on t=3, gamma .5: G3 = 1, G2 = .5, G1 = .25
    mask = torch.tensor([[0, 1, 1, 1, 0]], dtype=torch.bool)
    rewards = t([[5.0, 0.0, 0.0, 1.0, 9.0]])  # 5 and 9 sit off the mask and must be ignored
    assert close(reinforce_plus_plus_returns(rewards, mask, 0.5), [[0, 0.25, 0.5, 1.0, 0]])


def test_reinforce_plus_plus_returns_with_kl_penalty():
    # r' = r - .5 kl on t=1..3: [-.05, -.1, 1 - .2 = .8]; G3 = .8, G2 = -.1 + .5 * .8 = .3, G1 = -.05 + .15 = .1
    mask = torch.tensor([[0, 1, 1, 1, 0]], dtype=torch.bool)
    kl = t([[3.0, 0.1, 0.2, 0.4, 9.0]])
    out = reinforce_plus_plus_returns(t([[0, 0, 0, 1.0, 0]]), mask, 0.5, kl=kl, kl_coef=0.5)
    assert close(out, [[0, 0.1, 0.3, 0.8, 0]])


def test_reinforce_plus_plus_returns_skips_masked_hole():
    # t=1 is tool output: G2 = 1, t=1 carries 1 through undiscounted, G0 = .5 * 1
    out = reinforce_plus_plus_returns(t([[0, 7.0, 1.0]]), torch.tensor([[1, 0, 1]], dtype=torch.bool), 0.5)
    assert close(out, [[0.5, 0.0, 1.0]])


def test_gae_hand_computed():
    # response tokens t=1,2; values at t=0 (prompt) and t=3 (pad) are garbage; reward 1 on t=2
    # gamma .9, lambda .5: delta2 = 1 + 0 - .25 = .75, A2 = .75
    #   delta1 = 0 + .9 * .25 - .5 = -.275, A1 = -.275 + .9 * .5 * .75 = .0625
    # returns = A + V: [.5625, 1.0]
    mask = torch.tensor([[0, 1, 1, 0]], dtype=torch.bool)
    adv, ret = gae(t([[0, 0, 1.0, 0]]), t([[9.0, 0.5, 0.25, 7.0]]), mask, 0.9, 0.5)
    assert close(adv, [[0, 0.0625, 0.75, 0]])
    assert close(ret, [[0, 0.5625, 1.0, 0]])


def test_gae_skips_masked_hole_like_contiguous():
    # mask [1, 0, 1] with V = [.5, 100, .25], reward 1 at t=2, gamma = lambda = 1:
    # A2 = 1 - .25 = .75; the hole is skipped; delta0 = 0 + .25 - .5 = -.25, A0 = -.25 + .75 = .5
    adv, _ = gae(t([[0, 0, 1.0]]), t([[0.5, 100.0, 0.25]]), torch.tensor([[1, 0, 1]], dtype=torch.bool), 1.0, 1.0)
    assert close(adv, [[0.5, 0.0, 0.75]])


def test_gae_ignores_right_padding():
    mask = torch.tensor([[0, 1, 1]], dtype=torch.bool)
    r, v = t([[0, 0.3, 1.0]]), t([[0.1, 0.5, 0.2]])
    adv, ret = gae(r, v, mask, 0.95, 0.9)
    padded = torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)], dim=1)
    r_p, v_p = torch.cat([r, t([[4.0, 5.0, 6.0]])], 1), torch.cat([v, t([[7.0, 8.0, 9.0]])], 1)
    adv_p, ret_p = gae(r_p, v_p, padded, 0.95, 0.9)
    assert torch.equal(adv_p[:, :3], adv) and torch.equal(ret_p[:, :3], ret)
    assert (adv_p[:, 3:] == 0).all() and (ret_p[:, 3:] == 0).all()


# --- properties ----------------------------------------------------------------------------------

groups = st.integers(2, 5).flatmap(lambda g: st.tuples(
    st.just(g), st.lists(st.floats(-10, 10, allow_nan=False), min_size=g, max_size=4 * g).map(
        lambda xs, g=g: xs[: len(xs) // g * g])))


@settings(max_examples=40, deadline=None)
@given(groups, st.booleans())
def test_grpo_sums_to_zero_per_group(case, std_norm):
    g, xs = case
    adv = grpo_advantages(t(xs), g, std_norm=std_norm)
    assert torch.isfinite(adv).all()
    assert torch.allclose(adv.view(-1, g).sum(dim=1), torch.zeros(len(xs) // g, dtype=F64), atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(groups)
def test_rloo_is_scaled_centered_rewards(case):
    g, xs = case
    centered = grpo_advantages(t(xs), g, std_norm=False)
    assert torch.allclose(rloo_advantages(t(xs), g), g / (g - 1) * centered, atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.5, 1.0))
def test_gae_with_lambda_one_returns_the_discounted_return(seed, gamma):
    # lambda = 1 telescopes: A_t = G_t - V_t, so returns = G_t whatever the values
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(3, 6, generator=gen) > 0.3
    r, v = torch.randn(3, 6, generator=gen, dtype=F64), torch.randn(3, 6, generator=gen, dtype=F64)
    _, ret = gae(r, v, mask, gamma, 1.0)
    assert torch.allclose(ret, reinforce_plus_plus_returns(r, mask, gamma), atol=1e-9)
