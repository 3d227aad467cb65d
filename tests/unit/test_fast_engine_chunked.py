"""FastEngine's chunked prefill on CPU (float32, eager): prompts longer than `chunked_prefill_size`
prefilled piece by piece, beside the decode steps of the running sequences, with the outputs of
the unchunked engine and of a plain transformers forward."""

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.rollout.engines.fast import model as fast_model
from miles.rollout.engines.fast.engine import FastEngine
from miles.types import SamplingParams
from tests.tiny_model import make_tiny_model
from tests.unit.test_fast_engine import MANY, chi_square_p, model_path, reference_greedy  # noqa: F401 (a fixture)

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
# with chunks of 4: 1 token, exactly one chunk, exactly two and three chunks, one past two chunks
EDGES = [[9], [5, 6, 14, 11], [7, 8, 9, 10, 11, 12, 13, 14], [4 + i % 25 for i in range(12)],
         [21, 22, 20, 23, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def unchunked(model_path):
    return FastEngine(model_path, device="cpu", max_batch_size=3)


@pytest.mark.parametrize("size", [1, 3, 4])
def test_greedy_equals_the_unchunked_engine_and_a_full_forward_loop(model_path, unchunked, size):
    # more requests than slots, long and short mixed: pieces of some run while others decode,
    # finish and are refilled
    chunked = FastEngine(model_path, device="cpu", max_batch_size=3, chunked_prefill_size=size)
    prompts = EDGES + MANY
    got, want = chunked.generate(prompts, GREEDY), unchunked.generate(prompts, GREEDY)
    assert chunked.last_stats["prefill_pieces"] == sum(-(-len(p) // size) for p in prompts if len(p) > size)
    hf = AutoModelForCausalLM.from_pretrained(model_path).eval()
    for prompt, g, w in zip(prompts, got, want):
        assert g.response_ids == w.response_ids
        assert g.finish_reason == w.finish_reason
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-5
    for prompt, g in zip(EDGES, got):
        ids, lps = reference_greedy(hf, prompt, GREEDY.max_new_tokens)
        assert g.response_ids == ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, lps)) < 1e-5
    assert len({len(g.response_ids) for g in got}) > 2      # answers end at different steps


def test_pieces_write_the_cache_and_logits_of_one_whole_prefill(model_path, unchunked):
    # the piece path of Forward.prefill itself: K/V at the right positions, the last token's logits
    fwd, cache = unchunked._forward, unchunked._cache
    prompt = torch.tensor([[4 + (3 * i) % 25 for i in range(11)]])
    lens, slots = torch.tensor([11]), torch.tensor([0])
    with torch.inference_mode():
        whole = fwd.prefill(prompt, lens, slots, cache.layers)
        kv_whole = [(k[0, :, :11].clone(), v[0, :, :11].clone()) for k, v in cache.layers]
        for k, v in cache.layers:
            k[1].fill_(7.0), v[1].fill_(7.0)      # slot 1 starts dirty: every position is written first
        for start, end in ((0, 4), (4, 8), (8, 11)):
            last = fwd.prefill(prompt[:, start:end], torch.tensor([end - start]), torch.tensor([1]), cache.layers,
                               starts=torch.tensor([start]), span=end)
    assert torch.allclose(last, whole, atol=1e-5, rtol=0)
    for (k, v), (kw, vw) in zip(cache.layers, kv_whole):
        assert torch.allclose(k[1, :, :11], kw, atol=1e-5, rtol=0)
        assert torch.allclose(v[1, :, :11], vw, atol=1e-5, rtol=0)


def test_long_prompts_are_prefilled_beside_the_decode_steps(model_path, monkeypatch):
    # one piece per loop iteration, and a decode step of the running sequences between pieces: the
    # short prompts answer while the long one (7 pieces of 2) is prefilled, not after it
    engine = FastEngine(model_path, device="cpu", max_batch_size=3, chunked_prefill_size=2)
    events = []
    for name in ("_piece", "_decode"):
        method = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, _m=method, _n=name: (events.append(_n), _m(*a))[1])
    long_prompt = [4 + i % 25 for i in range(13)]
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    gens = engine.generate([[5, 6], long_prompt, [7, 8]], params)
    pieces = [i for i, e in enumerate(events) if e == "_piece"]
    assert len(pieces) == 7
    assert all(events[i + 1] == "_decode" for i in pieces)      # every piece followed by a decode step
    alone = FastEngine(model_path, device="cpu", max_batch_size=1).generate([long_prompt], params)
    assert gens[1].response_ids == alone[0].response_ids


def test_sampling_is_reproducible_and_follows_the_distribution(model_path, unchunked):
    # pieces consume no randomness but take their first draw at a later step than an unchunked prefill,
    # so seeded samples are the chunked engine's own (reproducible), not the unchunked engine's; their
    # distribution is the model's
    engine = FastEngine(model_path, device="cpu", max_batch_size=64, chunked_prefill_size=2)
    seeded = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    assert engine.generate(EDGES + MANY, seeded) == engine.generate(EDGES + MANY, seeded)
    prompt, n = [5, 6, 14], 1500
    gens = engine.generate([prompt] * n, SamplingParams(temperature=1.0, max_new_tokens=1, seed=5))
    hf = AutoModelForCausalLM.from_pretrained(model_path).eval()
    with torch.no_grad():
        probs = torch.softmax(hf(input_ids=torch.tensor([prompt])).logits[0, -1].double(), -1)
    counts = Counter(g.response_ids[0] for g in gens)
    assert chi_square_p(counts, probs, n) > 1e-3
    assert chi_square_p(counts, torch.softmax(probs.log() / 0.5, -1), n) < 1e-6   # it has power


def test_compiled_pieces_do_not_recompile(monkeypatch, tmp_path):
    # as test_fast_engine's compile test: "eager" shows dynamo's guards on CPU; after the warm-up, pieces
    # of every width and start, beside whole-prompt prefills, reuse the compiled layer pieces
    monkeypatch.setattr(fast_model, "COMPILE_BACKEND", "eager")
    engine = FastEngine(make_tiny_model(tmp_path / "qwen2"), device="cpu", max_batch_size=3, chunked_prefill_size=3)
    with torch._dynamo.config.patch(recompile_limit=2):   # whole prompts (n >= 2) and pieces (n = 1): two variants
        engine._use_compiled(True)
        engine._compile_shapes()
    with torch._dynamo.config.patch(error_on_recompile=True):
        gens = engine.generate(EDGES + MANY, SamplingParams(temperature=1.0, max_new_tokens=6, seed=0))
    assert engine._forward.compiled and engine.last_stats["prefill_pieces"] > 10 and len(gens) == len(EDGES + MANY)


def test_the_flag_reaches_the_engine_and_bad_values_are_refused(tmp_path):
    from inspect import signature

    from miles.config.flags import parse_flags
    from miles.config.schema import ConfigError
    from miles.rollout.engines.fast.spec import CHUNKED_PREFILL_SIZE, options

    data = tmp_path / "p.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    base = ["--hf-checkpoint", make_tiny_model(tmp_path / "model"), "--prompt-data", str(data),
            "--rollout-batch-size", "1", "--num-rollout", "1", "--n-samples-per-prompt", "2",
            "--rollout-engine", "fast"]
    cfg, _ = parse_flags(base + ["--rollout-chunked-prefill-size", "512"])
    assert options(cfg)["chunked_prefill_size"] == 512
    default, _ = parse_flags(base)
    assert "chunked_prefill_size" not in options(default)    # the engine's own default
    assert signature(FastEngine).parameters["chunked_prefill_size"].default == CHUNKED_PREFILL_SIZE == 8192
    with pytest.raises(ConfigError, match="--rollout-chunked-prefill-size 0: must be a positive integer"):
        parse_flags(base + ["--rollout-chunked-prefill-size", "0"])
    sglang = [a if a != "fast" else "sglang" for a in base]
    with pytest.raises(ConfigError, match="an SGLang server's is --sglang-chunked-prefill-size N"):
        parse_flags(sglang + ["--rollout-chunked-prefill-size", "512"])
