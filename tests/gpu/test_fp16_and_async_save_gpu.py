"""--fp16 and --async-save on CUDA (written Dec 5 2026 without a GPU; their CPU tests are
tests/unit/test_fp16_training.py and tests/unit/test_async_save.py).

float16 on CUDA reaches what the CPU does not: the fast engine's Triton attention and CUDA graphs in
float16, the trainer's compiled decoder layers and its chunked hidden-state logprobs under float16
autocast with loss scaling. A background save on CUDA copies the weights and AdamW's moments off the
GPU (or out of --optimizer-cpu-offload's pinned host buffers) before the next step changes them.
"""

from __future__ import annotations

import threading

import pytest
import torch

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.rollout.engines.embedded.engine import EmbeddedEngine
from miles.rollout.engines.fast.engine import FastEngine
from miles.training.torch.trainer import Trainer
from miles.types import SamplingParams
from tests.gpu.test_cuda_parts import samples_from
from tests.tiny_model import make_tiny_model
from tests.unit.test_async_save import same_files

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 6, 14], [7], [9, 4, 4, 4], [11, 12]] * 8


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def trainer(model_path, dtype: str = "auto", **train) -> Trainer:
    return Trainer(model_path, train=TrainConfig(**{"lr": 1e-3, "micro_batch_size": 8, **train}),
                   algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", eps_clip=0.2),
                   rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1), dtype=dtype)


@pytest.mark.parametrize("engine_cls", [EmbeddedEngine, FastEngine])
def test_fp16_engines_and_the_compiled_fp16_trainer_agree_and_sync(model_path, engine_cls):
    engine = engine_cls(model_path, dtype="float16")                  # auto device: cuda
    assert engine.weights_dtype() == torch.float16
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
    samples = samples_from(PROMPTS, engine.generate(PROMPTS, params), [1.0, -1.0] * 16)
    t = trainer(model_path, "float16")
    assert t.compute_dtype == torch.float16 and t._compiled_layers
    first = t.train(samples, 0)
    # float16 engine against the float16-autocast trainer: the same distribution up to float16 rounding
    assert first["logprob_diff_rollout"] < 0.05, first
    assert (first["loss_scale"], first["skipped_steps"]) == (2.0 ** 16, 0.0)     # the default start fits float16
    for r in range(1, 3):
        t.train(samples, r)
    engine.update_weights(t.weights(), version=3)
    assert engine.weights_checksum() == t.weights_checksum(torch.float16)
    engine.dispose()
    t.dispose()


def test_an_fp16_overflow_on_cuda_is_skipped_and_the_scale_falls(model_path):
    engine = EmbeddedEngine(model_path, dtype="float16")
    samples = samples_from(PROMPTS, engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)),
                           [1.0, -1.0] * 16)
    engine.dispose()
    t = trainer(model_path, "float16", initial_loss_scale=2.0 ** 40, hysteresis=1)
    before = t.weights_checksum()
    m = t.train(samples, 0)
    assert (m["skipped_steps"], m["loss_scale"], t.num_steps) == (1.0, 2.0 ** 39, 0)
    assert t.weights_checksum() == before
    t.dispose()


@pytest.mark.parametrize("host", [False, True], ids=["moments_on_gpu", "optimizer_cpu_offload"])
def test_a_background_save_on_cuda_is_its_snapshot(model_path, tmp_path, host):
    engine = EmbeddedEngine(model_path)
    samples = samples_from(PROMPTS, engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)),
                           [1.0, -1.0] * 16)
    engine.dispose()
    t = trainer(model_path, optimizer_cpu_offload=host)
    t.train(samples, 0)
    t.save(tmp_path / "sync")
    release = threading.Event()
    t._writes.submit(release.wait)                 # hold the writer until the next step has run
    t.save(tmp_path / "background", background=True)
    t.train(samples, 1)
    torch.cuda.synchronize()
    release.set()
    t.wait_saved()
    same_files(tmp_path / "sync", tmp_path / "background")
    t.dispose()
