"""KL estimators: hand-derived values, clamping, exact expectations on a small distribution, errors."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from miles.algorithms import KL_ESTIMATORS, get_kl_estimator, kl_estimate

torch.set_num_threads(1)
F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def test_estimators_hand_computed():
    # logp = -1, ref = -2: log_ratio 1 -> k1 1, k2 .5, k3 = e^-1 + 1 - 1 = e^-1
    lp, ref = t([-1.0, -0.5]), t([-2.0, -0.5])
    assert kl_estimate(lp, ref, "k1").tolist() == [1.0, 0.0]
    assert kl_estimate(lp, ref, "k2").tolist() == [0.5, 0.0]
    assert kl_estimate(lp, ref, "k3").tolist() == pytest.approx([math.exp(-1), 0.0], abs=1e-12)
    assert kl_estimate(lp, ref, "low_var_kl").tolist() == pytest.approx([math.exp(-1), 0.0], abs=1e-12)


def test_low_var_kl_clamps_outliers():
    # ref - logp = 30: k3 = e^30 - 31 ≈ 1.07e13; low_var clamps 30 -> 20, e^20 - 21 ≈ 4.85e8, then to 10.
    # ref - logp = -30: k3 = e^-30 + 29 ≈ 29 -> 10.
    lp, ref = t([-31.0, -1.0]), t([-1.0, -31.0])
    assert kl_estimate(lp, ref, "k3")[0].item() == pytest.approx(math.exp(30) - 31, rel=1e-9)
    assert kl_estimate(lp, ref, "low_var_kl").tolist() == [10.0, 10.0]


def test_k3_is_accurate_near_zero():
    # exp(x) - x - 1 ≈ x^2 / 2 for x = 1e-9: 5e-19, which the naive formula rounds to 0 in float64
    assert kl_estimate(t([0.0]), t([1e-9]), "k3").item() == pytest.approx(5e-19, rel=1e-6)


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_unbiased_estimators_average_to_the_true_kl(kind):
    # exact expectation over a 3-token distribution: sum_x p(x) k(x) = KL(p || q) = sum p log(p / q)
    p, q = t([0.5, 0.3, 0.2]), t([0.2, 0.2, 0.6])
    true_kl = (p * (p / q).log()).sum()
    assert (p * kl_estimate(p.log(), q.log(), kind)).sum().item() == pytest.approx(true_kl.item(), abs=1e-12)


def test_unknown_kind_names_the_valid_ones():
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl"):
        kl_estimate(t([0.0]), t([0.0]), "k4")
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "low_var_kl"}
    assert get_kl_estimator("k2") is KL_ESTIMATORS["k2"]


def test_k3_gradient_vanishes_at_equality():
    lp = t([-1.0]).requires_grad_()
    kl_estimate(lp, t([-1.0]), "k3").sum().backward()
    assert lp.grad.item() == 0.0


logs = st.floats(-15, 0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(logs, logs)
def test_k2_k3_nonnegative_and_zero_only_at_equality(lp, ref):
    for kind in ("k2", "k3", "low_var_kl"):
        k = kl_estimate(t([lp]), t([ref]), kind).item()
        assert k >= 0.0
        assert (k == 0.0) == (lp == ref) or abs(lp - ref) < 1e-7
