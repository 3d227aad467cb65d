"""The chunked logprob/entropy math compiled on CUDA (miles.algorithms.fused_logprobs) against the same
functions run eagerly: forward values and gradients of hidden states and LM head, bf16 matmuls.
Skipped without CUDA.

    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_fused_logprobs_gpu.py -q
"""

import pytest
import torch

from miles.algorithms import fused_logprobs as fl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def run(hidden, weight, target, temperature):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = fl.linear_logprobs_entropy(h, w, target, temperature, chunk_rows=1000, matmul_dtype=torch.bfloat16)
    ((lp * torch.linspace(-1, 1, lp.numel(), device=lp.device)).sum() + 0.01 * ent.sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compiled_chunk_math_equals_eager(monkeypatch, temperature):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(2500, 256, device="cuda", generator=g)          # 3 chunks, the last one short
    weight = torch.randn(32000, 256, device="cuda", generator=g) * 0.05
    target = torch.randint(0, 32000, (2500,), device="cuda", generator=g)
    compiled = run(hidden, weight, target, temperature)
    assert set(fl._COMPILED) == {"values", "grad"} and all(f not in (fl._chunk_values, fl._chunk_grad)
                                                           for f in fl._COMPILED.values()), "fell back to eager"
    monkeypatch.setattr(fl, "_math", lambda name, fn, device: fn)
    eager = run(hidden, weight, target, temperature)
    for name, a, b in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), compiled, eager):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 2e-3 * scale + 1e-5, name
