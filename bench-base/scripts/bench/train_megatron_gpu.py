"""Benchmark: train throughput of the megatron backend beside the torch backend, in one run, on one GPU.

Builds a random Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocab 151936, tied embeddings; bf16 safetensors plus the project's small test
tokenizer) and trains both backends on the same GRPO rollouts of random tokens: --samples samples
of --prompt-len prompt tokens and --response-len response tokens, one optimizer step per rollout
(global batch = the rollout), micro-batches of --micro-batch-size. Per backend, --warmup rollouts
first, then --rollouts timed ones, each timed in its two calls as the train phase makes them:

  prepare_s   prepare_rollout: the forward pass for the old logprobs (and packing)
  step_s      train: forward + backward + optimizer step
  logprob_passes  no-grad forwards prepare made (the train metric of that name: 0 when the torch
              trainer skipped the old-logprob pass)
  tokens_per_s  tokens (prompt + response, no padding) / (prepare_s + step_s)
  mfu         model FLOPs / time / peak: 2 N tokens per no-grad pass, 6 N tokens for the step (N =
              the parameters, the tied embedding once, as the LM head's matmul), plus the causal
              attention's 2 L h T per token forward (x 3 with the backward); peak --peak-tflops
              (989: H200 bf16 dense)
  peak_mem_gib  torch.cuda.max_memory_allocated over the backend's timed rollouts

Backends (--backends, in this order by default):
  torch        the torch trainer as a CUDA run gets it: HF model, float32 master weights and AdamW,
               bf16 autocast, logprobs chunked from the hidden states, the old-logprob pass skipped
  torch-plain  the same trainer computing what megatron computes: full logits, the old-logprob pass
  megatron     GPTModel (local layer spec without Transformer Engine), bf16 parameters, float32 main
               weights and Adam state in the distributed optimizer, one rank in this process (NCCL
               world of 1); full logits and the old-logprob pass

Usage (GPU machine, from the checkout, megatron-core installed):
  PYTHONPATH=$PWD python3 scripts/bench/train_megatron_gpu.py [--out result.json]
  --smoke: a tiny shape and batch (runs on the CPU too: float32, gloo)
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SHAPE_05B = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True, rope_theta=1e6,
                 max_position_embeddings=32768, rms_norm_eps=1e-6)
SHAPE_SMOKE = dict(SHAPE_05B, vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=128)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_model(path: Path, shape: dict, device: str = DEVICE) -> str:
    """A random Qwen2 of `shape` (made on `device`, saved in bf16) with the tests' tokenizer, in `path`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.tiny_model import _tokenizer

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.to(torch.bfloat16).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    del model
    return str(path)


def rollout(seed: int, n: int, prompt_len: int, response_len: int, vocab: int):
    from miles.types import Prompt, Sample

    rng = random.Random(seed)
    return [Sample(prompt=Prompt(index=i, text="", prompt_ids=tuple(rng.randrange(3, vocab) for _ in range(prompt_len))),
                   group=i // 8, response_ids=[rng.randrange(3, vocab) for _ in range(response_len)],
                   rollout_logprobs=[-5.0] * response_len, finish_reason="length", weight_version=0,
                   reward=float(i % 2), advantage=rng.uniform(-1, 1)) for i in range(n)]


def flops_per_token(shape: dict, seq: int) -> tuple[float, float]:
    """(forward, forward + backward) FLOPs per token: 2 N (+ causal attention) and three times that."""
    h, layers, v = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * shape["intermediate_size"]
    n = layers * per_layer + v * h
    forward = 2 * n + 2 * layers * h * seq          # QK^T and AV over half the positions on average
    return forward, 3 * forward


def time_backend(trainer, args, shape: dict) -> dict:
    tokens = args.samples * (args.prompt_len + args.response_len)
    for r in range(args.warmup):
        samples = rollout(r, args.samples, args.prompt_len, args.response_len, shape["vocab_size"])
        trainer.prepare_rollout(samples, r)
        trainer.train(samples, r)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    prepare_s = step_s = passes = 0.0
    for r in range(args.warmup, args.warmup + args.rollouts):
        samples = rollout(r, args.samples, args.prompt_len, args.response_len, shape["vocab_size"])
        t0 = time.perf_counter()
        trainer.prepare_rollout(samples, r)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        metrics = trainer.train(samples, r)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        prepare_s, step_s = prepare_s + t1 - t0, step_s + time.perf_counter() - t1
        passes += metrics["logprob_passes"]
    fwd, fwd_bwd = flops_per_token(shape, args.prompt_len + args.response_len)
    seconds = prepare_s + step_s
    flops = (passes * fwd + args.rollouts * fwd_bwd) * tokens
    return {"prepare_s": round(prepare_s / args.rollouts, 4), "step_s": round(step_s / args.rollouts, 4),
            "logprob_passes": passes / args.rollouts,
            "tokens_per_rollout": tokens, "tokens_per_s": round(tokens * args.rollouts / seconds),
            "mfu": round(flops / seconds / (args.peak_tflops * 1e12), 6),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else None}


def add_rollout_args(p: argparse.ArgumentParser) -> None:
    """The rollout's shape and the timing's length (this bench's and the FSDP bench's)."""
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rollouts", type=int, default=3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make(backend: str, model: str, args):
    from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig

    train = TrainConfig(lr=1e-5, micro_batch_size=args.micro_batch_size, global_batch_size=args.samples)
    rollout_cfg = RolloutConfig(batch_size=args.samples // 8, n_samples_per_prompt=8, max_response_len=args.response_len)
    if backend in ("torch", "torch-plain"):
        from miles.training.trainer import Trainer
        plain = {"hidden_forward": False, "skip_old_logprobs": False} if backend == "torch-plain" else {}
        return Trainer(model, train=train, algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"), rollout=rollout_cfg, device=DEVICE, **plain)
    if backend != "megatron":
        raise SystemExit(f"--backends: unknown backend {backend!r}; use torch, torch-plain, megatron")
    from miles.training.megatron.worker import MegatronWorker
    worker = MegatronWorker(model, train=train, algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"), rollout=rollout_cfg, rank=0,
                            world_size=1, device_type=DEVICE)
    worker.setup("127.0.0.1", free_port())
    return worker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_rollout_args(p)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--backends", default="torch,torch-plain,megatron")
    p.add_argument("--smoke", action="store_true", help="tiny shape and batch (CPU too)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    shape = SHAPE_SMOKE if args.smoke else SHAPE_05B
    if args.smoke:
        args.samples, args.prompt_len, args.response_len, args.micro_batch_size = 16, 8, 16, 4
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "shape": shape,
              "samples": args.samples, "prompt_len": args.prompt_len, "response_len": args.response_len,
              "micro_batch_size": args.micro_batch_size, "rollouts_timed": args.rollouts, "backends": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", shape)
        for backend in args.backends.split(","):
            log(f"{backend}: building")
            t0 = time.perf_counter()
            trainer = make(backend, model, args)
            log(f"{backend}: built in {time.perf_counter() - t0:.1f} s; timing")
            result["backends"][backend] = time_backend(trainer, args, shape)
            log(f"{backend}: {result['backends'][backend]}")
            trainer.dispose()
            del trainer
            gc.collect()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    done = result["backends"]
    for torch_name in ("torch", "torch-plain"):
        if {torch_name, "megatron"} <= done.keys():
            key = "megatron_over_" + torch_name.replace("-", "_")
            result[key] = round(done["megatron"]["tokens_per_s"] / done[torch_name]["tokens_per_s"], 3)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
