"""The megatron backend on CUDA (bf16, NCCL, one GPU, TP 1) against the torch backend; skipped without
CUDA or megatron-core. Run on the GPU machine (after installing the .whl wheels: ray, megatron-core,
transitions, structlog):

    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_megatron_gpu.py -x -q

The rank is used in this process (no Ray) except in the demo run, which goes through `miles train`.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from miles.training.megatron.checks import installed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not installed("megatron.core"), reason="needs megatron-core")]

ROOT = Path(__file__).resolve().parents[2]
BASE = str(ROOT / "examples/arithmetic/base_model")      # a trained Llama: realistic, peaked logits


def samples(rollout_id: int, n: int = 64, base: str = BASE):
    """Samples as a rollout makes them: the demo's prompts, responses sampled (temperature 1) from the
    base model itself in float32, with their logprobs, rewarded by the demo's task. Responses drawn
    from the policy keep the comparison where RL trains: uniformly random tokens would sit where
    this peaked model gives them logprobs near -15, and there bf16 rounding alone moves gradients
    by a third (in either backend)."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.types import Prompt, Sample

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in (ROOT / "examples/arithmetic/data/eval.jsonl").read_text().splitlines()]
    gen = torch.Generator().manual_seed(rollout_id)
    out = []
    for i in range(n):
        row = rows[(rollout_id * n + i // 8) % len(rows)]
        prompt = tok(row["input"]).input_ids
        ids, logprobs = list(prompt), []
        with torch.no_grad():
            for _ in range(6):
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
                token = int(torch.multinomial(lp.exp(), 1, generator=gen))
                ids.append(token)
                logprobs.append(float(lp[token]))
                if token == tok.eos_token_id:
                    break
        response = ids[len(prompt):]
        text = tok.decode(response, skip_special_tokens=True)
        out.append(Sample(prompt=Prompt(index=i // 8, text=row["input"], prompt_ids=tuple(prompt)), group=i // 8,
                          response_ids=response, rollout_logprobs=logprobs,
                          finish_reason="stop" if response[-1] == tok.eos_token_id else "length", weight_version=0,
                          reward=float(text.strip() == row["label"]), advantage=0.0))
    rewards = torch.tensor([s.reward for s in out]).view(-1, 8)
    advantages = (rewards - rewards.mean(1, keepdim=True)).flatten().tolist()
    return [replace(s, advantage=a) for s, a in zip(out, advantages)]


def configs(**train):
    from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig

    return (TrainConfig(**{"lr": 2e-4, "micro_batch_size": 16, "clip_grad": 0.0, **train}), AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"),
            RolloutConfig(batch_size=8, n_samples_per_prompt=8, max_response_len=6))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def megatron_rank(cfg, base: str = BASE):
    from miles.training.megatron.worker import MegatronWorker

    train, algorithm, rollout = cfg
    worker = MegatronWorker(base, train=train, algorithm=algorithm, rollout=rollout, rank=0, world_size=1,
                            device_type="cuda")
    worker.setup("127.0.0.1", free_port())
    return worker


def torch_trainer(cfg, base: str = BASE):
    from miles.training.torch.trainer import Trainer

    train, algorithm, rollout = cfg
    return Trainer(base, train=train, algorithm=algorithm, rollout=rollout, device="cuda")


@pytest.mark.parametrize("family", ["base_model", "base_model_llama3", "base_model_qwen3"])
def test_logprobs_equal_the_torch_backends_within_bf16(family):
    # Llama (plain RoPE), Llama 3 (rope scaling llama3, untied) and Qwen3 (q/k norms) through the
    # conversion on CUDA
    from miles.training.batch import make_train_batch

    base = str(ROOT / "examples/arithmetic" / family)
    cfg = configs()
    worker, trainer = megatron_rank(cfg, base), torch_trainer(cfg, base)
    try:
        batch = samples(0, base=base)
        worker.prepare_rollout(batch, 0)
        got = worker._prepared[1].old_logprobs                # [B, T] of the current weights
        want = trainer.prepare(make_train_batch(batch, trainer.pad_id)).old_logprobs
        mask = worker._prepared[1].loss_mask
        diff = (got - want)[mask].abs()
        # both run bf16 matmuls on the same bf16-rounded weights; norms and softmax differ in rounding
        assert diff.mean() < 0.02 and diff.max() < 0.25, (float(diff.mean()), float(diff.max()))
    finally:
        worker.dispose()
        trainer.dispose()


def megatron_grads(worker) -> dict[str, torch.Tensor]:
    """The last step's gradients (DDP's fp32 grad buffer) under HF names."""
    from miles.training.megatron.conversion import mcore_to_hf, te_names

    grads = {n: p.main_grad.float().clone() for n, p in worker._policy.gpt.named_parameters()}
    return mcore_to_hf(te_names(grads, to_te=False) if worker._policy.use_te else grads, worker.spec)


def test_one_grpo_step_same_loss_and_close_gradients():
    from miles.weights.hf import model_weights

    cfg = configs()                              # one optimizer step over the 64 samples, no clipping
    worker, trainer = megatron_rank(cfg), torch_trainer(cfg)
    grads: dict[int, torch.Tensor] = {}      # the torch trainer's, taken before its step drops them
    trainer._optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.update(
        {id(p): p.grad.detach().clone() for group in opt.param_groups for p in group["params"] if p.grad is not None}))
    try:
        got, want = worker.train(samples(0), 0), trainer.train(samples(0), 0)
        assert got["loss"] == pytest.approx(want["loss"], rel=0.02, abs=2e-3), (got["loss"], want["loss"])
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=0.03), (got["grad_norm"], want["grad_norm"])
        mg = megatron_grads(worker)
        tg = {n: grads[id(p)].float() for n, p in model_weights(trainer.model).items()}
        assert sorted(mg) == sorted(tg)
        for name, g in tg.items():
            cos = torch.nn.functional.cosine_similarity(mg[name].flatten(), g.flatten(), dim=0)
            assert cos > 0.99, (name, float(cos))
            assert float(mg[name].norm()) == pytest.approx(float(g.norm()), rel=0.05), name
    finally:
        worker.dispose()
        trainer.dispose()


def test_save_load_resume_continue_and_teardown_frees_everything(tmp_path):
    import torch.distributed as dist
    from megatron.core import parallel_state

    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    train, algorithm, rollout = configs(global_batch_size=32)              # two steps per rollout
    cfg = (train, replace(algorithm, use_kl_loss=True, kl_loss_coef=0.05), rollout)   # a reference model too
    worker = megatron_rank(cfg)
    worker.train(samples(0), 0)
    worker.save(tmp_path / "trainer")
    straight = [worker.train(samples(r), r) for r in (1, 2)]
    worker.dispose()
    worker = megatron_rank(cfg)
    worker.load(tmp_path / "trainer")
    resumed = [worker.train(samples(r), r) for r in (1, 2)]
    for s, r in zip(straight, resumed):
        for key in ("loss", "pg_loss", "kl", "grad_norm", "logprob_diff_rollout"):
            assert r[key] == pytest.approx(s[key], rel=1e-3, abs=1e-5), (key, s[key], r[key])
    worker.dispose()
    worker.dispose()                                                       # idempotent
    torch.cuda.synchronize()
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()
    leaked = torch.cuda.memory_allocated() - baseline
    assert leaked < 2**20, f"{leaked / 2**20:.1f} MiB still allocated after dispose"


def test_demo_grpo_with_the_megatron_backend_learns(tmp_path):
    """The arithmetic demo's recipe, 10 rollouts of 4 optimizer steps each (40 steps, as the 40-rollout
    recipe takes), through `miles train --train-backend megatron` on CUDA: +15 points of greedy
    accuracy on the held-out problems, and a resume from its checkpoint continues. Colocated, so
    one GPU holds the run: the rank gets the trainer's share of the placement plan's GPU, the
    engine frees its KV cache while the rank trains, the weights go by the object store (checked
    equal after every sync)."""
    pytest.importorskip("ray")
    from miles.api.launch import train
    from miles.config.flags import parse_flags
    from miles.runtime import read_trace, with_disposer

    def run(*flags):
        cfg, _ = parse_flags(["--config", str(ROOT / "examples/arithmetic/grpo.yaml"), "--train-backend", "megatron",
                              "--device", "cuda", "--colocate", "--check-weight-update-equal",
                              "--global-batch-size", "64", "--trace-console", "off", "--progress", "off", *flags])
        return asyncio.run(with_disposer(train, cfg))

    first = run("--num-rollout", "10", "--eval-interval", "5", "--run-dir", str(tmp_path / "run"),
                "--save", str(tmp_path / "ck"), "--save-interval", "5")
    evals = [r["eval/arith/pass@1"] for r in first.metrics if r.get("kind") == "eval"]
    assert len(evals) == 3 and evals[-1] - evals[0] >= 0.15, evals
    trace = read_trace(first.run_dir)
    assert [e.get("transport") for e in trace.of("weights_synced")] == ["object_store"] * 11
    assert trace.of("memory_to_engines") and trace.of("memory_to_trainer")      # the engine handed its cache over
    resumed = run("--num-rollout", "12", "--eval-interval", "12", "--skip-eval-before-train", "--run-dir",
                  str(tmp_path / "resumed"), "--load", str(tmp_path / "ck"))
    trained = [r["step"] for r in resumed.metrics if r.get("kind") == "train"]
    after = [r["eval/arith/pass@1"] for r in resumed.metrics if r.get("kind") == "eval"]
    assert trained == [10, 11] and after[-1] >= evals[-1] - 0.05, (evals, after)
