"""Benchmark (GPU machine, not a test): the torch trainer's step alone at a scale workload's shape, by variant.

`grpo_scale_gpu.py` measures a whole colocated iteration (minutes a rollout at 4B x 4k answers);
this bench times only the train phase, on random tokens of the same shape, so that the trainer's
levers (activation recompute, the token budget, packing, --offload-train) can be compared in one
call. Each variant is one `Trainer` built from the workload's random bf16 model, trained on
--samples samples of --prompt-len + --response-len tokens (one optimizer step per rollout, as the
scale workloads do): --warmup rollouts (the first compiles), then --rollouts timed ones; the
variants run one after another (a 4B trainer holds 60+ GB), each disposed before the next.

A colocated engine keeps its bf16 weights on the GPU while the trainer trains (the fast engine);
the bench holds as many bytes (2 B/param, plus --reserve-extra-gib for its CUDA context) so that the
memory plan sees what it sees in the colocated run.

Variants (--variants, comma-separated NAME:key=value;key=value): budget (tokens per micro-batch;
"plan": none given, the memory plan's), recompute (0/1), pack (0/1), offload (0/1: the optimizer
state to host memory after the warm-up, streamed by each step, as --offload-train does), fsdp (0/1: the
trainer as one FSDP2 rank, `miles.training.fsdp.rank.FSDPRank` in a world of one: bf16 parameters
gathered once a step and kept across its micro-batches, no autocast, whole float32 gradients
accumulated by FSDP; what each of N ranks runs), shadow (0/1: --trainer-weight-shadows, the decoder's
Linear weights cast to bf16 once a step instead of once a micro-batch; `miles.training.shadows`), fused
(0/1: --gradient-accumulation-fusion, which implies the shadows: the weight gradients summed into the
float32 ones by the matmuls).

Printed JSON per variant: step_s (median of the timed rollouts), mfu (6 x params x tokens / step_s /
989 TFLOP/s, the scale bench's formula), micro_batches, memory_token_budget, the torch
peak of the process (the engine's stand-in in it). --profile DIR: one more rollout of each variant under
torch.profiler, its ops by CUDA time into DIR/<variant>.txt, and in the JSON its wall time and its
kernels' seconds by kind (matmul, attention, copy, compiled, other) with `busy_s`, the time any ran.

Usage (GPU machine, from the checkout, after installing the .whl wheels):
  PYTHONPATH=$PWD python3 scripts/bench/train_mfu_gpu.py --size 4b --response-len 4096 --out r.json
A CPU smoke run of the script only: --device cpu (a tiny shape, a few tokens).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import grpo_step_gpu as step  # noqa: E402  (the shapes, the model builder, the peak)
from fsdp_step_gpu import sync  # noqa: E402
from train_megatron_gpu import free_port, log, rollout  # noqa: E402

DEFAULT_VARIANTS = ("recompute:recompute=1;budget=32768,plan:budget=plan,"
                    "packed:offload=1;budget=12800,padded:offload=1;budget=12800;pack=0")
KEYS = {"budget", "recompute", "pack", "offload", "fsdp", "shadow", "fused"}


def parse_variants(text: str) -> dict[str, dict]:
    """NAME:key=value;key=value,... -> {NAME: {budget, recompute, pack, offload, fsdp, shadow, fused}} (see the docstring)."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, spec = item.partition(":")
        v = {"budget": "plan", "recompute": 0, "pack": 1, "offload": 0, "fsdp": 0, "shadow": 0, "fused": 0}
        for kv in filter(None, spec.split(";")):
            key, _, value = kv.partition("=")
            if key not in KEYS:
                raise SystemExit(f"--variants: {item!r} has an unknown key {key!r}; use {sorted(KEYS)}")
            v[key] = value if key == "budget" and value == "plan" else int(value)
        out[name] = v
    return out


def make_trainer(model: str, v: dict, args):
    from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
    from miles.training.trainer import Trainer

    budget = None if v["budget"] == "plan" else v["budget"]
    train = TrainConfig(lr=1e-6, micro_batch_size=args.samples, global_batch_size=args.samples,
                        use_dynamic_batch_size=budget is not None, max_tokens_per_gpu=budget,
                        pack_sequences=bool(v["pack"]), recompute_activations=bool(v["recompute"]),
                        weight_shadows=bool(v["shadow"]), grad_accum_fusion=bool(v["fused"]))
    kw = dict(train=train, algorithm=AlgorithmConfig(loss_agg_mode="token_mean"),
              rollout=RolloutConfig(batch_size=args.samples // 8, n_samples_per_prompt=8,
                                    max_response_len=args.response_len), device=args.device)
    if v["fsdp"]:
        from miles.training.fsdp.rank import FSDPRank

        rank = FSDPRank(model, rank=0, world_size=1, **kw)
        rank.setup("127.0.0.1", free_port())      # its world of one; dispose() destroys it
        return rank
    return Trainer(model, **kw)


def one_rollout(trainer, v: dict, args, vocab: int, r: int) -> tuple[float, dict]:
    samples = rollout(r, args.samples, args.prompt_len, args.response_len, vocab)
    if v["offload"] and r > 0:
        trainer.onload()
    sync(args.device)
    t0 = time.perf_counter()
    metrics = trainer.train(samples, r)
    sync(args.device)
    took = time.perf_counter() - t0
    if v["offload"]:
        trainer.offload()
    return took, metrics


# kernel name -> what it does (the first pattern that matches; the names CUDA 13's cuBLAS, cuDNN's SDPA,
# torch's FlashAttention-2, inductor and the copy engines gave on the H200). Attention first: FA2's
# kernel names carry cutlass template arguments
KERNEL_KINDS = (("attention", re.compile(r"attention|flash|fmha|sdpa", re.I)),
                ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|cublas", re.I)),
                ("copy", re.compile(r"memcpy", re.I)),
                ("compiled", re.compile(r"^triton_")),
                ("other", re.compile(r"")))


def kernel_kind(name: str) -> str:
    return next(kind for kind, pattern in KERNEL_KINDS if pattern.search(name))


def kernel_breakdown(events) -> dict[str, float]:
    """Seconds of GPU kernels by kind (`kernel_kind`), and `busy_s`: the time at least one ran (copies
    on their own streams overlap the rest, so the kinds can add up to more than it). Empty on the CPU."""
    from torch.autograd import DeviceType

    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    out = {kind: 0.0 for kind, _ in KERNEL_KINDS}
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    for e in kernels:
        out[kernel_kind(e.name)] += e.time_range.elapsed_us() / 1e6
    busy, end = 0.0, float("-inf")
    for a, b in spans:           # the union of the kernels' intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    return {k: round(v, 3) for k, v in {**out, "busy_s": busy / 1e6}.items()} if kernels else {}


def profile_rollout(trainer, v: dict, args, vocab: int, r: int, path: Path) -> dict[str, float]:
    """One more rollout under torch.profiler: its op table into `path`; returns its wall time and its
    kernels' time by kind."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        took, _ = one_rollout(trainer, v, args, vocab, r)
    key = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=90))
    return {"wall_s": round(took, 3), **kernel_breakdown(prof.events())}


def run_variant(name: str, v: dict, model: str, args, params: int, vocab: int) -> dict:
    log(f"{name}: {v}")
    trainer = make_trainer(model, v, args)
    times, metrics, calls = [], {}, []
    micro_loss = trainer._micro_loss
    trainer._micro_loss = lambda *a, **k: calls.append(1) or micro_loss(*a, **k)   # micro-batches counted
    try:
        for r in range(args.warmup + args.rollouts):
            took, metrics = one_rollout(trainer, v, args, vocab, r)
            log(f"{name}: rollout {r} {took:.2f} s, loss {metrics['loss']:.5f}")
            if r >= args.warmup:
                times.append(took)
            micro_batches, calls[:] = len(calls), []
        profiled = None
        if args.profile:
            profiled = profile_rollout(trainer, v, args, vocab, args.warmup + args.rollouts, args.profile / f"{name}.txt")
    finally:
        trainer.dispose()
        del trainer
        gc.collect()
        torch._dynamo.reset()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    tokens = args.samples * (args.prompt_len + args.response_len)
    med = statistics.median(times)
    return {**v, "step_s": round(med, 3), "step_s_all": [round(t, 3) for t in times],
            "mfu": round(6 * params * tokens / (med * step.PEAK_TFLOPS * 1e12), 4) if args.device == "cuda" else None,
            "tokens_per_s": round(tokens / med), "micro_batches": micro_batches,
            "memory_token_budget": metrics.get("memory_token_budget"),
            "tokens_computed_per_real": round(metrics.get("tokens_computed_per_real", 0.0), 4),
            "torch_peak_gib": round(metrics["gpu_mem_peak_gib"], 2) if "gpu_mem_peak_gib" in metrics else None,
            "profiled_rollout": profiled}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--family", default="qwen3", choices=sorted({f for f, _ in step.SHAPES}))
    p.add_argument("--size", default="4b", choices=sorted({z for _, z in step.SHAPES}))
    p.add_argument("--samples", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rollouts", type=int, default=2)
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--reserve-extra-gib", type=float, default=2.0,
                   help="held besides the engine's bf16 weights (its CUDA context and buffers)")
    p.add_argument("--profile", type=Path)
    p.add_argument("--out")
    args = p.parse_args()
    variants = parse_variants(args.variants)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA here; pass --device cpu for the smoke run")
    if args.device == "cpu":      # the smoke run: a tiny Qwen2 (the 0.5B shape's vocabulary), a few tokens
        step.SHAPES[("qwen2", "smoke")] = dict(step.SHAPE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, intermediate_size=128)
        args.family, args.size, args.samples, args.prompt_len, args.response_len = "qwen2", "smoke", 8, 8, 16
    if (args.family, args.size) not in step.SHAPES:
        raise SystemExit(f"--family {args.family} --size {args.size}: no such shape; "
                         f"use one of {sorted(f'{f} {z}' for f, z in step.SHAPES)}")
    shape = step.SHAPES[(args.family, args.size)]
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "workload": f"{args.family}-{args.size}", "samples": args.samples, "prompt_len": args.prompt_len,
              "response_len": args.response_len, "rollouts_timed": args.rollouts, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        params = step.build_model(folder, args.family, args.size)
        result["params"] = params
        engine = None
        if args.device == "cuda":    # what a colocated fast engine keeps on the GPU while the trainer trains
            engine = torch.empty(int(2 * params + args.reserve_extra_gib * 2 ** 30), dtype=torch.uint8, device="cuda")
        for name, v in variants.items():
            try:
                result["variants"][name] = run_variant(name, v, str(folder), args, params, shape["vocab_size"])
            except torch.OutOfMemoryError as exc:   # run_variant freed the variant's memory on the way out
                result["variants"][name] = {**v, "error": f"out of memory: {str(exc)[:300]}"}
            log(f"{name}: {result['variants'][name]}")
        del engine
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
