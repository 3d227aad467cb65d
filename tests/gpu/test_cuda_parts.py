"""The embedded engine and the torch trainer on CUDA (bf16 by default); skipped without a GPU.

Run on the GPU machine (see ../shared/gpu/README.md): only torch, transformers and the small pure
Python wheels (structlog, transitions) are needed, no Ray.
"""

from __future__ import annotations

import pytest
import torch

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.rollout.engines.embedded.engine import EmbeddedEngine
from miles.training.torch.trainer import Trainer
from miles.types import Prompt, Sample, SamplingParams
from tests.tiny_model import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def samples_from(prompts, gens, advantages):
    return [Sample(prompt=Prompt(index=i, text="", prompt_ids=tuple(p)), group=i, response_ids=g.response_ids,
                   rollout_logprobs=g.logprobs, finish_reason=g.finish_reason, weight_version=g.weight_version,
                   advantage=a) for i, (p, g, a) in enumerate(zip(prompts, gens, advantages))]


def test_engine_and_trainer_on_cuda_agree_and_learn(model_path):
    engine = EmbeddedEngine(model_path)                      # auto: cuda, bf16
    assert engine.device.type == "cuda" and engine.dtype == torch.bfloat16
    prompts = [[5, 6, 14], [7], [9, 4, 4, 4], [11, 12]] * 8
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
    gens = engine.generate(prompts, params)
    assert gens == engine.generate(prompts, params)         # seeded sampling is reproducible on the GPU
    trainer = Trainer(model_path, train=TrainConfig(lr=1e-2), algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", eps_clip=0.2),
                      rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1))
    samples = samples_from(prompts, gens, [1.0, -1.0] * 16)
    first = trainer.train(samples, rollout_id=0)
    # bf16 engine vs bf16-autocast trainer: close, not equal (fp32 on CPU agrees to 1e-5)
    assert first["logprob_diff_rollout"] < 0.1, first
    for r in range(1, 4):
        trainer.train(samples, rollout_id=r)
    engine.update_weights(trainer.weights(), version=4)
    assert engine.weight_version() == 4
    assert engine.weights_checksum() == trainer.weights_checksum(engine.weights_dtype())
    after = samples_from(prompts, engine.generate(prompts, params), [1.0, -1.0] * 16)
    assert after != samples                                 # the new weights sample differently


@pytest.mark.parametrize("recompute", [False, True])
def test_compiled_layers_train_like_eager_ones(model_path, recompute):
    """The CUDA default (each decoder layer torch.compile'd) against --no-trainer-compile: the same
    batches give the same losses and weights within bf16 rounding, with and without activation
    recompute; shapes that change between rollouts (a recompile) change nothing either."""
    engine = EmbeddedEngine(model_path)
    prompts = [[5, 6, 14], [7], [9, 4, 4, 4], [11, 12]] * 8
    rollouts = [samples_from(prompts, engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=n, seed=n)),
                             [1.0, -1.0] * 16) for n in (8, 5, 11)]
    make = lambda compiled: Trainer(model_path, train=TrainConfig(lr=1e-3, micro_batch_size=8, compile_layers=compiled,  # noqa: E731
                                                                  recompute_activations=recompute),
                                    algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"), rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1))
    compiled, eager = make(None), make(False)
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.model.layers)   # None: compiled on CUDA
    start = torch.cat([p.detach().flatten().clone() for p in eager.model.parameters()])
    for r, samples in enumerate(rollouts):
        got, want = compiled.train(samples, r), eager.train(samples, r)
        assert got["loss"] == pytest.approx(want["loss"], rel=0.02, abs=1e-4), (r, got["loss"], want["loss"])
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=0.02), (r, got["grad_norm"], want["grad_norm"])
    # Adam moves every weight by about lr whatever its gradient's size, so compare the updates' directions
    moved = [torch.cat([p.detach().flatten() for p in t.model.parameters()]) - start for t in (compiled, eager)]
    assert torch.nn.functional.cosine_similarity(*moved, dim=0) > 0.95
    compiled.dispose()
    eager.dispose()


def test_optimizer_cpu_offload_trains_like_the_plain_trainer_with_its_state_in_pinned_host_memory(model_path):
    """--optimizer-cpu-offload on CUDA: the moments live in pinned host memory from the first step (no
    offload call), the GPU holds less than the plain trainer by about them, and the weights after
    each rollout equal the plain trainer's bit for bit (the streamed update is AdamW's own)."""
    engine = EmbeddedEngine(model_path)
    prompts = [[5, 6, 14], [7], [9, 4, 4, 4], [11, 12]] * 8
    samples = samples_from(prompts, engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)),
                           [1.0, -1.0] * 16)
    engine.dispose()
    make = lambda **kw: Trainer(model_path, train=TrainConfig(lr=1e-3, micro_batch_size=8, compile_layers=False,  # noqa: E731
                                                              **kw),
                                algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"),
                                rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1))
    held = {}
    for name, kw in (("plain", {}), ("host", {"optimizer_cpu_offload": True})):
        t = make(**kw)
        for r in range(3):
            m = t.train(samples, r)
            held.setdefault(name, []).append(t.weights_checksum())
            assert 0 < m["mfu"] < 1 and m["tflops"] > 0       # bf16 on an H100/H200/A100: a known peak
        torch.cuda.synchronize()
        moments = [v for s in t._optimizer.state.values() for k, v in s.items() if k != "step"]
        assert moments and all(v.is_cuda for v in moments) == (name == "plain")
        if name == "host":
            assert all(v.device.type == "cpu" and v.is_pinned() for v in moments)
        held[name + "_allocated"] = torch.cuda.memory_allocated()
        moment_bytes = sum(v.numel() * v.element_size() for v in moments)
        t.dispose()
    assert held["host"] == held["plain"]
    assert held["plain_allocated"] - held["host_allocated"] >= 0.99 * moment_bytes
