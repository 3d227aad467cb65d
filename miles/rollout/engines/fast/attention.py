"""Length-aware decode attention for the fast engine: a Triton kernel that reads each sequence's own
K/V, not the whole span bucket.

With answers of mixed lengths, the stock attention call reads every slot's cache up to the
longest sequence in the batch (its mask hides the rest); K/V reads dominate a decode step once
sequences are long, so this kernel reads only positions 0..pos[b] of slot b. One program per
(slot, KV head) holds that head's query group (GQA: the query heads sharing a KV head) and runs an
online softmax over blocks of keys, flash-attention style, in float32.

A paged cache (`--rollout-page-size`, `miles.rollout.engines.fast.cache.PagedKVCache`) is read through
its page table: key n of sequence b lives at offset n % PAGE of page TABLE[b, n // PAGE]; where a page holds
whole blocks of keys (PAGE a multiple of BLOCK) a block's page is read once and its rows addressed as a run, as
in a slot (compiled for sm_90, the e4m3 launch at 64 keys over pages of 64 takes 168 registers a thread where
the per-key addressing took 214: 3 programs an SM instead of 2; scripts/bench/attention_occupancy.py). Without
one, K/V rows are the slots themselves (row b's keys at positions 0..max_len-1 of slot b).

V_A (off in the engine; `scripts/bench/decode_attention_gpu.py` sweeps it): compiled for sm_90, the product
P V with an e4m3 cache reads V's tile from shared memory a byte at a time (64 8-bit loads a thread an
iteration at 64 keys, where bf16 takes `ldmatrix`): V is the product's B operand, which the tensor cores want
transposed, and Hopper's `ldmatrix` has no transposed 8-bit form. As (V^T P^T)^T, V is the A operand and
comes from registers, widened there: no byte loads, but 208 registers a thread (2 programs an SM instead of 4)
and its load no longer pipelined. Which costs less is the GPU's to say.

Optional: used on CUDA in bf16/fp16 when Triton imports and the head dim is a power of two, and
only after `matches_sdpa` has checked it against the stock call on the engine's own shapes; the
engine falls back to the stock call otherwise. On CPU it runs under Triton's interpreter
(TRITON_INTERPRET=1), which is how the unit test checks it without a GPU.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK_N = 64     # keys per loop iteration


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention_kernel(Q, K, V, O, POS, TABLE, scale, sqb, sqh, sqg, skb, skh, skn, svb, svh, svn,
                                sob, soh, sog, stb, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                                BLOCK: tl.constexpr, PRECISION: tl.constexpr, PAGED: tl.constexpr,
                                PAGE: tl.constexpr, V_A: tl.constexpr = False):
        b = tl.program_id(0)
        h = tl.program_id(1)
        n_keys = tl.load(POS + b) + 1
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        n = tl.arange(0, BLOCK)
        q = tl.load(Q + b * sqb + h * sqh + g[:, None] * sqg + d[None, :], mask=g[:, None] < G, other=0.0)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for start in range(0, n_keys, BLOCK):
            keys = start + n
            valid = keys < n_keys
            if PAGED and PAGE % BLOCK == 0:   # the block lies in one page: one id from the table, rows in a run
                page = tl.load(TABLE + b * stb + start // PAGE)
                within = start % PAGE + n
                k_rows = K + page * skb + h * skh + within[:, None] * skn
                v_rows = V + page * svb + h * svh + within[:, None] * svn
            elif PAGED:    # skb, svb: a page's stride; each key's page from the table, its offset in it
                page = tl.load(TABLE + b * stb + keys // PAGE, mask=valid, other=0)
                k_rows = K + page[:, None] * skb + h * skh + (keys % PAGE)[:, None] * skn
                v_rows = V + page[:, None] * svb + h * svh + (keys % PAGE)[:, None] * svn
            else:
                k_rows = K + b * skb + h * skh + keys[:, None] * skn
                v_rows = V + b * svb + h * svh + keys[:, None] * svn
            # an FP8 cache (--kv-cache-dtype fp8_e4m3) is read as e4m3 and widened here, in registers
            k = tl.load(k_rows + d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_rows + d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
            if V_A:   # (V^T P^T)^T: V the A operand, from registers (see V_A in the module docstring)
                acc = acc * alpha[:, None] + tl.trans(tl.dot(tl.trans(v), tl.trans(p.to(v.dtype)),
                                                             input_precision=PRECISION))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / total[:, None]
        tl.store(O + b * sob + h * soh + g[:, None] * sog + d[None, :], out.to(O.dtype.element_ty),
                 mask=g[:, None] < G)

    return decode_attention_kernel


def usable(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel may run here (it is then still checked with `matches_sdpa`)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False   # float32 engines are the exact reference: they keep the stock call
    if head_dim < 16 or head_dim & (head_dim - 1):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def padded_group(group: int) -> int:
    """The kernel's G_PAD: a KV head's query group padded to a power of two of at least 16 rows (tl.dot's least)."""
    return max(16, 1 << (group - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """The kernel's PRECISION: float32 operands in IEEE precision, not Triton's default TF32 (a 10-bit mantissa),
    so the kernel computes what it says for every dtype it takes (the engine runs it in bf16/fp16 only, where
    this choice has no effect)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention(q: Tensor, kc: Tensor, vc: Tensor, pos: Tensor, scale: float,
                     table: Tensor | None = None) -> Tensor:
    """q [B, kv_heads, group, D]; kc, vc [slots >= B, kv_heads, max_len, D]; slot b attends over its
    positions 0..pos[b]. -> [B, kv_heads, group, D]. With a page `table` [>= B, pages per sequence]: kc, vc
    are [pages, kv_heads, page, D] and row b's positions are in the pages of table[b]."""
    b, kv_heads, group, dim = q.shape
    paged = table is not None
    out = torch.empty_like(q)
    _kernel()[(b, kv_heads)](q, kc, vc, out, pos, table if paged else pos, scale, *q.stride()[:3],
                             *kc.stride()[:3], *vc.stride()[:3], *out.stride()[:3], table.stride(0) if paged else 0,
                             G=group, G_PAD=padded_group(group), D=dim, BLOCK=BLOCK_N, PRECISION=dot_precision(q.dtype),
                             PAGED=paged, PAGE=kc.shape[2] if paged else 1, num_warps=4)
    return out


def gather_pages(c: Tensor, table: Tensor, span: int) -> Tensor:
    """A paged layer cache c [pages, kv_heads, page, D] read as rows [n, kv_heads, span, D]: row i holds the
    first `span` positions of the sequence whose pages are table[i] (a copy, as the stock calls need)."""
    n, (_, kv_heads, page, dim) = table.shape[0], c.shape
    pages = -(-span // page)
    rows = c[table[:, :pages]]                      # [n, pages, kv_heads, page, D]
    return rows.transpose(1, 2).reshape(n, kv_heads, pages * page, dim)[:, :, :span]


def sdpa_decode_attention(q: Tensor, kc: Tensor, vc: Tensor, pos: Tensor, scale: float, span: int,
                          mask: Tensor, table: Tensor | None = None) -> Tensor:
    """The stock call: slots 0..B-1 over their first `span` positions, `mask` [B, 1, 1, span] additive
    (a paged cache: the sequences of table's first B rows, gathered)."""
    b = q.shape[0]
    if table is None:
        k, v = kc[:b, :, :span], vc[:b, :, :span]
    else:
        k, v = gather_pages(kc, table[:b], span), gather_pages(vc, table[:b], span)
    if k.dtype != q.dtype:      # an FP8 cache: widened to the compute dtype (a copy of the span; the kernel avoids it)
        k, v = k.to(q.dtype), v.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def matches_sdpa(kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_len: int, tol: float = 2e-2, cache_dtype: torch.dtype | None = None,
                 page: int | None = None) -> bool:
    """Run the kernel and the stock call on random data of the engine's shapes (`page`: a paged cache of
    pages that size, the sequences' pages shuffled); True when they agree."""
    gen = torch.Generator(device=device).manual_seed(0)
    b, slots = 5, 7
    q = torch.randn((b, kv_heads, group, head_dim), generator=gen, device=device).to(dtype)
    table = None
    if page is None:
        shape = (slots, kv_heads, max_len, head_dim)
    else:
        per_seq = -(-max_len // page)
        table = torch.randperm(slots * per_seq, generator=gen, device=device).view(slots, per_seq)
        shape = (slots * per_seq, kv_heads, page, head_dim)
    kc, vc = (torch.randn(shape, generator=gen, device=device).to(cache_dtype or dtype) for _ in range(2))
    pos = torch.tensor([0, 1, max_len // 3, max_len - 2, max_len - 1][:b], device=device)
    valid = torch.arange(max_len, device=device) <= pos[:, None]
    mask = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(~valid, float("-inf"))[:, None, None]
    want = sdpa_decode_attention(q, kc, vc, pos, head_dim ** -0.5, max_len, mask, table).float()
    got = decode_attention(q, kc, vc, pos, head_dim ** -0.5, table).float()
    return bool((got - want).abs().max() < tol)
