"""Benchmark (GPU machine, not a test): the fast engine's length-aware decode attention kernel alone, on a bf16
and an FP8 (e4m3) KV cache at the 4b-4k rollout's shapes, with its launch parameters swept (issue 58: the
FP8 run reached ~49% of its bandwidth bound against bf16's ~74%; is attention the part that falls short?).

What runs: `miles.rollout.engines.fast.attention._kernel()` (the engine's Triton kernel, unchanged), launched
here exactly as `decode_attention` launches it, so that BLOCK (keys per loop iteration; the engine's is 64),
num_warps (4) and num_stages (Triton's default) can be swept without editing attention.py; the stock SDPA
call (`sdpa_decode_attention`, over the span, with the FP8 cache widened by a copy as the engine does
without the kernel) for reference; and a split-K ("flash decoding") variant written here: each (slot, KV
head, split) program runs the online softmax over one CHUNK of the slot's keys and writes its partial
max, sum and output in float32, and a second kernel combines a slot's splits. The grid has
ceil(max_len / CHUNK) splits per (slot, head), as a captured graph would need; splits past a slot's length
do nothing. It asks whether more parallelism per sequence helps at 219 slots x 8 KV heads (1,752 programs
for the engine's kernel on 132 SMs).

Shapes (defaults: Qwen3-4B's attention, one layer): q [batch, 8 KV heads, group 4, head_dim 128] in bf16,
K and V caches [batch + 1, 8, --max-len 4160, 128] (the engine's slot stride: 64 prompt + 4,096 answer
positions) in bf16 or float8_e4m3fn, every slot at position context - 1 (the 4k run's answers all have
the same length at a step), for --batches 105,219,256 (bf16's and FP8's slot counts at 4k, and the
most) and --contexts 1024,2048,4096. Per (dtype, batch, context) and launch config: ms per call (CUDA events,
--warmup calls then the median of --reps), the K/V bytes the call must read (sum over slots of
(pos + 1) x kv_heads x head_dim x 2 x element size), GB/s and the fraction of --hbm-gbs (3,350 for an H100
SXM). Configs Triton refuses (too much shared memory, ...) are recorded with their error. Every config
(the swept ones and every split-K one) is first checked against SDPA on a small case of mixed lengths
(`checks`); a config that disagrees is left out of `best`. The JSON per (dtype, batch, context): `sdpa`,
`default` (BLOCK 64, 4 warps, default stages), `best` (of the sweep), `best_split_k`, and every config's time.
The sweep also holds the kernel's V_A variant (`--v-as-a-blocks`: P V computed as (V^T P^T)^T, V the A operand
from registers; attention.py's docstring says why an e4m3 V wants it). With --page-size P (default 64, 0: off)
the engine kernel's sweep also runs over the same K/V as a paged cache
(`--rollout-page-size`: pages of P positions in a shuffled order, read through the page table), `engine_paged`
configs, `default_paged`, `best_paged` and `paged_vs_default` (the slot kernel's time over the paged one's).
`ms_per_step` = one layer's ms x --layers (36): the attention share of a decode step. --out is rewritten after every
(dtype, batch, context) with `partial: true` until the run ends (a run cut by its time limit keeps its rows).

Usage (GPU machine, from the checkout): PYTHONPATH=$PWD python3 scripts/bench/decode_attention_gpu.py --out attn.json
  [--batches 105,219,256] [--contexts 1024,2048,4096] [--blocks 32,64,128] [--warps 4,8] [--stages 1,2,3,4]
  [--chunks 256,512,1024] [--no-split-k] [--page-size 64] [--hbm-gbs 3350]
CPU plumbing check: TRITON_INTERPRET=1 ... --tiny (tiny shapes in float32 under Triton's interpreter; the
split-K kernel checked against SDPA as on the GPU). About 3 minutes on an H100 with the defaults (the
sweep's ~70 Triton compiles dominate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import lru_cache, partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_report import emit, hbm_gbs  # noqa: E402

import torch  # noqa: E402
from miles.rollout.engines.fast.attention import dot_precision, padded_group  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"bf16": None, "fp8": torch.float8_e4m3fn}      # the cache's dtype (None: the compute dtype)
DEFAULT = dict(block=64, warps=4, stages=None)           # attention.decode_attention's launch


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def interpreter_scalars_as_loop_bounds() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into loop bounds with
    int(array), which numpy >= 2.? refuses for arrays that are not 0-d: take the element (as
    tests/unit/test_fast_engine.py does for the engine's kernel)."""
    import triton.runtime.interpreter as interp

    patch = interp._patch_lang_tensor
    if getattr(patch, "_miles_bench", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._miles_bench = True
    interp._patch_lang_tensor = patched


@lru_cache(maxsize=None)
def split_kernels():
    """(split, reduce): the split-K decode attention, in two Triton kernels (module docstring)."""
    import triton
    import triton.language as tl

    @triton.jit
    def split_attention_kernel(Q, K, V, MID_O, MID_ML, POS, scale, sqb, sqh, sqg, skb, skh, skn, svb, svh, svn,
                               H, SPLITS, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                               BLOCK: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        n_keys = tl.load(POS + b) + 1
        lo = s * CHUNK
        hi = tl.minimum(lo + CHUNK, n_keys)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        n = tl.arange(0, BLOCK)
        q = tl.load(Q + b * sqb + h * sqh + g[:, None] * sqg + d[None, :], mask=g[:, None] < G, other=0.0)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        k_base = K + b * skb + h * skh
        v_base = V + b * svb + h * svh
        for start in range(lo, hi, BLOCK):
            keys = start + n
            valid = keys < hi
            k = tl.load(k_base + keys[:, None] * skn + d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
            sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(sc - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_base + keys[:, None] * svn + d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        part = (b * H + h) * SPLITS + s
        live = (g < G) & (g * 0 + lo < n_keys)       # a vector compare: a scalar bool mask trips some interpreters
        tl.store(MID_O + part * G * D + g[:, None] * D + d[None, :], acc, mask=live[:, None])
        tl.store(MID_ML + part * 2 * G + g, m, mask=live)
        tl.store(MID_ML + part * 2 * G + G + g, total, mask=live)

    @triton.jit
    def split_reduce_kernel(MID_O, MID_ML, O, POS, sob, soh, sog, H, SPLITS, G: tl.constexpr, G_PAD: tl.constexpr,
                            D: tl.constexpr, CHUNK: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        n_keys = tl.load(POS + b) + 1
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        rows = g < G
        big_m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for s in range(0, tl.cdiv(n_keys, CHUNK)):
            part = (b * H + h) * SPLITS + s
            m_s = tl.load(MID_ML + part * 2 * G + g, mask=rows, other=0.0)
            l_s = tl.load(MID_ML + part * 2 * G + G + g, mask=rows, other=1.0)
            o_s = tl.load(MID_O + part * G * D + g[:, None] * D + d[None, :], mask=rows[:, None], other=0.0)
            m_new = tl.maximum(big_m, m_s)
            alpha = tl.exp(big_m - m_new)
            beta = tl.exp(m_s - m_new)
            acc = acc * alpha[:, None] + o_s * beta[:, None]
            total = total * alpha + l_s * beta
            big_m = m_new
        out = acc / total[:, None]
        tl.store(O + b * sob + h * soh + g[:, None] * sog + d[None, :], out.to(O.dtype.element_ty), mask=rows[:, None])

    return split_attention_kernel, split_reduce_kernel


def launch_engine_kernel(q, kc, vc, pos, out, scale: float, block: int, warps: int, stages: int | None,
                         table=None, v_a: bool = False) -> None:
    """`attention.decode_attention`'s launch, with BLOCK, num_warps and num_stages as given (`table`: a paged
    cache's page table, kc and vc its pages; `v_a`: the kernel's V_A, P V computed as (V^T P^T)^T)."""
    from miles.rollout.engines.fast.attention import _kernel

    b, kv_heads, group, dim = q.shape
    extra = {} if stages is None else dict(num_stages=stages)
    paged = table is not None
    _kernel()[(b, kv_heads)](q, kc, vc, out, pos, table if paged else pos, scale, *q.stride()[:3], *kc.stride()[:3],
                             *vc.stride()[:3], *out.stride()[:3], table.stride(0) if paged else 0, G=group,
                             G_PAD=padded_group(group), D=dim, BLOCK=block, PRECISION=dot_precision(q.dtype),
                             PAGED=paged, PAGE=kc.shape[2] if paged else 1, V_A=v_a, num_warps=warps, **extra)


def to_pages(c, page: int, gen):
    """A slot cache [slots, kv_heads, max_len, D] as a paged one (--rollout-page-size): (pages [slots x max_len /
    page, kv_heads, page, D] in a shuffled order, the table [slots, max_len / page] that finds them), the same K/V."""
    slots, kv_heads, max_len, dim = c.shape
    per_slot = -(-max_len // page)
    table = torch.randperm(slots * per_slot, generator=gen, device=c.device).view(slots, per_slot)
    padded = torch.zeros((slots, kv_heads, per_slot * page, dim), dtype=c.dtype, device=c.device)
    padded[:, :, :max_len] = c
    pages = torch.empty((slots * per_slot, kv_heads, page, dim), dtype=c.dtype, device=c.device)
    pages[table.reshape(-1)] = padded.view(slots, kv_heads, per_slot, page, dim).transpose(1, 2) \
        .reshape(slots * per_slot, kv_heads, page, dim)
    return pages, table


class SplitK:
    """The split-K variant's buffers for one (batch, max_len, chunk): partial outputs [B, H, splits, G, D]
    and max/sum [B, H, splits, 2, G] in float32."""

    def __init__(self, q, max_len: int, chunk: int):
        b, kv_heads, group, dim = q.shape
        self.splits = -(-max_len // chunk)
        self.chunk = chunk
        self.mid_o = torch.empty((b, kv_heads, self.splits, group, dim), dtype=torch.float32, device=q.device)
        self.mid_ml = torch.empty((b, kv_heads, self.splits, 2, group), dtype=torch.float32, device=q.device)

    def __call__(self, q, kc, vc, pos, out, scale: float, block: int, warps: int, stages: int | None) -> None:
        split, reduce = split_kernels()
        b, kv_heads, group, dim = q.shape
        extra = {} if stages is None else dict(num_stages=stages)
        split[(b, kv_heads, self.splits)](q, kc, vc, self.mid_o, self.mid_ml, pos, scale, *q.stride()[:3],
                                          *kc.stride()[:3], *vc.stride()[:3], kv_heads, self.splits, G=group,
                                          G_PAD=padded_group(group), D=dim, BLOCK=block, CHUNK=self.chunk,
                                          PRECISION=dot_precision(q.dtype), num_warps=warps, **extra)
        reduce[(b, kv_heads)](self.mid_o, self.mid_ml, out, pos, *out.stride()[:3], kv_heads, self.splits, G=group,
                              G_PAD=padded_group(group), D=dim, CHUNK=self.chunk, num_warps=4)


def span_mask(pos, span: int, dtype: torch.dtype):
    """The stock call's additive mask [B, 1, 1, span] (the engine makes it once per step, for every layer)."""
    valid = torch.arange(span, device=pos.device) <= pos[:, None]
    return torch.zeros(valid.shape, dtype=dtype, device=pos.device).masked_fill_(~valid, float("-inf"))[:, None, None]


def sdpa(q, kc, vc, pos, scale: float, span: int, mask=None):
    from miles.rollout.engines.fast.attention import sdpa_decode_attention

    mask = span_mask(pos, span, q.dtype) if mask is None else mask
    return sdpa_decode_attention(q, kc, vc, pos, scale, span, mask)


def time_call(fn, warmup: int, reps: int) -> float:
    """Median milliseconds of `fn()` (CUDA events on the GPU, the wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        if DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kv_bytes(pos: torch.Tensor, kv_heads: int, dim: int, elem: int) -> int:
    """K and V bytes a call must read: each slot's positions 0..pos."""
    return int((pos.long() + 1).sum().item()) * kv_heads * dim * 2 * elem


def config_name(kind: str, c: dict) -> str:
    stages = "default" if c["stages"] is None else c["stages"]
    chunk = f" chunk={c['chunk']}" if "chunk" in c else ""
    v_a = " v_as_a" if c.get("v_a") else ""
    return f"{kind} block={c['block']} warps={c['warps']} stages={stages}{chunk}{v_a}"


def check_configs(configs: list[tuple[str, dict]], dtype: torch.dtype, cache_dtype: torch.dtype, shape: dict,
                  tol: float) -> dict:
    """Every config's output against SDPA on a small case of mixed lengths: {config name: max |error|
    or the error message}."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    kv_heads, group, dim = shape["kv_heads"], shape["group"], shape["head_dim"]
    max_len = shape["check_len"]
    b = 6
    q = torch.randn((b, kv_heads, group, dim), generator=gen, device=DEVICE).to(dtype)
    kc, vc = (torch.randn((b + 1, kv_heads, max_len, dim), generator=gen, device=DEVICE).to(cache_dtype)
              for _ in range(2))
    # one key, a block and one past it, a chunk's end, the middle, all
    pos = torch.tensor([0, 64, 63, shape["check_chunk"] - 1, max_len // 2, max_len - 1], device=DEVICE)
    pos = pos.clamp(max=max_len - 1)
    scale = dim ** -0.5
    want = sdpa(q, kc, vc, pos, scale, max_len).float()
    paged = {}
    if shape["page"]:
        (kp, table), (vp, _) = (to_pages(c, shape["page"], torch.Generator(device=DEVICE).manual_seed(2))
                                for c in (kc, vc))
        paged = dict(kc=kp, vc=vp, table=table)
    out = {}
    for kind, c in configs:
        got = torch.full_like(q, float("nan"))
        try:
            if kind == "split_k":
                SplitK(q, max_len, c["chunk"])(q, kc, vc, pos, got, scale, c["block"], c["warps"], c["stages"])
            elif kind == "engine_paged":
                launch_engine_kernel(q, paged["kc"], paged["vc"], pos, got, scale, c["block"], c["warps"],
                                     c["stages"], paged["table"], v_a=c.get("v_a", False))
            else:
                launch_engine_kernel(q, kc, vc, pos, got, scale, c["block"], c["warps"], c["stages"],
                                     v_a=c.get("v_a", False))
            sync()
        except Exception as e:  # noqa: BLE001 - a config Triton refuses: recorded, not timed
            out[config_name(kind, c)] = f"error: {type(e).__name__}: {str(e)[:300]}"
            continue
        err = (got.float() - want).abs().max().item()
        out[config_name(kind, c)] = err if err == err else float("inf")      # NaN -> inf: fails the tolerance
    return out


def launch_configs(args) -> list[tuple[str, dict]]:
    """[(kind, config)]: the engine kernel's sweep (with the engine's own launch first) and the split-K ones."""
    sweep = [dict(block=bl, warps=w, stages=st) for bl in args.blocks for w in args.warps for st in args.stages]
    if DEFAULT not in sweep:
        sweep.insert(0, dict(DEFAULT))
    sweep += [dict(block=bl, warps=w, stages=None, v_a=True) for bl in args.v_as_a_blocks for w in args.warps]
    splits = [dict(block=bl, warps=w, stages=None, chunk=ch) for ch in args.chunks for bl in args.split_blocks
              for w in args.warps if ch % bl == 0]
    paged = [("engine_paged", c) for c in sweep] if args.page_size else []
    return [("engine", c) for c in sweep] + paged + [("split_k", c) for c in splits]


def measure(args, configs, checks: dict, q, kc, vc, out, split_bufs: dict, ctx: int, paged: dict | None = None) -> dict:
    """One (batch, context) row: SDPA and every config that passed its check, timed (`paged`: the same K/V as
    pages, {kc, vc, table}, for the engine_paged configs)."""
    batch = q.shape[0]
    pos = torch.full((batch,), ctx - 1, dtype=torch.long, device=DEVICE)
    nbytes = kv_bytes(pos, args.kv_heads, args.head_dim, kc.element_size())
    mask = span_mask(pos, ctx, q.dtype)
    scale = args.head_dim ** -0.5

    def entry(ms: float) -> dict:
        gbs = nbytes / (ms * 1e-3) / 1e9
        return dict(ms=round(ms, 4), gbs=round(gbs, 1), fraction_of_hbm=round(gbs / args.hbm_gbs, 3),
                    ms_per_step=round(ms * args.layers, 3))

    row = dict(batch=batch, context=ctx, kv_bytes=nbytes,
               sdpa=entry(time_call(lambda: sdpa(q, kc, vc, pos, scale, ctx, mask), args.warmup, args.reps)),
               configs={})
    for kind, c in configs:
        name = config_name(kind, c)
        if not isinstance(checks.get(name), float):
            row["configs"][name] = dict(error=checks.get(name))
            continue
        if kind == "engine_paged":
            def fn(q, kc, vc, pos, out, scale, block, warps, stages, v_a=c.get("v_a", False)):
                launch_engine_kernel(q, paged["kc"], paged["vc"], pos, out, scale, block, warps, stages,
                                     paged["table"][:q.shape[0]], v_a=v_a)
        elif kind == "split_k":
            fn = split_bufs[c["chunk"]]
        else:
            fn = partial(launch_engine_kernel, v_a=c.get("v_a", False))
        try:
            ms = time_call(lambda: fn(q, kc, vc, pos, out, scale, c["block"], c["warps"], c["stages"]),
                           args.warmup, args.reps)
        except Exception as e:  # noqa: BLE001 - recorded, as a refused config
            row["configs"][name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            continue
        row["configs"][name] = dict(entry(ms), kind=kind, **c, checked=checks[name] < args.tol)
    return row


def pick_best(row: dict) -> None:
    """`default`, `best` (engine kernel) and `best_split_k` among the configs that passed their check, and
    their ratios to the default's time."""
    timed = {n: r for n, r in row["configs"].items() if "ms" in r and r["checked"]}
    row["default"] = row["configs"].get(config_name("engine", DEFAULT))
    row["default_paged"] = row["configs"].get(config_name("engine_paged", DEFAULT))
    for label, kind in (("best", "engine"), ("best_split_k", "split_k"), ("best_paged", "engine_paged")):
        cands = {n: r for n, r in timed.items() if r["kind"] == kind}
        if cands:
            name = min(cands, key=lambda n: cands[n]["ms"])
            row[label] = dict(cands[name], name=name)
    if row.get("default") and "ms" in row["default"]:
        base = row["default"]["ms"]
        row["best_vs_default"] = round(base / row["best"]["ms"], 3) if "best" in row else None
        row["split_k_vs_default"] = round(base / row["best_split_k"]["ms"], 3) if "best_split_k" in row else None
        row["sdpa_vs_default"] = round(base / row["sdpa"]["ms"], 3)
        if row.get("default_paged") and "ms" in row["default_paged"]:
            row["paged_vs_default"] = round(base / row["default_paged"]["ms"], 3)


def run(args, save=lambda report: None) -> dict:
    """The checks and the sweep; `save(report)` after every (dtype, batch, context), so that a run cut short
    by its time limit still leaves what it measured."""
    shape = dict(kv_heads=args.kv_heads, group=args.group, head_dim=args.head_dim, max_len=args.max_len,
                 check_len=args.check_len, check_chunk=min(args.chunks) if args.chunks else 64, page=args.page_size)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    configs = launch_configs(args)
    report = dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
                  triton=_triton_version(), tiny=args.tiny, hbm_gbs=args.hbm_gbs, compute_dtype=str(dtype),
                  shape=dict(shape, batches=args.batches, contexts=args.contexts, layers=args.layers),
                  warmup=args.warmup, reps=args.reps, tolerance=args.tol, checks={}, results=[])
    for dname in args.dtypes:
        cache_dtype = DTYPES[dname] or dtype
        t0 = time.perf_counter()
        checks = report["checks"][dname] = check_configs(configs, dtype, cache_dtype, shape, args.tol)
        log(f"{dname}: {len(checks)} configs checked against SDPA in {time.perf_counter() - t0:.1f} s")
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        kc, vc = (torch.randn((max(args.batches) + 1, args.kv_heads, args.max_len, args.head_dim), generator=gen,
                              device=DEVICE, dtype=dtype).to(cache_dtype) for _ in range(2))
        paged = None
        if args.page_size:
            (kp, table), (vp, _) = (to_pages(c, args.page_size, torch.Generator(device=DEVICE).manual_seed(2))
                                    for c in (kc, vc))
            paged = dict(kc=kp, vc=vp, table=table)
        for batch in args.batches:
            q = torch.randn((batch, args.kv_heads, args.group, args.head_dim), generator=gen, device=DEVICE).to(dtype)
            out = torch.empty_like(q)
            split_bufs = {ch: SplitK(q, args.max_len, ch) for ch in args.chunks}
            for ctx in args.contexts:
                row = dict(dtype=dname, **measure(args, configs, checks, q, kc, vc, out, split_bufs, ctx, paged))
                pick_best(row)
                report["results"].append(row)
                save(report)
                log(f"{dname} batch {batch} ctx {ctx}: sdpa {row['sdpa']['ms']} ms, default "
                    f"{(row.get('default') or {}).get('ms')} ms, best {row.get('best', {}).get('name')} "
                    f"{row.get('best', {}).get('ms')} ms, split-K {row.get('best_split_k', {}).get('ms')} ms")
        del kc, vc, paged
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return report


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bf16,fp8", help="KV cache dtypes: bf16, fp8")
    p.add_argument("--batches", type=_ints, default=[105, 219, 256])
    p.add_argument("--contexts", type=_ints, default=[1024, 2048, 4096])
    p.add_argument("--max-len", type=int, default=4160, help="cache positions per slot (the slot stride)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=36, help="layers per decode step (ms_per_step = ms x layers)")
    p.add_argument("--blocks", type=_ints, default=[32, 64, 128])
    p.add_argument("--warps", type=_ints, default=[4, 8])
    p.add_argument("--stages", default="1,2,3,4", help="num_stages values; 'default' for Triton's own")
    p.add_argument("--v-as-a-blocks", type=_ints, default=[64, 128], help="the kernel's V_A variant (P V as "
                   "(V^T P^T)^T, no 8-bit shared-memory loads for an e4m3 V) at these BLOCKs, each --warps, default "
                   "stages; '' for none")
    p.add_argument("--chunks", type=_ints, default=[256, 512, 1024], help="split-K: keys per split")
    p.add_argument("--split-blocks", type=_ints, default=[64, 128], help="split-K: BLOCK values")
    p.add_argument("--no-split-k", action="store_true")
    p.add_argument("--page-size", type=int, default=64, help="also the engine kernel over a paged cache of pages this "
                   "long (--rollout-page-size; the same K/V, pages shuffled); 0: not")
    p.add_argument("--check-len", type=int, default=1100, help="positions of the check against SDPA")
    p.add_argument("--tol", type=float, default=2e-2, help="max |kernel - SDPA| of the check")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--hbm-gbs", type=float, default=None,
                   help="peak memory bandwidth in GB/s (default: by the device's name, H100 SXM 3350, H200 4800)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes in float32 (CPU: under TRITON_INTERPRET=1)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    args.hbm_gbs = hbm_gbs(args.hbm_gbs)
    args.dtypes = args.dtypes.split(",")
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        p.error(f"unknown --dtypes {unknown}; use {', '.join(DTYPES)}")
    args.stages = [None if s == "default" else int(s) for s in args.stages.split(",") if s]
    if args.tiny:
        args.batches, args.contexts, args.max_len, args.kv_heads, args.group, args.head_dim = [3], [5, 40], 48, 2, 3, 16
        args.layers = 2
        args.blocks, args.warps, args.stages, args.chunks, args.split_blocks = [32], [4], [None, 1], [16, 32], [16]
        args.v_as_a_blocks = [32]
        args.page_size = min(args.page_size, 16)
        args.check_len, args.warmup, args.reps, args.tol = 40, 0, 1, 1e-4
    if args.no_split_k:
        args.chunks = []
    if DEVICE != "cuda":
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("no GPU here: run the kernels under Triton's interpreter (TRITON_INTERPRET=1) with --tiny")
        interpreter_scalars_as_loop_bounds()
    if max(args.contexts) > args.max_len:
        p.error(f"--contexts {max(args.contexts)} exceeds --max-len {args.max_len}")
    t0 = time.perf_counter()

    def save(report: dict) -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(dict(report, partial=True), indent=2) + "\n")

    report = run(args, save)
    emit(report, args.out, t0)


if __name__ == "__main__":
    main()
