"""FP8 weights for rollout: 128 x 128 block quantization to float8 e4m3, its inverse, and an FP8 linear.

The layout is that of Qwen3-FP8 and DeepSeek-V3 checkpoints (`quantization_config` with
`quant_method: fp8`, `weight_block_size: [128, 128]`): a Linear weight W [N, K] is stored as
`weight` (float8_e4m3fn [N, K]) and `weight_scale_inv` (float32 [ceil(N/128), ceil(K/128)]), with
W ~= weight * scale_inv block by block; scale_inv = amax(|block|) / 448 (e4m3's largest finite value),
so each block's largest entry lands on +-448 and no entry overflows.

`linear(x, w, b)` is F.linear for a plain tensor and the FP8 product for a `QuantWeight`. Which FP8
product runs is chosen once per process (`select_kernel`) and reported by `kernel()`:
- `w8a16_triton` (with `scaled_mm_blockwise` above `W8A16_MAX_M` rows, where the GPU has it), only when
  `W8A16` is set (off: on an H100 it ran 2-6x slower than bf16's GEMM; docs/fp8.md): CUDA with
  Triton, for products of up to `W8A16_MAX_M` rows (a decode step's): the e4m3 weight read once and
  multiplied in the activations' dtype (`fp8_w8a16.py`); larger products (prefill) take the block-scaled
  GEMM below. One op (`miles::fp8_mm`) chooses by the rows at run time, so a compiled graph with a
  dynamic batch holds both. Used only after a probe on the device agrees with the dequantized product.
- `scaled_mm_blockwise`: CUDA with FP8 GEMMs (capability >= 9.0, Hopper), a cuBLAS block-scaled GEMM
  through `torch.nn.functional.scaled_mm` (torch >= 2.10) or `torch._scaled_mm` (which infers the
  recipe from the scales' shapes): the activations quantized at run time per token and 128-column
  group (BlockWise1x128), the weight's 128 x 128 scales as they are (BlockWise128x128). It is used
  only after a probe on the device agrees with the dequantized product.
- `dequant_matmul`: everywhere else (CPU, older GPUs, a torch without block scales): the weight is
  dequantized to the compute dtype and multiplied there. On the CPU this is the emulation: the
  weights are exactly the FP8 grid's values, the activations are not quantized, so the quality cost
  of FP8 weights is real and measurable without an FP8 GEMM.

Pure tensor math (its one miles import is the W8A16 kernel's module), used by the engines (fast and
embedded), the weight sync and the FP8 checkpoint reader/writer.
"""

from __future__ import annotations

import json
import re
from contextlib import nullcontext
from collections.abc import Iterator, Mapping
from functools import lru_cache, partial
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from miles.weights.fp8_w8a16 import w8a16_mm

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0            # torch.finfo(torch.float8_e4m3fn).max
BLOCK = 128                # weight blocks are BLOCK x BLOCK; activation groups 1 x BLOCK
SCALE_SUFFIX = "_scale_inv"   # HF's name of a weight's block scales: "<...>.weight" + SCALE_SUFFIX
KERNELS = ("w8a16_triton", "scaled_mm_blockwise", "dequant_matmul")
# the decoder's Linear weights that are quantized (HF names); embeddings, norms, lm_head, routers stay
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")


class QuantWeight(NamedTuple):
    """A Linear weight in FP8: e4m3 values [N, K] and float32 block scales [ceil(N/B), ceil(K/B)]."""
    weight: Tensor
    scale: Tensor


def is_quantized_name(name: str) -> bool:
    return QUANTIZED.match(name) is not None


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def quantize_blocks(w: Tensor, block: int = BLOCK, *, round_to: torch.dtype | None = None,
                    out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """W [N, K] -> (e4m3 [N, K], float32 scale_inv [ceil(N/B), ceil(K/B)]), scale_inv = amax / 448 per
    block (an all-zero block gets scale 1 and zeros). `round_to` (bf16/fp16): quantize W rounded to that
    dtype first (W.to(round_to): what an engine of that dtype would quantize), without making the copy;
    `out`: a contiguous e4m3 [N, K] tensor to write the values into (a weight-sync bucket's view), returned.
    Computed in float32 on W's device: on CUDA by one Triton kernel (`_quantize_blocks_triton`: W read
    once, e4m3 written once; it runs for every weight of an FP8 sync), elsewhere by torch ops
    (`_quantize_blocks_torch`); both give the same bits."""
    if w.dim() != 2:
        raise ValueError(f"block quantization takes a 2-D weight, got shape {tuple(w.shape)}")
    if round_to is not None and round_to not in (torch.bfloat16, torch.float16, torch.float32, w.dtype):
        raise ValueError(f"quantize_blocks round_to={round_to}: bf16, fp16 or the weight's own dtype")
    if out is not None and (out.shape != w.shape or out.dtype != FP8 or not out.is_contiguous()
                            or out.device != w.device):
        raise ValueError(f"quantize_blocks out= must be a contiguous {FP8} tensor of the weight's shape "
                         f"{tuple(w.shape)} on {w.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    if w.is_cuda and block == BLOCK and w.dtype in (torch.float32, torch.bfloat16, torch.float16) and _triton():
        return _quantize_blocks_triton(w, round_to, out)
    q, scale = _quantize_blocks_torch(w if round_to is None else w.to(round_to), block)
    return (q, scale) if out is None else (out.copy_(q), scale)


def _quantize_blocks_torch(w: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    n, k = w.shape
    nb, kb = _blocks(n, block), _blocks(k, block)
    wf = w.detach().float()             # two float32 temporaries in all (this and the quotient): it runs
    if nb * block != n or kb * block != k:   # on the trainer's GPU for every weight of an FP8 sync
        wf = F.pad(wf, (0, kb * block - k, 0, nb * block - n))
    tiles = wf.view(nb, block, kb, block)
    amax = torch.maximum(tiles.amax(dim=(1, 3)), -tiles.amin(dim=(1, 3)))    # max |w| without |w|
    # divided by a tensor, not the Python float: CUDA divides by a scalar as a product with its reciprocal,
    # which is off by an ulp in some blocks; this is IEEE division on every device (the Triton kernel's div_rn)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale.contiguous()


@lru_cache(maxsize=None)
def _triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _quantize_kernels():
    """(one tensor's kernel, a group's kernel): `miles.weights.fp8_kernels` (Triton)."""
    from miles.weights import fp8_kernels

    return fp8_kernels.quantize_blocks_kernel, fp8_kernels.quantize_group_kernel


def _rounding(w_dtype: torch.dtype, round_to: torch.dtype | None) -> int:
    """The kernels' ROUND: 0 none (a rounding that changes nothing: to the dtype W already has, or bf16/fp16
    W to float32), 1 to bf16, 2 to fp16."""
    if round_to not in (torch.bfloat16, torch.float16) or w_dtype == round_to:
        return 0
    return 1 if round_to == torch.bfloat16 else 2


def _quantize_blocks_triton(w: Tensor, round_to: torch.dtype | None = None,
                            out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    n, k = w.shape
    nb, kb = _blocks(n, BLOCK), _blocks(k, BLOCK)
    q = torch.empty((n, k), dtype=FP8, device=w.device) if out is None else out
    scale = torch.empty((nb, kb), dtype=torch.float32, device=w.device)
    with torch.cuda.device(w.device) if w.is_cuda else nullcontext():     # CPU: Triton's interpreter
        _quantize_kernels()[0][(nb, kb)](w.detach(), q, scale, n, k, w.stride(0), w.stride(1), kb, BLOCK_=BLOCK,
                                         QMAX=FP8_MAX, ROUND=_rounding(w.dtype, round_to), num_warps=8)
    return q, scale


ALIGN = 16      # elements: what `GroupTable.aligned` asks of every offset, row stride and width


class GroupTable(NamedTuple):
    """Where the weights of a group are, for `quantize_group`, on the device: one row of `FIELDS` int64 per
    weight (`tensors`) and the weight of each 128 x 128 block (`blocks`, int32: 4 bytes a block, about 1 MB
    for a 4B model). Made once for a group whose tensors stay where they are (`key`). Offsets are in elements
    from the group's first weight (`src`), in bytes from the bucket's start (`dst`: e4m3 elements are bytes),
    and in float32 elements from the bucket's start or from the carry buffer's (`s_off`, `carried`).
    `aligned`: every offset, row stride and width is a multiple of 16 elements, so the kernel may tell Triton
    so (`tl.multiple_of`) and it vectorizes the loads and stores (it cannot know it of values it reads from
    the table at run time; the one-weight kernel gets that from Triton's specialization of its arguments)."""
    key: tuple
    tensors: Tensor
    blocks: Tensor
    aligned: bool = False

    FIELDS = 9      # src, src row stride, dst, N, K, s_off, carried, first block, blocks per row (kb)


def group_key(weights: list[Tensor], dsts: list[int], scales: list[tuple[int, bool]]) -> tuple:
    """`GroupTable.key` of a group, to tell whether a table made before still holds."""
    return tuple((w.data_ptr(), tuple(w.shape), w.stride(0)) for w in weights) + (tuple(dsts), tuple(scales))


def group_table(weights: list[Tensor], dsts: list[int], scales: list[tuple[int, bool]], device) -> GroupTable:
    """The table of weights [N_i, K_i] (rows contiguous, one dtype: offsets are counted in its elements from
    `weights[0]`) whose e4m3 values go at byte offset `dsts[i]` of the bucket and whose scales at float32
    offset `scales[i][0]` of the bucket, or of the carry buffer when `scales[i][1]`."""
    base, elem = weights[0].data_ptr(), weights[0].element_size()
    rows, counts, first = [], [], 0
    for w, dst, (s_off, carried) in zip(weights, dsts, scales, strict=True):
        n, k = w.shape
        kb = _blocks(k, BLOCK)
        rows.append([(w.data_ptr() - base) // elem, w.stride(0), dst, n, k, s_off, int(carried), first, kb])
        counts.append(_blocks(n, BLOCK) * kb)
        first += counts[-1]
    which = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int32), torch.tensor(counts))
    aligned = base % ALIGN == 0 and all(v % ALIGN == 0 for row in rows for v in row[:3] + [row[4]])
    return GroupTable(group_key(weights, dsts, scales), torch.tensor(rows, dtype=torch.int64).to(device),
                      which.to(device), aligned)


def quantize_group(table: GroupTable, first: Tensor, flat: Tensor, carry: Tensor, round_to: torch.dtype | None) -> None:
    """Quantize every weight of `table`'s group (`first`: its first weight, the base of the offsets) into
    the uint8 bucket `flat` (values and scales at the table's offsets), scales marked carried into
    `carry` (float32): one kernel launch for the whole group (`group_table`)."""
    nbytes = flat.numel() - flat.numel() % 4
    with torch.cuda.device(flat.device) if flat.is_cuda else nullcontext():
        _quantize_kernels()[1][(table.blocks.numel(),)](
            first.detach(), flat.view(FP8), flat[:nbytes].view(torch.float32), carry, table.tensors, table.blocks,
            FIELDS=GroupTable.FIELDS, BLOCK_=BLOCK, QMAX=FP8_MAX, ROUND=_rounding(first.dtype, round_to),
            ALIGNED=table.aligned, num_warps=8)


def dequantize_blocks(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32, block: int = BLOCK) -> Tensor:
    """(e4m3 [N, K], scale_inv [ceil(N/B), ceil(K/B)]) -> W [N, K] in `dtype` (product in float32)."""
    n, k = q.shape
    s = scale.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (q.float() * s).to(dtype)


def round_to_grid(w: Tensor, block: int = BLOCK) -> Tensor:
    """dequant(quant(W)) in W's dtype: W rounded to its FP8 block grid (the CPU emulation's weights)."""
    return dequantize_blocks(*quantize_blocks(w, block), dtype=w.dtype, block=block)


def on_grid(w: Tensor, block: int = BLOCK) -> bool:
    """Whether W is already on its own FP8 block grid (round_to_grid leaves it unchanged)."""
    return bool(torch.equal(round_to_grid(w, block), w))


def quantize_activations(x: Tensor, group: int = BLOCK) -> tuple[Tensor, Tensor]:
    """x [M, K] (K a multiple of `group`) -> (e4m3 [M, K], float32 scales [M, K/group]), per token and group."""
    m, k = x.shape
    xg = x.float().reshape(m, k // group, group)
    scale = xg.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, k), scale


# --- the FP8 linear -------------------------------------------------------------------------------

_KERNEL = "dequant_matmul"      # set once by select_kernel; read by linear() (compiled code guards on it)
_API = None                     # "F.scaled_mm" | "torch._scaled_mm" for scaled_mm_blockwise
_PAD_OK = False                 # the GEMM also took K blocks padded to a multiple of 4 (K = 384 in the probe)
# products of up to this many rows take the Triton W8A16 kernel when it was selected (a decode step's
# batch; read at run time inside `miles::fp8_mm`, so setting it needs no recompile; 0: never)
W8A16_MAX_M = 512
# select_kernel may take the Triton W8A16 kernel: off (an H100 ran it 2-6x slower than bf16's GEMM, Dec 7;
# the benchmarks set it per variant; docs/fp8.md)
W8A16 = False


def kernel() -> str:
    """The FP8 product `linear` runs in this process (`KERNELS`), with the API used when it is a GEMM."""
    gemm = _KERNEL if _API is None else f"{_KERNEL} ({_API})"
    if _KERNEL != "w8a16_triton":
        return gemm
    return f"{_KERNEL} (rows <= {W8A16_MAX_M})" + (f" + scaled_mm_blockwise ({_API})" if _API else "")


def linear(x: Tensor, w: Tensor | QuantWeight, b: Tensor | None = None) -> Tensor:
    """F.linear(x, w, b) for a plain weight; the FP8 product for a QuantWeight (see the module)."""
    if not isinstance(w, QuantWeight):
        return F.linear(x, w, b)
    return _PRODUCT(x, w, b)


def _dequant_product(x: Tensor, w: QuantWeight, b: Tensor | None) -> Tensor:
    return F.linear(x, dequantize_blocks(w.weight, w.scale, x.dtype), b)


def _gemm_product(x: Tensor, w: QuantWeight, b: Tensor | None) -> Tensor:
    k = x.shape[-1]
    if k % BLOCK or not (_PAD_OK or k % (4 * BLOCK) == 0):     # a shape the probed GEMM does not take
        return _dequant_product(x, w, b)
    out = _blockwise(x.reshape(-1, k), w.weight, w.scale, x.dtype, _API).view(*x.shape[:-1], w.weight.shape[0])
    return out if b is None else out + b


def _w8a16_product(x: Tensor, w: QuantWeight, b: Tensor | None) -> Tensor:
    k = x.shape[-1]
    if k % BLOCK:
        return _dequant_product(x, w, b)
    out = fp8_mm(x.reshape(-1, k), w.weight, w.scale, _API or "", _PAD_OK or k % (4 * BLOCK) == 0)
    out = out.view(*x.shape[:-1], w.weight.shape[0])
    return out if b is None else out + b


_PRODUCT = _dequant_product     # select_kernel's choice


def _blockwise(x: Tensor, q: Tensor, scale: Tensor, dtype: torch.dtype, api: str | None) -> Tensor:
    """x [M, K] @ dequant(q, scale).T by cuBLAS's block-scaled FP8 GEMM (`fp8_blockwise_mm`). cuBLAS
    wants M a multiple of 4: the rows are padded before the activations are quantized (no branch on M:
    one compiled graph for every batch size); the quantization stays in the caller's compiled graph."""
    m = x.shape[0]
    a, a_scale = quantize_activations(F.pad(x, (0, 0, 0, (-m) % 4)))
    return fp8_blockwise_mm(a, a_scale, q, scale, dtype, api or "torch._scaled_mm")[:m]


@torch.library.custom_op("miles::fp8_blockwise_mm", mutates_args=())
def fp8_blockwise_mm(a: Tensor, a_scale: Tensor, q: Tensor, scale: Tensor, dtype: torch.dtype, api: str) -> Tensor:
    """a [M, K] e4m3 with per-token-and-group scales [M, K/128] times the 128 x 128 block-scaled weight q
    [N, K] (scales [N/128, K/128]), transposed: [M, N] in `dtype`. An op of its own so that torch.compile
    traces the decode graph around it (dynamo cannot trace `F.scaled_mm`: it fell back to eager, at half
    the bf16 engine's speed, on the H100 on Dec 7) and the layouts cuBLAS wants are made here, where the
    compiler cannot change them: the activation scales outer-dim-major, the weight's K blocks padded to
    a multiple of 4. Off CUDA it is the same product in float32 from the dequantized operands (what
    the CPU tests trace and compare)."""
    if a.device.type != "cuda":
        m, k = a.shape
        deq_a = (a.float().view(m, k // BLOCK, BLOCK) * a_scale[..., None]).view(m, k)
        return F.linear(deq_a, dequantize_blocks(q, scale)).to(dtype)
    return _cublas_mm(a, a_scale, q, scale, dtype, api)


@fp8_blockwise_mm.register_fake
def _(a: Tensor, a_scale: Tensor, q: Tensor, scale: Tensor, dtype: torch.dtype, api: str) -> Tensor:
    return a.new_empty((a.shape[0], q.shape[0]), dtype=dtype)


@torch.library.custom_op("miles::fp8_mm", mutates_args=())
def fp8_mm(x: Tensor, q: Tensor, scale: Tensor, api: str, gemm_ok: bool) -> Tensor:
    """x [M, K] (bf16/fp16) @ dequant(q, scale).T -> [M, N] in x's dtype, the `w8a16_triton` kernel's op:
    up to `W8A16_MAX_M` rows (or when `api` is "" or the block-scaled GEMM does not take this K:
    `gemm_ok` False) the Triton W8A16 kernel; more rows, the activations quantized here and cuBLAS's
    block-scaled GEMM by `api`. The choice is made at run time, on the rows this call has. Off CUDA: the
    dequantized product in float32 (what the CPU tests trace)."""
    if x.device.type != "cuda":
        return F.linear(x.float(), dequantize_blocks(q, scale)).to(x.dtype)
    m = x.shape[0]
    if m <= W8A16_MAX_M or not api or not gemm_ok:
        return w8a16_mm(x, q, scale)
    a, a_scale = quantize_activations(F.pad(x, (0, 0, 0, (-m) % 4)))
    return _cublas_mm(a, a_scale, q, scale, x.dtype, api)[:m]


@fp8_mm.register_fake
def _(x: Tensor, q: Tensor, scale: Tensor, api: str, gemm_ok: bool) -> Tensor:
    return x.new_empty((x.shape[0], q.shape[0]))


def _cublas_mm(a: Tensor, a_scale: Tensor, q: Tensor, scale: Tensor, dtype: torch.dtype, api: str) -> Tensor:
    """cuBLAS's block-scaled FP8 GEMM in the layouts it wants: the activation scales outer-dim-major, the
    weight's K blocks padded to a multiple of 4."""
    a_scale = a_scale.t().contiguous().t()
    kb = scale.shape[1]
    s = F.pad(scale, (0, 4 - kb % 4)) if kb % 4 else scale
    if api == "F.scaled_mm":
        return F.scaled_mm(a, q.t(), a_scale, F.ScalingType.BlockWise1x128, s.t(), F.ScalingType.BlockWise128x128,
                           output_dtype=dtype)
    return torch._scaled_mm(a, q.t(), scale_a=a_scale, scale_b=s.t(), out_dtype=dtype)


def select_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """Pick the FP8 product for this process (module docstring) and return `kernel()`. The block-scaled
    GEMM is taken only on CUDA >= 9.0 in bf16/fp16, and only when a probe of it agrees with the
    dequantized product (relative error under 3%: activation quantization's own error is ~1-2%); the
    Triton W8A16 kernel (unless `W8A16` is False) on CUDA >= 8.9 with Triton, when its probe agrees to
    within 1% (its only rounding is the output's)."""
    global _KERNEL, _API, _PAD_OK, _PRODUCT
    _KERNEL, _API, _PAD_OK, _PRODUCT = "dequant_matmul", None, False, _dequant_product
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return kernel()
    capability = torch.cuda.get_device_capability(device)
    if capability >= (9, 0):
        apis = (["F.scaled_mm"] if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType") else []) + ["torch._scaled_mm"]
        for api in apis:
            gemm = partial(_blockwise, dtype=dtype, api=api)
            if _probe(device, dtype, gemm, k=512, tolerance=3e-2):
                _KERNEL, _API, _PRODUCT = "scaled_mm_blockwise", api, _gemm_product
                _PAD_OK = _probe(device, dtype, gemm, k=384, tolerance=3e-2)
                break
    if W8A16 and capability >= (8, 9) and _triton():
        if all(_probe(device, dtype, w8a16_mm, k=k, rows=rows, tolerance=1e-2) for k, rows in ((512, 37), (384, 200))):
            _KERNEL, _PRODUCT = "w8a16_triton", _w8a16_product
    return kernel()


def _probe(device: torch.device, dtype: torch.dtype, product, k: int, tolerance: float, rows: int = 37) -> bool:
    """Whether `product(x, q, scale)` runs and agrees with the dequantized product on a rows x k x 384 case."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((rows, k), generator=gen, device=device).to(dtype)
    q, s = quantize_blocks(torch.randn((384, k), generator=gen, device=device) * 0.05)
    want = F.linear(x.float(), dequantize_blocks(q, s))
    try:
        got = product(x, q, s).float()
        torch.cuda.synchronize(device)
    except Exception:   # noqa: BLE001 - an API, layout or kernel this torch/cuBLAS/Triton lacks: fall back
        return False
    return bool(((got - want).norm() / want.norm()).item() < tolerance)


# --- HF names: a weight dict with FP8 Linear weights ------------------------------------------------

def quantize_state_dict(weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """{name: tensor} -> the same with every decoder Linear weight as e4m3 plus its `<name>_scale_inv`
    (right after it); the rest unchanged. What an FP8 engine holds and an FP8 checkpoint stores."""
    out: dict[str, Tensor] = {}
    for name, t in weights.items():
        if is_quantized_name(name):
            out[name], out[name + SCALE_SUFFIX] = quantize_blocks(t)
        else:
            out[name] = t
    return out


def dequantize_state_dict(weights: Mapping[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """The inverse: e4m3 weights with scales -> `dtype` weights, the scales dropped; others cast to `dtype`
    when floating point."""
    out: dict[str, Tensor] = {}
    for name, t in weights.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if t.dtype == FP8:
            out[name] = dequantize_blocks(t, weights[name + SCALE_SUFFIX], dtype)
        else:
            out[name] = t.to(dtype) if t.is_floating_point() else t
    return out


class Fp8Weights(Mapping):
    """A lazy view of a weight mapping with its decoder Linear weights quantized (`quantize_state_dict`'s
    names, order and dtypes), for the weight sync's bucket plan and fill: `items()` gives meta tensors
    of the right shapes and dtypes (the base is not read: what `plan_buckets` needs; `materialize()`
    gives the tensors); indexing a weight quantizes the base's tensor
    (which for the FSDP trainer is a collective gather) cast to `dtype`, the engine's (so every trainer
quantizes the same values), indexing its scale reuses that quantization.
    Every rank indexes the same names in the same order, so the collectives line up."""

    def __init__(self, base: Mapping[str, Tensor], dtype: torch.dtype):
        self._base, self.dtype = base, dtype      # quantized from the weights cast to the engine's dtype
        self._last: tuple[str, Tensor, Tensor] | None = None

    def _names(self) -> Iterator[tuple[str, str | None]]:
        for name in self._base:
            yield name, None
            if is_quantized_name(name):
                yield name + SCALE_SUFFIX, name

    def __iter__(self):
        return (n for n, _ in self._names())

    def __len__(self) -> int:
        return sum(1 for _ in self._names())

    def items(self):
        shapes = {}
        for name, t in self._base.items():      # a dict's items(): its values as stored (no gather)
            shapes[name] = (tuple(t.shape), t.dtype)
        for name, of in self._names():
            shape, dtype = shapes[of or name]
            if of is not None:
                yield name, torch.empty((_blocks(shape[0], BLOCK), _blocks(shape[1], BLOCK)), dtype=torch.float32,
                                        device="meta")
            elif is_quantized_name(name):
                yield name, torch.empty(shape, dtype=FP8, device="meta")
            else:
                yield name, torch.empty(shape, dtype=dtype, device="meta")

    def materialize(self) -> dict[str, Tensor]:
        """{name: tensor} of every entry (quantizing each Linear weight once), in order."""
        return {name: self[name] for name in self}

    def take_part(self, names: list[str]) -> None:
        """Index `names` and keep nothing: a rank's share of the gathers behind a bucket another rank fills."""
        for name in names:
            _ = self[name]

    def _quantized(self, name: str) -> tuple[Tensor, Tensor]:
        if self._last is None or self._last[0] != name:
            q, s = quantize_blocks(self._base[name].detach(), round_to=self.dtype)
            self._last = (name, q, s)
        return self._last[1], self._last[2]

    def write_into(self, name: str, out: Tensor) -> None:
        """Write entry `name` into `out` (a bucket's view of its shape and dtype): a Linear weight is
        quantized straight into it (from the base's tensor, rounded to `dtype` in the same pass: no
        bf16 copy, no e4m3 copy), its scale copied from that quantization; the rest copied (cast)."""
        if is_quantized_name(name):
            w = self._base[name].detach()
            q, s = quantize_blocks(w, round_to=self.dtype, out=out if out.device == w.device else None)
            self._last = (name, q, s)
            if q is not out:            # a bucket on another device (host bytes for the object store)
                out.copy_(q)
        else:
            out.copy_(self[name].detach())

    def write_bucket(self, metas, flat: Tensor, view, state: dict) -> None:
        """Write a whole bucket: `metas` (`miles.weights.transport.TensorMeta`: name, offset, ...) into the
        uint8 buffer `flat`, `view(meta)` giving an entry's view of it. On CUDA, the base a plain dict of
        live tensors (the trainer's own weights, not a gathering or computed mapping), its Linear weights
        are quantized by one kernel launch for the bucket (`quantize_group`, values and scales written in
        place) instead of a launch and a scale copy per weight; the rest entry by entry (`write_into`).
        `state` is the caller's, kept across fills: each bucket's table (made again only when a weight
        moved) and the scales of a bucket's last weight when they fall in the next bucket (carried)."""
        group = [m for m in metas if is_quantized_name(m.name)]
        weights = [self._base[m.name] for m in group] if type(self._base) is dict else []
        passed = state.setdefault("carried", {})       # scales the last bucket's kernel carried into this one
        written = self._write_group(group, weights, metas, flat, state) \
            if weights and self._groupable(weights, flat) else set()
        for meta in metas:
            if meta.name not in written:
                prior = passed.pop(meta.name, None)
                if prior is not None:
                    view(meta).copy_(prior)
                else:
                    self.write_into(meta.name, view(meta))

    def _write_group(self, group, weights: list[Tensor], metas, flat: Tensor, state: dict) -> set[str]:
        """`write_bucket`'s one launch: the Linear weights `group` (their `weights`) and the scales of theirs
        that are in this bucket; the others' scales into this bucket's carry buffer, passed on in `state`.
        The names it wrote."""
        here = {m.name: m for m in metas}
        scales, carried, size = [], {}, 0
        for m, w in zip(group, weights):
            inside = here.get(m.name + SCALE_SUFFIX)
            if inside is not None:
                scales.append((inside.offset // 4, False))
            else:           # its scale is the next bucket's first entry
                shape = (_blocks(w.shape[0], BLOCK), _blocks(w.shape[1], BLOCK))
                scales.append((size, True))
                carried[m.name + SCALE_SUFFIX] = (size, shape)
                size += shape[0] * shape[1]
        mine = state.setdefault(("bucket", metas[0].name), {})
        if mine.get("carry") is None or mine["carry"].numel() < max(size, 1):
            mine["carry"] = torch.empty(max(size, 1), dtype=torch.float32, device=flat.device)
        dsts = [m.offset for m in group]
        table = mine.get("table")
        if table is None or table.key != group_key(weights, dsts, scales):
            table = mine["table"] = group_table(weights, dsts, scales, flat.device)
        quantize_group(table, weights[0], flat, mine["carry"], self.dtype)
        for name, (at, shape) in carried.items():
            state["carried"][name] = mine["carry"][at:at + shape[0] * shape[1]].view(shape)
        return ({m.name for m in group} | {m.name + SCALE_SUFFIX for m in group}) - set(carried)

    @staticmethod
    def _groupable(weights: list[Tensor], flat: Tensor) -> bool:
        w0 = weights[0]
        return flat.is_cuda and _triton() and w0.dtype in (torch.float32, torch.bfloat16, torch.float16) and all(
            w.device == flat.device and w.dtype == w0.dtype and w.dim() == 2 and w.stride(1) == 1 for w in weights)

    def __getitem__(self, name: str) -> Tensor:
        if name.endswith(SCALE_SUFFIX) and is_quantized_name(name[:-len(SCALE_SUFFIX)]):
            return self._quantized(name[:-len(SCALE_SUFFIX)])[1]
        if is_quantized_name(name):
            return self._quantized(name)[0]
        return self._base[name]


# --- FP8 checkpoints ---------------------------------------------------------------------------------

def quantization_config(block: int = BLOCK) -> dict:
    """The `quantization_config` of an FP8 block-quantized HF checkpoint (Qwen3-FP8's)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": [block, block]}


def checkpoint_block(config) -> int | None:
    """The block size of an FP8 block-quantized checkpoint's config (HF config object or dict), else None.
    Raises ValueError for an FP8 config this build does not read (not 128 x 128 blocks)."""
    q = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if not q:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("quant_method") != "fp8":
        raise ValueError(f"quantization_config quant_method {q.get('quant_method')!r}: only FP8 block-quantized "
                         "checkpoints (quant_method fp8, weight_block_size [128, 128]) are read here")
    size = q.get("weight_block_size")
    if size != [BLOCK, BLOCK]:
        raise ValueError(f"quantization_config weight_block_size {size}: only [{BLOCK}, {BLOCK}] blocks are read here "
                         "(per-tensor FP8 checkpoints are not)")
    return BLOCK


def is_fp8_checkpoint(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    return cfg.is_file() and checkpoint_block(json.loads(cfg.read_text())) is not None


def read_checkpoint_tensors(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of an HF folder's safetensors files, as stored (e4m3 weights with their scales)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no .safetensors files")
    out: dict[str, Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def write_fp8_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """An FP8 block-quantized copy of the HF folder `src` at `dst`: its decoder Linear weights as e4m3
    with `weight_scale_inv`, the rest in the source dtype, and config.json's `quantization_config`
    (tokenizer and other files copied). Written into a temp folder and renamed: never half-written."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} exists; write the FP8 checkpoint to a new folder")
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".", dir=dst.parent))
    try:
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy2(f, tmp / f.name)
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"] = quantization_config()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = quantize_state_dict(read_checkpoint_tensors(src))
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


# --- the fast engine's fused FP8 weights ---------------------------------------------------------------

def fuse(parts: Mapping[str, tuple[Tensor, Tensor]], named: dict[str, Tensor], device) -> QuantWeight:
    """One QuantWeight of the row-wise concatenation of `parts` ({HF weight name: (e4m3, scale_inv)}),
    each part's weight and scales registered in `named` as views (so updates copy into them in place).
    Every part but the last must have a multiple of BLOCK rows (its scale rows then concatenate)."""
    names = list(parts)
    for n in names[:-1]:
        if parts[n][0].shape[0] % BLOCK:
            raise ValueError(f"FP8 weights: {n} has {parts[n][0].shape[0]} rows, not a multiple of {BLOCK}; "
                             f"the fused projection's block scales cannot be shared (use --rollout-quantization "
                             f"none for this model)")
    weight = torch.cat([parts[n][0].to(device) for n in names]).contiguous()
    scale = torch.cat([parts[n][1].to(device, torch.float32) for n in names]).contiguous()
    row = srow = 0
    for n in names:
        q, s = parts[n]
        named[n] = weight[row:row + q.shape[0]]
        named[n + SCALE_SUFFIX] = scale[srow:srow + s.shape[0]]
        row, srow = row + q.shape[0], srow + s.shape[0]
    return QuantWeight(weight, scale)


def fp8_layer(layer: tuple, prefix: str, src: Mapping[str, Tensor], source: Mapping[str, Tensor] | None,
              named: dict[str, Tensor], device) -> tuple:
    """A fast-engine layer tuple (`miles.rollout.engines.fast.model.LayerWeights`) with its q/k/v, o,
    gate/up and down weights as QuantWeights: quantized from `src` (the model's weights, HF names), or
    taken from `source` (an FP8 checkpoint's e4m3 weights and scales) when given."""
    ln1, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, ln2, gate_up_w, down_w = layer
    attn, mlp = prefix + "self_attn.", prefix + "mlp."

    def part(name: str) -> tuple[Tensor, Tensor]:
        if source is not None:
            return source[name], source[name + SCALE_SUFFIX]
        return quantize_blocks(src[name].to(device))

    def fused(names: list[str]) -> QuantWeight:
        return fuse({n: part(n) for n in names}, named, device)

    return (ln1, fused([attn + f"{p}_proj.weight" for p in "qkv"]), qkv_b, q_norm, k_norm,
            fused([attn + "o_proj.weight"]), o_b, ln2, fused([mlp + "gate_proj.weight", mlp + "up_proj.weight"]),
            fused([mlp + "down_proj.weight"]))


def keeps_dtype(name: str, t: Tensor) -> bool:
    """Tensors of an FP8 weight dict that keep their dtype when the rest is cast to the engine's: the e4m3
    weights and their float32 scales."""
    return t.dtype == FP8 or name.endswith(SCALE_SUFFIX)


def as_quantized(weights: Mapping[str, Tensor], dtype: torch.dtype) -> Mapping[str, Tensor]:
    """What an FP8 engine loads: `weights` as they are when they carry scales (a quantized sync or
    checkpoint), else quantized here from the weights cast to the engine's `dtype` (a trainer that sent
    plain weights: the same values a quantizing trainer would send)."""
    if any(n.endswith(SCALE_SUFFIX) for n in weights):
        return weights
    return quantize_state_dict({n: t.detach().to(dtype) if t.is_floating_point() else t for n, t in weights.items()})


def quantized_part(weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The e4m3 Linear weights of an FP8 weight dict and their scales (the rest left out)."""
    return {n: t for n, t in weights.items()
            if is_quantized_name(n) or (n.endswith(SCALE_SUFFIX) and is_quantized_name(n[:-len(SCALE_SUFFIX)]))}


def engine_quantization(quantization: str | None, hf_checkpoint: str | Path) -> str | None:
    """--rollout-quantization resolved: "fp8" or None; unset (None) follows the checkpoint (FP8 stays FP8)."""
    if quantization is None:
        return "fp8" if is_fp8_checkpoint(hf_checkpoint) else None
    return None if quantization == "none" else quantization
