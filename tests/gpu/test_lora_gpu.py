"""LoRA on CUDA: the adapters train inside the compiled decoder layers, the merged weights reach a
colocated engine by CUDA IPC (checked by checksum), and the engine's logprobs match the trainer's
within bf16. Skipped without CUDA. Not yet run on a GPU when written (no device in that session).

Run on the GPU machine, from the checkout:
    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_lora_gpu.py -q
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from miles.api.launch import train
from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.config.flags import parse_flags
from miles.runtime import read_trace, with_disposer
from miles.training.batch import make_train_batch
from miles.training.torch.trainer import Trainer
from tests.tiny_model import make_tiny_model
from tests.unit.test_trainer import SAMPLES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]


def test_compiled_lora_trains_only_its_adapters_on_cuda(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    t = Trainer(path, device="cuda", rollout=RolloutConfig(batch_size=1),
                algorithm=AlgorithmConfig(loss_agg_mode="token_mean", use_kl_loss=True, kl_loss_coef=0.1),
                train=TrainConfig(lr=1e-2, lora_rank=4, lora_alpha=8, lora_dropout=0.1))
    assert t._compiled_layers                                        # the CUDA default: compiled decoder layers
    base = t.weights_checksum(torch.bfloat16)
    frozen = {n: p.detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    for r in range(3):
        metrics = t.train(SAMPLES, rollout_id=r)
        assert metrics["grad_norm"] > 0
    assert all(torch.equal(p, frozen[n]) for n, p in t.model.named_parameters() if n in frozen)
    assert t.weights_checksum(torch.bfloat16) != base
    batch = t.prepare(make_train_batch(SAMPLES, t.pad_id))
    assert (batch.old_logprobs - batch.ref_logprobs).abs().max() > 0   # the adapters moved the policy off the base


@pytest.mark.ray
@pytest.mark.parametrize("engine", ["embedded", "fast"])
def test_colocated_lora_syncs_merged_weights_by_ipc_and_engine_logprobs_match(ray_cluster, tmp_path, engine):
    cfg, _ = parse_flags(["--config", str(ROOT / "examples/arithmetic/grpo.yaml"), "--run-dir", str(tmp_path / "run"),
                          "--trace-console", "off", "--device", "cuda", "--colocate", "--offload",
                          "--rollout-engine", engine, "--num-rollout", "10", "--eval-interval", "10",
                          "--check-weight-update-equal", "--lora-rank", "16", "--lora-alpha", "32",
                          "--lr", "2e-3", "--save", str(tmp_path / "ck"), "--save-interval", "10"])
    result = asyncio.run(with_disposer(train, cfg))
    trace = read_trace(result.run_dir)
    assert trace.of("weight_transport")[0].get("transport") == "cuda_ipc"
    synced = trace.of("weights_synced")
    assert len(synced) == 11 and all(e.get("checksum") for e in synced)      # each checked against merged weights
    assert len({e.get("checksum") for e in synced}) > 1                       # the merged weights changed
    rows = [r for r in result.metrics if r.get("kind") == "train"]
    # the engine's logprobs are the trainer's (merged bf16 weights vs. base + adapters under autocast)
    assert all(r["logprob_diff_rollout"] < 0.05 for r in rows), [r["logprob_diff_rollout"] for r in rows]
    evals = [r for r in result.metrics if r.get("kind") == "eval"]
    assert evals[-1]["eval/arith/pass@1"] >= evals[0]["eval/arith/pass@1"]
    ckpt = sorted((tmp_path / "ck").glob("iter_*"))[-1]
    assert (ckpt / "trainer" / "adapter_model.safetensors").is_file()
    assert (ckpt / "hf" / "adapter" / "adapter_config.json").is_file()
