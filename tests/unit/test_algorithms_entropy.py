"""Logprobs and entropies from logits: alignment to tokens, temperature, stability, chunking."""

import math

import pytest
import torch

from miles.algorithms import entropy_from_logits, logprobs_from_logits

torch.set_num_threads(1)


def test_logprobs_are_aligned_to_the_predicted_token():
    # V = 2. logits[0, 0] = [0, ln 3] predicts tokens[0, 1] = 1: p = 3 / 4.
    #        logits[0, 1] = [ln 4, 0] predicts tokens[0, 2] = 0: p = 4 / 5. logits[0, 2] predicts nothing.
    logits = torch.tensor([[[0.0, math.log(3)], [math.log(4), 0.0], [100.0, -100.0]]])
    tokens = torch.tensor([[1, 1, 0]])
    out = logprobs_from_logits(logits, tokens)
    assert out.shape == (1, 3) and out.dtype == torch.float32
    assert out[0].tolist() == pytest.approx([0.0, math.log(0.75), math.log(0.8)], abs=1e-6)


def test_logprobs_divide_logits_by_temperature():
    # [0, ln 9] / 2 = [0, ln 3]: p(1) = 3 / 4
    logits = torch.tensor([[[0.0, math.log(9)], [0.0, 0.0]]])
    out = logprobs_from_logits(logits, torch.tensor([[0, 1]]), temperature=2.0)
    assert out[0, 1].item() == pytest.approx(math.log(0.75), abs=1e-6)
    # temperature > 0 is the config's rule (miles.types.sampling_problems), not re-checked here


def test_logprobs_chunked_matches_log_softmax_and_keeps_gradient():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen, requires_grad=True)
    tokens = torch.randint(0, 11, (3, 5), generator=gen)
    out = logprobs_from_logits(logits, tokens, chunk_rows=4)
    ref = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert torch.allclose(out[:, 1:], ref, atol=1e-6) and (out[:, 0] == 0).all()
    out.sum().backward()
    assert logits.grad is not None and (logits.grad[:, -1] == 0).all()  # last logits predict nothing


def test_logprobs_reject_mismatched_shapes():
    with pytest.raises(ValueError):
        logprobs_from_logits(torch.zeros(1, 3, 4), torch.zeros(1, 2, dtype=torch.long))


def test_entropy_uniform_and_peaked():
    # uniform over 4 -> ln 4; logits [1000, 0, 0, 0] -> ~0 (naive softmax * log softmax would give NaN)
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1000.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]]])
    out = entropy_from_logits(logits)
    assert out[0].tolist() == pytest.approx([0.0, math.log(4), 0.0], abs=1e-6)  # shifted like logprobs


def test_entropy_chunked_bf16_matches_reference():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 9, generator=gen)
    p = torch.softmax(logits / 0.7, dim=-1)
    ref = -(p * p.log()).sum(-1)
    out = entropy_from_logits(logits.bfloat16().float(), temperature=0.7, chunk_rows=5)
    assert torch.allclose(out[:, 1:], ref[:, :-1], atol=0.05)  # bf16 rounding of the logits
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32
