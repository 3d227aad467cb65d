"""Chunked logprob/entropy from hidden states: values and gradients equal the full-logits computation."""

import math

import pytest
import torch

from miles.algorithms.entropy import entropy_from_logits, logprobs_from_logits
from miles.algorithms.fused_logprobs import linear_logprobs_entropy, masked_logprobs_entropy

torch.set_num_threads(1)


def plain(hidden, weight, target, temperature):
    """The reference: full [N, V] logits, log_softmax, gather; entropy from the probabilities."""
    logp = torch.log_softmax(hidden @ weight.T / temperature, dim=-1)
    return logp.gather(-1, target[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def inputs(n=13, h=6, v=17, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64, requires_grad=True)
    return hidden, weight, torch.randint(0, v, (n,), generator=gen)


def test_two_rows_by_hand():
    # W = I (V = H = 2), T = 1. Row [0, ln 3]: p = [1/4, 3/4]; target 1 → ln 3/4;
    # H = -(1/4 ln 1/4 + 3/4 ln 3/4). Row [ln 4, 0], target 0 → ln 4/5.
    hidden = torch.tensor([[0.0, math.log(3)], [math.log(4), 0.0]], dtype=torch.float64)
    lp, ent = linear_logprobs_entropy(hidden, torch.eye(2, dtype=torch.float64), torch.tensor([1, 0]))
    assert lp.tolist() == pytest.approx([math.log(0.75), math.log(0.8)], abs=1e-6)
    assert ent[0].item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)


@pytest.mark.parametrize("chunk_rows", [1, 4, 5, 13, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_full_logits(chunk_rows, temperature):
    hidden, weight, target = inputs()
    gen = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(13, generator=gen, dtype=torch.float64), torch.randn(13, generator=gen, dtype=torch.float64)

    ref_lp, ref_ent = plain(hidden, weight, target, temperature)
    ref_grads = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), (hidden, weight))
    lp, ent = linear_logprobs_entropy(hidden, weight, target, temperature, chunk_rows=chunk_rows)
    grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (hidden, weight))

    assert lp.dtype == ent.dtype == grads[0].dtype == grads[1].dtype == torch.float64
    torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("which", ["logprobs", "entropy"])
def test_gradient_of_one_output_alone(which):
    hidden, weight, target = inputs(seed=2)
    ref = plain(hidden, weight, target, 1.3)[0 if which == "logprobs" else 1]
    out = linear_logprobs_entropy(hidden, weight, target, 1.3, chunk_rows=3)[0 if which == "logprobs" else 1]
    want = torch.autograd.grad(ref.square().sum(), (hidden, weight))
    got = torch.autograd.grad(out.square().sum(), (hidden, weight))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10)


def saved_shapes(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        fn()
    return saved


def test_backward_keeps_no_full_logits():
    # autograd keeps the inputs and per-row [N] statistics, never an [N, V] tensor (the plain path does)
    hidden, weight, target = inputs(n=8, v=50)
    assert (8, 50) in saved_shapes(lambda: plain(hidden, weight, target, 1.0))
    saved = saved_shapes(lambda: linear_logprobs_entropy(hidden, weight, target, chunk_rows=2))
    assert saved and (8, 50) not in saved, saved


def test_masked_version_matches_the_logits_functions_on_the_mask():
    gen = torch.Generator().manual_seed(3)
    b, t, h, v = 3, 7, 5, 11
    hidden = torch.randn(b, t, h, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, v, (b, t), generator=gen)
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[0, 2:5], mask[1, 1:7], mask[2, 6] = True, True, True
    logits = hidden @ weight.T
    lp, ent = masked_logprobs_entropy(hidden, weight, tokens, mask, 0.9, chunk_rows=4)
    # the logits functions compute in float32, hence the float32 tolerance
    torch.testing.assert_close(lp, torch.where(mask, logprobs_from_logits(logits, tokens, 0.9), 0.0).double())
    torch.testing.assert_close(ent, torch.where(mask, entropy_from_logits(logits, 0.9), 0.0).double(),
                               atol=1e-5, rtol=1e-5)
    lp.sum().backward()
    assert hidden.grad[~mask.roll(-1, dims=1)].abs().sum() == 0      # rows predicting no response token get none
    # the trained positions handed in (the trainer's micro-batches know them on the host): the same numbers
    grad = hidden.grad.clone()
    hidden.grad = None
    trained = torch.tensor([i * t + j for i in range(b) for j in range(t) if mask[i, j]])
    lp2, ent2 = masked_logprobs_entropy(hidden, weight, tokens, mask, 0.9, chunk_rows=4, trained=trained)
    assert torch.equal(lp2, lp) and torch.equal(ent2, ent)
    lp2.sum().backward()
    assert torch.equal(hidden.grad, grad)


def test_bad_input_is_named():
    hidden, weight, target = inputs()
    # the temperature's range is the config's rule (--rollout-temperature), checked once, at parse time
    with pytest.raises(ValueError, match="target"):
        linear_logprobs_entropy(hidden, weight, target[:-1])
    with pytest.raises(ValueError, match="position 0"):
        masked_logprobs_entropy(hidden[None], weight, target[None], torch.ones(1, 13, dtype=torch.bool))


def test_float32_inputs_give_float32_outputs_close_to_float64():
    hidden, weight, target = inputs(seed=5)
    lp32, ent32 = linear_logprobs_entropy(hidden.float(), weight.float(), target, chunk_rows=4)
    lp64, ent64 = linear_logprobs_entropy(hidden, weight, target)
    assert lp32.dtype == ent32.dtype == torch.float32
    torch.testing.assert_close(lp32.double(), lp64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent32.double(), ent64, atol=1e-5, rtol=1e-5)


def test_bf16_matmul_is_close_to_float32():
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(9, 16, generator=gen)
    weight = torch.randn(40, 16, generator=gen) * 0.3
    target = torch.randint(0, 40, (9,), generator=gen)
    lp32, ent32 = linear_logprobs_entropy(hidden, weight, target)
    lp16, ent16 = linear_logprobs_entropy(hidden, weight, target, matmul_dtype=torch.bfloat16)
    assert (lp16 - lp32).abs().max() < 0.1 and (ent16 - ent32).abs().max() < 0.1


def test_bf16_matmul_gradients_are_as_good_as_the_autocast_logits_path():
    # what the trainer did before: logits from a bf16 autocast matmul, then float32 softmax. Both are
    # compared with float64; the chunked weight gradient sums float32 products, so it is no worse
    gen = torch.Generator().manual_seed(6)
    h0, w0 = torch.randn(64, 16, generator=gen), torch.randn(40, 16, generator=gen)
    target = torch.randint(0, 40, (64,), generator=gen)

    def grads(fn, dtype=torch.float32):
        h, w = h0.to(dtype, copy=True).requires_grad_(), w0.to(dtype, copy=True).requires_grad_()
        lp, ent = fn(h, w)
        (lp.sum() + ent.sum()).backward()
        return h.grad.double(), w.grad.double()

    def autocast_path(h, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp = torch.log_softmax((h @ w.T).float(), dim=-1)
        return logp.gather(-1, target[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    exact = grads(lambda h, w: plain(h, w, target, 1.0), torch.float64)
    before = grads(autocast_path)
    fused = grads(lambda h, w: linear_logprobs_entropy(h, w, target, matmul_dtype=torch.bfloat16, chunk_rows=8))
    for e, b, f in zip(exact, before, fused):
        assert (f - e).abs().max() <= 1.05 * (b - e).abs().max()
        torch.testing.assert_close(f, b, atol=0.05 * b.abs().max().item(), rtol=0.0)
