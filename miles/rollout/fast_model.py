"""The fast engine's own forward pass for Llama- and Qwen2-family causal LMs, over a per-slot KV cache.

Weights come from the HF model (loaded with transformers) and are repacked once: q/k/v fused into
one matrix per layer (one GEMM instead of three), gate/up fused likewise. The HF names stay
addressable as *views* into the fused tensors (`PackedWeights.named`), so weight updates copy in
place under HF names (a captured CUDA graph keeps reading the same memory) and checksums are those
of the HF-named dict, byte for byte.

Two entry points, both pure functions of tensors so the engine may `torch.compile` them and
capture them in CUDA graphs, and CI runs them eagerly on CPU:
- `prefill_layer`: right-padded prompts [n, P], causal attention over the prompt itself, K/V
  written into the prompt's cache slot at positions 0..P-1.
- `decode_layer`: one token per slot for the first B slots, K/V written at each slot's position,
  attention over the slot's first L cache positions with a length mask (L is a bucket >= every
  active slot's length, so one captured graph serves many steps).

The numerics follow transformers' Llama/Qwen2 modules (RMSNorm in float32 then cast, RoPE cos/sin
in float32 then cast, residual adds in the model dtype), so an fp32 forward agrees with HF's to
float rounding.
"""

from __future__ import annotations

import re
from functools import partial
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# RoPE variants whose inverse frequencies do not depend on the sequence length: we take them (and
# the cos/sin scale) from the HF module itself, so each is exactly what transformers computes
STATIC_ROPE_TYPES = ("default", "linear", "llama3")
FAMILIES = ("llama", "qwen2")


def rope_type(config) -> str:
    """The config's RoPE type; transformers 5 keeps it in `rope_parameters`, 4.x in `rope_scaling`."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


def supports(config) -> str | None:
    """None when the fast forward implements this HF config; else the reason it does not."""
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"model_type {kind!r} is not implemented (fast path: {', '.join(FAMILIES)})"
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


# per layer, in this order: ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, down_w (biases may be None)
LayerWeights = tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor | None, Tensor, Tensor, Tensor]


@dataclass
class PackedWeights:
    embed: Tensor                   # [V, H]
    layers: list[LayerWeights]
    norm: Tensor                    # [H]
    lm_head: Tensor                 # [V, H]; the same tensor as `embed` when tied
    inv_freq: Tensor                # [head_dim / 2] float32
    rope_scale: float               # cos/sin multiplier (1.0 but for scaled RoPE types)
    named: dict[str, Tensor]        # HF name -> live tensor or view (what model_weights gives)


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def pack_weights(model, arch: Arch, device: torch.device) -> PackedWeights:
    """Fused copies of `model`'s weights on `device` (same dtype), plus HF-named views into them.

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
                         rope_scale=float(rotary.attention_scaling), named=named)


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
    return (one(prefix + "input_layernorm.weight"), qkv_w, qkv_b, one(attn + "o_proj.weight"),
            one(attn + "o_proj.bias"), one(prefix + "post_attention_layernorm.weight"), gate_up,
            one(mlp + "down_proj.weight"))


# --- the forward ---------------------------------------------------------------------------------

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


def mlp(h: Tensor, gate_up_w: Tensor, down_w: Tensor) -> Tensor:
    gate, up = F.linear(h, gate_up_w).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_w)


def decode_layer(x: Tensor, w: LayerWeights, kc: Tensor, vc: Tensor, cos: Tensor, sin: Tensor,
                 pos: Tensor, mask: Tensor, arch: Arch) -> Tensor:
    """One layer for one new token in each of the first B cache slots.

    x [B, H]; kc, vc [slots, kv_heads, max_len, head_dim] (written at [b, :, pos[b]]);
    cos, sin [B, head_dim]; pos [B]; mask [B, 1, 1, L] (True where a key position is attended).
    """
    ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, down_w = w
    b, span = x.shape[0], mask.shape[-1]
    q, k, v = F.linear(rms_norm(x, ln1, arch.eps), qkv_w, qkv_b).split(
        [arch.q_size, arch.kv_size, arch.kv_size], dim=-1)
    q = apply_rope(q.view(b, arch.n_heads, arch.head_dim), cos[:, None], sin[:, None])
    k = apply_rope(k.view(b, arch.n_kv_heads, arch.head_dim), cos[:, None], sin[:, None])
    rows = torch.arange(b, device=x.device)
    kc[rows, :, pos] = k
    vc[rows, :, pos] = v.view(b, arch.n_kv_heads, arch.head_dim)
    # the query heads that share a KV head become that head's "query positions": plain
    # multi-head attention with no KV repeat, reading the cache once
    o = F.scaled_dot_product_attention(q.view(b, arch.n_kv_heads, arch.group, arch.head_dim),
                                       kc[:b, :, :span], vc[:b, :, :span], attn_mask=mask, scale=arch.scale)
    x = x + F.linear(o.reshape(b, arch.q_size), o_w, o_b)
    return x + mlp(rms_norm(x, ln2, arch.eps), gate_up_w, down_w)


def prefill_layer(x: Tensor, w: LayerWeights, kc: Tensor, vc: Tensor, slots: Tensor, cos: Tensor,
                  sin: Tensor, mask: Tensor, arch: Arch) -> Tensor:
    """One layer over right-padded prompts that start at position 0.

    x [n, P, H]; slots [n] (cache slot of each prompt; K/V written at positions 0..P-1);
    cos, sin [P, head_dim]; mask [n, 1, P, P] (causal and not padding).
    """
    ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, down_w = w
    n, p = x.shape[:2]
    q, k, v = F.linear(rms_norm(x, ln1, arch.eps), qkv_w, qkv_b).split(
        [arch.q_size, arch.kv_size, arch.kv_size], dim=-1)
    q = apply_rope(q.view(n, p, arch.n_heads, arch.head_dim).transpose(1, 2), cos, sin)
    k = apply_rope(k.view(n, p, arch.n_kv_heads, arch.head_dim).transpose(1, 2), cos, sin)
    v = v.view(n, p, arch.n_kv_heads, arch.head_dim).transpose(1, 2)
    kc[slots, :, :p] = k
    vc[slots, :, :p] = v
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(arch.group, dim=1),
                                       v.repeat_interleave(arch.group, dim=1), attn_mask=mask, scale=arch.scale)
    x = x + F.linear(o.transpose(1, 2).reshape(n, p, arch.q_size), o_w, o_b)
    return x + mlp(rms_norm(x, ln2, arch.eps), gate_up_w, down_w)


def final_logits(x: Tensor, w: PackedWeights, arch: Arch, out: Tensor | None = None) -> Tensor:
    """Logits [n, V] in the model dtype (as HF computes them) of hidden states x [n, H]."""
    h = rms_norm(x, w.norm, arch.eps)
    return torch.mm(h, w.lm_head.t(), out=out)


def _dynamic(*dims: tuple[Tensor, int]) -> None:
    """Mark batch/length dimensions dynamic so one compiled kernel serves every bucket."""
    for t, d in dims:
        torch._dynamo.maybe_mark_dynamic(t, d)


class Forward:
    """Embedding -> layers -> logits over a KV cache, with the layer functions eager or compiled."""

    def __init__(self, arch: Arch, weights: PackedWeights, *, compiled: bool):
        self.arch, self.weights = arch, weights
        self.use_compiled(compiled)

    def use_compiled(self, compiled: bool) -> None:
        decode = partial(decode_layer, arch=self.arch)
        prefill = partial(prefill_layer, arch=self.arch)
        if compiled:
            decode, prefill = torch.compile(decode, fullgraph=True), torch.compile(prefill, fullgraph=True)
        self._decode_layer, self._prefill_layer, self.compiled = decode, prefill, compiled

    def decode(self, tokens: Tensor, pos: Tensor, span: int, layers: list[tuple[Tensor, Tensor]],
               out: Tensor) -> None:
        """Feed tokens [B] at positions pos [B] of cache slots 0..B-1; logits [B, V] into `out`."""
        w = self.weights
        x = F.embedding(tokens, w.embed)
        cos, sin = rope_cos_sin(pos, w.inv_freq, w.rope_scale, x.dtype)
        mask = (torch.arange(span, device=pos.device) <= pos[:, None])[:, None, None, :]
        if self.compiled:
            _dynamic((x, 0), (cos, 0), (sin, 0), (pos, 0), (mask, 0), (mask, 3))
        for lw, (kc, vc) in zip(w.layers, layers):
            x = self._decode_layer(x, lw, kc, vc, cos, sin, pos, mask)
        final_logits(x, w, self.arch, out=out)

    def prefill(self, ids: Tensor, lens: Tensor, slots: Tensor, layers: list[tuple[Tensor, Tensor]]) -> Tensor:
        """Right-padded prompts ids [n, P] of lengths lens [n] into cache `slots` [n]; -> logits [n, V]
        of each prompt's last token."""
        w = self.weights
        n, p = ids.shape
        x = F.embedding(ids, w.embed)
        pos = torch.arange(p, device=ids.device)
        cos, sin = rope_cos_sin(pos, w.inv_freq, w.rope_scale, x.dtype)
        mask = ((pos[None, :] <= pos[:, None])[None] & (pos < lens[:, None])[:, None, :])[:, None]
        if self.compiled:
            _dynamic((x, 0), (x, 1), (slots, 0), (cos, 0), (sin, 0), (mask, 0), (mask, 2), (mask, 3))
        for lw, (kc, vc) in zip(w.layers, layers):
            x = self._prefill_layer(x, lw, kc, vc, slots, cos, sin, mask)
        return final_logits(x[torch.arange(n, device=ids.device), lens - 1], w, self.arch)
