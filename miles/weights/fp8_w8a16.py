"""FP8 weights times bf16 activations in one Triton kernel: the decode step's FP8 projection (issue 58).

A decode step multiplies a few hundred rows (one per sequence) by every weight of the model: it is bound
by the bytes of the weights, and FP8 weights are half of bf16's. cuBLAS's block-scaled FP8 GEMM (the
`scaled_mm_blockwise` product in `fp8.py`) wants the activations quantized too and ran at 0.95x of the
bf16 engine on the H100 (Dec 7): at these row counts it does not turn the halved bytes into time. This
kernel reads the e4m3 weight once, converts each [BN, 128] tile to the activations' dtype in registers
(exact: every e4m3 value is a bf16/fp16 value), multiplies on the tensor cores with a float32
accumulator and applies the tile's 128 x 128 block scale to the partial product, so the result is the
dequantized weight's product in float32 rounded once (no activation quantization: closer to the bf16
model than the W8A8 GEMM).

Tiles: BK = 128 (one scale per row block per K step), BM the rows rounded up (16..128), BN the widest of
128/64/32/16 that still gives every SM a tile (`tile_config`); the M tiles of one N tile are launched
side by side so they share that weight tile through L2. K must be a multiple of 128 (the caller falls
back to the dequantized product otherwise).

Measured on an H100 (Dec 7, `scripts/bench/fp8_gemm_gpu.py --w8a16-sweep`): 2-6x slower than bf16's GEMM at
105-512 rows, 2-4x at the best of 24 tile shapes, so `fp8.W8A16` leaves it off; kept as the decode slot of
`miles::fp8_mm` (docs/fp8.md says what would beat it).
"""

from __future__ import annotations

from contextlib import nullcontext as _no_device
from functools import lru_cache

import torch
from torch import Tensor

BLOCK = 128


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def w8a16_kernel(X, Q, S, Y, M, N, K, stride_xm, stride_ym, KB,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SBLOCK: tl.constexpr):
        pid_m = tl.program_id(0)        # fastest: the M tiles of one weight tile run together (L2 reuse)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        n_ok = rn < N
        x_ptr = X + rm[:, None] * stride_xm + rk[None, :]
        q_ptr = Q + rn[:, None] * K + rk[None, :]
        s_ptr = S + (rn // SBLOCK) * KB
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, KB):
            x = tl.load(x_ptr, mask=m_ok[:, None], other=0.0)
            w = tl.load(q_ptr, mask=n_ok[:, None], other=0.0)
            s = tl.load(s_ptr + kb, mask=n_ok, other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype))) * s[None, :]
            x_ptr += BK
            q_ptr += BK
        tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    return w8a16_kernel


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tile_config(m: int, n: int, sms: int) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) for M rows and N outputs on a GPU of `sms` SMs (module docstring)."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    m_tiles = -(-m // bm)
    bn = 128
    while bn > 16 and -(-n // bn) * m_tiles < sms:
        bn //= 2
    return bm, bn, 4, 4


def w8a16_mm(x: Tensor, q: Tensor, scale: Tensor, config: tuple[int, int, int, int] | None = None) -> Tensor:
    """x [M, K] (bf16/fp16, rows contiguous) @ dequant(q [N, K] e4m3, scale [ceil(N/128), K/128]).T ->
    [M, N] in x's dtype, by the Triton kernel (CUDA; under TRITON_INTERPRET=1 on CPU tensors too).
    `config` overrides `tile_config` (the benchmark's sweep)."""
    m, k = x.shape
    n = q.shape[0]
    if k % BLOCK or q.shape[1] != k or scale.shape != (-(-n // BLOCK), k // BLOCK):
        raise ValueError(f"w8a16_mm: x {tuple(x.shape)}, q {tuple(q.shape)}, scale {tuple(scale.shape)}: K must be "
                         f"a multiple of {BLOCK} and the scales one per {BLOCK} x {BLOCK} block")
    if x.stride(1) != 1:
        x = x.contiguous()
    q, scale = q.contiguous(), scale.float().contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, warps, stages = config or tile_config(m, n, _sm_count(x.device.index or 0) if x.is_cuda else 132)
    grid = (-(-m // bm), -(-n // bn))
    with torch.cuda.device(x.device) if x.is_cuda else _no_device():
        _kernel()[grid](x, q, scale, y, m, n, k, x.stride(0), y.stride(0), k // BLOCK, BM=bm, BN=bn, BK=BLOCK,
                        SBLOCK=BLOCK, num_warps=warps, num_stages=stages)
    return y
