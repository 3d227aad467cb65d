"""Benchmark (GPU machine, not a test): where the FP8 weight sync's time goes (issue 58: on an H100 the FP8
sync of Qwen3-4B took 0.04 s against bf16's 0.02 s; the goal is no slower). Per-tensor overhead or bandwidth?

The weights: a Qwen3-4B-shaped bf16 state dict made on the device (HF names; 36 layers of q/k/v/o and
gate/up/down, the norms, the tied embedding), the trainer's side of a sync without the engine. Timed, each
the best of --repeats after a warm-up pass (CUDA synchronize at both ends; one cuda event pair per tensor
for the per-shape table):
- `bf16_fill`: the bf16 sync's buckets: `transport.fill_bucket` over every tensor (512 MiB buckets, planned
  once), as `BucketSender` and `fp8_rollout_gpu.py`'s `time_sync` fill them.
- `fp8_fill`: the FP8 sync's: the same over `fp8.Fp8Weights` (on CUDA the Linear weights of a bucket quantized
  straight into it, values and scales, by one kernel launch: `Fp8Weights.write_bucket`; the rest copied). `bf16_fill_from_fp32`, `fp8_fill_from_fp32`: both again from float32
  copies of the weights (the torch trainer's: FP8 rounds them to bf16 inside the quantization pass).
- `quantize_triton` / `quantize_torch`: the quantization alone, over the 252 Linear weights, by each path
  `fp8.quantize_blocks` can take (`_quantize_blocks_triton`, one Triton program per 128 x 128 block, which
  it runs on CUDA; `_quantize_blocks_torch`, torch ops, elsewhere), called directly.
- `copy_bf16`: a plain copy of the same 252 weights (read and write bf16), the bandwidth reference.
Per path: seconds, host seconds to enqueue the whole loop (the Python and launch cost: when it is close to
the total, the GPU waited on the host), kernels launched per tensor (torch.profiler over one tensor),
bytes read + written (bf16 in, e4m3 + float32 scales out) and GB/s against --hbm-gbs; per weight shape, the
mean microseconds per tensor and GB/s. `bits_equal`: the Triton and torch paths' scales and e4m3 bytes
compared tensor by tensor (they are meant to be identical; the e4m3 bytes only on the GPU: Triton's CPU
interpreter rounds to e4m3 differently).

Usage (GPU machine, from the checkout): PYTHONPATH=$PWD python3 scripts/bench/fp8_quantize_gpu.py --out q.json
  [--repeats 5] [--layers 36] [--hbm-gbs 3350]
CPU plumbing check: --tiny (a 2-layer shape with 128-multiples, float32 timing on the CPU; the Triton path
runs only under TRITON_INTERPRET=1, else it is reported as skipped). Under 30 s on an H100.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_report import emit, hbm_gbs  # noqa: E402

import torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QWEN3_4B = dict(vocab=151936, hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728)
TINY = dict(vocab=512, hidden=256, layers=2, heads=2, kv_heads=1, head_dim=128, intermediate=384)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def state_dict(shape: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Qwen3-shaped weights under HF names, random on the device (the embedding tied: no lm_head)."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    h, q, kv, inter = shape["hidden"], shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"], \
        shape["intermediate"]

    def w(*dims):
        return (torch.randn(dims, generator=gen, device=DEVICE) * 0.02).to(dtype)

    out = {"model.embed_tokens.weight": w(shape["vocab"], h)}
    for i in range(shape["layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": w(h), p + "self_attn.q_proj.weight": w(q, h),
                    p + "self_attn.k_proj.weight": w(kv, h), p + "self_attn.v_proj.weight": w(kv, h),
                    p + "self_attn.o_proj.weight": w(h, q), p + "self_attn.q_norm.weight": w(shape["head_dim"]),
                    p + "self_attn.k_norm.weight": w(shape["head_dim"]), p + "post_attention_layernorm.weight": w(h),
                    p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                    p + "mlp.down_proj.weight": w(h, inter)})
    out["model.norm.weight"] = w(h)
    return out


def triton_quantize(w: torch.Tensor):
    """The Triton path, `fp8._quantize_blocks_triton` (on the CPU under TRITON_INTERPRET=1)."""
    from miles.weights import fp8

    return fp8._quantize_blocks_triton(w)


def triton_available() -> str | None:
    """None when the Triton path runs here, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if DEVICE != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "no GPU and TRITON_INTERPRET is not 1"
    return None


def timed(fn, repeats: int) -> tuple[float, float]:
    """(best seconds of `fn()` with a synchronize at both ends, the host seconds to enqueue it in that run)."""
    fn()
    sync()
    best = (float("inf"), 0.0)
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        if t2 - t0 < best[0]:
            best = (t2 - t0, t1 - t0)
    return best


def kernels_per_call(fn) -> tuple[int, list[str]]:
    """Device kernels (CUDA) or aten ops (CPU) one call of `fn` launches, by torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync()
    if DEVICE == "cuda":
        names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:   # the CPU has no kernels: the top-level aten ops
        names = [e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    return len(names), sorted(set(n[:100] for n in names))


def per_shape(fn, weights: list[torch.Tensor], bytes_of) -> dict:
    """Mean microseconds per tensor and GB/s, by weight shape (one CUDA event pair per call; wall clock on CPU)."""
    times: dict[tuple, list[float]] = {}
    for w in weights:
        fn(w)
    sync()
    for w in weights:
        if DEVICE == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(w)
            b.record()
            times.setdefault(tuple(w.shape), []).append((a, b))
        else:
            t0 = time.perf_counter()
            fn(w)
            times.setdefault(tuple(w.shape), []).append(time.perf_counter() - t0)
    sync()
    out = {}
    for shp, ts in times.items():
        us = [a.elapsed_time(b) * 1e3 for a, b in ts] if DEVICE == "cuda" else [t * 1e6 for t in ts]
        mean = statistics.mean(us)
        out["x".join(map(str, shp))] = dict(tensors=len(us), us_per_tensor=round(mean, 2),
                                            gbs=round(bytes_of(shp) / (mean * 1e-6) / 1e9, 1))
    return out


def q_bytes(shp: tuple[int, int]) -> int:
    """Bytes a quantization moves: bf16 read (2 per element), e4m3 written (1) and the float32 block scales."""
    n, k = shp
    return n * k * 3 + (-(-n // 128)) * (-(-k // 128)) * 4


def copy_bytes(shp: tuple[int, int]) -> int:
    """Bytes a bf16 copy moves: read 2 and write 2 per element."""
    return shp[0] * shp[1] * 4


def entry(secs: float, host: float, nbytes: int, hbm_gbs: float, **extra) -> dict:
    gbs = nbytes / secs / 1e9
    return dict(seconds=round(secs, 5), host_enqueue_seconds=round(host, 5), bytes=nbytes, gbs=round(gbs, 1),
                fraction_of_hbm=round(gbs / hbm_gbs, 3), **extra)


def time_fills(live: dict, bucket: int, args, suffix: str = "") -> dict:
    """The bf16 and the FP8 sync's bucket fills over every weight (the module's `bf16_fill`, `fp8_fill`; with
    `suffix`, e.g. from float32 weights)."""
    from miles.weights import fp8
    from miles.weights.transport import fill_bucket, plan_buckets

    dtype = torch.bfloat16

    plans16 = plan_buckets(live, dtype=dtype, bucket_bytes=bucket)
    plans8 = plan_buckets(fp8.Fp8Weights(live, dtype), dtype=dtype, bucket_bytes=bucket)
    state: dict = {}        # the FP8 bucket writer's tables, kept across fills as BucketSender keeps them

    def fill(weights):      # planned once, as BucketSender does
        for plan in plans8 if isinstance(weights, fp8.Fp8Weights) else plans16:
            flat = fill_bucket(plan, weights, device=DEVICE, state=state)
            del flat

    bytes16, bytes8 = sum(p.nbytes for p in plans16), sum(p.nbytes for p in plans8)
    out = {}
    s, h = timed(lambda: fill(live), args.repeats)
    # a bucket fill reads each tensor (in its own dtype) and writes it into the bucket as bf16
    read = sum(t.numel() * t.element_size() for t in live.values())
    out["bf16_fill" + suffix] = entry(s, h, read + bytes16, args.hbm_gbs, buckets=len(plans16), bucket_bytes=bytes16)
    s, h = timed(lambda: fill(fp8.Fp8Weights(live, dtype)), args.repeats)
    # FP8: each Linear weight read once and quantized into its bucket (e4m3 + scales written); every other
    # tensor read and written as bf16
    out["fp8_fill" + suffix] = entry(s, h, read + bytes8, args.hbm_gbs, buckets=len(plans8), bucket_bytes=bytes8)
    out["fp8_vs_bf16_fill" + suffix] = round(out["fp8_fill" + suffix]["seconds"] / out["bf16_fill" + suffix]["seconds"], 2)
    log(f"fill{suffix}: bf16 {out['bf16_fill' + suffix]['seconds']} s, fp8 {out['fp8_fill' + suffix]['seconds']} s")
    return out


def time_paths(linear: list, args) -> dict:
    """The quantization alone by each path, and a plain copy, over the Linear weights."""
    from miles.weights import fp8

    out = {}
    paths = {"quantize_torch": fp8._quantize_blocks_torch, "copy_bf16": lambda w: w.clone()}
    why_not = triton_available()
    if why_not is None:
        paths = {"quantize_triton": triton_quantize, **paths}
    else:
        out["quantize_triton"] = dict(skipped=why_not)
    for name, fn in paths.items():
        s, h = timed(lambda: [fn(w) for w in linear], args.repeats)
        bytes_of = copy_bytes if name == "copy_bf16" else q_bytes
        kernels, names = kernels_per_call(lambda: fn(linear[0]))
        out[name] = entry(s, h, sum(bytes_of(tuple(t.shape)) for t in linear), args.hbm_gbs,
                          kernels_per_tensor=kernels, kernel_names=names,
                          launch_us_per_tensor=round(h / len(linear) * 1e6, 2),
                          per_shape=per_shape(fn, linear, bytes_of))
        log(f"{name}: {out[name]['seconds']} s ({out[name]['gbs']} GB/s), host {out[name]['host_enqueue_seconds']} "
            f"s, {kernels} kernels per tensor")
    return out


def compare_bits(live: dict) -> dict:
    """The Triton and torch paths' scales and e4m3 bytes, tensor by tensor."""
    from miles.weights import fp8

    values, scales = [], []
    for n, t in live.items():
        if fp8.is_quantized_name(n):
            (qa, sa), (qb, sb) = triton_quantize(t), fp8._quantize_blocks_torch(t)
            if not torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)):
                values.append(n)
            if not torch.equal(sa, sb):
                scales.append(n)
    # Triton's interpreter (the CPU) rounds float32 -> e4m3 its own way (31.77 -> 16, a tie 116 -> 120 on
    # 3.6): there the values' comparison is the interpreter's, not the kernel's; the scales' holds
    return dict(tensors=sum(fp8.is_quantized_name(n) for n in live), scales_differ=len(scales),
                values_differ=len(values), first_differing=(scales or values)[:5], values_meaningful=DEVICE == "cuda")


def run(args) -> dict:
    from miles.weights import fp8
    from miles.weights.transport import DEFAULT_BUCKET_BYTES

    shape = dict(TINY if args.tiny else QWEN3_4B)
    if args.layers:
        shape["layers"] = args.layers
    t0 = time.perf_counter()
    live = state_dict(shape, torch.bfloat16)
    sync()
    linear = [t for n, t in live.items() if fp8.is_quantized_name(n)]
    report = dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
                  tiny=args.tiny, hbm_gbs=args.hbm_gbs, shape=shape, repeats=args.repeats,
                  tensors=len(live), linear_tensors=len(linear),
                  bf16_bytes=sum(t.numel() * t.element_size() for t in live.values()),
                  linear_bf16_bytes=sum(t.numel() * 2 for t in linear), build_s=round(time.perf_counter() - t0, 2))
    bucket = args.bucket_mib << 20 if args.bucket_mib else DEFAULT_BUCKET_BYTES
    report.update(time_fills(live, bucket, args))
    live32 = {n: t.float() for n, t in live.items()}    # the torch trainer's weights are float32
    report.update(time_fills(live32, bucket, args, suffix="_from_fp32"))
    del live32
    report.update(time_paths(linear, args))
    if triton_available() is None:
        report["bits_equal"] = compare_bits(live)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's, 36)")
    p.add_argument("--bucket-mib", type=int, default=0, help="bucket size (0: the sync's default, 512 MiB)")
    p.add_argument("--hbm-gbs", type=float, default=None,
                   help="peak memory bandwidth in GB/s (default: by the device's name, H100 SXM 3350, H200 4800)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer shape on the CPU (checks the script)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    args.hbm_gbs = hbm_gbs(args.hbm_gbs)
    if args.repeats < 1 or args.layers < 0 or args.bucket_mib < 0:
        p.error("--repeats takes a count >= 1; --layers and --bucket-mib >= 0")
    if args.tiny:
        args.repeats = min(args.repeats, 2)
    t0 = time.perf_counter()
    report = run(args)
    emit(report, args.out, t0)


if __name__ == "__main__":
    main()
