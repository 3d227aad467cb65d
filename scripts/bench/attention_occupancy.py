"""Static analysis, no GPU: the fast engine's decode attention kernel compiled for Hopper (sm_90) by Triton's own
NVIDIA backend on this machine, launch by launch, and what each leaves of an SM.

Per (KV cache dtype, keys per loop iteration, warps, stages): registers per thread and spilled bytes (from the
cubin, `cuobjdump -res-usage`), shared memory, whether the K/V loads are software-pipelined (`cp.async` in the
PTX: the loads of later iterations issued while this one computes), the programs an SM holds at once (the least
of what its 65,536 registers, its 228 KiB of shared memory, 64 warps and 32 blocks allow), and the K/V bytes those
programs read per loop iteration together (`kv_bytes_per_iteration_per_sm`).

What it is for (issue 58): on an H100 the kernel reads an e4m3 cache at ~40-43% of the bandwidth where a bf16 one
reaches 74% (docs/performance.md, the FP8 section). A compile shows both dtypes pipelined, and the e4m3 launch at
the engine's default (64 keys, 4 warps) holding 4 programs of 16 KiB per iteration (64 KiB an SM) against bf16's 3
of 32 KiB (96 KiB): each iteration does the same work (the same scores, softmax and products) on half the bytes,
so an iteration-bound loop reads half as fast. 128 keys per iteration gives e4m3 bf16's 96 KiB. Which launch is
fastest is still the GPU's to say (`decode_attention_gpu.py` times them); this says which are worth timing and
why, in seconds, on the CPU.

The signature is the engine's call (`attention.decode_attention`) at the given shapes: the integer arguments are
marked divisible by 16 where their values are, as Triton's JIT specialises them at run time (without that the
loads are not vectorised and not pipelined: a different kernel from the one the GPU runs).

Usage (this machine; a Triton wheel with its NVIDIA backend, e.g. the GPU machine's version, unpacked):
    pip download --no-deps triton==3.6.0 -d /tmp/t36 && (cd /tmp/t36 && python3 -m zipfile -e triton-*.whl site)
    chmod +x /tmp/t36/site/triton/backends/nvidia/bin/*
    PYTHONPATH=$PWD:/tmp/t36/site python3 scripts/bench/attention_occupancy.py [--out occ.json]
        [--cache-dtypes bf16,fp8] [--blocks 32,64,128,256] [--warps 4,8] [--stages default,2,3,4] [--page-size 0]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_report import emit  # noqa: E402

# an sm_90 SM (H100, H200): registers, shared memory (228 KiB, of which a block may take 227 KiB; each block also
# takes 1 KiB the system reserves), warps and blocks it holds at once; registers are given per warp in 256s
SM90 = dict(registers=65536, shared=233472, shared_per_block=232448, reserved_per_block=1024, warps=64, blocks=32,
            register_unit=256, max_registers_per_thread=255)
CACHE_TYPES = {"bf16": ("bf16", 2), "fp8": ("fp8e4nv", 1)}
POINTERS = ("Q", "K", "V", "O", "POS", "TABLE")


def resident(regs: int, shared: int, warps: int, sm: dict = SM90) -> dict:
    """Programs (blocks) of one launch an SM holds at once, and what limits it."""
    per_warp = -(-regs * 32 // sm["register_unit"]) * sm["register_unit"]
    limits = dict(registers=(sm["registers"] // per_warp) // warps,
                  shared=sm["shared"] // (shared + sm["reserved_per_block"]) if shared <= sm["shared_per_block"] else 0,
                  warps=sm["warps"] // warps, blocks=sm["blocks"])
    n = min(limits.values())
    return dict(programs=n, limited_by=[k for k, v in limits.items() if v == n], limits=limits)


def call_values(args, page: int) -> dict:
    """The integer arguments of the engine's launch at these shapes (attention.decode_attention's order)."""
    kv, g, d, max_len = args.kv_heads, args.group, args.head_dim, args.max_len
    q = dict(sqb=kv * g * d, sqh=g * d, sqg=d)
    if page:
        per_seq = -(-max_len // page)
        k = dict(skb=kv * page * d, skh=page * d, skn=d)
        stb = per_seq
    else:
        k = dict(skb=kv * max_len * d, skh=max_len * d, skn=d)
        stb = 0
    return dict(q, **k, svb=k["skb"], svh=k["skh"], svn=k["skn"], sob=q["sqb"], soh=q["sqh"], sog=q["sqg"], stb=stb)


def compile_launch(kernel, args, cache: str, block: int, warps: int, stages: int | None, page: int, triton_mod,
                   v_a: bool = False):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from miles.rollout.engines.fast.attention import padded_group

    cache_type, _ = CACHE_TYPES[cache]
    names = list(kernel.arg_names)
    ints = call_values(args, page)
    group = args.group
    consts = dict(G=group, G_PAD=padded_group(group), D=args.head_dim, BLOCK=block,
                  PRECISION="tf32", PAGED=bool(page), PAGE=page or 1, V_A=v_a)
    sig, attrs = {}, {}
    for i, name in enumerate(names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = {"K": f"*{cache_type}", "V": f"*{cache_type}", "POS": "*i64",
                         "TABLE": "*i64"}.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]          # torch's allocations are 256-byte aligned
        elif name == "scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if ints[name] % 16 == 0 and ints[name]:          # the JIT's specialisation of this value
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = dict(num_warps=warps, **({} if stages is None else dict(num_stages=stages)))
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton_mod.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def resource_usage(cubin: bytes, triton_mod) -> dict:
    """REG, STACK, SHARED, LOCAL of the cubin's kernel, by cuobjdump (Triton's own copy)."""
    tool = Path(triton_mod.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k.lower(): int(v) for k, v in found.items()}


def analyse(args) -> dict:
    import triton

    from miles.rollout.engines.fast.attention import _kernel

    kernel = _kernel()
    rows = []
    for cache in args.cache_dtypes:
        elem = CACHE_TYPES[cache][1]
        for block, warps, stages, v_a in itertools.product(args.blocks, args.warps, args.stages, args.v_as_a):
            row = dict(cache=cache, block=block, warps=warps, stages=stages or "default", page=args.page_size,
                       v_as_a=v_a)
            t0 = time.perf_counter()
            try:
                compiled = compile_launch(kernel, args, cache, block, warps, stages, args.page_size, triton, v_a)
                usage = resource_usage(compiled.asm["cubin"], triton)
            except Exception as e:  # noqa: BLE001 - a launch Triton refuses: recorded
                rows.append(dict(row, error=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            ptx = compiled.asm["ptx"]
            shared = int(compiled.metadata.shared)
            occ = resident(usage["reg"], shared, warps)
            rows.append(dict(row, registers=usage["reg"], spilled_bytes=usage.get("stack", 0) + usage.get("local", 0),
                             shared_bytes=shared, pipelined=ptx.count("cp.async") > 0,
                             tensor_core_ops=ptx.count("mma.sync") + ptx.count("wgmma"),
                             # 8-bit shared-memory loads: an e4m3 operand read a byte at a time
                             byte_shared_loads=ptx.count("ld.shared.b8") + ptx.count("ld.shared.u8"), **occ,
                             kv_bytes_per_iteration=2 * block * args.head_dim * elem,
                             kv_bytes_per_iteration_per_sm=occ["programs"] * 2 * block * args.head_dim * elem,
                             compile_s=round(time.perf_counter() - t0, 2)))
            print(_line(rows[-1]), file=sys.stderr, flush=True)
    return dict(triton=triton.__version__, target="cuda sm_90", shapes=dict(kv_heads=args.kv_heads, group=args.group,
                head_dim=args.head_dim, max_len=args.max_len, page_size=args.page_size), sm=SM90, launches=rows)


def _line(r: dict) -> str:
    return (f"{r['cache']:>4} block={r['block']:<3} warps={r['warps']} stages={r['stages']!s:<7}"
            f"{' v_as_a' if r['v_as_a'] else ''} regs={r['registers']:<3} byte_loads={r['byte_shared_loads']:<3} "
            f"spill={r['spilled_bytes']:<3} smem={r['shared_bytes']:<6} pipelined={r['pipelined']!s:<5} "
            f"programs/SM={r['programs']} ({','.join(r['limited_by'])}) "
            f"kv/iter/SM={r['kv_bytes_per_iteration_per_sm'] >> 10} KiB")


def _stages(text: str) -> list[int | None]:
    return [None if s == "default" else int(s) for s in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dtypes", type=lambda s: s.split(","), default=["bf16", "fp8"])
    p.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")], default=[32, 64, 128, 256])
    p.add_argument("--warps", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8])
    p.add_argument("--stages", type=_stages, default=[None, 2, 4], help="num_stages values; 'default': Triton's own")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head (Qwen3-4B: 32 / 8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--max-len", type=int, default=4160, help="positions per slot (the 4b-4k run's)")
    p.add_argument("--page-size", type=int, default=0, help="a paged cache of pages this size (0: the slot cache)")
    p.add_argument("--v-as-a", type=lambda s: [x == "1" for x in s.split(",")], default=[False],
                   help="the kernel's V_A (P V as (V^T P^T)^T): 0, 1 or 0,1")
    p.add_argument("--out")
    args = p.parse_args()
    bad = [c for c in args.cache_dtypes if c not in CACHE_TYPES]
    if bad:
        p.error(f"--cache-dtypes {','.join(bad)}: not one of {', '.join(CACHE_TYPES)}")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")      # Triton 3.9 warns without it; 3.6 ignores it
    started = time.perf_counter()
    emit(analyse(args), args.out, started)


if __name__ == "__main__":
    main()
