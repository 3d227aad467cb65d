"""The train step's micro-batch loop never makes the host wait for the GPU: every micro-batch, with
what the loop needs of it (`HostLayout`), is made before the first forward, and the loop runs under
torch's sync debug mode set to "error" (a `.item()`, a boolean index, a copy from pageable memory
inside it raises). Padded and packed micro-batches, the chunked logprob path and compiled layers (the
CUDA defaults), with and without --trainer-weight-shadows or --gradient-accumulation-fusion. Skipped without a GPU; no Ray."""

from __future__ import annotations

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
