"""Masked reductions and loss reductions, including micro-batch combination with a global normalizer."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from miles.algorithms import (
    LOSS_REDUCTIONS,
    NORMALIZER_COUNTS,
    masked_mean,
    masked_sum,
    seq_mean_token_mean,
    seq_mean_token_sum_norm,
    token_mean,
)

torch.set_num_threads(1)
F64 = torch.float64

# two sequences with 3 and 1 response tokens, a third without any
LOSS = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)


def test_masked_sum_and_mean_drop_nan_off_the_mask():
    x = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]], dtype=F64)
    m = torch.tensor([[1, 0], [1, 0]], dtype=torch.bool)
    assert masked_sum(x, m).item() == 4.0
    assert masked_mean(x, m).item() == 2.0
    assert masked_mean(x, m, dim=-1).tolist() == [1.0, 3.0]
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0


def test_token_mean():
    # (1 + 2 + 3 + 4) / 4 tokens
    assert token_mean(LOSS, MASK).item() == 2.5


def test_seq_mean_token_mean_skips_empty_rows():
    # per-sequence means 2 and 4, the empty row not counted: (2 + 4) / 2
    assert seq_mean_token_mean(LOSS, MASK).item() == 3.0


def test_seq_mean_token_sum_norm_divides_by_constant():
    # sums 6 and 4, / max_len 4 -> 1.5 and 1, mean over 2 sequences
    assert seq_mean_token_sum_norm(LOSS, MASK, max_len=4).item() == 1.25
    with pytest.raises(ValueError):
        seq_mean_token_sum_norm(LOSS, MASK, max_len=0)


@pytest.mark.parametrize("name", sorted(LOSS_REDUCTIONS))
def test_empty_mask_reduces_to_zero(name):
    kw = {"max_len": 4} if name == "seq_mean_token_sum_norm" else {}
    assert LOSS_REDUCTIONS[name](LOSS, torch.zeros_like(MASK), **kw).item() == 0.0


def test_normalizer_replaces_the_local_count():
    # numerator 10 / global count 8
    assert token_mean(LOSS, MASK, normalizer=8).item() == 1.25
    with pytest.raises(ValueError):
        token_mean(LOSS, MASK, normalizer=0)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(sorted(LOSS_REDUCTIONS)), st.integers(1, 4))
def test_micro_batches_with_global_normalizer_sum_to_the_batch_value(seed, name, mb_size):
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(8, 5, generator=gen, dtype=F64)
    mask = torch.rand(8, 5, generator=gen) > 0.4
    reduce = LOSS_REDUCTIONS[name]
    kw = {"max_len": 5} if name == "seq_mean_token_sum_norm" else {}
    chunks = [(loss[i:i + mb_size], mask[i:i + mb_size]) for i in range(0, 8, mb_size)]
    n = sum(NORMALIZER_COUNTS[name](m) for _, m in chunks)
    if n == 0:
        return  # nothing to normalize; covered by test_empty_mask_reduces_to_zero
    total = sum(reduce(lo, m, normalizer=n, **kw) for lo, m in chunks)
    assert total.item() == pytest.approx(reduce(loss, mask, **kw).item(), abs=1e-12)
