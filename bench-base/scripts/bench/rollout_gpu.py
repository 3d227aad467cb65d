"""Benchmark: rollout generation on one GPU, FastEngine vs transformers `model.generate` (and EmbeddedEngine).

Builds a random Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocab 151936, tied embeddings, rope_theta 1e6; bf16 safetensors plus the
project's small test tokenizer) and generates token ids from random prompts, all peers in one run:

  short  256 prompts x 64 tokens, 256 new tokens, temperature 1 (the issue's shape)
  long   64 prompts x 8 samples, prompts of 16..128 tokens, up to 1024 new tokens, temperature 1,
         with --stop-tokens random stop tokens (EOS on): answers end at mixed lengths
         (mean ~ vocab / stop tokens), which is where continuous batching matters

For each shape and engine: generated tokens (up to and including a stop token), seconds, tok/s,
the ratio to `model.generate`, peak GPU memory, and for FastEngine its cold call (first use of
each (batch, span) graph captured on the way) and warm call; construction time (weights, cache,
torch.compile) is reported separately. FastEngine runs twice: with its length-aware decode
attention kernel ("fast") and with the stock attention call ("fast_sdpa"), to pick the default.

Bandwidth bound: a decode step must read every weight once and the K/V of every cached position
of every sequence in the batch. For the tokens actually generated, at the engine's batch size S:
  bytes = ceil(tokens / S) * weight_bytes + sum over sequences, over answer tokens t >= 1, of
          (prompt_len + t) * kv_bytes_per_position,
and bound_s = bytes / 4.3e12 (the H200's device-to-device copy rate measured on these machines).
`bw_fraction` = bound_s / measured seconds (the measured time includes prefill and sampling).

Usage (GPU machine, from the checkout): PYTHONPATH=$PWD python3 scripts/bench/rollout_gpu.py
  [--shapes short,long] [--skip-long-baselines] [--skip-embedded] [--skip-sdpa-variant] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

BANDWIDTH = 4.3e12          # bytes/s, H200 device-to-device copy (read + write) seen on these machines
SHAPE_05B = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True, rope_theta=1e6,
                 max_position_embeddings=32768, rms_norm_eps=1e-6)
SHAPE_SMOKE = dict(SHAPE_05B, vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=128)
EOS = 2                     # the test tokenizer's <eos>
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_model(path: Path, shape: dict, seed: int = 0) -> str:
    """A random-init Qwen2 of `shape` in bf16 (initialised on the GPU: seconds, not minutes)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.tiny_model import _tokenizer

    cfg = Qwen2Config(**shape, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return str(path)


def make_shape(name: str, vocab: int, stop_tokens: int, scale: int = 1, seed: int = 0) -> dict:
    """The request set of a shape; `scale` > 1 divides its sizes (the --smoke run)."""
    g = torch.Generator().manual_seed(seed)
    if name == "short":
        prompts = torch.randint(3, vocab, (256 // scale, 64 // scale), generator=g).tolist()
        return dict(name=name, prompts=prompts, max_new_tokens=256 // scale, stop=())
    lens = torch.randint(16 // scale, 128 // scale + 1, (64 // scale,), generator=g).tolist()
    base = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    stop = tuple(torch.randperm(vocab - 3, generator=g)[:stop_tokens].add(3).tolist())
    return dict(name=name, prompts=[p for p in base for _ in range(8)], max_new_tokens=1024 // scale, stop=stop)


def answer_lengths(rows: list[list[int]], stop: set[int]) -> list[int]:
    """Tokens generated per row, up to and including the first stop token."""
    out = []
    for r in rows:
        cut = next((i + 1 for i, t in enumerate(r) if t in stop), len(r))
        out.append(cut)
    return out


def bound_seconds(prompts: list[list[int]], lengths: list[int], batch: int, weight_bytes: int,
                  kv_bytes: int) -> float:
    steps = math.ceil(sum(lengths) / batch)
    kv = sum(sum(len(p) + t for t in range(1, n)) for p, n in zip(prompts, lengths)) * kv_bytes
    return (steps * weight_bytes + kv) / BANDWIDTH


def timed(fn) -> tuple[object, float, int]:
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        return fn(), time.perf_counter() - t0, 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0, torch.cuda.max_memory_allocated()


def result(lengths: list[int], seconds: float, peak: int, **extra) -> dict:
    tokens = sum(lengths)
    return dict(tokens=tokens, seconds=round(seconds, 3), tok_s=round(tokens / seconds, 1),
                mean_answer_len=round(tokens / len(lengths), 1), peak_mem_gib=round(peak / 2**30, 2), **extra)


def run_hf_generate(path: str, shape: dict) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
    prompts = shape["prompts"]
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):   # left padding, as generate wants
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    ids, attn = ids.to(DEVICE), attn.to(DEVICE)
    stop = sorted({EOS, *shape["stop"]})
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=stop)
    with torch.inference_mode():
        model.generate(ids[:8], attention_mask=attn[:8], max_new_tokens=4, **kw)   # warm-up
        torch.manual_seed(0)
        out, secs, peak = timed(lambda: model.generate(ids, attention_mask=attn,
                                                       max_new_tokens=shape["max_new_tokens"], **kw))
    lengths = answer_lengths(out[:, width:].tolist(), set(stop))
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result(lengths, secs, peak)


def run_engine(engine, shape: dict, warm: bool) -> tuple[dict, list[int]]:
    from miles.types import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=shape["max_new_tokens"], stop_token_ids=shape["stop"],
                            seed=0)
    runs = []
    for _ in range(2 if warm else 1):
        gens, secs, peak = timed(lambda: engine.generate(shape["prompts"], params))
        runs.append((gens, secs, peak))
    gens, secs, peak = runs[-1]
    lengths = [len(g.response_ids) for g in gens]
    extra = dict(cold_seconds=round(runs[0][1], 3)) if warm else {}
    return result(lengths, secs, peak, **extra), lengths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="short,long", help="comma list of: short, long")
    p.add_argument("--skip-long-baselines", action="store_true",
                   help="long shape: run FastEngine only (model.generate takes minutes there)")
    p.add_argument("--skip-embedded", action="store_true", help="do not run EmbeddedEngine")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--mem-fraction", type=float, default=0.5)
    p.add_argument("--stop-tokens", type=int, default=380, help="long shape: random stop tokens (EOS is always on)")
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--skip-sdpa-variant", action="store_true",
                   help="do not also run FastEngine with the stock attention call (attention_kernel=False)")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--smoke", action="store_true", help="a tiny model and shapes (checks the script, on CPU too)")
    args = p.parse_args()
    t_start = time.perf_counter()
    model_shape, scale = (SHAPE_SMOKE, 8) if args.smoke else (SHAPE_05B, 1)
    report = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
              "smoke": args.smoke, "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = build_model(Path(tmp) / "model", model_shape)
        report["build_model_s"] = round(time.perf_counter() - t0, 1)
        stop_tokens = max(1, args.stop_tokens * model_shape["vocab_size"] // SHAPE_05B["vocab_size"] * scale)
        shapes = [make_shape(n, model_shape["vocab_size"], stop_tokens, scale) for n in args.shapes.split(",")]
        for shape in shapes:
            report["shapes"][shape["name"]] = {"requests": len(shape["prompts"]),
                                               "max_new_tokens": shape["max_new_tokens"],
                                               "stop_tokens": len(shape["stop"]) + 1}
        run_baselines(path, shapes, args, report)
        run_fast(path, shapes, args, report)
        if not args.skip_sdpa_variant:
            run_fast(path, shapes, args, report, label="fast_sdpa", attention_kernel=False)
    for shape in report["shapes"].values():
        if "generate" in shape and "fast" in shape:
            shape["fast_vs_generate"] = round(shape["fast"]["tok_s"] / shape["generate"]["tok_s"], 1)
        if "generate" in shape and "fast_sdpa" in shape:
            shape["fast_sdpa_vs_generate"] = round(shape["fast_sdpa"]["tok_s"] / shape["generate"]["tok_s"], 1)
        if "embedded" in shape and "fast" in shape:
            shape["fast_vs_embedded"] = round(shape["fast"]["tok_s"] / shape["embedded"]["tok_s"], 1)
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


def run_baselines(path: str, shapes: list[dict], args, report: dict) -> None:
    from miles.rollout.engines.embedded.engine import EmbeddedEngine

    for shape in shapes:
        if shape["name"] == "long" and args.skip_long_baselines:
            continue
        log(f"{shape['name']}: model.generate")
        report["shapes"][shape["name"]]["generate"] = run_hf_generate(path, shape)
        log(f"  {report['shapes'][shape['name']]['generate']}")
        if args.skip_embedded:
            continue
        log(f"{shape['name']}: EmbeddedEngine max_batch_size={args.max_batch_size}")
        engine = EmbeddedEngine(path, device=DEVICE, max_batch_size=args.max_batch_size)
        report["shapes"][shape["name"]]["embedded"] = run_engine(engine, shape, warm=False)[0]
        engine.dispose()
        log(f"  {report['shapes'][shape['name']]['embedded']}")


def run_fast(path: str, shapes: list[dict], args, report: dict, *, label: str = "fast",
             attention_kernel: bool = True) -> None:
    from miles.rollout.engines.fast.engine import FastEngine

    context = max(max(len(q) for q in s["prompts"]) + s["max_new_tokens"] for s in shapes)
    log(f"FastEngine ({label}): max_batch_size={args.max_batch_size} max_context_len={context}")
    t0 = time.perf_counter()
    engine = FastEngine(path, device=DEVICE, max_batch_size=args.max_batch_size, mem_fraction=args.mem_fraction,
                        max_context_len=context, cuda_graph=not args.no_cuda_graph,
                        torch_compile=not args.no_compile, attention_kernel=attention_kernel)
    weight_bytes = sum(t.numel() * t.element_size() for t in engine._weights.named.values())
    kv_bytes = engine.arch.kv_bytes_per_position(engine.dtype)
    report[f"{label}_engine"] = dict(
        construct_s=round(time.perf_counter() - t0, 1), warm_up_s=round(engine.compile_seconds, 1),
        compiled=engine._forward.compiled, cuda_graph=engine._graphs.enabled,
        length_aware_attention=engine._forward.length_aware, max_len=engine.max_len,
        kv_cache_gib=round(engine._cache.nbytes / 2**30, 2), weight_bytes=weight_bytes,
        kv_bytes_per_position=kv_bytes)
    for shape in shapes:
        log(f"{shape['name']}: FastEngine {label} (cold, then warm)")
        res, lengths = run_engine(engine, shape, warm=True)
        bound = bound_seconds(shape["prompts"], lengths, args.max_batch_size, weight_bytes, kv_bytes)
        res.update(bw_bound_s=round(bound, 4), bw_fraction=round(bound / res["seconds"], 3),
                   decode_steps=engine.last_stats["decode_steps"], prefills=engine.last_stats["prefills"])
        report["shapes"][shape["name"]][label] = res
        log(f"  {res}")
    report[f"{label}_engine"]["graphs_captured"] = len(engine._graphs)
    engine.dispose()


if __name__ == "__main__":
    main()
