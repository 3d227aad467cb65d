"""The Triton kernels of the FP8 weight sync's block quantizer (`miles.weights.fp8.quantize_blocks`,
`quantize_group`): each quantizes 128 x 128 tiles by `tile` (float32 amax, IEEE-rounded divisions: the bits
of the torch path). Defined where Triton is installed (CUDA machines; CI's CPU torch has none), at module
level so that both kernels, compiled or under Triton's CPU interpreter, find `tile`.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:         # no Triton: fp8.quantize_blocks takes its torch path
    triton = None

if triton is not None:
    @triton.jit
    def tile(w, QMAX: tl.constexpr, ROUND: tl.constexpr):
        if ROUND == 1:      # round_to bf16 / fp16 (nearest even, as torch's .to), in registers
            w = w.to(tl.bfloat16, fp_downcast_rounding="rtne")
        elif ROUND == 2:
            w = w.to(tl.float16, fp_downcast_rounding="rtne")
        w = w.to(tl.float32)
        amax = tl.max(tl.max(tl.abs(w), 1), 0)
        # IEEE-rounded divisions (Triton's `/` may be approximate): the bits of the torch path
        scale = tl.where(amax > 0, tl.math.div_rn(amax, QMAX), 1.0)
        q = tl.math.div_rn(w, tl.zeros(w.shape, tl.float32) + scale)
        return tl.minimum(tl.maximum(q, -QMAX), QMAX), scale

    @triton.jit
    def quantize_blocks_kernel(W, Q, S, n, k, swn, swk, kb, BLOCK_: tl.constexpr, QMAX: tl.constexpr,
                               ROUND: tl.constexpr):
        i = tl.program_id(0)
        j = tl.program_id(1)
        rows = i * BLOCK_ + tl.arange(0, BLOCK_)
        cols = j * BLOCK_ + tl.arange(0, BLOCK_)
        inside = (rows[:, None] < n) & (cols[None, :] < k)
        w = tl.load(W + rows[:, None] * swn + cols[None, :] * swk, mask=inside, other=0.0)
        q, scale = tile(w, QMAX, ROUND)
        tl.store(Q + rows[:, None] * k + cols[None, :], q.to(Q.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=inside)
        tl.store(S + i * kb + j, scale)

    @triton.jit
    def quantize_group_kernel(W, Q, S, C, T, B, FIELDS: tl.constexpr, BLOCK_: tl.constexpr, QMAX: tl.constexpr,
                              ROUND: tl.constexpr, ALIGNED: tl.constexpr):
        # one program per block of any weight of the group: B gives its weight, that weight's row of T
        # (`fp8.GroupTable`) where the weight, its values and its scales are
        b = tl.program_id(0)
        row = T + tl.load(B + b).to(tl.int64) * FIELDS
        src, src_stride, dst, n, k = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
        if ALIGNED:     # the table checked it (`GroupTable.aligned`): Triton may vectorize the loads and stores
            src = tl.multiple_of(src, 16)
            src_stride = tl.multiple_of(src_stride, 16)
            dst = tl.multiple_of(dst, 16)
            k = tl.multiple_of(k, 16)
        s_off, carried, first, kb = tl.load(row + 5), tl.load(row + 6), tl.load(row + 7), tl.load(row + 8)
        i = (b - first) // kb
        j = (b - first) % kb
        rows = i * BLOCK_ + tl.arange(0, BLOCK_)
        cols = j * BLOCK_ + tl.arange(0, BLOCK_)
        inside = (rows[:, None] < n) & (cols[None, :] < k)
        w = tl.load(W + src + rows[:, None] * src_stride + cols[None, :], mask=inside, other=0.0)
        q, scale = tile(w, QMAX, ROUND)
        tl.store(Q + dst + rows[:, None] * k + cols[None, :], q.to(Q.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=inside)
        tl.store(S + s_off + i * kb + j, scale, mask=carried == 0)      # its scale in the bucket, or carried
        tl.store(C + s_off + i * kb + j, scale, mask=carried != 0)
