"""Qwen3 and Llama 3 on the fast engine (CPU, float32, eager): the same parity as Qwen2's in
test_fast_engine.py, against plain transformers forwards of the same weights, tied and untied.

Qwen3's q_norm/k_norm (per-head RMSNorm before RoPE, head_dim 16 != hidden 32 / 4 heads) and Llama 3's
`llama3` RoPE scaling (original context 16, so positions past it use the scaled frequencies) are
the parts a forward could get wrong; norms are drawn away from 1 so a skipped norm shows.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.rollout.engines.embedded.engine import EmbeddedEngine
from miles.rollout.engines.fast.engine import FastEngine
from miles.rollout.engines.fast.model import supports
from miles.types import SamplingParams
from miles.weights.hf import model_weights
from tests.tiny_model import make_tiny_family, tiny_config
from tests.unit.test_fast_engine import MANY, PROMPTS, forward_logprobs, reference_greedy

# 24 new tokens after prompts of up to 11: positions past llama3's original context of 16
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
CASES = [("qwen3", True), ("qwen3", False), ("llama3", True), ("llama3", False)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def case(request, tmp_path_factory):
    torch.set_num_threads(1)
    family, tied = request.param
    path = make_tiny_family(tmp_path_factory.mktemp(family), family, tied=tied)
    return path, AutoModelForCausalLM.from_pretrained(path).eval()


def test_greedy_tokens_and_logprobs_equal_a_transformers_forward(case):
    path, hf = case
    engine = FastEngine(path, device="cpu", seed=0, max_batch_size=3)   # 11 prompts through 3 slots
    gens = engine.generate(MANY, GREEDY)
    assert max(len(p) + len(g.response_ids) for p, g in zip(MANY, gens)) > 20
    for prompt, gen in zip(MANY, gens):
        ids, lps = reference_greedy(hf, prompt, GREEDY.max_new_tokens)
        assert gen.response_ids == ids
        assert max(abs(a - b) for a, b in zip(gen.logprobs, lps)) < 1e-5


def test_sampled_logprobs_equal_a_full_sequence_forward(case):
    path, hf = case
    gens = FastEngine(path, device="cpu", seed=3, max_batch_size=4).generate(
        PROMPTS * 2, SamplingParams(temperature=0.8, max_new_tokens=20, seed=2))
    for prompt, g in zip(PROMPTS * 2, gens):
        ref = forward_logprobs(hf, prompt, g.response_ids, 0.8)
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref)) < 1e-4


def test_weight_updates_by_hf_name_reach_the_norms_and_match_the_embedded_engine(case):
    # the q_norm/k_norm weights travel like every other (HF names, in place); the checksums are the
    # embedded engine's, byte for byte, before and after
    path, hf = case
    fast, embedded = FastEngine(path, device="cpu"), EmbeddedEngine(path, device="cpu")
    names = set(fast._weights.named)
    assert names == set(model_weights(hf))
    assert ("lm_head.weight" in names) != hf.config.tie_word_embeddings
    if hf.config.model_type == "qwen3":
        assert {"model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} <= names
        assert fast._weights.named["model.layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert fast.weights_checksum() == embedded.weights_checksum()
    gen = torch.Generator().manual_seed(0)
    new = {n: t.detach() + 0.1 * torch.randn(t.shape, generator=gen) for n, t in model_weights(hf).items()}
    for engine in (fast, embedded):
        engine.update_weights(new, version=2)
    assert fast.weights_checksum() == embedded.weights_checksum()
    assert [g.response_ids for g in fast.generate(PROMPTS, GREEDY)] == \
           [g.response_ids for g in embedded.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_fast_path_takes_both_families_and_names_what_it_refuses(family):
    assert supports(tiny_config(family)) is None
    assert supports(tiny_config(family, tied=False)) is None
    assert "'dynamic'" in supports(tiny_config(family, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


def test_an_unknown_architecture_is_refused_by_name():
    from transformers import GPT2Config

    assert supports(GPT2Config()) == "model_type 'gpt2' is not implemented (fast path: llama, qwen2, qwen3, qwen3_moe)"
