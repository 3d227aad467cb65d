"""Benchmark: rollout of a Qwen3-30B-A3B-shaped MoE on one GPU, FastEngine vs transformers `generate`.

The model: a random Qwen3-MoE of Qwen3-30B-A3B's shape (hidden 2048, 48 layers, 32 heads, 4 KV heads,
head_dim 128, 128 experts, top-8 renormalised, moe_intermediate_size 768, vocab 151936, untied; 30.5 B
parameters, 61 GB in bf16), built on the meta device and materialised on the GPU (`to_empty` + a random
init there: nothing of it passes through host memory). `--layers` cuts it to fewer layers (a quick check).

FastEngine (grouped-matmul experts, CUDA-graph decode, torch.compile) serves N prompts of 64 random tokens
x 1,024 new tokens (temperature 1; `min_new_tokens` bars the stop tokens, so every sequence runs to the end
and all decode in lockstep). N is `--prompts` (default 256) or, when their K/V does not fit beside the
weights (an H100's 80 GB), as many as do: `prompts_run` and `prompts_fit_note` in the JSON say which.

Bandwidth bound, per decode step (a step feeds one token of every sequence): the non-expert weights (attention,
routers, norms, lm_head; the embedding is a gather), the experts that step actually touches (for each layer,
the distinct experts over the batch's top-k, from the routing the engine captured, x 3 x hidden x 768 x 2
bytes), and the live K/V (each sequence's positions so far), all read once at the GPU's bandwidth (H100 SXM
3.35 TB/s, H200 4.8 TB/s, from the device name; `--bandwidth` to override). `bw_fraction` = the sum over the
decode steps / the measured seconds of the call (which also holds the prefill and sampling).

transformers `generate` runs on the same model (the same tensors) in the same process for the ratio, with
fewer prompts and tokens (`--hf-generate-prompts`, `--hf-new-tokens`) so the run fits one 10-minute call;
its tok/s is at its own batch, so the ratio is of throughputs, not of equal work.

Usage (GPU machine, from the checkout): PYTHONPATH=$PWD python3 scripts/bench/moe_rollout_gpu.py [--out r.json]
  quick: --layers 4 --prompts 64 --new-tokens 128; plumbing on CPU: --tiny (a tiny shape, float32)
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_report import BANDWIDTHS  # noqa: E402

SHAPE_30B_A3B = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, intermediate_size=6144, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
SHAPE_TINY = dict(SHAPE_30B_A3B, vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32)
EOS = 2                     # the test tokenizer's <eos>
RESERVE = 5 << 30           # bytes left beside the KV cache: activations, logits, graphs, the routing outputs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_model(shape: dict, layers: int | None, dtype: torch.dtype, seed: int = 0):
    """A random Qwen3-MoE of `shape`, built on the meta device and materialised on DEVICE in `dtype`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**{**shape, "num_hidden_layers": layers or shape["num_hidden_layers"]},
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model.to_empty(device=DEVICE)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)
        rotary = model.model.rotary_emb      # a buffer to_empty left uninitialised: transformers' own formula
        inv_freq, _ = rotary.compute_default_rope_parameters(cfg)
        rotary.inv_freq.copy_(inv_freq)
        rotary.original_inv_freq.copy_(inv_freq)
    return model.eval()


def bandwidth(args) -> tuple[float, str]:
    if args.bandwidth:
        return args.bandwidth, "--bandwidth"
    if DEVICE != "cuda":
        return 1e11, "cpu (nominal 100 GB/s: the fraction means nothing here)"
    name = torch.cuda.get_device_name()
    for key, bw in BANDWIDTHS:
        if key in name:
            return bw, f"{key} from the device name {name!r}"
    return 3.35e12, f"unknown device {name!r}: H100 SXM's 3.35 TB/s assumed"


def byte_counts(engine) -> dict:
    """Weight bytes a decode step reads: the non-expert ones (minus the embedding's gather), one expert's."""
    named = engine._weights.named
    expert = {n for n in named if ".mlp.experts." in n}
    embed = named["model.embed_tokens.weight"]
    tied = engine._weights.lm_head is engine._weights.embed
    dense = sum(t.numel() * t.element_size() for n, t in named.items() if n not in expert)
    if not tied:
        dense -= embed.numel() * embed.element_size()   # a gather of b rows; the untied lm_head is read whole
    moe = engine._weights.moe
    one_expert = 3 * engine.arch.hidden * moe.intermediate * torch.empty((), dtype=engine.dtype).element_size()
    total = sum(t.numel() * t.element_size() for t in named.values())
    return dict(non_expert_bytes=dense, expert_bytes=one_expert, weight_bytes=total,
                kv_bytes_per_position=engine.arch.kv_bytes_per_position(engine.dtype))


def bound(gens, prompt_len: int, n_experts: int, counts: dict, bw: float) -> dict:
    """The bandwidth bound of the decode steps (sequences in lockstep: response token t >= 1 of every
    sequence came from decode step t - 1, whose experts are its routed_experts[t]). A sequence that
    ended early (shorter routed_experts) is read, experts and K/V, only while it runs."""
    import numpy as np

    routed = [np.asarray(g.routed_experts, dtype=np.int64) for g in gens]              # each [T_i, L, k]
    lengths = np.array([len(r) for r in routed])
    n, steps, (layers, k) = len(routed), int(lengths.max()), routed[int(lengths.argmax())].shape[1:]
    padded = np.zeros((n, steps, layers, k), dtype=np.int64)
    for i, r in enumerate(routed):
        padded[i, :len(r)] = r
    base = (np.arange(layers) * n_experts)[None, :, None]
    touched, kv_positions = [], 0
    for t in range(1, steps):
        live = lengths > t
        seen = np.zeros(layers * n_experts, dtype=bool)
        seen[(padded[live, t] + base).ravel()] = True     # (layer, expert) pairs some sequence used at this step
        touched.append(int(seen.sum()))
        kv_positions += int(live.sum()) * (prompt_len + t)
    experts_read = sum(touched) * counts["expert_bytes"]
    kv_read = kv_positions * counts["kv_bytes_per_position"]
    dense_read = (steps - 1) * counts["non_expert_bytes"]
    total = experts_read + kv_read + dense_read
    return dict(decode_steps=steps - 1, bound_s=sig(total / bw),
                mean_distinct_experts_per_layer=round(sum(touched) / max(1, len(touched)) / layers, 1),
                bytes_per_step_gb=round(total / max(1, steps - 1) / 1e9, 2),
                share_experts=round(experts_read / total, 3), share_kv=round(kv_read / total, 3))


def sig(x: float) -> float:
    return float(f"{x:.3g}")


def timed(fn):
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def mem_plan(args, counts_kv: int, context: int) -> tuple[float, int, str]:
    """(mem_fraction, prompts to run, a note): the KV cache takes what is free but RESERVE, capped at 0.9."""
    if DEVICE != "cuda":
        return 0.5, args.prompts, "cpu: all prompts"
    free = torch.cuda.mem_get_info()[0]
    fraction = max(0.05, min(0.9, 1 - RESERVE / free))
    fit = int(free * fraction) // (context * counts_kv)
    n = min(args.prompts, fit)
    note = (f"{args.prompts} prompts fit" if n == args.prompts else
            f"{fit} sequences of {context} positions fit in {fraction:.2f} of the {free / 2**30:.1f} GiB free after "
            f"the weights ({counts_kv * context / 2**20:.0f} MiB of K/V each; {RESERVE / 2**30:.0f} GiB kept for "
            f"activations): {n} of the {args.prompts} asked run")
    return fraction, n, note


def run_fast(model, path: str, prompts: list[list[int]], args, report: dict, bw: float) -> None:
    from miles.rollout.engines.fast.engine import FastEngine
    from miles.types import SamplingParams

    context = args.prompt_len + args.new_tokens
    a = model.config
    elem = torch.empty((), dtype=model.dtype).element_size()
    kv = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * elem
    fraction, n, note = mem_plan(args, kv, context)
    prompts = prompts[:n]
    log(f"FastEngine: {n} prompts, mem_fraction {fraction:.2f} ({note})")
    t0 = time.perf_counter()
    engine = FastEngine(path, model=model, device=DEVICE, max_batch_size=n, mem_fraction=fraction,
                        context_len=context, cuda_graph=not args.no_cuda_graph, torch_compile=not args.no_compile)
    counts = byte_counts(engine)
    report["fast_engine"] = dict(construct_s=round(time.perf_counter() - t0, 1),
                                 warm_up_s=round(engine.compile_seconds, 1),
                                 moe_experts=engine.moe_experts, compiled=engine._forward.compiled,
                                 cuda_graph=engine._graphs.enabled, length_aware_attention=engine._forward.length_aware,
                                 slots=engine.max_batch_size, max_len=engine.max_len,
                                 kv_cache_gib=round(engine._cache.nbytes / 2**30, 2), **counts)
    report["prompts_asked"], report["prompts_run"], report["prompts_fit_note"] = args.prompts, len(prompts), note
    if engine.max_batch_size < len(prompts):    # the engine's own plan is stricter: run what it holds at once
        prompts = prompts[:engine.max_batch_size]
        report["prompts_run"] = len(prompts)
        report["prompts_fit_note"] += f"; the engine's plan holds {engine.max_batch_size} slots"
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, seed=0)
    warm = SamplingParams(temperature=1.0, max_new_tokens=8, min_new_tokens=8, seed=1)
    log("FastEngine: warm-up call (captures the batch's decode graph)")
    _, warm_s = timed(lambda: engine.generate(prompts, warm))
    report["fast_engine"]["warm_call_s"] = round(warm_s, 2)
    log(f"FastEngine: {len(prompts)} x ({args.prompt_len} + {args.new_tokens})")
    gens, secs = timed(lambda: engine.generate(prompts, params))
    tokens = sum(len(g.response_ids) for g in gens)
    assert {len(g.response_ids) for g in gens} == {args.new_tokens}, "min_new_tokens: every sequence runs to the end"
    b = bound(gens, args.prompt_len, engine._weights.moe.n_experts, counts, bw)
    to_host = engine.last_stats["routing_to_host_seconds"]
    report["fast"] = dict(tokens=tokens, seconds=round(secs, 2), tok_s=round(tokens / secs, 1),
                          bw_fraction=sig(b["bound_s"] / secs), routing_to_host_s=round(to_host, 2),
                          bw_fraction_without_routing_to_host=sig(b["bound_s"] / (secs - to_host)), **b,
                          peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else 0,
                          graphs_captured=len(engine._graphs), engine_decode_steps=engine.last_stats["decode_steps"])
    log(f"  {report['fast']}")
    engine.release_memory()     # its KV cache; the weights are the model's own tensors, which generate uses next


def run_hf_generate(model, prompts: list[list[int]], args, report: dict) -> None:
    ids = torch.tensor(prompts[:args.hf_generate_prompts], device=DEVICE)   # equal lengths: no padding
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=EOS)
    log(f"transformers generate: {len(ids)} x ({args.prompt_len} + {args.hf_new_tokens})")
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=2, **kw)     # warm-up
        torch.manual_seed(0)
        out, secs = timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids),
                                                 min_new_tokens=args.hf_new_tokens,
                                                 max_new_tokens=args.hf_new_tokens, **kw))
    tokens = (out.shape[1] - ids.shape[1]) * len(ids)
    report["generate"] = dict(prompts=len(ids), new_tokens=args.hf_new_tokens, tokens=tokens, seconds=round(secs, 2),
                              tok_s=round(tokens / secs, 1),
                              experts_implementation=getattr(model.config, "_experts_implementation", None))
    log(f"  {report['generate']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, help="cut the model to this many layers (default: the shape's 48)")
    p.add_argument("--hf-generate-prompts", type=int, default=32, help="0: skip transformers generate")
    p.add_argument("--hf-new-tokens", type=int, default=128)
    p.add_argument("--bandwidth", type=float, help="bytes/s (default: from the device name)")
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a tiny shape (the script's plumbing, on CPU too)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    t_start = time.perf_counter()
    shape = SHAPE_TINY if args.tiny else SHAPE_30B_A3B
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    bw, bw_source = bandwidth(args)
    report = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
              "tiny": args.tiny, "layers": args.layers or shape["num_hidden_layers"], "bandwidth": bw,
              "bandwidth_source": bw_source, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    from tests.tiny_model import _tokenizer

    t0 = time.perf_counter()
    model = build_model(shape, args.layers, dtype)
    report["parameters_b"] = round(sum(t.numel() for t in model.parameters()) / 1e9, 2)
    report["build_model_s"] = round(time.perf_counter() - t0, 1)
    log(f"model: {report['parameters_b']} B parameters in {report['build_model_s']} s")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, shape["vocab_size"], (args.prompts, args.prompt_len), generator=g).tolist()
    with tempfile.TemporaryDirectory() as tmp:      # the engine reads the config and the tokenizer from a folder
        model.config.save_pretrained(tmp)
        _tokenizer().save_pretrained(tmp)
        try:
            run_fast(model, tmp, prompts, args, report, bw)
        except BaseException as e:
            report["fast_error"] = repr(e)[:2000]
            print(save(report, args.out))     # what was measured before the failure
            raise
    save(report, args.out)      # what the fast engine measured stays, whatever generate does next
    if args.hf_generate_prompts:
        try:
            run_hf_generate(model, prompts, args, report)
            report["fast_vs_generate_tok_s"] = round(report["fast"]["tok_s"] / report["generate"]["tok_s"], 1)
        except Exception as e:  # noqa: BLE001 - the reason it could not run goes into the report
            report["generate"] = {"error": repr(e)[:1000]}
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    print(save(report, args.out))


def save(report: dict, out: str | None) -> str:
    text = json.dumps(report, indent=1)
    if out:
        Path(out).write_text(text)
    return text


if __name__ == "__main__":
    main()
