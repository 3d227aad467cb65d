"""--trainer-weight-shadows on CUDA, where it is meant to run: bf16, the decoder layers compiled by
Inductor, the chunked logprobs. Three rollouts of two optimizer steps each (a no-grad old-logprob pass
and a KL reference in every one) train to autocast's weights, no step recompiles the layers for its
new shadows, and the shadowed step's peak memory is not above autocast's. Skipped without a GPU; no Ray."""

from __future__ import annotations

import pytest
import torch

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
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
def test_shadowed_steps_on_cuda_train_like_autocast(packed):
    from torch._dynamo.utils import counters

    runs = {}
    for shadows in (False, True):
        torch._dynamo.reset()
        t = policy(shadows, packed)
        assert t._compiled_layers
        peaks, graphs = [], []
        for rollout in range(3):
            metrics = t.train(samples(), rollout)     # the same shapes: a new graph would be the shadows'
            peaks.append(metrics["gpu_mem_peak_gib"])
            graphs.append(counters["stats"]["unique_graphs"])
        runs[shadows] = ({n: p.detach().clone() for n, p in t.model.named_parameters()}, peaks, graphs, metrics)
        t.dispose()
    (plain, plain_peaks, _, plain_m), (shadowed, peaks, graphs, m) = runs[False], runs[True]
    exact = sum(torch.equal(plain[n], shadowed[n]) for n in plain)
    print(f"packed={packed}: {exact}/{len(plain)} tensors bit-identical; peaks GiB autocast {plain_peaks} "
          f"shadows {peaks}; dynamo graphs after each rollout {graphs}")
    for n in plain:
        torch.testing.assert_close(shadowed[n], plain[n], rtol=1e-5, atol=1e-6, msg=n)
    assert m["loss"] == pytest.approx(plain_m["loss"], rel=1e-4, abs=1e-6)
    assert graphs[0] == graphs[2]                     # later rollouts' new shadows compiled nothing
    assert max(peaks[1:]) <= max(plain_peaks[1:]) * 1.01
