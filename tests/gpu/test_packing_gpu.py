"""Packed micro-batches on CUDA: torch's variable-length flash attention inside a pack against each
sample's own causal SDPA (values and gradients, GQA), and the trainer's packed step against its
padded one in bf16 with the CUDA defaults (chunked logprobs, compiled layers; activation recompute
trains padded rows on CUDA). Skipped without a GPU; no Ray."""

from __future__ import annotations

import random

import pytest
import torch

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.training.batch import make_train_batch
from miles.training.packing import _varlen_once, attention_path, packed_attention
from miles.training.torch.trainer import Trainer
from tests.unit.test_packing import per_sample_attention
from tests.unit.test_trainer import sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
QWEN3 = "examples/arithmetic/base_model_qwen3"


def test_this_torch_has_varlen_attention():
    # without it a pack runs span by span (exact, slower): the GPU speed claims assume it is there
    assert _varlen_once() is not None, f"torch {torch.__version__} has no usable torch.nn.attention.varlen.varlen_attn"


@pytest.mark.parametrize("lengths,path", [([37, 1, 300, 64, 5], "varlen"), ([300, 290, 300, 271], "rows")])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (14, 2, 64)])
def test_a_pack_equals_each_samples_own_attention(heads, kv_heads, head_dim, lengths, path):
    """Both CUDA paths of a pack (`attention_path`): the variable-length kernel for ragged samples, the
    padded rows through SDPA (cuDNN, GQA) for samples of about one length."""
    assert attention_path(len(lengths), sum(lengths), max(lengths), True) == path
    torch.manual_seed(0)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(1, heads, total, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, total, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv_heads, total, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, _ = packed_attention(torch.nn.Module(), q, k, v, None, scaling=head_dim ** -0.5, cu_seq_lens_q=cu,
                              max_length_q=max(lengths))
    ref = per_sample_attention(q, k, v, cu, head_dim ** -0.5).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


def samples(n=48, seed=0):
    rng = random.Random(seed)
    return [sample([rng.randrange(4, 24) for _ in range(rng.randrange(2, 30))],
                   [rng.randrange(4, 24) for _ in range(rng.randrange(1, 120))], rng.uniform(-1, 1))
            for _ in range(n)]


def step(packed: bool, recompute: bool, data, compiled: bool | None = None):
    train = TrainConfig(lr=1e-3, micro_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=1024,
                        pack_sequences=packed, recompute_activations=recompute, compile_layers=compiled)
    t = Trainer(QWEN3, train=train, algorithm=AlgorithmConfig(loss_agg_mode="seq_mean_token_mean", kl_loss_type="k3"),
                rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=6), device="cuda")
    assert t._packed is packed
    batch = t.prepare(make_train_batch(data, t.pad_id))
    t._optimizer.zero_grad(set_to_none=True)
    seen = torch.zeros(batch.tokens.shape, device="cuda")
    terms = t.accumulate_gradients(batch, record=seen)
    grads = torch.cat([p.grad.flatten() for p in t.model.parameters() if p.grad is not None])
    return batch, seen, terms, grads


def test_packed_training_step_matches_the_padded_one_in_bf16():
    # with --recompute-activations and compiled layers the trainer does not pack on CUDA (miles.training.
    # packing.RECOMPUTE_ON_CUDA): packed that way, this comparison found a logprob 0.86 off
    data = samples()
    a, b = step(False, False, data), step(True, False, data)
    mask = a[0].loss_mask
    assert (b[1][mask] - a[1][mask]).abs().max() < 0.1          # bf16 forwards of different shapes
    assert b[2]["loss"] == pytest.approx(a[2]["loss"], abs=2e-2)
    assert torch.nn.functional.cosine_similarity(a[3], b[3], dim=0) > 0.99
    assert (b[3].norm() / a[3].norm() - 1).abs() < 0.05


@pytest.mark.parametrize("compiled", [
    False,
    pytest.param(True, marks=pytest.mark.xfail(reason="packed + recompute + compiled layers disagreed (one logprob "
                                                      "0.86 off): why --recompute-activations trains padded rows on CUDA")),
])
def test_packed_step_under_recompute_matches_the_padded_one(monkeypatch, compiled):
    """Where the packed-under-recompute disagreement lives: packed under recompute with eager layers (what
    --no-trainer-compile gives) against the padded step, and with compiled layers, where the trainer's
    rule (RECOMPUTE_ON_CUDA) is lifted here to pack anyway."""
    import miles.training.torch.trainer as trainer_module
    from miles.training.packing import enable_packing

    def pack_anyway(train, *models, device=None):
        return train.use_dynamic_batch_size and train.pack_sequences and \
            enable_packing(*(m for m in models if m is not None)) is None
    data = samples()
    a = step(False, True, data, compiled)
    monkeypatch.setattr(trainer_module, "use_packing", pack_anyway)
    b = step(True, True, data, compiled)
    mask = a[0].loss_mask
    diff = (b[1][mask] - a[1][mask]).abs().max()
    assert diff < 0.1, f"packed under recompute (compiled layers: {compiled}): a logprob {float(diff):.3f} off"
    assert b[2]["loss"] == pytest.approx(a[2]["loss"], abs=2e-2)
    assert torch.nn.functional.cosine_similarity(a[3], b[3], dim=0) > 0.99


def test_without_a_token_budget_cuda_plans_one_from_free_memory():
    """No --max-tokens-per-gpu on CUDA: each train call plans a budget from the free memory
    (miles.training.torch.memory_plan), reports it, and trains; the first call reserves the optimizer
    state that does not exist yet, so the second call's budget is not smaller."""
    data = samples(n=64)
    t = Trainer(QWEN3, train=TrainConfig(lr=1e-3, micro_batch_size=64),
                algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"),
                rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=8), device="cuda")
    first, second = t.train(data, 0), t.train(data, 1)
    longest = max(len(s.prompt.prompt_ids) + len(s.response_ids) for s in data)
    assert first["memory_token_budget"] >= longest
    assert second["memory_token_budget"] >= first["memory_token_budget"] * 0.95
    assert first["gpu_mem_peak_gib"] * 2 ** 30 < torch.cuda.get_device_properties(0).total_memory
