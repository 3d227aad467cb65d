"""--trainer-weight-shadows on CUDA, where it is meant to run: bf16, the decoder layers compiled by
Inductor, the chunked logprobs. A global batch's gradients equal autocast's (bit for bit on the CPU;
here printed, and checked to float32 rounding), the shadowed training compiles nothing new for each
step's new shadows, and its peak memory is not above autocast's. Skipped without a GPU; no Ray."""

from __future__ import annotations

import pytest
import torch

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.training.batch import make_train_batch
from miles.training.trainer import Trainer
from tests.gpu.test_packing_gpu import QWEN3, samples

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def policy(shadows: bool, packed: bool) -> Trainer:
    train = TrainConfig(lr=1e-3, micro_batch_size=8, global_batch_size=24, use_dynamic_batch_size=True,
                        max_tokens_per_gpu=1024, pack_sequences=packed, weight_shadows=shadows)
    algorithm = AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", use_kl_loss=True, kl_loss_coef=0.01,
                                entropy_coef=0.001)
    return Trainer(QWEN3, train=train, algorithm=algorithm, rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=6),
                   device="cuda")


@pytest.mark.parametrize("packed", [False, True])
def test_shadowed_gradients_on_cuda_equal_autocasts(packed):
    grads, terms = {}, {}
    for shadows in (False, True):
        torch._dynamo.reset()
        t = policy(shadows, packed)
        assert t._compiled_layers
        batch = t.prepare(make_train_batch(samples(), t.pad_id))      # the reference's no-grad pass in it
        t.accumulate_gradients(batch)                                  # compiles
        t._optimizer.zero_grad(set_to_none=True)
        terms[shadows] = t.accumulate_gradients(batch)
        grads[shadows] = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
        t.dispose()
    plain, shadowed = grads[False], grads[True]
    assert plain.keys() == shadowed.keys() and plain
    exact = sum(torch.equal(plain[n], shadowed[n]) for n in plain)
    print(f"packed={packed}: {exact}/{len(plain)} gradients bit-identical to autocast's")
    for n, g in plain.items():
        torch.testing.assert_close(shadowed[n], g, rtol=1e-5, atol=1e-6 * float(g.abs().max()), msg=n)
    assert terms[True] == pytest.approx(terms[False], rel=1e-5, abs=1e-7)


def test_shadowed_training_on_cuda_compiles_once_and_peaks_no_higher():
    from torch._dynamo.utils import counters

    peaks = {}
    for shadows in (False, True):
        torch._dynamo.reset()
        t = policy(shadows, packed=True)
        runs, graphs = [], []
        for rollout in range(3):      # the same shapes each rollout: a new graph would be the new shadows'
            runs.append(t.train(samples(), rollout)["gpu_mem_peak_gib"])
            graphs.append(counters["stats"]["unique_graphs"])
        peaks[shadows] = runs
        t.dispose()
        assert graphs[0] == graphs[2], graphs
    print(f"peak GiB by rollout: autocast {peaks[False]}, shadows {peaks[True]}")
    assert max(peaks[True][1:]) <= max(peaks[False][1:]) * 1.01
