from miles.rollout.evals import pass_at_k
import pytest


def test_pass_at_k_by_hand():
    # n=4, c=1: pass@1 = 1 - C(3,1)/C(4,1) = 1 - 3/4 = 0.25; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=4, c=2, k=4: fewer wrong (2) than draws (4) -> certain
    assert pass_at_k(4, 2, 4) == 1.0
    assert pass_at_k(5, 0, 3) == 0.0


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="n=2, c=3"):
        pass_at_k(2, 3, 1)
