"""The train step's micro-batch loop asks the device nothing: on CUDA each such read (`.item()`, a
count turned into a Python number, a boolean index, `nonzero`, a `repeat_interleave` without its output
size) makes the host wait until the GPU has run everything queued, and the GPU then idles until the
host launches the next kernel. Checked on the CPU by intercepting every aten op the loop dispatches
(tests/gpu/test_step_syncs_gpu.py checks the same under CUDA's sync debug mode)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.training.batch import make_train_batch
from miles.training.torch.trainer import Trainer
from tests.unit.test_trainer import sample

QWEN3 = "examples/arithmetic/base_model_qwen3"
READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
         "aten.item.default"}


class HostReads(TorchDispatchMode):
    """Records the ops that would make a CUDA host wait for the device."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, kwargs = str(func), kwargs or {}
        if name in READS or (name.startswith("aten.repeat_interleave") and kwargs.get("output_size") is None):
            self.seen.append(name)
        elif name.startswith(("aten.index.Tensor", "aten.index_put")) and \
                any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.seen.append(f"{name} (boolean index)")
        return func(*args, **kwargs)


def samples(n=24, seed=0):
    rng = random.Random(seed)
    return [sample([rng.randrange(4, 24) for _ in range(rng.randrange(2, 30))],
                   [rng.randrange(4, 24) for _ in range(rng.randrange(1, 60))], rng.uniform(-1, 1)) for _ in range(n)]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("shadows", [False, True], ids=["autocast", "shadows"])
def test_the_micro_batch_loop_reads_nothing_from_the_device(packed, mode, shadows):
    train = TrainConfig(lr=1e-3, micro_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=512,
                        pack_sequences=packed, weight_shadows=shadows)
    algorithm = AlgorithmConfig(loss_agg_mode=mode, kl_loss_type="k3", use_kl_loss=True, kl_loss_coef=0.01,
                                entropy_coef=0.001)
    # the chunked path from the hidden states: the CUDA trainer's forward
    t = Trainer(QWEN3, train=train, algorithm=algorithm, rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=3),
                device="cpu", dtype="bfloat16" if shadows else "float32", hidden_forward=True)
    assert t._packed is packed
    batch = t.prepare(make_train_batch(samples(), t.pad_id))
    normalizer, num_tokens = t._objective.normalizers(batch)
    pairs = t._micro_batches(batch)         # made before the loop: these may read (once a step)
    assert len(pairs) > 1
    record, probe = torch.zeros(batch.tokens.shape), HostReads()
    with probe:
        sums = t._accumulate(pairs, normalizer, num_tokens, record)     # Trainer.accumulate_gradients' loop
    assert probe.seen == []
    assert record[batch.loss_mask].abs().min() > 0        # the loop did compute every trained token
    assert sums.floats()["loss"] != 0


def test_the_loop_after_a_skipped_pass_with_tis_reads_nothing_from_the_device():
    # the old-logprob pass skipped (one optimizer step): each micro-batch makes its TIS weights in the loop
    train = TrainConfig(lr=1e-3, micro_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=512)
    algorithm = AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", use_tis=True, tis_clip_low=0.5)
    t = Trainer(QWEN3, train=train, algorithm=algorithm, rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=3),
                device="cpu", hidden_forward=True)
    batch, _, metrics = t._prepare(make_train_batch(samples(), t.pad_id), None, may_skip=True)
    assert metrics["logprob_passes"] == 0 and batch.old_logprobs is None and batch.is_weights is None
    normalizer, num_tokens = t._objective.normalizers(batch)
    pairs = t._micro_batches(batch)
    assert len(pairs) > 1
    record, probe = torch.zeros(batch.tokens.shape), HostReads()
    with probe:
        t._accumulate(pairs, normalizer, num_tokens, record)
    assert probe.seen == []
    assert "tis_clip_frac" in t._objective.mismatch(record, batch)     # read once, after the loop


def test_the_probe_sees_a_host_read():
    # the check above can fail: a count turned into a Python number is seen
    probe = HostReads()
    with probe:
        x = torch.ones(3)
        int(x.sum())
        x[x > 0]
    assert probe.seen[0] == "aten._local_scalar_dense.default" and len(probe.seen) >= 2
