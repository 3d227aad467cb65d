"""The fast engine's own forward pass for Llama-, Qwen2- and Qwen3-family causal LMs, over its KV cache (per slot
or paged).

Weights come from the HF model (loaded with transformers) and are repacked once: q/k/v fused into
one matrix per layer (one GEMM instead of three), gate/up fused likewise. The HF names stay
addressable as *views* into the fused tensors (`PackedWeights.named`), so weight updates copy in
place under HF names (a captured CUDA graph keeps reading the same memory) and checksums are those
of the HF-named dict, byte for byte.

Two entry points (`Forward`), built from pure functions of tensors so the engine may
`torch.compile` them and capture them in CUDA graphs, and CI runs them eagerly on CPU:
- `prefill`: right-padded prompts [n, P], causal attention over the prompt itself, K/V
  written into the prompt's cache slot at positions 0..P-1; or pieces of long prompts (chunked
  prefill): a piece's K/V written at its positions start..start+P-1, its queries attending to
  the slot's cache up to themselves (the earlier pieces' K/V and the piece's own, causally).
- `decode`: one token per slot for the first B slots, K/V written at each slot's position,
  attention over the slot's first L cache positions with a length mask (L is a bucket >= every
  busy slot's length, so one captured graph serves many steps).

The numerics follow transformers' Llama/Qwen2/Qwen3 modules (RMSNorm in float32 then cast, RoPE
cos/sin in float32 then cast, residual adds in the model dtype), so an fp32 forward agrees with HF's
to float rounding. The families differ only in optional pieces, each present or absent per model:
q/k/v and o biases (Qwen2, Llama with attention_bias), per-head RMSNorm of q and k before RoPE
(Qwen3's q_norm/k_norm), an untied lm_head, and RoPE scaling (Llama 3's `llama3`). Qwen3-MoE is Qwen3
with experts in its sparse layers: their router and experts are `miles.rollout.engines.fast.moe`'s.
"""

from __future__ import annotations

import re
import types
from functools import lru_cache
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from miles.rollout.engines.fast.attention import decode_attention, gather_pages, sdpa_decode_attention
from miles.rollout.engines.fast.moe import (MoeArch, MoeLayerWeights, check_layout, experts_loop, pack_moe_layer,
                                            route, supports_moe)
from miles.weights.fp8 import linear

# RoPE variants whose inverse frequencies do not depend on the sequence length: we take them (and
# the cos/sin scale) from the HF module itself, so each is exactly what transformers computes
STATIC_ROPE_TYPES = ("default", "linear", "llama3")
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def rope_type(config) -> str:
    """The config's RoPE type; transformers 5 keeps it in `rope_parameters`, 4.x in `rope_scaling`."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


def supports(config) -> str | None:
    """None when the fast forward implements this HF config; else the reason it does not."""
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        from miles.training.moe_checks import moe_kind

        other_moe = moe_kind(config.to_dict())
        if other_moe not in ("dense", "built"):     # another MoE family: named, with what it has that is not built
            return other_moe
        return f"model_type {kind!r} is not implemented (fast path: {', '.join(FAMILIES)})"
    moe_reason = supports_moe(config)
    if moe_reason:
        return moe_reason
    if rope_type(config) not in STATIC_ROPE_TYPES:
        return f"RoPE type {rope_type(config)!r} is not implemented (fast path: {', '.join(STATIC_ROPE_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not implemented (fast path: silu)"
    if getattr(config, "use_sliding_window", False) or \
            any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return "sliding-window attention is not implemented"
    if getattr(config, "mlp_bias", False):
        return "MLP biases (mlp_bias=True) are not implemented"
    if config.num_attention_heads % config.num_key_value_heads:
        return (f"num_attention_heads {config.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {config.num_key_value_heads}")
    return None


@dataclass(frozen=True)
class Arch:
    """The shapes and constants of one model, read from its HF config."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    max_positions: int | None

    @classmethod
    def from_config(cls, config) -> Arch:
        return cls(n_layers=config.num_hidden_layers, hidden=config.hidden_size,
                   n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                   intermediate=config.intermediate_size, vocab=config.vocab_size, eps=config.rms_norm_eps,
                   max_positions=getattr(config, "max_position_embeddings", None))

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    def kv_bytes_per_position(self, dtype: torch.dtype) -> int:
        """K and V of one position of one sequence, all layers."""
        return 2 * self.n_layers * self.kv_size * torch.empty((), dtype=dtype).element_size()


# per layer, in this order: ln1, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, ln2, gate_up_w, down_w
# (biases and the per-head q/k norms may be None)
LayerWeights = tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor, Tensor | None, Tensor,
                     Tensor, Tensor]


@dataclass
class PackedWeights:
    embed: Tensor                   # [V, H]
    layers: list[LayerWeights]
    norm: Tensor                    # [H]
    lm_head: Tensor                 # [V, H]; the same tensor as `embed` when tied
    inv_freq: Tensor                # [head_dim / 2] float32
    rope_scale: float               # cos/sin multiplier (1.0 but for scaled RoPE types)
    named: dict[str, Tensor]        # HF name -> live tensor or view (what model_weights gives)
    moe: MoeArch | None = None      # a mixture-of-experts model's expert shapes and routing (None: dense)
    # per decoder layer, its router and experts (None for a dense layer, whose MLP is in `layers`)
    moe_layers: list[MoeLayerWeights | None] | None = None


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def pack_weights(model, arch: Arch, device: torch.device, *, fp8: bool = False,
                 fp8_source: dict[str, Tensor] | None = None) -> PackedWeights:
    """Fused copies of `model`'s weights on `device` (same dtype), plus HF-named views into them.

    `fp8` (--rollout-quantization fp8): the decoder's Linear weights become `QuantWeight`s (e4m3 and
    128 x 128 block scales, `miles.weights.fp8`), quantized from the model's, or taken as they are from
    `fp8_source` (an FP8 checkpoint's tensors); their scales are named `<weight name>_scale_inv`.
    Raises ValueError naming any HF parameter this forward would not use (the model must not
    silently lose weights).
    """
    from miles.weights.hf import model_weights

    src = {n: t.detach() for n, t in model_weights(model).items()}
    named: dict[str, Tensor] = {}

    def take(name: str) -> Tensor:
        t = src[name].to(device).contiguous()
        named[name] = t
        return t

    layers = [_pack_layer(src, named, f"model.layers.{i}.", arch, device) for i in range(arch.n_layers)]
    if fp8:
        from miles.weights.fp8 import fp8_layer
        if MoeArch.from_config(model.config) is not None:
            raise ValueError("FP8 weights for a mixture-of-experts model: its experts in FP8 are not built yet "
                             "(docs/fp8.md); serve it in --dtype")
        layers = [fp8_layer(layer, f"model.layers.{i}.", src, fp8_source, named, device)
                  for i, layer in enumerate(layers)]
    moe = MoeArch.from_config(model.config)
    if moe is not None:
        check_layout(model, moe)
    moe_layers = None if moe is None else [
        pack_moe_layer(src, named, f"model.layers.{i}.", moe, arch.hidden, device) if i in moe.layers else None
        for i in range(arch.n_layers)]
    embed = take("model.embed_tokens.weight")
    lm_head = take("lm_head.weight") if "lm_head.weight" in src else embed
    norm = take("model.norm.weight")
    unused = sorted(set(src) - set(named))
    if unused:
        raise ValueError(f"the fast forward does not implement these weights: {', '.join(unused[:5])}; "
                         f"use the EmbeddedEngine for this model")
    rotary = model.model.rotary_emb
    return PackedWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head,
                         inv_freq=rotary.inv_freq.detach().to(device, torch.float32),
                         rope_scale=float(rotary.attention_scaling), named=named, moe=moe, moe_layers=moe_layers)


def _fuse(src: dict[str, Tensor], named: dict[str, Tensor], names: list[str], device) -> Tensor | None:
    """cat(src[names]) on `device`, registering each part as a view under its HF name."""
    if not any(n in src for n in names):
        return None
    fused = torch.cat([src[n].to(device) for n in names])
    offset = 0
    for n in names:
        rows = src[n].shape[0]
        named[n] = fused[offset:offset + rows]  # a row range of a contiguous tensor: contiguous
        offset += rows
    return fused


def _pack_layer(src, named, prefix: str, arch: Arch, device) -> LayerWeights:
    attn, mlp = prefix + "self_attn.", prefix + "mlp."

    def one(name: str) -> Tensor | None:
        if name not in src:
            return None
        named[name] = src[name].to(device).contiguous()
        return named[name]

    qkv_w = _fuse(src, named, [attn + f"{p}_proj.weight" for p in "qkv"], device)
    qkv_b = _fuse(src, named, [attn + f"{p}_proj.bias" for p in "qkv"], device)
    gate_up = _fuse(src, named, [mlp + "gate_proj.weight", mlp + "up_proj.weight"], device)
    return (one(prefix + "input_layernorm.weight"), qkv_w, qkv_b, one(attn + "q_norm.weight"),
            one(attn + "k_norm.weight"), one(attn + "o_proj.weight"), one(attn + "o_proj.bias"),
            one(prefix + "post_attention_layernorm.weight"), gate_up, one(mlp + "down_proj.weight"))


# --- the forward ---------------------------------------------------------------------------------
# Each layer is three pieces: `*_qkv` (norm, QKV projection, RoPE, K/V into the cache), the
# attention (one stock SDPA call, left out of compilation on purpose: it is one kernel already),
# and `out_mlp` (output projection, residual, norm, MLP, residual). The engine compiles the two
# pieces on CUDA (fusing their elementwise work) and runs them eagerly on CPU.

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_cos_sin(pos: Tensor, inv_freq: Tensor, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [..., head_dim] for integer positions `pos` [...]."""
    freqs = pos.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def additive_mask(valid: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where attended, -inf elsewhere: built once per step, not once per layer."""
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))


def head_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """Qwen3's RMSNorm over each head's head_dim (q_norm / k_norm); identity where the model has none."""
    return x if weight is None else rms_norm(x, weight, eps)


def cache_index(kc: Tensor, rows: Tensor, pos: Tensor, table: Tensor | None) -> tuple[Tensor, Tensor]:
    """Where K/V of cache rows `rows` at positions `pos` go: (slot, position), or through a paged cache's
    `table` (page, offset in it)."""
    if table is None:
        return rows, pos
    page = kc.shape[2]
    return table[rows, pos // page], pos % page


def decode_qkv(x: Tensor, ln1: Tensor, qkv_w: Tensor, qkv_b: Tensor | None, q_norm: Tensor | None,
               k_norm: Tensor | None, kc: Tensor, vc: Tensor, cos: Tensor, sin: Tensor, pos: Tensor,
               arch: Arch, table: Tensor | None = None) -> Tensor:
    """x [B, H] -> q [B, kv_heads, group, head_dim]; K/V of slot b written at cache position pos[b] (a paged
    cache: at offset pos[b] % page of page table[b, pos[b] // page])."""
    b = x.shape[0]
    q, k, v = linear(rms_norm(x, ln1, arch.eps), qkv_w, qkv_b).split(
        [arch.q_size, arch.kv_size, arch.kv_size], dim=-1)
    q = head_norm(q.view(b, arch.n_heads, arch.head_dim), q_norm, arch.eps)
    k = head_norm(k.view(b, arch.n_kv_heads, arch.head_dim), k_norm, arch.eps)
    q = apply_rope(q, cos[:, None], sin[:, None])
    k = apply_rope(k, cos[:, None], sin[:, None])
    rows, pos = cache_index(kc, torch.arange(b, device=x.device), pos, table)
    kc[rows, :, pos] = k.to(kc.dtype)     # an FP8 cache (--kv-cache-dtype fp8_e4m3) stores e4m3, scale 1
    vc[rows, :, pos] = v.view(b, arch.n_kv_heads, arch.head_dim).to(vc.dtype)
    # the query heads that share a KV head become that head's "query positions": plain multi-head
    # attention with no K/V repeat, reading the cache once
    return q.view(b, arch.n_kv_heads, arch.group, arch.head_dim)


def prefill_qkv(x: Tensor, ln1: Tensor, qkv_w: Tensor, qkv_b: Tensor | None, q_norm: Tensor | None,
                k_norm: Tensor | None, kc: Tensor, vc: Tensor, slots: Tensor, pos: Tensor, cos: Tensor, sin: Tensor,
                arch: Arch, table: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """x [n, P, H] at cache positions pos [n, P] -> q [n, heads, P, head_dim] and k, v repeated to
    every query head; K/V of row i written at positions pos[i] of cache slot slots[i] (a paged cache:
    through its page table's row slots[i]). cos, sin [n, P, head_dim] are pos's RoPE."""
    n, p = x.shape[:2]
    q, k, v = linear(rms_norm(x, ln1, arch.eps), qkv_w, qkv_b).split(
        [arch.q_size, arch.kv_size, arch.kv_size], dim=-1)
    q = head_norm(q.view(n, p, arch.n_heads, arch.head_dim), q_norm, arch.eps)
    k = head_norm(k.view(n, p, arch.n_kv_heads, arch.head_dim), k_norm, arch.eps)
    q = apply_rope(q.transpose(1, 2), cos[:, None], sin[:, None])
    k = apply_rope(k.transpose(1, 2), cos[:, None], sin[:, None])
    v = v.view(n, p, arch.n_kv_heads, arch.head_dim).transpose(1, 2)
    # advanced indices on dims 0 and 2 put their [n, P] dims first: [n, P, kv_heads, head_dim]
    rows, pos = cache_index(kc, slots[:, None], pos, table)
    kc[rows, :, pos] = k.transpose(1, 2).to(kc.dtype)
    vc[rows, :, pos] = v.transpose(1, 2).to(vc.dtype)
    return q, k.repeat_interleave(arch.group, dim=1), v.repeat_interleave(arch.group, dim=1)


def out_mlp(x: Tensor, o: Tensor, o_w: Tensor, o_b: Tensor | None, ln2: Tensor, gate_up_w: Tensor,
            down_w: Tensor, arch: Arch) -> Tensor:
    """x [T, H] (residual stream), o [T, heads * head_dim] (attention output) -> x after the layer."""
    x = x + linear(o, o_w, o_b)
    gate, up = linear(rms_norm(x, ln2, arch.eps), gate_up_w).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, down_w)


def out_moe_route(x: Tensor, o: Tensor, o_w: Tensor, o_b: Tensor | None, ln2: Tensor, router: Tensor,
                  arch: Arch, moe: MoeArch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A sparse layer's `out_mlp` up to its experts: x [T, H], o [T, heads * head_dim] -> (x after the
    attention's residual, its normed h [T, H], the routing weights [T, k] and experts [T, k])."""
    x = x + F.linear(o, o_w, o_b)
    h = rms_norm(x, ln2, arch.eps)
    weights, ids = route(h, router, moe)
    return x, h, weights, ids


def final_logits(x: Tensor, w: PackedWeights, arch: Arch, out: Tensor | None = None) -> Tensor:
    """Logits [n, V] in the model dtype (as HF computes them) of hidden states x [n, H]."""
    h = rms_norm(x, w.norm, arch.eps)
    return torch.mm(h, w.lm_head.t(), out=out)


def _dynamic(*dims: tuple[Tensor, int]) -> None:
    """Mark batch/length dimensions, and the cache's slot and position counts, dynamic: one compiled
    kernel serves every bucket, and every engine of one model and dtype."""
    for t, d in dims:
        torch._dynamo.maybe_mark_dynamic(t, d)


def _cache_dims(kc: Tensor, vc: Tensor, table: Tensor | None = None) -> tuple[tuple[Tensor, int], ...]:
    """A layer's K/V cache [slots, kv_heads, max_len, head_dim]: slots and max_len vary by engine (paged:
    [pages, kv_heads, page, head_dim], the pages and the table's rows and width vary)."""
    if table is not None:
        return (kc, 0), (vc, 0), (table, 0), (table, 1)
    return (kc, 0), (kc, 2), (vc, 0), (vc, 2)


COMPILE_BACKEND = "inductor"   # a unit test swaps in "eager": dynamo's guards and recompiles are the same


def compile_for(fn, arch: Arch, dtype: torch.dtype, variant: str = ""):
    """`torch.compile(fn, fullgraph=True)`, one per (fn, arch, dtype, variant) in a process: see
    `_compile_isolated` (`variant`: FP8 weights or KV cache, whose inputs differ in structure or dtype)."""
    return _compile_isolated(fn, arch, dtype, COMPILE_BACKEND, variant)


@lru_cache(maxsize=None)
def _compile_isolated(fn, arch: Arch, dtype: torch.dtype, backend: str, variant: str = ""):
    # Dynamo keeps its compiled variants of a function, and counts them against recompile_limit
    # (8), per *code object*. Shared by every engine of a process, a piece gathers a variant per
    # model and dtype (qwen2 then llama, fp32 and bf16: each changes the guards) until the limit
    # hits, which fullgraph=True turns into an error and the engine into eager. So each (model
    # shape, dtype) compiles its own copy of the code, named for it (dynamo's automatic-dynamic
    # memory is keyed by name): its variants and limit are its own, and the engines that share it
    # differ only in dims marked dynamic. torch >= 2.12 offers this as torch.compile(...,
    # isolate_recompiles=True); the copy works on every version we support.
    tag = (f"{str(dtype).removeprefix('torch.')}_{arch.n_layers}x{arch.hidden}_{arch.n_heads}q"
           f"{arch.n_kv_heads}kv{arch.head_dim}_{arch.vocab}{variant}")
    name = f"{fn.__name__}__{tag}"
    copy = types.FunctionType(fn.__code__.replace(co_name=name, co_qualname=name), fn.__globals__, name,
                              fn.__defaults__, fn.__closure__)
    return torch.compile(copy, fullgraph=True, backend=backend)


class Forward:
    """Embedding -> layers -> logits over a KV cache, with the layer pieces eager or compiled, and
    decode attention by the stock call over a span bucket or by the length-aware kernel."""

    def __init__(self, arch: Arch, weights: PackedWeights, *, compiled: bool, length_aware: bool = False,
                 variant: str = ""):
        self.arch, self.weights, self.length_aware, self.variant = arch, weights, length_aware, variant
        # a mixture-of-experts model (miles.rollout.engines.fast.moe): its experts' implementation (the
        # engine picks the grouped one where it runs), the static [slots, MoE layers, k] buffer each decode
        # step writes its experts into (graph-captured: the engine reads it after the step), and the last
        # prefill's experts of each row's last position [n, MoE layers, k]
        self.experts = experts_loop
        self.decode_routed: Tensor | None = None
        self.prefill_routed: Tensor | None = None
        self.use_compiled(compiled)

    def use_compiled(self, compiled: bool) -> None:
        pieces = (decode_qkv, prefill_qkv, out_mlp, out_moe_route)
        if compiled:
            pieces = tuple(compile_for(f, self.arch, self.weights.embed.dtype, self.variant) for f in pieces)
        (self._decode_qkv, self._prefill_qkv, self._out_mlp, self._out_moe_route), self.compiled = pieces, compiled

    def _mlp(self, i: int, x: Tensor, o: Tensor, o_w: Tensor, o_b: Tensor | None, ln2: Tensor,
             gate_up_w: Tensor | None, down_w: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Layer i's output projection, residual and MLP (dense, or its experts): -> (x after the layer,
        the experts each token was routed to [T, k], None for a dense layer)."""
        sparse = None if self.weights.moe_layers is None else self.weights.moe_layers[i]
        if sparse is None:
            return self._out_mlp(x, o, o_w, o_b, ln2, gate_up_w, down_w, self.arch), None
        x, h, weights, ids = self._out_moe_route(x, o, o_w, o_b, ln2, sparse.router, self.arch, self.weights.moe)
        return x + self.experts(h, ids, weights, sparse), ids

    def decode(self, tokens: Tensor, pos: Tensor, span: int, layers: list[tuple[Tensor, Tensor]],
               out: Tensor, table: Tensor | None = None) -> None:
        """Feed tokens [B] at positions pos [B] of cache slots 0..B-1, attending over the first
        `span` positions; logits [B, V] into `out`. `table` [B, pages per sequence]: a paged cache's
        rows for the B slots."""
        a, w = self.arch, self.weights
        b = tokens.shape[0]
        x = F.embedding(tokens, w.embed)
        cos, sin = rope_cos_sin(pos, w.inv_freq, w.rope_scale, x.dtype)
        if not self.length_aware:
            mask = additive_mask(torch.arange(span, device=pos.device) <= pos[:, None], x.dtype)[:, None, None, :]
        moe_layer = 0
        for i, ((ln1, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, ln2, gate_up_w, down_w), (kc, vc)) in enumerate(
                zip(w.layers, layers)):
            if self.compiled:
                _dynamic((x, 0), (cos, 0), (sin, 0), (pos, 0), *_cache_dims(kc, vc, table))
            q = self._decode_qkv(x, ln1, qkv_w, qkv_b, q_norm, k_norm, kc, vc, cos, sin, pos, a, table)
            if self.length_aware:
                o = decode_attention(q, kc, vc, pos, a.scale, table)
            else:
                o = sdpa_decode_attention(q, kc, vc, pos, a.scale, span, mask, table)
            o = o.reshape(b, a.q_size)
            if self.compiled:
                _dynamic((x, 0), (o, 0))
            x, ids = self._mlp(i, x, o, o_w, o_b, ln2, gate_up_w, down_w)
            if ids is not None:
                if self.decode_routed is not None:
                    self.decode_routed[:b, moe_layer] = ids
                moe_layer += 1
        final_logits(x, w, a, out=out)

    def prefill(self, ids: Tensor, lens: Tensor, slots: Tensor, layers: list[tuple[Tensor, Tensor]],
                starts: Tensor | None = None, span: int = 0, table: Tensor | None = None) -> Tensor:
        """Right-padded prompts ids [n, P] of lengths lens [n] into cache `slots` [n]; -> logits [n, V]
        of each row's last token.

        `starts` [1] (one piece of a longer prompt, chunked prefill; n must be 1): its tokens go to
        positions starts[0]..starts[0]+P-1 of its slot, with span = starts[0] + P, and its queries
        attend to the K/V already in the slot before them (earlier pieces) and causally to the piece
        itself, read from the cache. The mask is implicit (bottom-right aligned causal: no [P, span]
        tensor). Right padding in a piece (P > lens[0]) is attended only by the padding's own
        queries. None: whole prompts from position 0, whose attention reads the fresh K/V alone.
        `table`: a paged cache's page table (all slots' rows)."""
        a, w = self.arch, self.weights
        n, p = ids.shape
        if starts is not None and (n != 1 or span < p):
            raise ValueError(f"a prefill piece is one row with span >= its width; got {n} rows, width {p}, span {span}")
        x = F.embedding(ids, w.embed)
        offsets = torch.arange(p, device=ids.device)
        pos = offsets.repeat(n, 1) if starts is None else starts[:, None] + offsets   # [n, P], contiguous
        cos, sin = rope_cos_sin(pos, w.inv_freq, w.rope_scale, x.dtype)
        if starts is None:
            valid = (offsets[None, :] <= offsets[:, None])[None] & (offsets < lens[:, None])[:, None, :]
            mask = additive_mask(valid, x.dtype)[:, None]   # [n, 1, P, P]: causal, not padding
        else:
            mask = causal_lower_right(p, span)
        last = lens - 1
        rows = torch.arange(n, device=ids.device)
        routed = []
        for i, ((ln1, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, ln2, gate_up_w, down_w), (kc, vc)) in enumerate(
                zip(w.layers, layers)):
            if self.compiled:
                _dynamic((x, 0), (x, 1), (slots, 0), (pos, 0), (pos, 1), (cos, 0), (cos, 1), (sin, 0), (sin, 1),
                         *_cache_dims(kc, vc, table))
            q, k, v = self._prefill_qkv(x, ln1, qkv_w, qkv_b, q_norm, k_norm, kc, vc, slots, pos, cos, sin, a, table)
            if starts is not None:   # this piece's K/V is in the cache now, after the earlier pieces'
                k, v = ((c[slots, :, :span] if table is None else gather_pages(c, table[slots], span))
                        .to(x.dtype).repeat_interleave(a.group, dim=1) for c in (kc, vc))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a.scale)
            o = o.transpose(1, 2).reshape(n * p, a.q_size)
            flat = x.view(n * p, a.hidden)
            if self.compiled:
                _dynamic((flat, 0), (o, 0))
            flat, experts = self._mlp(i, flat, o, o_w, o_b, ln2, gate_up_w, down_w)
            x = flat.view(n, p, a.hidden)
            if experts is not None:     # the experts of each row's last position: the one its logits come from
                routed.append(experts.view(n, p, -1)[rows, last])
        self.prefill_routed = torch.stack(routed, dim=1) if routed else None
        return final_logits(x[rows, last], w, a)
