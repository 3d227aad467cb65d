"""HF <-> megatron-core weight conversion as pure tensor functions (no megatron-core needed): the fused
layouts by hand, and bit-exact round trips of tiny Qwen2 (QKV bias, tied and untied) and Llama (GQA,
untied) models, whole and in TP = 2 shards and PP = 2 stages."""

from __future__ import annotations

import json
import math

import pytest
import torch

from miles.config import ConfigError
from miles.training.megatron.conversion import (
    EMBEDDING, OUTPUT, ModelSpec, hf_to_mcore, mcore_to_hf, merge_tensor, model_spec, pack_qkv, padded_vocab, shard_tensor,
    shard_tp, spec_problems, stage_weights, te_names, tp_problems, unpack_qkv, unstage_weights,
)
from miles.weights.hf import model_weights


def merge_tp(shards, spec: ModelSpec) -> dict:
    """The inverse of `shard_tp` over a model's weights (the worker merges one tensor at a time: `merge_tensor`)."""
    return {n: merge_tensor(n, [s[n] for s in shards], spec) for n in shards[0]}


def tiny(family: str, *, tied: bool, vocab: int = 33, heads: int = 4, kv: int = 2, layers: int = 2):
    """A random HF model of `family` (qwen2 / llama) and its config.json dict."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    cfg = cfg_cls(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, intermediate_size=48, tie_word_embeddings=tied, max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_cls(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()            # biases too: a zero bias would hide a misplaced one
    return model, json.loads(cfg.to_json_string())


def weights_of(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model_weights(model).items()}


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def spec_of(heads=4, kv=2, d=1, ffn=4, vocab=5, tied=True) -> ModelSpec:
    return ModelSpec(family="qwen2", num_layers=1, hidden_size=heads * d, num_heads=heads, num_kv_heads=kv, head_dim=d,
                     ffn_hidden_size=ffn, vocab_size=vocab, tied=tied, qkv_bias=True, rope_theta=1e4, norm_eps=1e-6,
                     max_position_embeddings=16)


def test_fused_qkv_is_grouped_per_key_value_head():
    # 4 query heads in 2 groups, head_dim 1: group g = its 2 query heads, then k_g, then v_g
    spec = spec_of()
    q, k, v = torch.tensor([10., 11., 12., 13.]), torch.tensor([20., 21.]), torch.tensor([30., 31.])
    qkv = pack_qkv(q, k, v, spec)
    assert qkv.tolist() == [10., 11., 20., 30., 12., 13., 21., 31.]
    assert [t.tolist() for t in unpack_qkv(qkv, spec)] == [q.tolist(), k.tolist(), v.tolist()]
    # a TP shard is whole groups: rank 1 of 2 holds group 1
    assert shard_tensor("decoder.layers.0.self_attention.linear_qkv.bias", qkv, spec, 2, 1).tolist() == [12., 13., 21., 31.]


def test_gated_fc1_shards_hold_their_rows_of_gate_and_up():
    spec = spec_of(ffn=4)
    fc1 = torch.arange(8.)[:, None]         # gate rows 0..3, up rows 4..7
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert shard_tensor(name, fc1, spec, 2, 0).flatten().tolist() == [0., 1., 4., 5.]
    assert shard_tensor(name, fc1, spec, 2, 1).flatten().tolist() == [2., 3., 6., 7.]


def test_vocab_rows_are_padded_to_a_multiple_of_tp_and_cut_back():
    spec = spec_of(vocab=5)
    emb = torch.arange(5.)[:, None].repeat(1, 4)
    assert padded_vocab(spec, 2) == 6 and padded_vocab(spec, 1) == 5
    last = shard_tensor(EMBEDDING, emb, spec, 2, 1)
    assert last[:, 0].tolist() == [3., 4., 0.]       # a zero row pads the vocabulary
    full = merge_tp([shard_tp({EMBEDDING: emb}, spec, 2, r) for r in range(2)], spec)[EMBEDDING]
    assert torch.equal(full, emb)


@pytest.mark.parametrize("family,tied,kv", [("qwen2", True, 2), ("qwen2", False, 1), ("llama", False, 2),
                                            ("llama", True, 4)])
def test_hf_mcore_hf_is_bit_exact(family, tied, kv):
    model, cfg = tiny(family, tied=tied, kv=kv)
    spec = model_spec(cfg)
    assert spec.qkv_bias == (family == "qwen2") and spec.tied == tied
    hf = weights_of(model)
    mc = hf_to_mcore(hf, spec)
    assert (OUTPUT in mc) == (not tied)
    assert_same(mcore_to_hf(mc, spec), hf)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_tp2_shards_round_trip_bit_exact(family):
    model, cfg = tiny(family, tied=family == "qwen2", vocab=33)    # 33: the vocabulary needs padding at TP 2
    spec = model_spec(cfg)
    hf = weights_of(model)
    shards = [shard_tp(hf_to_mcore(hf, spec), spec, 2, r) for r in range(2)]
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert shards[0][qkv].shape[0] == (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim // 2
    assert shards[1][EMBEDDING].shape[0] == padded_vocab(spec, 2) // 2 == 17
    assert torch.equal(shards[0]["decoder.layers.0.input_layernorm.weight"],
                       shards[1]["decoder.layers.0.input_layernorm.weight"])    # norms are replicated
    assert_same(mcore_to_hf(merge_tp(shards, spec), spec), hf)


def test_pp2_stages_round_trip_and_the_last_stage_holds_the_tied_output_layer():
    model, cfg = tiny("qwen2", tied=True, layers=4)
    spec = model_spec(cfg)
    hf = weights_of(model)
    mc = hf_to_mcore(hf, spec)
    first = stage_weights(mc, spec, range(0, 2), first=True, last=False)
    last = stage_weights(mc, spec, range(2, 4), first=False, last=True)
    assert EMBEDDING in first and EMBEDDING not in last
    assert torch.equal(last[OUTPUT], mc[EMBEDDING])          # the tied copy megatron keeps on the last stage
    assert "decoder.layers.0.mlp.linear_fc2.weight" in last and "decoder.layers.2.mlp.linear_fc2.weight" not in last
    merged = {**unstage_weights(first, spec, range(0, 2)), **unstage_weights(last, spec, range(2, 4))}
    assert_same(mcore_to_hf(merged, spec), hf)


def test_te_names_rename_the_fused_norms_and_back():
    mc = {"decoder.layers.3.input_layernorm.weight": torch.ones(1), "decoder.layers.3.pre_mlp_layernorm.weight":
          torch.zeros(1), EMBEDDING: torch.ones(1)}
    te = te_names(mc, to_te=True)
    assert sorted(te) == sorted([EMBEDDING, "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight",
                                 "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"])
    assert te_names(te, to_te=False).keys() == mc.keys()


def test_unsupported_configs_are_named():
    assert "GPT2LMHeadModel" in spec_problems({"architectures": ["GPT2LMHeadModel"]})[0]
    _, cfg = tiny("llama", tied=False)
    bad = {**cfg, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5e5}, "attention_bias": True}
    problems = spec_problems(bad)
    assert len(problems) == 2 and "'dynamic'" in problems[0] and "attention_bias" in problems[1]
    with pytest.raises(ConfigError, match="dynamic"):
        model_spec(bad)
    no_context = {**cfg, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}
    assert "original_max_position_embeddings" in spec_problems(no_context)[0]
    old_style = {k: v for k, v in cfg.items() if k != "rope_parameters"} | {"rope_theta": 1e6, "rope_scaling": None}
    assert model_spec(old_style).rope_theta == 1e6


def test_tp_must_divide_heads_and_key_value_heads():
    spec = spec_of(heads=4, kv=2, ffn=4)
    assert tp_problems(spec, 2) == []
    problems = tp_problems(spec, 4)
    assert len(problems) == 1 and "num_key_value_heads 2" in problems[0]
    assert "num_attention_heads 4" in tp_problems(spec, 8)[0]


def test_names_that_do_not_fit_the_spec_fail_with_both_lists():
    model, cfg = tiny("qwen2", tied=True)
    hf = weights_of(model)
    del hf["model.layers.1.self_attn.q_proj.bias"]
    with pytest.raises(ValueError, match="1 missing"):
        hf_to_mcore(hf, model_spec(cfg))


# --- Qwen3 and Llama 3 ------------------------------------------------------------------------------
def family_model(family: str, *, tied: bool):
    """A random tiny Qwen3 / Llama 3 model (tests.tiny_model) and its config.json dict; every weight drawn,
    the q/k norms away from 1, so a misplaced one shows."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_model import tiny_config

    cfg = tiny_config(family, tied=tied)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    return model, json.loads(cfg.to_json_string())


@pytest.mark.parametrize("family,tied", [("qwen3", True), ("qwen3", False), ("llama3", True), ("llama3", False)])
def test_qwen3_and_llama3_round_trip_bit_exact_whole_and_in_tp2_shards(family, tied):
    model, cfg = family_model(family, tied=tied)
    spec = model_spec(cfg)
    assert (spec.qk_norm, spec.qkv_bias, spec.tied) == (family == "qwen3", False, tied)
    assert spec.head_dim == model.config.head_dim == (16 if family == "qwen3" else 8)      # qwen3: != hidden / heads
    assert (spec.llama3_rope is not None) == (family == "llama3")
    hf = weights_of(model)
    mc = hf_to_mcore(hf, spec)
    assert ("decoder.layers.1.self_attention.q_layernorm.weight" in mc) == (family == "qwen3")
    if family == "qwen3":
        assert torch.equal(mc["decoder.layers.1.self_attention.k_layernorm.weight"],
                           hf["model.layers.1.self_attn.k_norm.weight"])
    assert_same(mcore_to_hf(mc, spec), hf)
    shards = [shard_tp(mc, spec, 2, r) for r in range(2)]
    if family == "qwen3":        # over head_dim: every TP rank holds all of it
        assert torch.equal(shards[0]["decoder.layers.0.self_attention.q_layernorm.weight"],
                           shards[1]["decoder.layers.0.self_attention.q_layernorm.weight"])
    assert_same(mcore_to_hf(merge_tp(shards, spec), spec), hf)


@pytest.mark.parametrize("rope", [dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=2.0,
                                       original_max_position_embeddings=16),
                                  dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,      # Llama 3.2's
                                       original_max_position_embeddings=8192)])
def test_llama3_inverse_frequencies_equal_transformers_bit_for_bit(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from miles.training.megatron.conversion import llama3_inv_freq

    for head_dim, theta in ((8, 500.0), (128, 500000.0)):
        cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_theta=theta,
                          rope_scaling={"rope_type": "llama3", **rope}, max_position_embeddings=131072)
        spec = model_spec(json.loads(cfg.to_json_string()) | {"architectures": ["LlamaForCausalLM"]})
        theirs = LlamaRotaryEmbedding(cfg).inv_freq
        ours = llama3_inv_freq(spec)
        assert ours.dtype == theirs.dtype == torch.float32 and torch.equal(ours, theirs), (head_dim, rope)
        plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        assert torch.equal(ours, plain) == (2 * math.pi / plain.min() < rope["original_max_position_embeddings"] / rope["high_freq_factor"])  # scaled: the slow ones
