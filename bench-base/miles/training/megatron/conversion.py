"""HF <-> megatron-core weights for the Llama (Llama 3 included), Qwen2 and Qwen3 families, as pure tensor functions.

Names on the megatron side are GPTModel's with the local layer spec (the Transformer Engine spec
fuses the two norms into the following linear layer: `te_names` renames them). Layer indices are
global here; a pipeline stage renumbers its own (`stage_weights`).

    HF (per layer i)                                     megatron-core
    model.embed_tokens.weight                            embedding.word_embeddings.weight
    layers.i.input_layernorm.weight                      decoder.layers.i.input_layernorm.weight
    layers.i.self_attn.{q,k,v}_proj.{weight,bias}        decoder.layers.i.self_attention.linear_qkv.{weight,bias}
    layers.i.self_attn.{q,k}_norm.weight (Qwen3)         decoder.layers.i.self_attention.{q,k}_layernorm.weight
    layers.i.self_attn.o_proj.weight                     decoder.layers.i.self_attention.linear_proj.weight
    layers.i.post_attention_layernorm.weight             decoder.layers.i.pre_mlp_layernorm.weight
    layers.i.mlp.{gate,up}_proj.weight                   decoder.layers.i.mlp.linear_fc1.weight
    layers.i.mlp.down_proj.weight                        decoder.layers.i.mlp.linear_fc2.weight
    model.norm.weight                                    decoder.final_layernorm.weight
    lm_head.weight (absent when tied)                    output_layer.weight (absent when tied, one stage)

The fused QKV is megatron's grouped layout: for each of the G key/value groups, that group's query
heads, then its key head, then its value head, each `head_dim` rows. A TP shard is then a contiguous
run of G / TP whole groups. The gated MLP's fc1 is [gate; up]; its TP shard r is
[gate shard r; up shard r], not a contiguous slice of the concatenation. Embedding and output
layer are split by vocabulary rows, padded with zero rows to a multiple of TP (the padded logits
are cut off before any softmax). Every conversion is reshapes, slices and concatenations of the
same values: HF -> megatron -> HF is bit-exact.

Qwen3's per-head q/k RMSNorm (over head_dim, before RoPE) is megatron's `qk_layernorm`; its head_dim,
which need not be hidden / heads, is `kv_channels`. Llama 3's `llama3` RoPE scaling is not what
GPTModel's `rope_scaling` computes in general (megatron fixes low/high frequency factors 1 and 4 and
an original context of 8192; only its factor is a parameter), so `llama3_inv_freq` computes the
inverse frequencies as transformers does, from all four parameters, and the model takes them in
place of its own (`miles.training.megatron.model`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import math

import torch
from torch import Tensor

from miles.config import ConfigError

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
QK_NORMS = {"q_norm.weight": "q_layernorm.weight", "k_norm.weight": "k_layernorm.weight"}   # HF -> megatron
LAYER = "decoder.layers."
EMBEDDING, FINAL_NORM, OUTPUT = "embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"
# local-spec name -> Transformer Engine spec name (the norm fused into the next linear layer)
TE_RENAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What megatron needs to know of an HF Llama/Qwen2/Qwen3 config.json."""

    family: str                 # "llama" | "qwen2" | "qwen3"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied: bool                  # tie_word_embeddings
    qkv_bias: bool              # Qwen2: q/k/v projections have biases
    rope_theta: float
    norm_eps: float
    max_position_embeddings: int
    qk_norm: bool = False       # Qwen3: per-head RMSNorm of q and k (megatron's qk_layernorm)
    llama3_rope: tuple[float, float, float, int] | None = None   # factor, low/high freq factors, original context

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _rope(cfg: Mapping[str, Any]) -> tuple[float | None, str, dict[str, Any]]:
    """(theta, rope type, its parameters) from transformers 5's `rope_parameters` or the older
    `rope_theta`/`rope_scaling`."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return theta, kind, {**scaling, **params}


def _llama3_rope(cfg: Mapping[str, Any]) -> tuple[float, float, float, int] | None:
    _, kind, params = _rope(cfg)
    if kind != "llama3":
        return None
    return (float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]))


def llama3_inv_freq(spec: ModelSpec) -> Tensor:
    """RoPE inverse frequencies [head_dim / 2] float32 of Llama 3's `llama3` scaling, computed as
    transformers computes them (the same operations in the same order: equal bit for bit)."""
    assert spec.llama3_rope is not None
    factor, low_freq_factor, high_freq_factor, old_context_len = spec.llama3_rope
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * scaled / factor + smooth_factor * scaled
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, scaled)


def _family(cfg: Mapping[str, Any]) -> str | None:
    """"llama" | "qwen2" | "qwen3" from `architectures` (or `model_type` when a config has no architectures)."""
    archs = list(cfg.get("architectures") or [])
    if archs:
        return SUPPORTED_ARCHITECTURES.get(archs[0]) if len(archs) == 1 else None
    return cfg.get("model_type") if cfg.get("model_type") in SUPPORTED_ARCHITECTURES.values() else None


def spec_problems(cfg: Mapping[str, Any]) -> list[str]:
    """What in an HF config.json this backend cannot train (empty: fit)."""
    if _family(cfg) is None:
        what = cfg.get("architectures") or cfg.get("model_type")
        return [f"architecture {what} is not supported by --train-backend megatron; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (or use --train-backend torch)"]
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r}: the megatron backend converts SwiGLU (silu) MLPs only")
    theta, kind, params = _rope(cfg)
    if kind not in ROPE_TYPES or theta is None:
        problems.append(f"rope type {kind!r} (theta {theta}): the megatron backend converts plain RoPE and "
                        f"Llama 3's llama3 scaling only")
    elif kind == "llama3" and any(params.get(k) is None for k in LLAMA3_ROPE_KEYS):
        problems.append(f"rope type 'llama3' needs {', '.join(LLAMA3_ROPE_KEYS)}; the config has "
                        f"{ {k: params.get(k) for k in LLAMA3_ROPE_KEYS} }")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor {params['partial_rotary_factor']}: the megatron backend rotates whole heads")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        problems.append("attention_bias / mlp_bias: Llama and Qwen3 checkpoints with linear biases are not "
                        "supported by the megatron backend (Qwen2's q/k/v biases are)")
    if cfg.get("use_sliding_window"):
        problems.append("use_sliding_window: sliding-window attention is not supported by the megatron backend")
    heads, kv = cfg.get("num_attention_heads", 0), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads", 0)
    if not heads or heads % kv:
        problems.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    return problems


def model_spec(cfg: Mapping[str, Any]) -> ModelSpec:
    """The ModelSpec of an HF config.json dict; ConfigError naming every unsupported feature."""
    problems = spec_problems(cfg)
    if problems:
        raise ConfigError(problems)
    family = _family(cfg)
    heads = cfg["num_attention_heads"]
    return ModelSpec(
        family=family, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, ffn_hidden_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"], tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2", rope_theta=float(_rope(cfg)[0]), norm_eps=float(cfg["rms_norm_eps"]),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096), qk_norm=family == "qwen3",
        llama3_rope=_llama3_rope(cfg))


def tp_problems(spec: ModelSpec, tp: int) -> list[str]:
    """Why `spec` cannot be split over `tp` tensor-parallel ranks (empty: it can)."""
    problems = []
    for what, n in (("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_kv_heads),
                    ("intermediate_size", spec.ffn_hidden_size)):
        if n % tp:
            problems.append(f"--tensor-model-parallel-size {tp} does not divide the model's {what} {n}; "
                            f"use a TP size that divides it")
    return problems


def padded_vocab(spec: ModelSpec, tp: int) -> int:
    """Vocabulary rows of the megatron model: vocab_size rounded up to a multiple of `tp`."""
    return -(-spec.vocab_size // tp) * tp


# --- the fused layouts ------------------------------------------------------------------------------
def pack_qkv(q: Tensor, k: Tensor, v: Tensor, spec: ModelSpec) -> Tensor:
    """HF q [H*d, ...], k [G*d, ...], v [G*d, ...] (weights or biases) -> megatron's grouped [(H + 2G)*d, ...]."""
    g, d, rest = spec.num_kv_heads, spec.head_dim, q.shape[1:]
    per_group = torch.cat([q.reshape(g, spec.heads_per_group * d, *rest), k.reshape(g, d, *rest),
                           v.reshape(g, d, *rest)], dim=1)
    return per_group.reshape(-1, *rest)


def unpack_qkv(qkv: Tensor, spec: ModelSpec, groups: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `pack_qkv` (on `groups` groups: a TP shard holds fewer than the model's)."""
    g, d, rest = groups or spec.num_kv_heads, spec.head_dim, qkv.shape[1:]
    q, k, v = qkv.reshape(g, (spec.heads_per_group + 2) * d, *rest).split([spec.heads_per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# --- whole models -----------------------------------------------------------------------------------
def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def hf_to_mcore(hf: Mapping[str, Tensor], spec: ModelSpec) -> dict[str, Tensor]:
    """HF weights (as `miles.weights.hf.model_weights` or model.safetensors name them) -> full
    (unsharded) megatron-core weights, global layer indices. Tied: no output_layer.weight."""
    _check_names(hf, expected_hf_names(spec), "HF")
    out = {EMBEDDING: hf["model.embed_tokens.weight"], FINAL_NORM: hf["model.norm.weight"]}
    if not spec.tied:
        out[OUTPUT] = hf["lm_head.weight"]
    for i in range(spec.num_layers):
        h, m = _hf_layer(i), f"{LAYER}{i}."
        attn = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = pack_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], spec)
        if spec.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = pack_qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], spec)
        if spec.qk_norm:
            for theirs, ours in QK_NORMS.items():
                out[m + "self_attention." + ours] = hf[attn + theirs]
        out[m + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    return out


def mcore_to_hf(mc: Mapping[str, Tensor], spec: ModelSpec) -> dict[str, Tensor]:
    """Inverse of `hf_to_mcore`: full megatron-core weights -> HF names (tied: no lm_head.weight)."""
    _check_names(mc, expected_mcore_names(spec), "megatron-core")
    out = {"model.embed_tokens.weight": mc[EMBEDDING]}
    for i in range(spec.num_layers):
        h, m = _hf_layer(i), f"{LAYER}{i}."
        attn = h + "self_attn."
        out[h + "input_layernorm.weight"] = mc[m + "input_layernorm.weight"]
        for name, t in zip("qkv", unpack_qkv(mc[m + "self_attention.linear_qkv.weight"], spec)):
            out[f"{attn}{name}_proj.weight"] = t
        if spec.qkv_bias:
            for name, t in zip("qkv", unpack_qkv(mc[m + "self_attention.linear_qkv.bias"], spec)):
                out[f"{attn}{name}_proj.bias"] = t
        if spec.qk_norm:
            for theirs, ours in QK_NORMS.items():
                out[attn + theirs] = mc[m + "self_attention." + ours]
        out[attn + "o_proj.weight"] = mc[m + "self_attention.linear_proj.weight"]
        out[h + "post_attention_layernorm.weight"] = mc[m + "pre_mlp_layernorm.weight"]
        gate, up = mc[m + "mlp.linear_fc1.weight"].chunk(2)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = mc[m + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = mc[FINAL_NORM]
    if not spec.tied:
        out["lm_head.weight"] = mc[OUTPUT]
    return out


def expected_hf_names(spec: ModelSpec) -> list[str]:
    names = ["model.embed_tokens.weight"]
    for i in range(spec.num_layers):
        h = _hf_layer(i)
        names += [h + "input_layernorm.weight", h + "post_attention_layernorm.weight", h + "self_attn.o_proj.weight",
                  h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight", h + "mlp.down_proj.weight"]
        names += [f"{h}self_attn.{p}_proj.{kind}" for p in "qkv"
                  for kind in (("weight", "bias") if spec.qkv_bias else ("weight",))]
        names += [h + "self_attn." + n for n in QK_NORMS] if spec.qk_norm else []
    return names + ["model.norm.weight"] + ([] if spec.tied else ["lm_head.weight"])


def expected_mcore_names(spec: ModelSpec) -> list[str]:
    per_layer = ["input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                 "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    per_layer += ["self_attention.linear_qkv.bias"] if spec.qkv_bias else []
    per_layer += ["self_attention." + n for n in QK_NORMS.values()] if spec.qk_norm else []
    names = [EMBEDDING, FINAL_NORM] + ([] if spec.tied else [OUTPUT])
    return names + [f"{LAYER}{i}.{n}" for i in range(spec.num_layers) for n in per_layer]


def _check_names(given: Mapping[str, Tensor], expected: list[str], side: str) -> None:
    # HF files of tied models sometimes carry lm_head.weight anyway (a copy of the embedding): allowed
    missing = [n for n in expected if n not in given]
    extra = [n for n in given if n not in expected and n != "lm_head.weight"]
    if missing or extra:
        raise ValueError(f"{side} weights do not fit the model spec: {len(missing)} missing (e.g. {missing[:3]}), "
                         f"{len(extra)} unexpected (e.g. {extra[:3]}); is the config.json that of these weights?")


# --- tensor-parallel shards -------------------------------------------------------------------------
def is_tp_split(name: str) -> bool:
    """Whether TP ranks hold different parts of `name` (else each holds all of it)."""
    return _split_dim(name) is not None


def _split_dim(name: str) -> int | None:
    """The dimension a TP shard of `name` splits (None: every rank holds all of it)."""
    if name in (EMBEDDING, OUTPUT) or name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def shard_tensor(name: str, t: Tensor, spec: ModelSpec, tp: int, rank: int) -> Tensor:
    """TP rank `rank`'s part of the full megatron tensor `name` (a view where one exists)."""
    dim = _split_dim(name)
    if dim is None:
        return t
    if name in (EMBEDDING, OUTPUT):
        pad = padded_vocab(spec, tp) - t.shape[0]
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
    if name.endswith("linear_fc1.weight"):          # [gate; up]: each rank gets its rows of both
        gate, up = t.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return t.chunk(tp, dim=dim)[rank]


def merge_tensor(name: str, shards: list[Tensor], spec: ModelSpec) -> Tensor:
    """Inverse of `shard_tensor`: the TP shards of `name`, in rank order -> the full tensor."""
    dim = _split_dim(name)
    if dim is None:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    full = torch.cat(shards, dim=dim)
    return full[:spec.vocab_size] if name in (EMBEDDING, OUTPUT) else full


def shard_tp(mc: Mapping[str, Tensor], spec: ModelSpec, tp: int, rank: int) -> dict[str, Tensor]:
    return {n: shard_tensor(n, t, spec, tp, rank) for n, t in mc.items()}


def merge_tp(shards: list[Mapping[str, Tensor]], spec: ModelSpec) -> dict[str, Tensor]:
    return {n: merge_tensor(n, [s[n] for s in shards], spec) for n in shards[0]}


# --- pipeline stages --------------------------------------------------------------------------------
def _layer_index(name: str) -> int:
    return int(name[len(LAYER):].split(".", 1)[0])


def _renumber(name: str, shift: int) -> str:
    index, rest = name[len(LAYER):].split(".", 1)
    return f"{LAYER}{int(index) + shift}.{rest}"


def stage_weights(mc: Mapping[str, Tensor], spec: ModelSpec, layers: range, *, first: bool,
                  last: bool) -> dict[str, Tensor]:
    """A pipeline stage's part of full megatron weights, its layers renumbered from 0. The first
    stage holds the embedding, the last the final norm and the output layer; with tied embeddings
    and more than one stage the last holds a copy of the embedding as its output layer (megatron
    keeps the two equal by all-reducing their gradients)."""
    out = {_renumber(n, -layers.start): t for n, t in mc.items()
           if n.startswith(LAYER) and _layer_index(n) in layers}
    if first:
        out[EMBEDDING] = mc[EMBEDDING]
    if last:
        out[FINAL_NORM] = mc[FINAL_NORM]
        if not spec.tied:
            out[OUTPUT] = mc[OUTPUT]
        elif not first:
            out[OUTPUT] = mc[EMBEDDING]
    return out


def unstage_weights(stage: Mapping[str, Tensor], spec: ModelSpec, layers: range) -> dict[str, Tensor]:
    """Inverse of `stage_weights`: global layer indices, and no tied copy of the embedding."""
    return {(_renumber(n, layers.start) if n.startswith(LAYER) else n): t for n, t in stage.items()
            if not (spec.tied and n == OUTPUT)}


def te_names(mc: Mapping[str, Tensor], to_te: bool) -> dict[str, Tensor]:
    """Local-spec names <-> Transformer Engine spec names (the two layer norms)."""
    pairs = TE_RENAMES.items() if to_te else ((b, a) for a, b in TE_RENAMES.items())
    renames = dict(pairs)
    out = {}
    for n, t in mc.items():
        for old, new in renames.items():
            if n.startswith(LAYER) and n.endswith("." + old):
                n = n[: -len(old)] + new
                break
        out[n] = t
    return out
