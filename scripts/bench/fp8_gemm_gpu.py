"""Benchmark (GPU machine, not a test): the decode step's projections alone, bf16 against FP8 (issue 58: FP8
weights alone ran at 0.95x of bf16 at 512 tokens on an H100; a decode step's projections read every weight
once, so at decode batch sizes FP8's half-size weights should be nearly twice as fast, and are not).

Per Qwen3-4B projection (q/k/v fused 6144 x 2560, o 2560 x 4096, gate/up fused 19456 x 2560, down 2560 x 9728)
and decode batch M (--batches 105,219,256: the 4k run's bf16 and FP8-KV slot counts, the most), each timed
inside one CUDA graph of --reps calls (what the engine's graphs replay; no launch gaps), after a warm-up:
- `bf16`: F.linear(x, w), the bf16 engine's product;
- `fp8_gemm`: `miles::fp8_blockwise_mm` alone, activations already quantized (the cuBLAS block-scaled GEMM and
  the layout copy the op makes of the activation scales);
- `fp8_quantize`: `fp8.quantize_activations` of the padded rows alone, compiled as the engine compiles its pieces
  (there it is fused with what precedes it, e.g. the RMSNorm);
- `fp8_w8a16`: the Triton W8A16 kernel alone (`fp8_w8a16.w8a16_mm`: the e4m3 weight times the bf16 rows, no
  activation quantization), at `tile_config`'s tiles; with --w8a16-sweep each (shape, M) also times a set of
  other tiles (`w8a16_sweep`: us per config, the best first);
- `fp8_linear_cublas`: the block-scaled GEMM's whole product (pad, quantize, GEMM), compiled: `fp8.linear`'s
  product on Hopper by default (`fp8.W8A16` off);
- `fp8_linear`: `fp8.linear(x, w)` whole, the product `select_kernel` chose with `fp8.W8A16` set (`fp8_kernel` in
  the JSON: the W8A16 kernel up to `fp8.W8A16_MAX_M` rows where Triton has it), compiled; and eager
  (`fp8_linear_eager`).
Per entry: us per call, the bytes it must move (the weight: bf16 N x K x 2, FP8 N x K + the float32 scales;
for `fp8_quantize` the padded activations: bf16 read, e4m3 and scales written), GB/s and the fraction of
--hbm-gbs (an entry that fails, e.g. a GPU without the block-scaled GEMM, records its error); per (shape, M)
`fp8_vs_bf16` (bf16 us / fp8_linear us: > 1 is FP8 faster); per M, one decoder layer's four projections
summed and x --layers (36) as ms per decode step, each entry.

Usage (GPU machine, from the checkout): PYTHONPATH=$PWD python3 scripts/bench/fp8_gemm_gpu.py --out gemm.json
  [--batches 105,219,256] [--reps 50] [--hbm-gbs 3350] [--w8a16-sweep]
CPU plumbing check: --tiny (small shapes in float32, eager, timed by the wall clock; FP8 emulated: the op
dequantizes). About a minute on an H100 (the compiles).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_report import emit, hbm_gbs  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from miles.weights import fp8  # noqa: E402
from miles.weights.fp8_w8a16 import tile_config, w8a16_mm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QWEN3_4B = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
TINY = {"qkv": (512, 256), "o": (256, 256), "gate_up": (768, 256), "down": (256, 384)}
ENTRIES = ("bf16", "fp8_gemm", "fp8_quantize", "fp8_w8a16", "fp8_linear_cublas", "fp8_linear", "fp8_linear_eager")
SWEEP = [(bm, bn, warps, stages) for bm in (None, 64) for bn in (16, 32, 64, 128)
         for warps, stages in ((4, 3), (4, 4), (8, 4))]     # bm None: tile_config's rows


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def isolated_compile(fn, tag: str, compiled: bool):
    """`torch.compile(fn, fullgraph=True)` of a copy of `fn` named for `tag` (dynamo's recompile limit counts
    per code object: each shape gets its own, as the engine's pieces do); `fn` itself when not compiled."""
    if not compiled:
        return fn
    name = f"{fn.__name__}__{tag}"
    copy = types.FunctionType(fn.__code__.replace(co_name=name, co_qualname=name), fn.__globals__, name,
                              fn.__defaults__, fn.__closure__)
    return torch.compile(copy, fullgraph=True)


def fp8_linear(x, w):
    return fp8.linear(x, w)


def padded_quantize(x):
    return fp8.quantize_activations(F.pad(x, (0, 0, 0, (-x.shape[0]) % 4)))


def cublas_linear(x, q, s, api):
    return fp8._blockwise(x, q, s, x.dtype, api)


def triton_ready() -> bool:
    """The W8A16 kernel can run here: CUDA with Triton, or Triton's interpreter (TRITON_INTERPRET=1)."""
    import os
    return fp8._triton() and (DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def time_us(fn, reps: int) -> float:
    """Microseconds per call of `fn()`: --reps calls captured in one CUDA graph, the median of 5 replays
    (the wall clock over the calls on the CPU)."""
    fn()
    sync()
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    sync()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def run(args) -> dict:
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shapes = TINY if args.tiny else QWEN3_4B
    fp8.W8A16 = True        # fp8_linear: the W8A16 kernel where it runs (fp8_linear_cublas is the GEMM's product)
    kernel = fp8.select_kernel(torch.device(DEVICE), dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 132
    api = fp8._API or "torch._scaled_mm"
    compiled = DEVICE == "cuda" and not args.no_compile
    report = dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
                  tiny=args.tiny, fp8_kernel=kernel, w8a16_max_m=fp8.W8A16_MAX_M, sms=sms, compiled=compiled, reps=args.reps, hbm_gbs=args.hbm_gbs,
                  layers=args.layers, results=[], per_step={})
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for pname, (n, k) in shapes.items():
        w = (torch.randn((n, k), generator=gen, device=DEVICE) * 0.02).to(dtype)
        q, s = fp8.quantize_blocks(w)
        qw = fp8.QuantWeight(q, s)
        lin, quant = isolated_compile(fp8_linear, pname, compiled), isolated_compile(padded_quantize, pname, compiled)
        cublas = isolated_compile(cublas_linear, pname + "_cublas", compiled)
        bytes16, bytes8 = n * k * w.element_size(), n * k + s.numel() * 4
        for m in args.batches:
            x = torch.randn((m, k), generator=gen, device=DEVICE).to(dtype)
            if compiled:
                torch._dynamo.mark_dynamic(x, 0)
            a, a_scale = padded_quantize(x)

            def entry(fn, nbytes: int) -> dict:
                try:
                    us = time_us(fn, args.reps)
                except Exception as e:  # noqa: BLE001 - e.g. no block-scaled GEMM here: recorded
                    return dict(error=f"{type(e).__name__}: {str(e)[:300]}")
                gbs = nbytes / (us * 1e-6) / 1e9
                return dict(us=round(us, 2), bytes=nbytes, gbs=round(gbs, 1),
                            fraction_of_hbm=round(gbs / args.hbm_gbs, 3))

            def w8a16(config=None) -> dict:
                if not triton_ready():
                    return dict(skipped="no Triton here (CUDA with Triton, or TRITON_INTERPRET=1 on the CPU)")
                return entry(lambda: w8a16_mm(x, q, s, config), bytes8)

            act = -(-m // 4) * 4 * k      # the padded activations: bf16 read, e4m3 written, a scale per 128
            row = dict(proj=pname, n=n, k=k, m=m, bf16=entry(lambda: F.linear(x, w), bytes16),
                       fp8_gemm=entry(lambda: fp8.fp8_blockwise_mm(a, a_scale, q, s, dtype, api), bytes8),
                       fp8_quantize=entry(lambda: quant(x), act * 3 + act // 128 * 4),
                       fp8_w8a16=dict(w8a16(), tiles=tile_config(m, n, sms)),
                       fp8_linear_cublas=entry(lambda: cublas(x, q, s, api), bytes8),
                       fp8_linear=entry(lambda: lin(x, qw), bytes8),
                       fp8_linear_eager=entry(lambda: fp8_linear(x, qw), bytes8))
            if args.w8a16_sweep and triton_ready():
                sweep = []
                for bm, bn, warps, stages in SWEEP:
                    config = (bm or tile_config(m, n, sms)[0], bn, warps, stages)
                    sweep.append(dict(tiles=config, **{k_: v for k_, v in w8a16(config).items() if k_ in ("us", "error")}))
                row["w8a16_sweep"] = sorted(sweep, key=lambda e: e.get("us", float("inf")))
            if "us" in row["bf16"] and "us" in row["fp8_linear"]:
                row["fp8_vs_bf16"] = round(row["bf16"]["us"] / row["fp8_linear"]["us"], 3)
            report["results"].append(row)
            log(f"{pname} {n}x{k} M={m}: " + ", ".join(f"{key} {row[key].get('us', row[key].get('error'))} us"
                                                       for key in ENTRIES)
                + (f", sweep's best {row['w8a16_sweep'][0]}" if row.get("w8a16_sweep") else ""))
    for m in args.batches:
        rows = [r for r in report["results"] if r["m"] == m]
        report["per_step"][str(m)] = {key: round(sum(r[key]["us"] for r in rows) * args.layers / 1e3, 3)
                                      for key in ENTRIES if all("us" in r[key] for r in rows)}
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",") if x], default=[105, 219, 256])
    p.add_argument("--reps", type=int, default=50, help="calls per timed CUDA graph")
    p.add_argument("--layers", type=int, default=36, help="decoder layers per step (per_step = a layer x this)")
    p.add_argument("--no-compile", action="store_true", help="time fp8_linear and fp8_quantize eagerly")
    p.add_argument("--w8a16-sweep", action="store_true", help="also time the W8A16 kernel at other tiles (SWEEP)")
    p.add_argument("--hbm-gbs", type=float, default=None,
                   help="peak memory bandwidth in GB/s (default: by the device's name, H100 SXM 3350, H200 4800)")
    p.add_argument("--tiny", action="store_true", help="small shapes in float32 on the CPU (checks the script)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    args.hbm_gbs = hbm_gbs(args.hbm_gbs)
    if args.reps < 1 or not args.batches or min(args.batches) < 1:
        p.error("--reps and every --batches entry take a count >= 1")
    if args.tiny:
        args.batches, args.reps, args.layers = [3, 8], 2, 2
    t0 = time.perf_counter()
    report = run(args)
    emit(report, args.out, t0)


if __name__ == "__main__":
    main()
