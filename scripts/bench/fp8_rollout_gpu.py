"""Benchmark (GPU machine, not a test): FastEngine rollout in bf16, with FP8 weights, with the FP8 KV cache,
and with both, in one run on one GPU (issue 58).

The workload is 4b-4k's rollout (`grpo_scale_gpu.py`): a random-init Qwen3-4B-shaped bf16 model (hidden
2560, 36 layers, 32 heads, 8 KV heads, head_dim 128, intermediate 9728, vocab 151936, tied), 32 prompts x 8
samples of 64 random tokens, temperature 1; every answer is made to run to --new-tokens (min_new_tokens =
max_new_tokens: a random model's rare EOS would make the variants' work differ). Default --new-tokens 2048,
half of 4b-4k's 4,096, so that the four variants, each built and compiled afresh, fit one 10-minute device
call; `--new-tokens 4096 --variants bf16,both` runs the full length for the goal's pair.

Per variant: the engine's construction seconds (weights, cache, compile), the FP8 kernel that ran
(`miles.weights.fp8.kernel()`), KV slots and cache GiB (the FP8 cache holds twice the sequences in the same
memory), the timed call's generated tokens, seconds and tokens/s (after a warm-up call of 8 tokens per
request, which captures the full batch's CUDA graphs), and the speed-up over bf16.

The logprob gap ("train vs rollout"): for --gap-sequences of each variant's sequences, the logprobs
the engine sampled with against the bf16 HF model's (transformers, teacher-forced: what a bf16 trainer
computes), as mean |delta| and the k3 KL estimate mean(exp(d) - 1 - d), d = train - rollout
(miles.algorithms' train_rollout_k3_kl). bf16's own gap is the floor (kernels differ).

Weight sync: the time to push the model (the bf16 HF model's weights standing in for the trainer's)
into an engine by the bucket protocol (`miles.weights.transport`, 512 MiB buckets on the GPU, the
payload path: no IPC mapping, which is the same in both), bf16 buckets vs FP8 buckets (quantized on the
GPU as they are filled: `miles.weights.fp8.Fp8Weights`), bytes moved, best of --sync-repeats.

Usage (GPU machine, from the checkout): PYTHONPATH=$PWD python3 scripts/bench/fp8_rollout_gpu.py
  [--variants bf16,fp8_weights,fp8_kv,both] [--prompts 32] [--samples 8] [--new-tokens 2048] [--out result.json]
CPU plumbing check: --tiny (a tiny Qwen3 shape, float32, eager, FP8 emulated).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=9728, tie_word_embeddings=True,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960)
# the smallest Qwen3 shape whose fused projections keep 128-row blocks (FP8's block scales)
QWEN3_TINY = dict(QWEN3_4B, vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=64, intermediate_size=256, max_position_embeddings=512)
VARIANTS = {"bf16": (None, "auto"), "fp8_weights": ("fp8", "auto"), "fp8_kv": (None, "fp8_e4m3"),
            "both": ("fp8", "fp8_e4m3")}
EOS = 2


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def build_model(path: Path, shape: dict, dtype: torch.dtype) -> str:
    """A random-init Qwen3 of `shape` (initialised on the device: seconds), saved with the tests' tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.tiny_model import _tokenizer

    cfg = Qwen3Config(**shape, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return str(path)


def run_variant(path: str, name: str, prompts: list[list[int]], new_tokens: int, args) -> tuple[dict, list]:
    from miles.rollout.engines.fast.engine import FastEngine
    from miles.types import SamplingParams

    quantization, kv = VARIANTS[name]
    t0 = time.perf_counter()
    engine = FastEngine(path, max_batch_size=args.max_batch_size, mem_fraction=args.mem_fraction,
                        context_len=len(prompts[0]) + new_tokens, quantization=quantization, kv_cache_dtype=kv,
                        cuda_graph=not args.tiny, torch_compile=not args.tiny)
    build_s = time.perf_counter() - t0
    warm = min(8, new_tokens)       # a short call first: captures the full batch's graphs (and compiles what is left)
    runs = []
    for n in (warm, new_tokens):
        params = SamplingParams(temperature=1.0, max_new_tokens=n, min_new_tokens=n, seed=0)
        sync()
        t0 = time.perf_counter()
        gens = engine.generate(prompts, params)
        sync()
        runs.append((gens, time.perf_counter() - t0))
    gens, secs = runs[-1]
    tokens = sum(len(g.response_ids) for g in gens)
    out = dict(build_s=round(build_s, 1), compile_s=round(engine.compile_seconds, 1), fp8_kernel=engine.fp8_kernel,
               kv_cache_dtype=str(engine.cache_dtype), slots=engine.max_batch_size,
               kv_cache_gib=round(engine._cache.nbytes / 2**30, 2), tokens=tokens, seconds=round(secs, 3),
               warm_up_seconds=round(runs[0][1], 3), tok_s=round(tokens / secs, 1),
               stats={k: v for k, v in engine.last_stats.items() if k in ("decode_steps", "graphs", "prefills")})
    if DEVICE == "cuda":
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    kept = [(prompts[i], gens[i].response_ids, gens[i].logprobs) for i in range(min(args.gap_sequences, len(gens)))]
    engine.dispose()
    del engine
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out, kept


@torch.inference_mode()
def logprob_gap(model, kept: list) -> dict:
    """mean |train - rollout| and k3 KL over the kept sequences' answer tokens, train = `model`'s logprobs with
    EOS barred, as the engine sampled them (min_new_tokens = max_new_tokens bars it at every step)."""
    diffs = []
    for prompt, response, rollout_lp in kept:
        ids = torch.tensor([prompt + response], device=model.device)
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        logits[:, EOS] = float("-inf")
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
        diffs.append(lp.cpu() - torch.tensor(rollout_lp, dtype=torch.float32))
        del logits
    d = torch.cat(diffs)
    return dict(tokens=d.numel(), mean_abs=round(d.abs().mean().item(), 5),
                k3_kl=round((d.exp() - 1 - d).mean().item(), 6))


def time_sync(path: str, model, quantization: str | None, repeats: int, dtype: torch.dtype) -> dict:
    """Seconds to push `model`'s weights into a small engine by buckets (see the module), best of `repeats`."""
    from miles.rollout.engines.fast.engine import FastEngine
    from miles.weights.fp8 import Fp8Weights
    from miles.weights.hf import model_weights
    from miles.weights.transport import DEFAULT_BUCKET_BYTES, WeightBucket, fill_bucket, plan_buckets

    engine = FastEngine(path, max_batch_size=2, max_context_len=64, quantization=quantization,
                        cuda_graph=False, torch_compile=False)
    live = model_weights(model)
    best, nbytes = float("inf"), 0
    for version in range(1, repeats + 1):
        sync()
        t0 = time.perf_counter()
        weights = Fp8Weights(live, dtype) if quantization == "fp8" else live
        plans = plan_buckets(weights, dtype=dtype, bucket_bytes=DEFAULT_BUCKET_BYTES)
        for i, plan in enumerate(plans):
            flat = fill_bucket(plan, weights, device=DEVICE)
            engine.load_weight_bucket(WeightBucket(index=i, count=len(plans), version=version, metas=plan.metas,
                                                   payload=flat))
            del flat
        sync()
        best = min(best, time.perf_counter() - t0)
        nbytes = sum(p.nbytes for p in plans)
    assert engine.weight_version() == repeats
    engine.dispose()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return dict(seconds=round(best, 3), bytes=nbytes, gib=round(nbytes / 2**30, 3))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of: {', '.join(VARIANTS)}")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--mem-fraction", type=float, default=0.85)
    p.add_argument("--gap-sequences", type=int, default=8, help="sequences per variant in the logprob gap")
    p.add_argument("--sync-repeats", type=int, default=3)
    p.add_argument("--skip-sync", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen3 on the CPU in float32 (checks the script)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    if args.tiny:
        args.prompts, args.samples, args.prompt_len, args.new_tokens = 2, 2, 8, 8
        args.max_batch_size, args.gap_sequences, args.sync_repeats = 4, 2, 1
    shape, dtype = (QWEN3_TINY, torch.float32) if args.tiny else (QWEN3_4B, torch.bfloat16)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown --variants {unknown}; use {', '.join(VARIANTS)}")
    t_start = time.perf_counter()
    report = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
              "tiny": args.tiny, "workload": dict(prompts=args.prompts, samples=args.samples,
                                                  prompt_len=args.prompt_len, new_tokens=args.new_tokens),
              "variants": {}}
    g = torch.Generator().manual_seed(0)
    base = torch.randint(3, shape["vocab_size"], (args.prompts, args.prompt_len), generator=g).tolist()
    prompts = [q for q in base for _ in range(args.samples)]
    kept = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "model", shape, dtype)
        for name in names:
            log(f"variant {name}")
            report["variants"][name], kept[name] = run_variant(path, name, prompts, args.new_tokens, args)
            log(json.dumps(report["variants"][name]))
        from miles.weights.hf import load_causal_lm

        model = load_causal_lm(path, device=torch.device(DEVICE), dtype=dtype)
        for name in names:
            report["variants"][name]["logprob_gap_vs_bf16_hf"] = logprob_gap(model, kept[name])
        if not args.skip_sync:
            report["weight_sync"] = {q or "bf16": time_sync(path, model, q, args.sync_repeats, dtype)
                                     for q in (None, "fp8")}
            s = report["weight_sync"]
            s["fp8_vs_bf16_time"] = round(s["fp8"]["seconds"] / s["bf16"]["seconds"], 2)
        del model
    if "bf16" in report["variants"]:
        ref = report["variants"]["bf16"]["tok_s"]
        for v in report["variants"].values():
            v["speedup_vs_bf16"] = round(v["tok_s"] / ref, 2)
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
