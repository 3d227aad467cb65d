"""Benchmark (not a test): FastEngine's slot KV cache against its paged one (--rollout-page-size) on a long-tail
rollout, on the same K/V memory.

The workload is an RL rollout's shape: --prompts x --samples answers whose caps are drawn from a long tail
(geometric with mean --mean-len, at most --max-len: most answers short, a few at the cap), every answer made to
run to its cap (min_new_tokens = its cap), so both caches do the same work. The slot cache sizes each slot for
the longest prompt + answer a request may have (the engine's `context_len`, as a run gives it), so the K/V
budget holds budget / (prompt + max-len) sequences at once and the others queue; the paged cache starts as
many as --max-batch-size while the positions they have reached fit, preempting the newest when the pages run
out. The K/V budget is fixed in positions (--kv-positions, the engine's free memory pinned so that
--rollout-mem-fraction 0.5 of it holds that many), so the result does not depend on what the machine has free.

Per cache: decode steps, prefills, preemptions, the mean rows of a decode step (generated tokens / steps: how
full the batch stayed), seconds and generated tokens/s of the timed call (after a warm-up call). The step
counts do not depend on the hardware; the seconds do (on a CPU a decode step's cost grows with its rows, so
fuller batches save less time there than on a GPU, where a step costs about the same for 16 rows as for 256).

Usage:
  python scripts/bench/paged_kv_bench.py [--device cpu|cuda] [--prompts 16] [--samples 8] [--mean-len 64]
      [--max-len 512] [--kv-positions 16384] [--max-batch-size 128] [--page-size 64] [--out result.json]
CPU by default: a small random Qwen3 (2 layers, hidden 128) in float32, eager; `--device cuda`: the same model
in bf16 with CUDA graphs and torch.compile.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPE = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
             head_dim=64, intermediate_size=256, tie_word_embeddings=True, rope_theta=1_000_000.0,
             rms_norm_eps=1e-6, max_position_embeddings=8192)
EOS = 2


def build_model(path: Path) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.tiny_model import _tokenizer

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**SHAPE, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)


def long_tail_caps(n: int, mean: int, cap: int, seed: int) -> list[int]:
    """n answer lengths, geometric with mean `mean` (at least 1), at most `cap`."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64).clamp(min=1e-12)
    p = 1.0 / mean
    return [int(min(cap, max(1, k))) for k in (torch.log(u) / torch.log1p(torch.tensor(-p))).ceil().tolist()]


def run_cache(path: str, name: str, page_size: int | None, prompts, caps, args) -> dict:
    from miles.rollout.engines.fast import engine as fast_engine
    from miles.rollout.engines.fast.engine import FastEngine
    from miles.types import SamplingParams

    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    probe = FastEngine(path, device=args.device, dtype=dtype, max_batch_size=1, max_context_len=64, cuda_graph=False,
                       torch_compile=False)
    per_position = probe.arch.kv_bytes_per_position(probe.cache_dtype)
    workspace = probe._workspace_bytes() * args.max_batch_size      # generous: the rest must hold the workspace
    del probe
    # the engine's free memory pinned: --rollout-mem-fraction 0.5 of it is --kv-positions positions of K/V
    budget = args.kv_positions * per_position
    real = fast_engine.free_memory
    fast_engine.free_memory = lambda device: 2 * max(budget, workspace) + 1
    try:
        t0 = time.perf_counter()
        engine = FastEngine(path, device=args.device, dtype=dtype, max_batch_size=args.max_batch_size,
                            mem_fraction=budget / (2 * max(budget, workspace) + 1),
                            context_len=args.prompt_len + args.max_len, page_size=page_size,
                            cuda_graph=cuda, torch_compile=cuda)
        build_s = time.perf_counter() - t0
    finally:
        fast_engine.free_memory = real
    runs = []
    for call_caps in ([min(c, 8) for c in caps], caps):       # a short warm-up call, then the timed one
        # every answer runs to its own cap: the stop token barred for as many tokens as the longest cap
        params = SamplingParams(temperature=1.0, seed=0, max_new_tokens=max(call_caps),
                                min_new_tokens=max(call_caps))
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        gens = engine.generate(prompts, params, max_new_tokens=call_caps)
        if cuda:
            torch.cuda.synchronize()
        runs.append((gens, time.perf_counter() - t0))
    gens, secs = runs[-1]
    tokens = sum(len(g.response_ids) for g in gens)
    stats = engine.last_stats
    return dict(cache=name, page_size=page_size, slots=engine.max_batch_size, kv_pages=engine.kv_pages,
                max_len=engine.max_len, build_s=round(build_s, 2), tokens=tokens, seconds=round(secs, 3),
                tok_s=round(tokens / secs, 1), decode_steps=stats["decode_steps"], prefills=stats["prefills"],
                preemptions=stats["preemptions"], mean_rows=round(tokens / max(stats["decode_steps"], 1), 1),
                lengths_equal_caps=[len(g.response_ids) for g in gens] == caps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--mean-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--kv-positions", type=int, default=16384, help="the K/V budget of both caches, in positions")
    p.add_argument("--max-batch-size", type=int, default=128)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    base = torch.randint(3, SHAPE["vocab_size"], (args.prompts, args.prompt_len), generator=g).tolist()
    prompts = [q for q in base for _ in range(args.samples)]
    caps = long_tail_caps(len(prompts), args.mean_len, args.max_len, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "model")
        results = [run_cache(path, "slot", None, prompts, caps, args),
                   run_cache(path, "paged", args.page_size, prompts, caps, args)]
    slot, paged = results
    out = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
               workload=dict(answers=len(prompts), prompt_len=args.prompt_len, mean_len=args.mean_len,
                             max_len=args.max_len, mean_cap=round(sum(caps) / len(caps), 1), max_cap=max(caps),
                             kv_positions=args.kv_positions, max_batch_size=args.max_batch_size),
               results=results,
               paged_vs_slot=dict(tok_s=round(paged["tok_s"] / slot["tok_s"], 3),
                                  decode_steps=round(paged["decode_steps"] / slot["decode_steps"], 3)))
    print(json.dumps(out, indent=2))
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
