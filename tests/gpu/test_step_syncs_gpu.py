"""The train step's micro-batch loop never makes the host wait for the GPU: every micro-batch, with
what the loop needs of it (`HostLayout`), is made before the first forward, and the loop runs under
torch's sync debug mode set to "error" (a `.item()`, a boolean index, a copy from pageable memory
inside it raises). Padded and packed micro-batches, the chunked logprob path and compiled layers (the
CUDA defaults), with and without --trainer-weight-shadows or --gradient-accumulation-fusion; and a Qwen3-MoE model
with R3 and both router losses (its routing statistics and losses are masked sums: no boolean index), eager and
compiled. Skipped without a GPU; no Ray."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.training.batch import make_train_batch
from miles.training.torch.trainer import Trainer
from tests.gpu.test_packing_gpu import QWEN3, samples

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def run_loop(t: Trainer, batch, record):
    """`Trainer.accumulate_gradients` with its loop under sync debug mode "error"."""
    normalizer, num_tokens = t._objective.normalizers(batch)
    pairs = t._micro_batches(batch)
    torch.cuda.set_sync_debug_mode("error")
    try:
        sums = t._accumulate(pairs, normalizer, num_tokens, record)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return len(pairs), sums.floats()


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("cast", ["autocast", "shadows", "fused"])
def test_the_micro_batch_loop_reads_nothing_back_from_the_gpu(packed, cast):
    train = TrainConfig(lr=1e-3, micro_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=1024,
                        pack_sequences=packed, weight_shadows=cast == "shadows", grad_accum_fusion=cast == "fused")
    algorithm = AlgorithmConfig(loss_agg_mode="seq_mean_token_mean", kl_loss_type="k3", use_kl_loss=True,
                                kl_loss_coef=0.01, entropy_coef=0.001)
    t = Trainer(QWEN3, train=train, algorithm=algorithm, rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=6),
                device="cuda")
    assert t._packed is packed
    batch = t.prepare(make_train_batch(samples(), t.pad_id))
    t.accumulate_gradients(batch)           # compiles the layers and the chunk math (which reads the device)
    t._optimizer.zero_grad(set_to_none=True)
    want = t.accumulate_gradients(batch)
    grads = [p.grad.clone() for p in t.model.parameters() if p.grad is not None]
    t._optimizer.zero_grad(set_to_none=True)
    record = torch.zeros(batch.tokens.shape, device="cuda")
    count, got = run_loop(t, batch, record)
    assert count > 1
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for a, b in zip(grads, (p.grad for p in t.model.parameters() if p.grad is not None)):
        torch.testing.assert_close(a, b)
    assert record[batch.loss_mask].abs().min() > 0     # every trained token's logprob was recorded


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="the experts' grouped matmul (torch._grouped_mm) needs compute capability >= 9.0")
@pytest.mark.parametrize("compiled", [False, True])
def test_the_moe_micro_batch_loop_reads_nothing_back_from_the_gpu(compiled):
    moe = "examples/arithmetic/base_model_qwen3_moe"
    train = TrainConfig(lr=1e-3, micro_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=1024,
                        use_rollout_routing_replay=True, moe_aux_loss_coeff=1e-3,
                        moe_router_load_balancing_type="seq_aux_loss", moe_z_loss_coeff=1e-4, compile_layers=compiled)
    t = Trainer(moe, train=train, algorithm=AlgorithmConfig(loss_agg_mode="token_mean"),
                rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=6), device="cuda")
    layers, k, experts = len(t._moe.routing.layers), t._moe.routing.top_k, t._moe.routing.num_experts
    rng = np.random.default_rng(0)
    data = samples()
    for s in data:          # the rollout's experts for each response token: what R3 replays
        s.rollout_routed_experts = np.stack([rng.permutation(experts)[:k] for _ in range(s.response_length * layers)]
                                            ).reshape(s.response_length, layers, k)
    batch = t.prepare(make_train_batch(data, t.pad_id))
    t.accumulate_gradients(batch)           # compiles (with compiled layers)
    t._optimizer.zero_grad(set_to_none=True)
    want = t.accumulate_gradients(batch)
    t._optimizer.zero_grad(set_to_none=True)
    count, got = run_loop(t, batch, torch.zeros(batch.tokens.shape, device="cuda"))
    assert count > 1
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
