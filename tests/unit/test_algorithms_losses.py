"""Policy, SFT and value losses, TIS weights and mismatch metrics: hand-derived numbers, both sides of
every clip, padding, empty masks, gradients, properties."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from miles.algorithms import (
    POLICY_LOSSES,
    get_policy_loss,
    gspo_loss,
    mismatch_metrics,
    ppo_clip_loss,
    seq_mean_token_mean,
    sft_loss,
    tis_weights,
    token_mean,
    value_loss,
)

torch.set_num_threads(1)
F64 = torch.float64


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def approx(x, tol=1e-9):
    return pytest.approx(x, abs=tol)


def ppo_case():
    """Five response tokens and one pad. Ratios r and advantages A, eps = .2 (range [.8, 1.2]):
      r=1.5, A=+1: max(-1.5, -1.2) = -1.2   clipped (high side)
      r=0.5, A=+1: max(-0.5, -0.8) = -0.5   not clipped (pessimistic bound already)
      r=0.5, A=-1: max( 0.5,  0.8) =  0.8   clipped (low side)
      r=1.5, A=-1: max( 1.5,  1.2) =  1.5   not clipped
      r=1.1, A=+1: inside the range  = -1.1
    """
    ratios = [1.5, 0.5, 0.5, 1.5, 1.1, 1.0]
    old = t([[-1.0, -2.0, -0.5, -3.0, -1.5, -0.7]])
    new = (old + t([[math.log(r) for r in ratios]])).requires_grad_()
    adv = t([[1.0, 1.0, -1.0, -1.0, 1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    return new, old, adv, mask


def test_ppo_loss_and_metrics_hand_computed():
    new, old, adv, mask = ppo_case()
    loss, m = ppo_clip_loss(new, old, adv, mask, eps_clip=0.2)
    assert loss.item() == approx((-1.2 - 0.5 + 0.8 + 1.5 - 1.1) / 5)       # -0.1
    assert m["clip_frac"].item() == approx(2 / 5)
    assert m["ratio_mean"].item() == approx((1.5 + 0.5 + 0.5 + 1.5 + 1.1) / 5)  # 1.02
    # approx_kl = mean(old - new) = -(2 ln .75 + ln 1.1) / 5
    assert m["approx_kl"].item() == approx(-(2 * math.log(0.75) + math.log(1.1)) / 5)
    assert m["dual_clip_frac"].item() == 0.0


def test_ppo_gradient_is_zero_on_clipped_tokens():
    # d/dlogp of -A r is -A r; divided by 5 tokens: [0, -.5/5, 0, 1.5/5, -1.1/5], pad 0
    new, old, adv, mask = ppo_case()
    ppo_clip_loss(new, old, adv, mask, eps_clip=0.2)[0].backward()
    assert torch.allclose(new.grad, t([[0.0, -0.1, 0.0, 0.3, -0.22, 0.0]]), atol=1e-12)


def test_ppo_clip_higher_is_asymmetric():
    # eps_clip_high .6: r = 1.5, A = +1 is inside [.8, 1.6] -> -1.5; the low side still clips r = .5, A = -1
    new, old, adv, mask = ppo_case()
    loss, m = ppo_clip_loss(new, old, adv, mask, eps_clip=0.2, eps_clip_high=0.6)
    assert loss.item() == approx((-1.5 - 0.5 + 0.8 + 1.5 - 1.1) / 5)
    assert m["clip_frac"].item() == approx(1 / 5)


def test_ppo_dual_clip_caps_negative_advantage_loss():
    # c = 3: r=5, A=-1: max(5, 1.2) = 5, capped at -c A = 3 (no gradient)
    #        r=2, A=-1: 2 < 3, unchanged;  r=5, A=+1: -1.2, dual clip does not touch A > 0
    old = t([[0.0, 0.0, 0.0]])
    new = t([[math.log(5.0), math.log(2.0), math.log(5.0)]]).requires_grad_()
    adv, mask = t([[-1.0, -1.0, 1.0]]), torch.ones(1, 3, dtype=torch.bool)
    loss, m = ppo_clip_loss(new, old, adv, mask, eps_clip=0.2, eps_clip_c=3.0)
    assert loss.item() == approx((3.0 + 2.0 - 1.2) / 3)
    assert m["dual_clip_frac"].item() == approx(1 / 3)
    loss.backward()
    assert torch.allclose(new.grad, t([[0.0, 2.0 / 3, 0.0]]), atol=1e-12)  # d(-A r)/dlogp = r, / 3 tokens


def test_ppo_padding_with_inf_and_nan_stays_finite():
    old = t([[-1.0, float("nan"), -float("inf")]])
    new = t([[-1.0, -float("inf"), float("nan")]]).requires_grad_()
    loss, m = ppo_clip_loss(new, old, t([[1.0, 1.0, 1.0]]), torch.tensor([[True, False, False]]), eps_clip=0.2)
    loss.backward()
    assert loss.item() == -1.0 and torch.isfinite(new.grad).all()
    assert all(torch.isfinite(v) for v in m.values())


def test_ppo_empty_mask_gives_zero_loss_and_metrics():
    z = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    loss, m = ppo_clip_loss(z, torch.zeros(2, 3, dtype=F64), torch.ones(2, 3, dtype=F64),
                            torch.zeros(2, 3, dtype=torch.bool), eps_clip=0.2)
    loss.backward()
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in m.values()) and (z.grad == 0).all()


def test_ppo_is_weights_scale_the_token_loss():
    # r = 1 everywhere, A = [1, 2]: losses [-1, -2] * weights [.5, 2] = [-.5, -4], mean -2.25
    z = torch.zeros(1, 2, dtype=F64)
    loss, _ = ppo_clip_loss(z, z, t([[1.0, 2.0]]), torch.ones(1, 2, dtype=torch.bool), eps_clip=0.2,
                            is_weights=t([[0.5, 2.0]]))
    assert loss.item() == approx(-2.25)


@pytest.mark.parametrize("kw", [{"eps_clip": 1.0}, {"eps_clip": -0.1}, {"eps_clip": 0.2, "eps_clip_high": -0.1},
                                {"eps_clip": 0.2, "eps_clip_c": 1.0}])
def test_ppo_bad_clip_values_raise(kw):
    z = torch.zeros(1, 1)
    with pytest.raises(ValueError):
        ppo_clip_loss(z, z, z, torch.ones(1, 1, dtype=torch.bool), **kw)


def gspo_case():
    """Sequence 0: token log ratios [ln 2, 0] -> s = exp(ln 2 / 2) = sqrt 2 = 1.414, A = +1:
    clipped at 1.2 -> -1.2 per token. Sequence 1: log ratios [.1, -.1, 0] -> s = 1, A = -1 -> 1 per
    token (unclipped), then one pad."""
    old = t([[-1.0, -2.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    new = (old + t([[math.log(2.0), 0.0, 0.0, 0.0], [0.1, -0.1, 0.0, 9.0]])).requires_grad_()
    adv = t([[1.0, 1.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    return new, old, adv, mask


def test_gspo_uses_one_clipped_ratio_per_sequence():
    new, old, adv, mask = gspo_case()
    loss, m = gspo_loss(new, old, adv, mask, eps_clip=0.2)
    assert loss.item() == approx((-1.2 * 2 + 1.0 * 3) / 5)   # token_mean: 0.12
    assert m["clip_frac"].item() == approx(2 / 5)            # both tokens of sequence 0
    assert m["ratio_mean"].item() == approx((2 * math.sqrt(2) + 3) / 5)
    # sequence 1: loss per token s, ds/dlogp_t = s / 3 = 1/3; summed over 3 tokens, / 5 -> 1/5 each
    loss.backward()
    assert torch.allclose(new.grad, t([[0, 0, 0, 0], [0.2, 0.2, 0.2, 0]]), atol=1e-12)


def test_gspo_with_seq_mean_is_the_paper_objective():
    # mean over sequences of -min(s A, clip(s) A): (-1.2 + 1) / 2
    new, old, adv, mask = gspo_case()
    loss, _ = gspo_loss(new, old, adv, mask, eps_clip=0.2, reduce=seq_mean_token_mean)
    assert loss.item() == approx(-0.1)


def test_gspo_equals_ppo_on_single_token_sequences():
    gen = torch.Generator().manual_seed(0)
    old, new = torch.randn(4, 1, generator=gen, dtype=F64), torch.randn(4, 1, generator=gen, dtype=F64) * 0.3
    adv, mask = torch.randn(4, 1, generator=gen, dtype=F64), torch.ones(4, 1, dtype=torch.bool)
    a, _ = gspo_loss(old + new, old, adv, mask, eps_clip=0.2, eps_clip_c=3.0)
    b, _ = ppo_clip_loss(old + new, old, adv, mask, eps_clip=0.2, eps_clip_c=3.0)
    assert a.item() == approx(b.item())


def test_policy_loss_registry():
    assert set(POLICY_LOSSES) == {"ppo", "gspo"}
    new, old, adv, mask = ppo_case()
    loss, _ = get_policy_loss("ppo", eps_clip=0.2)(new, old, adv, mask)
    assert loss.item() == approx(-0.1)
    with pytest.raises(ValueError, match="gspo, ppo"):
        get_policy_loss("grpo")
    with pytest.raises(TypeError, match="clip_ratio"):
        get_policy_loss("ppo", clip_ratio=0.2)


def test_sft_loss_is_masked_mean_nll():
    # response tokens t=1,2 with logprobs -1, -2: NLL mean 1.5 (the 99 is padding)
    assert sft_loss(t([[0.0, -1.0, -2.0, 99.0]]), torch.tensor([[0, 1, 1, 0]], dtype=torch.bool)).item() == 1.5


def test_value_loss_clipped_and_unclipped():
    # token 0: V 1, V_old .5, R 2: (1-2)^2 = 1; V_clip = .5 + clip(.5, -.2, .2) = .7, (.7-2)^2 = 1.69 -> clip active
    # token 1: V 2, V_old 2, R 3: both 1 -> not clipped. loss .5 * (1.69 + 1) / 2 = .6725; without clip .5 * 1 = .5
    v, old, ret = t([[1.0, 2.0, 5.0]]), t([[0.5, 2.0, 0.0]]), t([[2.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    loss, m = value_loss(v, old, ret, mask, value_clip=0.2)
    assert loss.item() == approx(0.6725) and m["value_clip_frac"].item() == approx(0.5)
    loss, m = value_loss(v, old, ret, mask)
    assert loss.item() == approx(0.5) and m["value_clip_frac"].item() == 0.0


def test_tis_weights_truncate_and_detach():
    # exp(old - rollout) = [3, .5, .01, 1] clamped to [.1, 2] -> [2, .5, .1, 1]; masked-out -> 1
    rollout = t([[0.0, 0.0, 0.0, 0.0, 0.0]])
    old = t([[math.log(3), math.log(0.5), math.log(0.01), 0.0, 50.0]]).requires_grad_()
    w = tis_weights(old, rollout, torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool), clip=2.0, clip_low=0.1)
    assert torch.allclose(w, t([[2.0, 0.5, 0.1, 1.0, 1.0]]), atol=1e-12) and not w.requires_grad
    with pytest.raises(ValueError):
        tis_weights(old, rollout, torch.ones(1, 5, dtype=torch.bool), clip=0.5, clip_low=1.0)


def test_mismatch_metrics():
    # |train - rollout| on response tokens = [.5, 0]; k3(rollout || train) = [e^.5 - .5 - 1, 0]
    train, rollout = t([[-1.0, -2.0, 7.0]]), t([[-1.5, -2.0, -9.0]])
    m = mismatch_metrics(train, rollout, torch.tensor([[1, 1, 0]], dtype=torch.bool))
    assert m["logprob_abs_diff_mean"].item() == approx(0.25)
    assert m["logprob_abs_diff_max"].item() == approx(0.5)
    assert m["k3_kl"].item() == approx((math.exp(0.5) - 1.5) / 2)


# --- properties ----------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_ppo_equals_minus_a_ratio_inside_clip_range(seed):
    gen = torch.Generator().manual_seed(seed)
    log_r = (torch.rand(3, 5, generator=gen, dtype=F64) * 2 - 1) * 0.18  # r in [.835, 1.197] ⊂ [.8, 1.2]
    old, adv = torch.randn(3, 5, generator=gen, dtype=F64), torch.randn(3, 5, generator=gen, dtype=F64)
    mask = torch.rand(3, 5, generator=gen) > 0.3
    loss, m = ppo_clip_loss(old + log_r, old, adv, mask, eps_clip=0.2)
    assert loss.item() == approx(token_mean(-adv * log_r.exp(), mask).item())
    assert m["clip_frac"].item() == 0.0


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.05, 0.4))
def test_ppo_gradient_zero_exactly_where_clipped(seed, eps):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(4, 6, generator=gen, dtype=F64)
    new = (old + torch.randn(4, 6, generator=gen, dtype=F64) * 0.5).requires_grad_()
    adv = torch.randn(4, 6, generator=gen, dtype=F64)
    mask = torch.ones(4, 6, dtype=torch.bool)
    ppo_clip_loss(new, old, adv, mask, eps_clip=eps)[0].backward()
    r = (new - old).detach().exp()
    clipped = ((adv > 0) & (r > 1 + eps)) | ((adv < 0) & (r < 1 - eps))
    assert (new.grad[clipped] == 0).all()
    assert (new.grad[~clipped] != 0).all()


def opsm_case():
    """Three sequences of two response tokens (and one pad), old - new per token:
      row 0: [.3, .1]  mean .2 > delta .1, A = -1      -> masked
      row 1: [.3, .1]  mean .2 > delta .1, A = +1      -> kept (positive advantage)
      row 2: [.1, .0]  mean .05 <= delta .1, A = -1    -> kept (close to the old policy)
    The pad of row 0 holds a large old - new (3.0): it must not count in the row's mean."""
    old = t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    new = t([[-0.3, -0.1, -3.0], [-0.3, -0.1, -3.0], [-0.1, 0.0, -3.0]]).requires_grad_()
    adv = t([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    return new, old, adv, mask


def test_opsm_masks_exactly_the_negative_advantage_sequences_past_delta():
    new, old, adv, mask = opsm_case()
    loss, m = ppo_clip_loss(new, old, adv, mask, eps_clip=0.5, opsm_delta=0.1)
    # eps .5 clips nothing here (ratios e^-.3 = .74 .. 1). Kept tokens' loss -A r: row 1: -(e^-.3 + e^-.1),
    # row 2: e^-.1 + 1; row 0 is 0; token_mean over the 6 response tokens
    kept = -(math.exp(-0.3) + math.exp(-0.1)) + (math.exp(-0.1) + 1.0)
    assert loss.item() == approx(kept / 6)
    assert m["opsm_clipfrac"].item() == approx(2 / 6)
    # a threshold above row 0's mean .2 masks nothing: the plain PPO loss
    plain, _ = ppo_clip_loss(new, old, adv, mask, eps_clip=0.5)
    off, m_off = ppo_clip_loss(new, old, adv, mask, eps_clip=0.5, opsm_delta=0.2)
    assert off.item() == approx(plain.item()) and m_off["opsm_clipfrac"].item() == 0.0
    assert "opsm_clipfrac" not in ppo_clip_loss(new, old, adv, mask, eps_clip=0.5)[1]


def test_opsm_masked_sequence_has_zero_gradient_and_the_others_keep_theirs():
    new, old, adv, mask = opsm_case()
    ppo_clip_loss(new, old, adv, mask, eps_clip=0.5, opsm_delta=0.1)[0].backward()
    with_opsm = new.grad.clone()
    new.grad = None
    ppo_clip_loss(new, old, adv, mask, eps_clip=0.5)[0].backward()
    assert torch.equal(with_opsm[0], torch.zeros(3, dtype=F64))
    assert with_opsm[0].abs().sum() == 0 and new.grad[0, :2].abs().min() > 0    # PPO alone moves row 0
    assert torch.allclose(with_opsm[1:], new.grad[1:], atol=0, rtol=0)


def test_opsm_reads_each_token_s_advantage_and_the_gspo_loss_takes_it_too():
    # one sequence past delta with advantages [-1, +1]: only its negative token is masked (miles' rule is
    # per token: advantage < 0 and the sequence's KL > delta)
    new, old, adv, mask = opsm_case()
    adv = adv.clone()
    adv[0, 1] = 1.0
    _, m = ppo_clip_loss(new, old, adv, mask, eps_clip=0.5, opsm_delta=0.1)
    assert m["opsm_clipfrac"].item() == approx(1 / 6)
    _, g = gspo_loss(new, old, adv, mask, eps_clip=0.5, opsm_delta=0.1)
    assert g["opsm_clipfrac"].item() == approx(1 / 6)
