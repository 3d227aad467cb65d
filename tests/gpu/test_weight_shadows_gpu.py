"""--trainer-weight-shadows on CUDA, where it is meant to run: bf16, the decoder layers compiled by
Inductor, the chunked logprobs. A global batch's gradients equal autocast's (bit for bit on the CPU;
here the bit-identical ones counted, and all checked to bf16 rounding by norm), the shadowed training compiles nothing new for each
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
    # The two compiled graphs differ (a float32 parameter cast inside the graph against a bf16 input),
    # so cuBLAS may sum a matmul in another order: its bf16 result then differs by an ulp here and
    # there (2^-8 relative), and through the layers after it, the gradients by about as much. What a
    # wrong fold would do (a micro-batch's gradient lost, added twice, or added unscaled) is a
    # difference of the order of the gradient itself; each parameter's gradient is checked by norm
    # to a percent.
    rel = {n: float((shadowed[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in plain.items()}
    worst = max(rel, key=rel.get)
    print(f"packed={packed}: {exact}/{len(plain)} gradients bit-identical to autocast's; the largest relative "
          f"difference {rel[worst]:.2e} ({worst})")
    assert rel[worst] < 1e-2, (worst, rel[worst])
    assert terms[True] == pytest.approx(terms[False], rel=1e-3, abs=1e-6)


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
