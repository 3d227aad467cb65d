"""Benchmark (GPU machine, not a test): FastEngine rollout in bf16, with FP8 weights, with the FP8 KV cache,
and with both, in one run on one GPU (issue 58).

The workload is 4b-4k's rollout (`grpo_scale_gpu.py`): a random-init Qwen3-4B-shaped bf16 model (hidden
2560, 36 layers, 32 heads, 8 KV heads, head_dim 128, intermediate 9728, vocab 151936, tied), 32 prompts x 8
samples of 64 random tokens, temperature 1; every answer is made to run to --new-tokens (min_new_tokens =
max_new_tokens: a random model's rare EOS would make the variants' work differ). Default --new-tokens 2048,
half of 4b-4k's 4,096, so that the four variants, each built and compiled afresh, fit one 10-minute device
call; `--new-tokens 4096 --variants bf16,both` runs the full length for the goal's pair.

Each variant has a `_paged` twin (`bf16_paged`, `both_paged`, ...): the same engine over a paged KV cache of
--page-size positions a page (`--rollout-page-size`): all 256 answers start at once and the newest are
preempted (prefilled again later) when the pages run out, where the slot cache runs them in waves of as many
slots as hold a whole answer; its JSON adds the preemptions.

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

Where the time goes (--profile-steps N, default 0 = off): after each variant's timed call, one more generate
on the same engine per --profile-context L (a comma list) with every slot busy (the steady state of a long
call): `slots` prompts of L random tokens (default: half of --plan-context, about the mean context of a
call whose answers fill the plan; attention is linear in the context, so a window there costs what the
call's steps cost on average; add ~4000 for the long end). Its decode steps are watched by a wrapper
around the engine's `_decode` (a bench-side instance attribute, removed after; nothing under miles/
changes): after 4 steps, N steps timed (CUDA synchronize at both ends, no profiler), then N steps under
torch.profiler (CPU + CUDA activities) with the CUDA graphs as captured (CUPTI reports the kernels a graph
replay runs, not attributed to ops; `graph_kernels_visible` checks it: the attention kernel's calls per
step >= the layers), then, with --profile-modes graphs,eager, N steps with the graphs off (the same
compiled step launched op by op: what the graphs save in launches, and the fallback should graph replays
show no kernels; `eager` alone never attaches the profiler to a graph replay, for a stack where that
misbehaves: torch's own `_init_for_cuda_graphs` note says CUDA < 12 did, and TEARDOWN_CUPTI=0 is set as
torch.profiler sets it for inductor's graphs). Prefill is outside every window. The variant's JSON gets
`profile` {L: ...}: the timed ms/step against a bandwidth bound (every weight once + the batch's K/V at
that context, at --hbm-gbs) and, per profiled window, the top 25 kernels by total device time (name,
calls, ms, share) and the device ms per decode step by category (`categorize`: attention, fp8_gemm,
bf16_gemm, quantize, sampling, fused_elementwise, copies, other). Which GEMM kernels are FP8 is learned
first by profiling `miles::fp8_blockwise_mm` on the engine's own projections (`fp8_gemm_kernel_names`).
--profile-dir DIR writes each window's chrome trace there, gzipped (dropped when over 5 MB).
`profile_comparison` puts the variants side by side per context (each category's ms per step, the timed
us per generated token) and, given two contexts or more, fits each variant's ms/step as fixed + per-1k-
context parts. --plan-context C plans the engines' KV slots for C positions (default prompt + new
tokens), so that a short timed call gets the 4k run's slot counts (105 bf16, 219 FP8 KV on an H100 80GB).

Usage (GPU machine, from the checkout): PYTHONPATH=$PWD python3 scripts/bench/fp8_rollout_gpu.py
  [--variants bf16,fp8_weights,fp8_kv,both] [--prompts 32] [--samples 8] [--new-tokens 2048] [--out result.json]
  [--profile-steps 16 --profile-modes graphs,eager --plan-context 4160 --profile-context 2080,4000 --profile-dir DIR]
CPU plumbing check: --tiny (a tiny Qwen3 shape, float32, eager, FP8 emulated; the profile's ops are CPU ops).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_report import emit, hbm_gbs  # noqa: E402

import torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=9728, tie_word_embeddings=True,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960)
# the smallest Qwen3 shape whose fused projections keep 128-row blocks (FP8's block scales)
QWEN3_TINY = dict(QWEN3_4B, vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=64, intermediate_size=256, max_position_embeddings=512)
VARIANTS = {"bf16": (None, "auto"), "fp8_weights": ("fp8", "auto"), "fp8_kv": (None, "fp8_e4m3"),
            "both": ("fp8", "fp8_e4m3"), "fp8_weights_cublas": ("fp8", "auto"), "both_cublas": ("fp8", "fp8_e4m3"),
            "fp8_weights_w8a16": ("fp8", "auto"), "both_w8a16": ("fp8", "fp8_e4m3")}
# the same over a paged KV cache (--page-size positions a page, --rollout-page-size): every answer starts at once
VARIANTS |= {f"{name}_paged": VARIANTS[name] for name in ("bf16", "fp8_weights", "fp8_kv", "both")}
DEFAULT_VARIANTS = ("bf16", "fp8_weights", "fp8_kv", "both")
# fp8.W8A16 while these variants' engines are built and run: the Triton W8A16 kernel for decode rows or cuBLAS's
# block-scaled GEMM for every product, for the A/B in one run (the others: the module's default)
W8A16_VARIANTS = {"fp8_weights_cublas": False, "both_cublas": False, "fp8_weights_w8a16": True, "both_w8a16": True}
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
    from miles.weights import fp8

    quantization, kv = VARIANTS[name]
    default = fp8.W8A16
    fp8.W8A16 = W8A16_VARIANTS.get(name, default)
    try:
        return _run_variant(path, name, prompts, new_tokens, args, quantization, kv)
    finally:
        fp8.W8A16 = default


def _run_variant(path: str, name: str, prompts: list[list[int]], new_tokens: int, args, quantization: str | None,
                 kv: str) -> tuple[dict, list]:
    from miles.rollout.engines.fast.engine import FastEngine
    from miles.types import SamplingParams

    t0 = time.perf_counter()
    engine = FastEngine(path, max_batch_size=args.max_batch_size, mem_fraction=args.mem_fraction,
                        context_len=args.plan_context or len(prompts[0]) + new_tokens, quantization=quantization,
                        kv_cache_dtype=kv, cuda_graph=not args.tiny, torch_compile=not args.tiny,
                        page_size=args.page_size if name.endswith("_paged") else None)
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
               stats={k: v for k, v in engine.last_stats.items() if k in ("decode_steps", "graphs", "prefills",
                                                                          "preemptions")},
               page_size=engine.page_size, kv_pages=engine.kv_pages)
    if DEVICE == "cuda":
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if args.profile_steps:
        log(f"profile {name}")
        plan = args.plan_context or args.prompt_len + args.new_tokens
        gemms = fp8_gemm_kernel_names(engine)
        out["profile"] = {}
        for context in args.profile_contexts or [plan // 2]:
            prof = profile_variant(engine, name, args, context, gemms)
            out["profile"][str(prof["context"])] = prof
    kept = [(prompts[i], gens[i].response_ids, gens[i].logprobs) for i in range(min(args.gap_sequences, len(gens)))]
    engine.dispose()
    del engine
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out, kept


# --- the profile (--profile-steps) -----------------------------------------------------------------------

SKIP_STEPS = 4          # decode steps before the first window (the first snapshot taken, the loop settled)
TRACE_LIMIT = 5 << 20   # bytes: a gzipped chrome trace larger than this is dropped
GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|wgmma|gemv|splitk|aten::(mm|addmm|bmm|linear)$", re.I)
ATTENTION = re.compile(r"decode_attention|attention|flash|fmha|sdpa|_attn", re.I)   # before GEMM: "fmha_cutlass"
FP8_GEMM = re.compile(r"e4m3|e5m2|fp8|f8f8|scaled_mm|blockwise", re.I)               # among GEMM names
QUANTIZE = re.compile(r"amax|quantiz|fused_abs|_abs_|aten::abs$", re.I)      # the activations' per-group amax
SAMPLING = re.compile(r"exponential|distribution|argmax|argmin|logsumexp|softmax|gumbel|multinomial|topk|sort|"
                      r"philox|uniform", re.I)
# aten's own (eager) kernels outside the compiled pieces; inductor's names say "_to_copy" for every cast they
# fuse, so a `triton_` kernel is never put here
COPIES = re.compile(r"memcpy|memset|copy|cast|fill|index|scatter|gather|cat|elementwise|vectorized|"
                    r"aten::(to|_to_copy|copy_|clone|contiguous|empty)$", re.I)
CATEGORY_NAMES = ("attention", "fp8_gemm", "bf16_gemm", "quantize", "sampling", "fused_elementwise", "copies",
                  "other")


def categorize(name: str, fp8_gemms: frozenset = frozenset()) -> str:
    """The category of a kernel (or, on the CPU, an aten op) by its name, the first rule that matches:
    attention; fp8_gemm (a name in `fp8_gemms`, the GEMM kernels one `miles::fp8_blockwise_mm` call
    launched, see `fp8_gemm_kernel_names`, or a GEMM name saying e4m3/fp8); bf16_gemm (other GEMMs);
    quantize (the activations' amax: inductor fuses it with what precedes, e.g. the norm); sampling;
    fused_elementwise (inductor's other `triton_` kernels: norms, RoPE, SiLU, residuals, the KV write);
    copies (aten's copy, cast, fill, index and elementwise kernels); other."""
    if ATTENTION.search(name):
        return "attention"
    if name in fp8_gemms:
        return "fp8_gemm"
    if GEMM.search(name):
        return "fp8_gemm" if FP8_GEMM.search(name) else "bf16_gemm"
    if QUANTIZE.search(name):
        return "quantize"
    if SAMPLING.search(name):
        return "sampling"
    if name.startswith("triton_"):
        return "fused_elementwise"
    if COPIES.search(name):
        return "copies"
    return "other"


def summarize(events: list[tuple[str, float]], steps: int, fp8_gemms: frozenset = frozenset(),
              top: int = 25) -> dict:
    """(name, microseconds) of every kernel in a window of `steps` decode steps -> the top kernels by
    total time and the per-category ms per step."""
    by_name: dict[str, list] = {}
    for name, us in events:
        row = by_name.setdefault(name, [0, 0.0])
        row[0] += 1
        row[1] += us
    total_us = sum(us for _, us in by_name.values()) or 1e-9
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    cats = {c: [0, 0.0] for c in CATEGORY_NAMES}
    for name, (calls, us) in by_name.items():
        c = cats[categorize(name, fp8_gemms)]
        c[0] += calls
        c[1] += us
    return dict(
        kernels=sum(n for n, _ in by_name.values()), distinct=len(by_name),
        device_ms_per_step=round(total_us / 1e3 / steps, 4),
        categories={c: dict(ms_per_step=round(us / 1e3 / steps, 4), share=round(us / total_us, 4),
                            calls_per_step=round(n / steps, 2)) for c, (n, us) in cats.items()},
        top=[dict(name=name[:120], category=categorize(name, fp8_gemms), calls=calls, total_ms=round(us / 1e3, 3),
                  share=round(us / total_us, 4)) for name, (calls, us) in rows[:top]])


def profiled_events(prof) -> tuple[list[tuple[str, float]], dict]:
    """The window's device kernels, memcpys and memsets as (name, us); on the CPU (no device events) the
    aten ops' self CPU time instead. With counts of the host's graph launches and kernel launches."""
    from torch.autograd import DeviceType

    device, cpu, host = [], [], dict(graph_launches=0, kernel_launches=0, gpu_annotations=0)
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            # a record_function range projected onto the GPU's timeline (compiled regions have them) is no kernel
            if getattr(e, "is_user_annotation", False) or "annotation" in str(getattr(e, "activity_type", "") or ""):
                host["gpu_annotations"] += 1
                continue
            device.append((e.name, e.time_range.elapsed_us()))
        elif e.name.startswith("aten::"):
            cpu.append((e.name, e.self_cpu_time_total))
        elif e.name == "cudaGraphLaunch":
            host["graph_launches"] += 1
        elif e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
            host["kernel_launches"] += 1
    return (device if device else cpu), dict(host, source="cuda_kernels" if device else "cpu_aten_ops")


def _activities() -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])


def fp8_gemm_kernel_names(engine) -> tuple[frozenset, list[str]]:
    """The kernels `miles::fp8_blockwise_mm` launches for each of the engine's FP8 projections (layer 0's
    q/k/v, o, gate/up, down) at the full decode batch (cuBLAS picks its kernel by shape): its GEMMs,
    and the layout copies the op makes. The GEMM names are what `categorize` calls fp8_gemm."""
    from torch.profiler import profile

    from miles.weights import fp8

    if DEVICE != "cuda" or not (engine.fp8_kernel or "").startswith("scaled_mm_blockwise"):
        return frozenset(), []
    gen = torch.Generator(device=engine.device).manual_seed(0)
    m = -(-engine.max_batch_size // 4) * 4          # the rows fp8._blockwise pads to
    api = fp8._API or "torch._scaled_mm"
    calls = []
    for w in engine._weights.layers[0]:
        if isinstance(w, fp8.QuantWeight):
            x = torch.randn((m, w.weight.shape[1]), generator=gen, device=engine.device).to(engine.dtype)
            calls.append((*fp8.quantize_activations(x), w.weight, w.scale))
    for a, a_scale, q, s in calls:                  # the first calls' one-time work outside the profile
        fp8.fp8_blockwise_mm(a, a_scale, q, s, engine.dtype, api)
    sync()
    with profile(activities=_activities()) as prof:
        for a, a_scale, q, s in calls:
            fp8.fp8_blockwise_mm(a, a_scale, q, s, engine.dtype, api)
        sync()
    names = sorted({n for n, _ in profiled_events(prof)[0]})
    return frozenset(n for n in names if GEMM.search(n)), names


class StepWindows:
    """Stands in for `engine._decode` (an instance attribute, removed after): counts decode steps and
    opens the windows [(name, first step, last step + 1, profiled, graphs on)], each bracketed by CUDA
    synchronizes; a profiled window runs under its own torch.profiler."""

    def __init__(self, engine, windows: list[tuple[str, int, int, bool, bool]]):
        self.engine, self.windows, self.k = engine, windows, 0
        self.inner = engine._decode
        self.results: dict[str, dict] = {}
        self._open: dict[str, tuple] = {}

    def __call__(self, table, step, call) -> None:
        for name, lo, hi, profiled, graphs in self.windows:
            if self.k == lo:
                self._begin(name, profiled, graphs)
        self.inner(table, step, call)
        self.k += 1
        for name, lo, hi, _, _ in self.windows:
            if self.k == hi:
                self._end(name, hi - lo)

    def _begin(self, name: str, profiled: bool, graphs: bool) -> None:
        from torch.profiler import profile

        g = self.engine._graphs
        was = g.enabled
        g.enabled = was and graphs
        sync()
        prof = profile(activities=_activities()) if profiled else None
        if prof is not None:
            prof.start()
        self._open[name] = (prof, was, g.enabled, time.perf_counter())

    def _end(self, name: str, steps: int) -> None:
        prof, was, graphs, t0 = self._open.pop(name)
        sync()
        secs = time.perf_counter() - t0
        if prof is not None:
            prof.stop()
        self.engine._graphs.enabled = was
        self.results[name] = dict(steps=steps, ms_per_step=round(secs * 1e3 / steps, 3), prof=prof, graphs=graphs)


def weight_bytes(engine) -> int:
    """Bytes of the engine's weights (each storage once: the HF names are views into fused tensors)."""
    seen = {}
    for t in engine._weights.named.values():
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def profile_variant(engine, name: str, args, context: int, gemms: tuple[frozenset, list[str]]) -> dict:
    """Timed and profiled windows of decode steps with every slot busy at `context` prompt tokens (module
    docstring); `gemms`: `fp8_gemm_kernel_names(engine)`."""
    from miles.types import SamplingParams

    n = args.profile_steps
    windows = [("timed", SKIP_STEPS, SKIP_STEPS + n, False, True)]
    for mode in args.profile_modes:         # "graphs": the CUDA graphs as captured; "eager": the graphs off
        lo = windows[-1][2]
        windows.append(("profiled" if mode == "graphs" else "profiled_eager", lo, lo + n, True, mode == "graphs"))
    new = windows[-1][2] + 2                       # decode steps = new tokens - 1 (the first comes from prefill)
    context = min(context, engine.max_len - new)
    slots = engine.max_batch_size
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, engine._vocab_size, (slots, context), generator=g).tolist()
    gemms, op_kernels = gemms
    watch = StepWindows(engine, windows)
    engine._decode = watch
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=new, min_new_tokens=new, seed=1)
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        call_s = time.perf_counter() - t0
    finally:
        del engine._decode
    steps = engine.last_stats["decode_steps"]
    if steps < new - 1 or set(watch.results) != {w[0] for w in windows}:
        raise RuntimeError(f"profile of {name}: {steps} decode steps, windows {sorted(watch.results)}; expected "
                           f"{new - 1} steps and {[w[0] for w in windows]}")
    # the bandwidth bound of one step in the window: every weight once, each slot's K/V at its positions
    mid = context + SKIP_STEPS + n                  # the mean position of the windows, about
    kv = slots * mid * engine.arch.kv_bytes_per_position(engine.cache_dtype)
    wb = weight_bytes(engine)
    bound_ms = (wb + kv) / (args.hbm_gbs * 1e9) * 1e3
    timed = watch.results["timed"]["ms_per_step"]
    out = dict(context=context, slots=slots, steps_per_window=n, generate_s=round(call_s, 2),
               timed_ms_per_step=timed, weight_gib=round(wb / 2**30, 4), kv_gib_per_step=round(kv / 2**30, 4),
               bound_ms_per_step=round(bound_ms, 5), fraction_of_bound=round(bound_ms / timed, 4),
               hbm_gbs=args.hbm_gbs, fp8_gemm_kernel_names=sorted(gemms), fp8_op_kernels=op_kernels, windows={})
    for wname, r in watch.results.items():
        if r["prof"] is not None:
            out["windows"][wname] = window_summary(r, gemms, engine.arch.n_layers)
            if args.profile_dir:
                out["windows"][wname]["trace"] = save_trace(r["prof"], Path(args.profile_dir) /
                                                            f"{name}-{context}-{wname}.json")
    return out


def window_summary(r: dict, gemms: frozenset, layers: int) -> dict:
    """One profiled window (a `StepWindows` result): `summarize`d, with its mode, its ms/step under the
    profiler, the host's launches per step and whether the graph replays' kernels were seen."""
    events, host = profiled_events(r["prof"])
    summary = summarize(events, r["steps"], gemms)
    att = summary["categories"]["attention"]["calls_per_step"]
    summary.update(mode="cuda_graphs" if r["graphs"] else "eager", ms_per_step_under_profiler=r["ms_per_step"],
                   host_per_step={k: (round(v / r["steps"], 2) if isinstance(v, int) else v) for k, v in host.items()},
                   graph_kernels_visible=att >= layers if host["source"] == "cuda_kernels" else None)
    return summary


def compare_profiles(variants: dict) -> dict:
    """The variants' profiles side by side, per profiled context: per window, each category's ms per decode
    step by variant, with the slots, the timed ms/step, us per generated token (ms/step / slots: what
    tokens/s inverts) and the fraction of the bound; with two contexts or more, per variant the timed
    ms/step fitted as a + b x context (least squares: the fixed part and the part that grows with the K/V)."""
    out: dict = {"by_context": {}, "fit": {}}
    for name, v in variants.items():
        for ctx, prof in (v.get("profile") or {}).items():
            side = out["by_context"].setdefault(ctx, dict(slots={}, timed_ms_per_step={}, timed_us_per_token={},
                                                          fraction_of_bound={}, windows={}))
            side["slots"][name] = prof["slots"]
            side["timed_ms_per_step"][name] = prof["timed_ms_per_step"]
            side["timed_us_per_token"][name] = round(prof["timed_ms_per_step"] * 1e3 / prof["slots"], 2)
            side["fraction_of_bound"][name] = prof["fraction_of_bound"]
            for wname, w in prof["windows"].items():
                table = side["windows"].setdefault(wname, {c: {} for c in CATEGORY_NAMES + ("total",)})
                for c in CATEGORY_NAMES:
                    table[c][name] = w["categories"][c]["ms_per_step"]
                table["total"][name] = w["device_ms_per_step"]
        points = [(p["context"], p["timed_ms_per_step"]) for p in (v.get("profile") or {}).values()]
        if len(points) >= 2:
            mx, my = (sum(c) / len(points) for c in zip(*points))
            slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
            out["fit"][name] = dict(ms_per_step_fixed=round(my - slope * mx, 3),
                                    ms_per_step_per_1k_context=round(slope * 1e3, 3))
    return out


def save_trace(prof, path: Path) -> str:
    """The window's chrome trace, gzipped, at `path`.gz; dropped (and said so) when over TRACE_LIMIT."""
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    gz = path.with_name(path.name + ".gz")
    with open(path, "rb") as src, gzip.open(gz, "wb") as dst:
        dst.write(src.read())
    path.unlink()
    size = gz.stat().st_size
    if size > TRACE_LIMIT:
        gz.unlink()
        return f"dropped: {size} bytes gzipped > {TRACE_LIMIT}"
    return str(gz)


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
    weights_of = (lambda: Fp8Weights(live, dtype)) if quantization == "fp8" else (lambda: live)
    plans = plan_buckets(weights_of(), dtype=dtype, bucket_bytes=DEFAULT_BUCKET_BYTES)   # once, as BucketSender
    state: dict = {}                # what the bucket writer keeps across syncs (BucketSender's)
    for version in range(1, repeats + 1):
        sync()
        t0 = time.perf_counter()
        weights = weights_of()
        for i, plan in enumerate(plans):
            flat = fill_bucket(plan, weights, device=DEVICE, state=state)
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
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma list of: {', '.join(VARIANTS)} "
                   f"(_cublas: FP8 weights by the block-scaled GEMM alone; _w8a16: the Triton W8A16 kernel for decode rows)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--mem-fraction", type=float, default=0.85)
    p.add_argument("--page-size", type=int, default=64, help="positions a page of the *_paged variants' KV cache")
    p.add_argument("--gap-sequences", type=int, default=8, help="sequences per variant in the logprob gap")
    p.add_argument("--sync-repeats", type=int, default=3)
    p.add_argument("--skip-sync", action="store_true")
    p.add_argument("--plan-context", type=int, default=0,
                   help="positions each KV slot is planned for (0: prompt + new tokens); e.g. 4160 with a short "
                        "--new-tokens gives the 4k run's slot counts")
    p.add_argument("--profile-steps", type=int, default=0, help="decode steps per profile window (0: no profile)")
    p.add_argument("--profile-context", default="",
                   help="prompt tokens of the profiled call's prompts, a comma list: one profiled call each "
                        "(default: half of the plan context)")
    p.add_argument("--profile-modes", default="graphs",
                   help="profiled windows, in order: graphs (the CUDA graphs as captured), eager (graphs off)")
    p.add_argument("--profile-dir", help="write each profiled window's chrome trace here (gzipped, < 5 MB)")
    p.add_argument("--hbm-gbs", type=float, default=None,
                   help="memory bandwidth for the bound, GB/s (default: by the device name, H100 SXM 3350, H200 4800)")
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen3 on the CPU in float32 (checks the script)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    args.hbm_gbs = hbm_gbs(args.hbm_gbs)
    if args.tiny:
        args.prompts, args.samples, args.prompt_len, args.new_tokens = 2, 2, 8, 8
        args.max_batch_size, args.gap_sequences, args.sync_repeats = 4, 2, 1
    shape, dtype = (QWEN3_TINY, torch.float32) if args.tiny else (QWEN3_4B, torch.bfloat16)
    try:
        args.profile_contexts = [int(c) for c in args.profile_context.split(",") if c]
    except ValueError:
        p.error(f"--profile-context {args.profile_context!r}: a comma list of token counts, e.g. 2080,4000")
    if args.profile_steps < 0 or args.plan_context < 0 or any(c < 1 for c in args.profile_contexts):
        p.error("--profile-steps and --plan-context take a count >= 0, --profile-context counts >= 1")
    args.profile_modes = [m for m in args.profile_modes.split(",") if m]
    if not args.profile_modes or set(args.profile_modes) - {"graphs", "eager"} or \
            len(set(args.profile_modes)) < len(args.profile_modes):
        p.error(f"--profile-modes {','.join(args.profile_modes)!r}: a comma list of graphs and eager, each once")
    if args.profile_steps:
        # CUPTI torn down and set up again around each window with CUDA graphs in the process has crashed
        # on CUDA 12 (torch.profiler.profiler's own workaround, which it applies only to inductor's graphs)
        import os

        os.environ.setdefault("TEARDOWN_CUPTI", "0")
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown --variants {unknown}; use {', '.join(VARIANTS)}")
    t_start = time.perf_counter()
    report = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
              "tiny": args.tiny, "workload": dict(prompts=args.prompts, samples=args.samples,
                                                  prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                                  plan_context=args.plan_context or args.prompt_len + args.new_tokens),
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
            if args.out:      # what is measured so far, should a later variant not finish
                Path(args.out).write_text(json.dumps(dict(report, partial=True), indent=2) + "\n")
        from miles.weights.hf import load_causal_lm

        needed = any(kept.values()) or not args.skip_sync      # --gap-sequences 0 --skip-sync: no HF model
        model = load_causal_lm(path, device=torch.device(DEVICE), dtype=dtype) if needed else None
        for name in names:
            if kept[name]:
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
    if args.profile_steps:
        report["profile_comparison"] = compare_profiles(report["variants"])
    emit(report, args.out, t_start)


if __name__ == "__main__":
    main()
