"""FastEngine on CPU (float32, eager): the same code path the GPU runs, minus graphs and compilation.

References are plain transformers forwards of the same weights: a full-sequence forward per new
token (greedy) and one forward over prompt + response (logprobs); the embedded engine gives the
request errors and the checksums to match.
"""

import math
import os
from collections import Counter
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config

from miles.rollout.engines.fast import engine as fast_engine
from miles.rollout.engines.fast import model as fast_model
from miles.rollout.engines.embedded.engine import EmbeddedEngine, EngineDisposedError, _truncate
from miles.rollout.engines.fast.attention import decode_attention, sdpa_decode_attention
from miles.rollout.engines.fast.cache import batch_buckets, plan_positions, span_buckets
from miles.rollout.engines.fast.engine import FastEngine
from miles.types import SamplingParams
from miles.weights.hf import model_weights
from tests.tiny_model import EOS_ID, VOCAB_SIZE, _tokenizer, make_tiny_model

PROMPTS = [[5, 6, 14, 11, 18], [7, 8], [9, 4, 4, 4, 4, 4, 4, 4, 5], [21, 22, 20, 23]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
MANY = [[(7 * i + j) % 28 + 4 for j in range(1 + (5 * i) % 11)] for i in range(11)]  # lengths 1..11


def make_tiny_llama(path) -> str:
    """A tiny untied Llama with the parts Qwen2 lacks: llama3 RoPE scaling, head_dim != hidden /
    heads, biases on q/k/v and o (attention_bias), two query heads per KV head."""
    cfg = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=48, tie_word_embeddings=False,
                      attention_bias=True, max_position_embeddings=128, bos_token_id=1, eos_token_id=EOS_ID,
                      pad_token_id=0, rope_theta=500.0,
                      rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 2.0, "original_max_position_embeddings": 16})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = LlamaForCausalLM(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_path(request, tmp_path_factory):
    torch.set_num_threads(1)
    make = make_tiny_model if request.param == "qwen2" else make_tiny_llama
    return make(tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def engine(model_path):
    return FastEngine(model_path, device="cpu", seed=0, max_batch_size=4)


@pytest.fixture(scope="module")
def hf_model(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path).eval()


@torch.no_grad()
def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """The plainest greedy decoder: a full forward over the whole sequence for every new token."""
    ids, lps = list(prompt), []
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        tok = int(logits.argmax())
        ids.append(tok)
        lps.append(float(torch.log_softmax(logits, -1)[tok]))
        if tok == EOS_ID:
            break
    return ids[len(prompt):], lps


@torch.no_grad()
def forward_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) at each response token, from one forward over prompt + response."""
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, -1)
    return lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


def test_greedy_matches_a_full_forward_argmax_loop(engine, hf_model):
    for prompt, gen in zip(PROMPTS, engine.generate(PROMPTS, GREEDY)):
        ids, lps = reference_greedy(hf_model, prompt, GREEDY.max_new_tokens)
        assert gen.response_ids == ids
        assert max(abs(a - b) for a, b in zip(gen.logprobs, lps)) < 1e-5
        assert gen.finish_reason == ("stop" if ids[-1] == EOS_ID else "length")


def test_sampled_logprobs_match_a_full_sequence_forward(engine, hf_model):
    params = SamplingParams(temperature=0.7, max_new_tokens=12, seed=1)
    gens = engine.generate(PROMPTS * 3, params)
    assert sum(len(g.response_ids) for g in gens) > 30
    for prompt, g in zip(PROMPTS * 3, gens):
        ref = forward_logprobs(hf_model, prompt, g.response_ids, 0.7)
        assert len(g.logprobs) == len(g.response_ids)
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref)) < 1e-4


def test_continuous_batching_equals_one_by_one(model_path):
    # 11 prompts through 3 slots: slots are refilled as sequences stop (EOS at different steps)
    # and compacted at the tail; each answer must be what it is alone
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    batched = FastEngine(model_path, device="cpu", max_batch_size=3).generate(MANY, params)
    alone = FastEngine(model_path, device="cpu", max_batch_size=1)
    embedded = EmbeddedEngine(model_path, device="cpu").generate(MANY, params)
    lengths = set()
    for prompt, b, e in zip(MANY, batched, embedded):
        single, = alone.generate([prompt], params)
        assert b.response_ids == single.response_ids == e.response_ids
        assert b.finish_reason == single.finish_reason == e.finish_reason
        assert max(abs(x - y) for x, y in zip(b.logprobs, single.logprobs)) < 1e-5
        lengths.add(len(b.response_ids))
    assert len(lengths) > 2, lengths  # the answers really end at different steps


def test_sampling_is_reproducible_and_seeds_matter(model_path, engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    a = FastEngine(model_path, device="cpu", seed=7).generate(PROMPTS, params)
    b = FastEngine(model_path, device="cpu", seed=7).generate(PROMPTS, params)
    c = FastEngine(model_path, device="cpu", seed=8).generate(PROMPTS, params)
    assert a == b
    assert [g.response_ids for g in a] != [g.response_ids for g in c]
    seeded = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)
    assert engine.generate(MANY, seeded) == engine.generate(MANY, seeded)


def test_top_k_1_and_tiny_top_p_sample_the_argmax(engine):
    greedy = [g.response_ids for g in engine.generate(PROMPTS, GREEDY)]
    for params in (SamplingParams(temperature=1.5, top_k=1, max_new_tokens=16, seed=0),
                   SamplingParams(temperature=1.5, top_p=1e-6, max_new_tokens=16, seed=0)):
        gens = engine.generate(PROMPTS, params)
        assert [g.response_ids for g in gens] == greedy
        assert all(lp < -1e-3 for g in gens for lp in g.logprobs)  # untruncated, at T = 1.5


MIN_EXPECTED = 5.0   # Pearson's chi-square approximation wants about this many expected counts per bin


def chi_square_p(counts: Counter, probs: torch.Tensor, n: int) -> float:
    """p-value of Pearson's test of `counts` (bin index -> observations, n in all) against `probs` [bins].

    Bins are merged, smallest expected count first, until each merged bin expects >= MIN_EXPECTED
    (the merging reads only `probs`, so the test stays valid). An observation in a bin of
    probability 0 cannot happen under `probs`: p = 0. Fewer than two merged bins test nothing: an
    error, not a pass (nor a nan).
    """
    obs = torch.tensor([counts.get(i, 0) for i in range(len(probs))], dtype=torch.float64)
    if n < 1 or obs.sum() != n or sum(counts.values()) != n:
        raise ValueError(f"{sum(counts.values())} observations ({obs.sum():.0f} in range) for n = {n}")
    expected = probs.double() * n
    if obs[expected == 0].sum() > 0:
        return 0.0
    bins, e_acc, o_acc = [], 0.0, 0.0
    for i in expected.argsort().tolist():
        e_acc, o_acc = e_acc + float(expected[i]), o_acc + float(obs[i])
        if e_acc >= MIN_EXPECTED:
            bins.append((e_acc, o_acc))
            e_acc = o_acc = 0.0
    if bins:  # what is left (< MIN_EXPECTED in all) joins the last bin
        bins[-1] = (bins[-1][0] + e_acc, bins[-1][1] + o_acc)
    else:
        bins = [(e_acc, o_acc)]
    if len(bins) < 2:
        raise ValueError(f"{n} observations make {len(bins)} bin of >= {MIN_EXPECTED} expected: the test needs "
                         f"more samples or a less certain distribution")
    stat = sum((o - e) ** 2 / e for e, o in bins)
    return float(torch.special.gammaincc(torch.tensor((len(bins) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_chi_square_p_accepts_the_right_distribution_and_rejects_wrong_ones():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.0495, 0.0005, 0.0], dtype=torch.float64)  # a tiny and a zero bin
    draws = torch.multinomial(probs, 4000, replacement=True, generator=g).tolist()
    assert chi_square_p(Counter(draws), probs, 4000) > 1e-3
    wrong = torch.tensor([0.45, 0.35, 0.15, 0.0495, 0.0005, 0.0], dtype=torch.float64)
    assert chi_square_p(Counter(draws), wrong, 4000) < 1e-6
    assert chi_square_p(Counter(draws + [5]), probs, 4001) == 0.0          # a draw of probability 0
    with pytest.raises(ValueError, match="0 observations"):
        chi_square_p(Counter(), probs, 0)                                    # was nan: no test at all
    with pytest.raises(ValueError, match="1 bin"):                          # a near-certain outcome
        chi_square_p(Counter([0] * 100), torch.tensor([0.999, 0.001], dtype=torch.float64), 100)


def sampling_p_values(engine, model, params: SamplingParams, n: int, prompt=(5, 6, 14),
                      expected: SamplingParams | None = None) -> tuple[float, float]:
    """Chi-square p-values of the first sampled tokens (from the prefill's logits) and of the second
    tokens after the most common first one (from a decode step), against `model`'s distribution
    at `expected`'s (default: `params`') temperature and truncation. Answers that stopped at the
    first token are left out (so the first token's expected distribution is conditioned on not
    stopping)."""
    expected = expected or params
    gens = [g for g in engine.generate([list(prompt)] * n, params) if len(g.response_ids) == 2]
    first = Counter(g.response_ids[0] for g in gens)
    t1 = first.most_common(1)[0][0]
    second = Counter(g.response_ids[1] for g in gens if g.response_ids[0] == t1)
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt) + [t1]], device=device)).logits[0, -2:].double().cpu()
    p_values = []
    for i, counts in enumerate((first, second)):
        probs = torch.softmax(_truncate(logits[i][None] / expected.temperature, expected.top_k, expected.top_p)[0], -1)
        if i == 0:
            probs[sorted(engine._eos_ids | set(params.stop_token_ids))] = 0
            probs /= probs.sum()
        p_values.append(chi_square_p(counts, probs, sum(counts.values())))
    return p_values[0], p_values[1]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.6, -1, 1.0), (1.3, 5, 1.0), (1.0, -1, 0.8)])
def test_sampling_follows_the_distribution(model_path, hf_model, temperature, top_k, top_p):
    engine = FastEngine(model_path, device="cpu", max_batch_size=256, seed=11)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=2)
    p_first, p_second = sampling_p_values(engine, hf_model, params, 3000)
    assert p_first > 1e-3 and p_second > 1e-3, (p_first, p_second)
    # the test has power: the same samples are far from the distribution at half the temperature
    colder = SamplingParams(temperature=temperature / 2, top_k=top_k, top_p=top_p, max_new_tokens=2)
    assert sampling_p_values(engine, hf_model, params, 3000, expected=colder)[0] < 1e-6
    gens = engine.generate([[5, 6, 14]] * 50, params)
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(input_ids=torch.tensor([[5, 6, 14]])).logits[0, -1] / temperature, -1)
    assert max(abs(g.logprobs[0] - float(lp[g.response_ids[0]])) for g in gens) < 1e-4  # untruncated logprobs


def own_logprob_p_values(gens: list) -> tuple[float, float]:
    """Chi-square p-values of the first sampled tokens, and of the second tokens after the most common
    first token of the answers that went on, against the probabilities the engine itself reported
    for them (exp of its logprobs; the tokens never drawn share one bin with the mass left over)."""
    going_on = [g for g in gens if len(g.response_ids) == 2]
    t1 = Counter(g.response_ids[0] for g in going_on).most_common(1)[0][0]   # not EOS: that answer stopped
    p_values = []
    for pos, chosen in ((0, gens), (1, [g for g in going_on if g.response_ids[0] == t1])):
        lps: dict[int, list[float]] = {}
        for g in chosen:
            lps.setdefault(g.response_ids[pos], []).append(g.logprobs[pos])
        toks = sorted(lps)
        probs = torch.tensor([math.exp(sum(lps[t]) / len(lps[t])) for t in toks], dtype=torch.float64)
        assert probs.sum() <= 1.0 + 1e-2, (pos, float(probs.sum()))
        probs = torch.cat([probs, (1 - probs.sum()).clamp(min=0)[None]])
        observed = Counter({i: len(lps[t]) for i, t in enumerate(toks)})
        p_values.append(chi_square_p(observed, probs / probs.sum(), len(chosen)))
    return p_values[0], p_values[1]


def test_sampling_follows_the_engines_own_logprobs(engine, hf_model):
    # the check the GPU test makes in bf16 (where no reference has the engine's exact logits); on the
    # tiny Llama, EOS is the most common first token, so the second tokens must follow another one
    params = SamplingParams(temperature=1.0, max_new_tokens=2, seed=3)
    gens = engine.generate([[5, 6, 14]] * 3000, params)
    assert min(own_logprob_p_values(gens)) > 1e-3
    # the test has power: the same draws reported with the logprobs of half the temperature fail
    with torch.no_grad():
        cold = torch.log_softmax(hf_model(input_ids=torch.tensor([[5, 6, 14]])).logits[0, -1] / 0.5, -1)
    misreported = [replace(g, logprobs=[float(cold[g.response_ids[0]])] + g.logprobs[1:]) for g in gens]
    assert own_logprob_p_values(misreported)[0] < 1e-6


def test_stop_tokens_and_lengths_are_decided_on_the_device(engine):
    gens = engine.generate(PROMPTS * 4, SamplingParams(temperature=1.0, max_new_tokens=40, seed=0))
    for g in gens:
        assert len(g.logprobs) == len(g.response_ids)
        assert EOS_ID not in g.response_ids[:-1]
        assert (g.finish_reason == "stop" and g.response_ids[-1] == EOS_ID) or \
               (g.finish_reason == "length" and len(g.response_ids) == 40)
    prompt, full = max(zip(PROMPTS, engine.generate(PROMPTS, GREEDY)), key=lambda pg: len(pg[1].response_ids))
    stop = full.response_ids[len(full.response_ids) // 2]
    cut, = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.response_ids == full.response_ids[:full.response_ids.index(stop) + 1]
    one = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=1))
    assert [len(g.response_ids) for g in one] == [1] * 4


def test_update_weights_in_place_changes_outputs_and_matches_embedded_checksums(model_path, hf_model):
    fast, embedded = FastEngine(model_path, device="cpu"), EmbeddedEngine(model_path, device="cpu")
    assert fast.weights_checksum() == embedded.weights_checksum()
    before = fast.generate(PROMPTS, GREEDY)
    live = [t.data_ptr() for t in fast._weights.named.values()]
    new = {n: t.detach() + 0.05 * torch.randn_like(t) for n, t in model_weights(hf_model).items()}
    fast.update_weights(new, version=3)
    embedded.update_weights(new, version=3)
    assert fast.weights_checksum() == embedded.weights_checksum() != before and fast.weight_version() == 3
    assert [t.data_ptr() for t in fast._weights.named.values()] == live  # in place: graphs stay valid
    after = fast.generate(PROMPTS, GREEDY)
    assert {g.weight_version for g in after} == {3}
    assert [g.response_ids for g in after] != [g.response_ids for g in before]
    assert [g.response_ids for g in after] == [g.response_ids for g in embedded.generate(PROMPTS, GREEDY)]
    bf16 = FastEngine(model_path, device="cpu", dtype="bfloat16")
    assert bf16.weights_checksum() == EmbeddedEngine(model_path, device="cpu", dtype="bfloat16").weights_checksum()


def test_update_weights_rejects_a_mismatched_dict(engine, hf_model):
    weights = {name: t.clone() for name, t in model_weights(hf_model).items()}
    checksum = engine.weights_checksum()
    del weights["model.norm.weight"]
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="missing.*model.norm.weight.*wrong shape.*k_proj"):
        engine.update_weights(weights, version=5)
    assert engine.weights_checksum() == checksum and engine.weight_version() == 0


def test_bad_requests_fail_like_the_embedded_engine(model_path, engine):
    embedded = EmbeddedEngine(model_path, device="cpu")
    limit = embedded._max_positions
    for prompts, params in ((PROMPTS, SamplingParams(top_p=0.0)), ([[5], []], GREEDY), ([[5, 99]], GREEDY),
                            ([[5] * (limit - 6)], GREEDY), (PROMPTS, SamplingParams(top_k=0, temperature=-1))):
        with pytest.raises(ValueError) as fast_err:
            engine.generate(prompts, params)
        with pytest.raises(ValueError) as embedded_err:
            embedded.generate(prompts, params)
        assert str(fast_err.value) == str(embedded_err.value)


def test_a_request_longer_than_the_cache_is_refused(model_path):
    engine = FastEngine(model_path, device="cpu", max_context_len=24)
    assert engine.max_len == 24
    with pytest.raises(ValueError, match=r"prompt 1 \(9 tokens\) \+ max_new_tokens 16 exceeds the KV cache's 24 "
                                         r"positions.*--rollout-max-context-len"):
        engine.generate([[5], [5] * 9], GREEDY)
    assert len(engine.generate([[5] * 8], GREEDY)[0].response_ids) <= 16  # 8 + 16 fits exactly


def test_per_prompt_caps_bound_each_response_and_uniform_caps_are_the_plain_call(model_path):
    # custom generation sends one cap per prompt (a multi-turn sample's remaining budget)
    engine = FastEngine(model_path, device="cpu", max_batch_size=3)
    never_stop = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=())
    plain = engine.generate(PROMPTS, never_stop)
    assert engine.generate(PROMPTS, never_stop, [16] * len(PROMPTS)) == plain
    capped = engine.generate(PROMPTS, never_stop, [3, 16, 5, 3])
    for g, p, cap in zip(capped, plain, [3, 16, 5, 3]):
        assert len(g.response_ids) <= cap and g.response_ids == p.response_ids[:len(g.response_ids)]   # greedy


def test_release_and_resume_memory_leave_outputs_unchanged(model_path):
    engine = FastEngine(model_path, device="cpu", max_batch_size=3)
    params = SamplingParams(temperature=0.8, max_new_tokens=12, seed=5)
    before = engine.generate(MANY, params)
    engine.release_memory()
    engine.release_memory()  # idempotent
    assert engine._cache is None
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate(PROMPTS, GREEDY)
    engine.resume_memory()
    engine.resume_memory()
    assert engine.generate(MANY, params) == before


def test_memory_tags_the_fast_engine_does_not_hold_released_are_no_ops(model_path):
    # the run's hand-off (miles.cluster.memory): release every tag, resume "weights" before the push
    # (they never left: nothing to do), then the KV cache and the graphs after it
    engine = FastEngine(model_path, device="cpu", max_batch_size=3)
    engine.release_memory(("weights",))
    assert engine._cache is not None
    engine.release_memory(("weights", "kv_cache", "cuda_graph"))
    engine.resume_memory(("weights",))
    assert engine._cache is None
    engine.resume_memory(("kv_cache", "cuda_graph"))
    assert engine._cache is not None and len(engine.generate(PROMPTS, GREEDY)) == len(PROMPTS)


def test_tokenizer_accessors_and_dispose(model_path):
    engine = FastEngine(model_path, device="cpu")
    assert engine.eos_token_id == EOS_ID and engine.pad_token_id == 0
    assert engine.decode([5, 6, 14, 11, 18, 20, EOS_ID]) == "12+7= "
    assert engine.weights_dtype() == torch.float32 and engine.generate([], GREEDY) == []
    engine.dispose()
    engine.dispose()  # idempotent
    with pytest.raises(EngineDisposedError):
        engine.generate(PROMPTS, GREEDY)


def test_supports_names_what_it_cannot_run(tmp_path):
    base = dict(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=64)
    assert fast_model.supports(Qwen2Config(**base)) is None
    assert fast_model.supports(LlamaConfig(**base)) is None
    assert "sliding-window" in fast_model.supports(Qwen2Config(**base, use_sliding_window=True, max_window_layers=0))
    assert "'dynamic'" in fast_model.supports(LlamaConfig(**base, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert "mlp_bias" in fast_model.supports(LlamaConfig(**base, mlp_bias=True))
    assert "gelu" in fast_model.supports(LlamaConfig(**base, hidden_act="gelu"))
    from transformers import GPT2Config, GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not implemented.*use EmbeddedEngine"):
        FastEngine(str(tmp_path), device="cpu")


def test_compiled_pieces_serve_every_engine_and_size_of_a_model_without_recompiling(monkeypatch, tmp_path):
    # dynamo's guards and recompile counting do not depend on the backend: "eager" shows them on CPU in
    # seconds. Three (model, dtype) pairs and two slot counts in one process, as in a GPU test session:
    # one shared compile would need a variant per pair (recompile_limit 2 stops that at the third);
    # each pair must instead compile once, for every engine and every batch and prompt size
    monkeypatch.setattr(fast_model, "COMPILE_BACKEND", "eager")
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=0)
    qwen2, llama = make_tiny_model(tmp_path / "qwen2"), make_tiny_llama(tmp_path / "llama")
    with torch._dynamo.config.patch(recompile_limit=2):
        for path, dtype in ((qwen2, "float32"), (qwen2, "bfloat16"), (llama, "float32")):
            for slots in (3, 64):
                engine = FastEngine(path, device="cpu", dtype=dtype, max_batch_size=slots)
                engine._use_compiled(True)
                engine._compile_shapes()      # the CUDA warm-up's compile: raises past the limit
            with torch._dynamo.config.patch(error_on_recompile=True):
                gens = engine.generate(MANY, params)   # prefills of several sizes, decode buckets 2..64
            assert engine._forward.compiled and len({len(g.response_ids) for g in gens}) > 1


def test_cache_plan_fits_the_memory_or_names_the_flags():
    gib = 1 << 30
    plan = dict(free_bytes=10 * gib, slots=8, bytes_per_position=1 << 20, workspace_bytes=gib)
    # 0.5 of 10 GiB = 5 GiB = 5120 positions of 1 MiB over 8 slots = 640 per slot
    assert plan_positions(mem_fraction=0.5, model_limit=None, max_context_len=None, **plan) == 640
    assert plan_positions(mem_fraction=0.5, model_limit=300, max_context_len=None, **plan) == 300
    assert plan_positions(mem_fraction=0.5, model_limit=None, max_context_len=600, **plan) == 600
    # rounded down to 64 positions, but never below what every request may need (a run's context_len)
    assert plan_positions(mem_fraction=0.5, model_limit=None, max_context_len=None, needed=600, **plan) == 640
    odd = dict(plan, free_bytes=plan["free_bytes"] * 620 // 640)
    assert plan_positions(mem_fraction=0.5, model_limit=None, max_context_len=None, **odd) == 576
    assert plan_positions(mem_fraction=0.5, model_limit=None, max_context_len=None, needed=600, **odd) == 620
    with pytest.raises(ValueError, match=r"--rollout-max-batch-size 8 x --rollout-max-context-len 700 needs "
                                         r"5.47 GiB.*--rollout-mem-fraction 0.5.*fits 640 positions"):
        plan_positions(mem_fraction=0.5, model_limit=None, max_context_len=700, **plan)
    # --rollout-mem-fraction's range (0, 1) is the config's rule, checked once (tests/unit/test_check_registry.py)
    with pytest.raises(ValueError, match="leaves 0.50 GiB .* need about 1.00 GiB; lower --rollout-mem-fraction"):
        plan_positions(mem_fraction=0.95, model_limit=None, max_context_len=None, **plan)
    with pytest.raises(ValueError, match="exceeds the model's 512 positions"):
        plan_positions(mem_fraction=0.5, model_limit=512, max_context_len=600, **plan)


def _interpreter_scalars_as_loop_bounds(monkeypatch) -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into loop bounds
    with int(array), which numpy >= 2.? refuses for arrays that are not 0-d: take the element."""
    import triton.runtime.interpreter as interp

    patch = interp._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interp, "_patch_lang_tensor", patched)


def kernel_device(monkeypatch) -> str:
    """Where the Triton attention kernel runs: CUDA, or the CPU under Triton's interpreter (TRITON_INTERPRET=1
    with triton installed); skips the test elsewhere (CI)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA, or TRITON_INTERPRET=1 to run the Triton kernel on the CPU")
    _interpreter_scalars_as_loop_bounds(monkeypatch)
    return "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_length_aware_attention_kernel_equals_the_masked_stock_call(dtype, monkeypatch):
    device = kernel_device(monkeypatch)
    kv_heads, group, dim, max_len = 2, 7, 64, 150            # 150: the last key block is partial
    g = torch.Generator().manual_seed(0)
    q = torch.randn((4, kv_heads, group, dim), generator=g).to(device, dtype)
    kc, vc = (torch.randn((6, kv_heads, max_len, dim), generator=g).to(device, dtype) for _ in range(2))
    pos = torch.tensor([0, 63, 64, 149], device=device)       # 1 key, a full block, one past it, all
    valid = torch.arange(max_len, device=device) <= pos[:, None]
    mask = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(~valid, float("-inf"))[:, None, None]
    want = sdpa_decode_attention(q, kc, vc, pos, dim ** -0.5, max_len, mask).float()
    got = decode_attention(q, kc, vc, pos, dim ** -0.5).float()
    # float32 runs the kernel's dots in IEEE precision (TF32 would give ~2e-3): a tight check of the algorithm
    assert (got - want).abs().max() < (1e-4 if dtype == torch.float32 else 5e-3)
    # slot 0 attends to its first key only: its output is that key's value
    assert torch.allclose(got[0], vc[0, :, :1].float().expand(kv_heads, group, dim), atol=1e-3)


def test_buckets_cover_every_size_with_little_waste():
    assert batch_buckets(1) == [2] and batch_buckets(256)[-1] == 256 and 192 in batch_buckets(256)
    assert span_buckets(320) == [64, 96, 128, 192, 256, 320]
    for n in range(2, 257):
        b = min(x for x in batch_buckets(256) if x >= n)
        assert b < 1.5 * n + 2
    assert span_buckets(10) == [10]
    assert math.isclose(max(s2 / s1 for s1, s2 in zip(span_buckets(4096), span_buckets(4096)[1:])), 1.5)


def _stop_string_in(gens: list, tokenizer) -> str:
    """Two characters from the middle of the longest greedy answer (a stop string these outputs reach;
    none of the special tokens' text, which the engines' rule reads too)."""
    text = tokenizer.decode(max(gens, key=lambda g: len(g.response_ids)).response_ids, skip_special_tokens=True)
    return text[len(text) // 3:len(text) // 3 + 2]


def _ends_at_the_first_stop(g, prompt_free_text, stops) -> bool:
    """The response's text holds a stop string, and no shorter prefix of it does (the engines' rule)."""
    texts = [prompt_free_text(g.response_ids[:k]) for k in range(len(g.response_ids) + 1)]
    return any(s in texts[-1] for s in stops) and not any(s in t for t in texts[:-1] for s in stops)


@pytest.mark.parametrize("window", [None, 2])
def test_stop_strings_end_each_response_as_the_embedded_engine_does(model_path, window, monkeypatch):
    # 11 prompts through 3 slots: a stop found while its sequence runs frees the slot for a queued prompt,
    # one found when the call ends (a sequence that reached its cap first) cuts the output only. With a
    # window of 2 tokens a snapshot misses most new tokens, which are then read from the device
    if window is not None:
        monkeypatch.setattr(fast_engine, "STOP_WINDOW", window)
    fast, embedded = FastEngine(model_path, device="cpu", max_batch_size=3), EmbeddedEngine(model_path, device="cpu")
    plain = fast.generate(MANY, SamplingParams(temperature=0.0, max_new_tokens=96))
    stops = (_stop_string_in(plain, fast.tokenizer), "zz")
    params = SamplingParams(temperature=0.0, max_new_tokens=96, stop=stops)
    got, want = fast.generate(MANY, params), embedded.generate(MANY, params)
    assert [g.response_ids for g in got] == [g.response_ids for g in want]
    assert [g.finish_reason for g in got] == [g.finish_reason for g in want]
    for g, w, p in zip(got, want, plain):
        assert g.response_ids == p.response_ids[:len(g.response_ids)]
        assert max((abs(x - y) for x, y in zip(g.logprobs, w.logprobs)), default=0.0) < 1e-4
    cut = [g for g, p in zip(got, plain) if len(g.response_ids) < len(p.response_ids)]
    assert len(cut) >= 2 and all(g.finish_reason == "stop" for g in cut)
    def text(ids):
        return fast.tokenizer.decode(ids, skip_special_tokens=False)
    assert all(_ends_at_the_first_stop(g, text, stops) for g in cut)


def test_a_stop_string_frees_its_slot_while_the_call_runs(model_path):
    # every answer stops at its first token; 11 prompts through 3 slots: each slot is seen free at the
    # next snapshot and takes a queued prompt, so the call ends after a few steps a wave (not 4 x 63)
    fast = FastEngine(model_path, device="cpu", max_batch_size=3)
    never = SamplingParams(temperature=0.0, max_new_tokens=64, stop_token_ids=())
    plain = fast.generate(MANY, never)
    assert fast.last_stats["decode_steps"] >= 3 * 63
    early = tuple(sorted({fast.tokenizer.decode(g.response_ids[:1]) for g in plain}))   # each one's first token
    gens = fast.generate(MANY, replace(never, stop=early))
    assert [g.response_ids for g in gens] == [p.response_ids[:1] for p in plain]
    assert {g.finish_reason for g in gens} == {"stop"}
    assert fast.last_stats["decode_steps"] < 64


def test_sampled_responses_with_stop_strings_are_reproducible_and_end_at_the_first(model_path):
    fast = FastEngine(model_path, device="cpu", max_batch_size=3)
    plain = fast.generate(MANY, SamplingParams(temperature=0.0, max_new_tokens=64))
    stops = (_stop_string_in(plain, fast.tokenizer), "7")
    params = SamplingParams(temperature=1.0, max_new_tokens=64, stop=stops, seed=11)
    gens = fast.generate(MANY * 2, params)
    assert gens == fast.generate(MANY * 2, params)
    def text(ids):
        return fast.tokenizer.decode(ids, skip_special_tokens=False)
    stopped = [g for g in gens if g.finish_reason == "stop" and g.response_ids[-1] != EOS_ID]
    assert len(stopped) >= 3
    assert all(_ends_at_the_first_stop(g, text, stops) for g in stopped)
    assert not any(s in text(g.response_ids) for g in gens if g not in stopped for s in stops)


def test_max_context_len_caps_each_response_by_its_prompt_as_the_embedded_engine(model_path):
    fast, embedded = FastEngine(model_path, device="cpu", max_batch_size=3), EmbeddedEngine(model_path, device="cpu")
    never = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=())
    plain = fast.generate(MANY, never)
    capped = replace(never, max_context_len=14)
    got, want = fast.generate(MANY, capped), embedded.generate(MANY, capped)
    assert [g.response_ids for g in got] == [g.response_ids for g in want]
    for prompt, g, p in zip(MANY, got, plain):
        assert g.response_ids == p.response_ids[:len(g.response_ids)]
        if g.finish_reason == "length":
            assert len(prompt) + len(g.response_ids) == min(14, len(prompt) + 20)
    assert len({len(g.response_ids) for g in got if g.finish_reason == "length"}) > 3   # caps that differ
    with pytest.raises(ValueError, match="leaves no room for a response under max_context_len 5"):
        fast.generate([[5, 6, 7, 8, 9]], replace(never, max_context_len=5))


def test_requests_with_different_caps_share_the_decode_batch(model_path):
    fast = FastEngine(model_path, device="cpu", max_batch_size=4)
    never = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=())
    fast.generate(PROMPTS, never, [3, 16, 5, 3])
    assert fast.last_stats["prefills"] == 1 and fast.last_stats["decode_steps"] == 15   # one batch, not one per cap


@pytest.mark.parametrize("kind", ["fast", "embedded"])
def test_a_tail_cut_returns_the_call_with_its_last_requests_cut_short(model_path, kind):
    """SamplingParams.tail_cut_share (the fully-async producer's --async-tail-cut-share): once no request
    waits and at most that share of the batch still runs, the call returns; those end "abort" with what they
    generated, a prefix of what the uncut call gives (greedy), the others as the uncut call ends them."""
    engine = FastEngine(model_path, device="cpu", max_batch_size=4) if kind == "fast" else \
        EmbeddedEngine(model_path, device="cpu", max_batch_size=4)
    never = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=())
    caps = [3, 40, 3, 40]
    plain = engine.generate(PROMPTS, never, caps)
    assert engine.generate(PROMPTS, replace(never, tail_cut_share=0.0), caps) == plain
    assert engine.generate(PROMPTS, replace(never, tail_cut_share=0.24), caps) == plain     # 0.24 x 4: none cut
    cut = engine.generate(PROMPTS, replace(never, tail_cut_share=0.5), caps)                 # 2 of the 4
    for g, p, cap in zip(cut, plain, caps):
        assert g.response_ids == p.response_ids[:len(g.response_ids)] and g.logprobs == p.logprobs[:len(g.logprobs)]
        if cap == 3:
            assert g == p                                  # ended before the cut, as in the plain call
    long = [(g, p) for g, p, cap in zip(cut, plain, caps) if cap == 40 and p.finish_reason == "length"]
    assert long, [p.finish_reason for p in plain]           # the tiny model's greedy answers run to the cap
    assert all(g.finish_reason == "abort" and 3 <= len(g.response_ids) < 40 for g, _ in long)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"tail_cut_share must be in \[0, 1\)"):
            engine.generate(PROMPTS, replace(never, tail_cut_share=bad))


def test_the_tail_cut_is_a_share_of_the_batch_not_of_a_call_longer_than_the_slots(model_path):
    """8 requests on 4 slots, the second wave capped 10 / 20 / 30 / 40: a share 0.5 of the batch cuts when
    2 of the 4 slots still run (after the 20-token one ends), not when 4 of the 8 requests do, which is the
    moment the second wave starts with its batch full."""
    engine = FastEngine(model_path, device="cpu", max_batch_size=4)
    never = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=(), tail_cut_share=0.5)
    plain = engine.generate(PROMPTS, replace(never, tail_cut_share=0.0))
    long = [p for p, g in zip(PROMPTS, plain) if g.finish_reason == "length"]    # greedy answers that run to the cap
    assert long, [g.finish_reason for g in plain]
    prompts = [long[i % len(long)] for i in range(8)]
    gens = engine.generate(prompts, never, [40] * 4 + [10, 20, 30, 40])
    assert [g.finish_reason for g in gens] == ["length"] * 6 + ["abort"] * 2, [g.finish_reason for g in gens]
    assert [len(g.response_ids) for g in gens[:6]] == [40] * 4 + [10, 20]
    assert all(20 <= len(g.response_ids) < 30 for g in gens[6:])


@pytest.mark.parametrize("page_size", [None, 16])
def test_one_token_requests_beyond_the_slots_are_all_served(model_path, page_size):
    # each ends at its prefill, so no slot is ever busy at a decode step: the queue behind them still runs
    # (the loop returned with the slots' worth served and the rest "abort" and empty before Dec 8)
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    engine = FastEngine(model_path, device="cpu", max_batch_size=2, page_size=page_size)
    got = engine.generate(MANY, params)
    want = EmbeddedEngine(model_path, device="cpu").generate(MANY, params)
    assert [g.response_ids for g in got] == [g.response_ids for g in want]
    assert all(len(g.response_ids) == 1 and g.finish_reason in ("length", "stop") for g in got)
