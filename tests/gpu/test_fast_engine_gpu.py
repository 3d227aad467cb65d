"""FastEngine on CUDA with CUDA graphs and torch.compile on; skipped without a GPU.

float32 engines are held to exact greedy equality with transformers' forward of the same weights
(the arithmetic is float32 either way); bfloat16 engines to bf16 tolerances. Run on the GPU
machine with only torch, transformers and structlog (no Ray):
    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_fast_engine_gpu.py -x -q
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.rollout.engines.embedded.engine import EmbeddedEngine
from miles.rollout.engines.fast.engine import FastEngine
from miles.types import SamplingParams
from miles.weights.hf import model_weights
from tests.tiny_model import EOS_ID, make_tiny_model
from tests.unit.test_fast_engine import MANY, PROMPTS, make_tiny_llama, own_logprob_p_values, sampling_p_values

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_path(request, tmp_path_factory):
    make = make_tiny_model if request.param == "qwen2" else make_tiny_llama
    return make(tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def fp32(model_path):
    return FastEngine(model_path, device="cuda", dtype="float32", max_batch_size=256)


@pytest.fixture(scope="module")
def bf16(model_path):
    return FastEngine(model_path, device="cuda", max_batch_size=8)


def hf(model_path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to("cuda").eval()


@torch.no_grad()
def full_forward_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """float32 logits [len(response), V] predicting each response token, one forward over all of it."""
    return model(input_ids=torch.tensor([prompt + response], device="cuda")).logits[0, len(prompt) - 1:-1].float()


def assert_fast_path(engine: FastEngine) -> None:
    assert engine._forward.compiled, "torch.compile fell back to eager (see the torch_compile_failed log line)"
    assert engine._graphs.enabled and len(engine._graphs) > 0
    if engine.dtype != torch.float32:   # float32 keeps the stock attention call by design
        assert engine._forward.length_aware, "the attention kernel was refused (see attention_kernel_* log lines)"


def test_attention_kernel_equals_the_masked_stock_call_in_bf16():
    from miles.rollout.engines.fast.attention import decode_attention, sdpa_decode_attention

    kv_heads, group, dim, max_len = 2, 7, 64, 1000
    q = torch.randn((6, kv_heads, group, dim), device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn((9, kv_heads, max_len, dim), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pos = torch.tensor([0, 1, 63, 64, 500, 999], device="cuda")
    valid = torch.arange(max_len, device="cuda") <= pos[:, None]
    mask = torch.zeros(valid.shape, dtype=torch.bfloat16, device="cuda").masked_fill_(~valid, float("-inf"))
    want = sdpa_decode_attention(q, kc, vc, pos, dim ** -0.5, max_len, mask[:, None, None]).float()
    got = decode_attention(q, kc, vc, pos, dim ** -0.5).float()
    assert (got - want).abs().max() < 2e-2


def test_fp32_greedy_equals_the_full_forward_argmax(model_path, fp32):
    model = hf(model_path)
    for prompt, g in zip(PROMPTS, fp32.generate(PROMPTS, GREEDY)):
        logits = full_forward_logits(model, prompt, g.response_ids)
        assert g.response_ids == logits.argmax(-1).tolist()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.response_ids, device="cuda")[:, None])
        assert (lp.squeeze(-1).cpu() - torch.tensor(g.logprobs)).abs().max() < 1e-3
        assert g.finish_reason == ("stop" if g.response_ids[-1] == EOS_ID else "length")
    assert_fast_path(fp32)


def test_bf16_logprobs_and_greedy_within_bf16_tolerance(model_path, bf16):
    model = hf(model_path, torch.bfloat16)
    params = SamplingParams(temperature=0.8, max_new_tokens=24, seed=0)
    diffs = []
    for prompt, g in zip(PROMPTS * 4, bf16.generate(PROMPTS * 4, params)):
        logits = full_forward_logits(model, prompt, g.response_ids)
        lp = torch.log_softmax(logits / 0.8, -1).gather(-1, torch.tensor(g.response_ids, device="cuda")[:, None])
        diffs += (lp.squeeze(-1).cpu() - torch.tensor(g.logprobs)).abs().tolist()
    assert sum(diffs) / len(diffs) < 0.05 and max(diffs) < 0.5, (sum(diffs) / len(diffs), max(diffs))
    for prompt, g in zip(PROMPTS, bf16.generate(PROMPTS, GREEDY)):
        # each greedy token is the reference's argmax up to a bf16 near-tie
        logits = full_forward_logits(model, prompt, g.response_ids)
        chosen = logits.gather(-1, torch.tensor(g.response_ids, device="cuda")[:, None]).squeeze(-1)
        assert (logits.max(-1).values - chosen).max() < 0.25
    assert_fast_path(bf16)


def test_continuous_batching_equals_one_by_one_and_eager(model_path, fp32):
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    # the fp32 engine (256 slots) compiled this model's pieces: an engine of other slot counts, batch
    # and prompt sizes reuses them (a recompile here would raise, and the warm-up fall back to eager)
    with torch._dynamo.config.patch(error_on_recompile=True):
        small = FastEngine(model_path, device="cuda", dtype="float32", max_batch_size=3)
        batched = small.generate(MANY, params)
    eager = FastEngine(model_path, device="cuda", dtype="float32", max_batch_size=3, cuda_graph=False,
                       torch_compile=False)
    plain = eager.generate(MANY, params)
    for prompt, b, e in zip(MANY, batched, plain):
        alone, = fp32.generate([prompt], params)
        assert b.response_ids == alone.response_ids == e.response_ids
        assert b.finish_reason == alone.finish_reason == e.finish_reason
    assert len({len(b.response_ids) for b in batched}) > 2
    assert_fast_path(small)


def test_stop_strings_caps_and_context_len_equal_the_embedded_engine(model_path, fp32):
    """The host-side stop strings (snapshots of each slot's newest tokens, slots freed mid-call), each
    request's own cap and --rollout-max-context-len with graphs and compiled pieces on: the float32
    greedy outputs are the embedded engine's on the same GPU."""
    from tests.unit.test_fast_engine import _stop_string_in

    small = FastEngine(model_path, device="cuda", dtype="float32", max_batch_size=3)
    embedded = EmbeddedEngine(model_path, device="cuda", dtype="float32")
    plain = small.generate(MANY, SamplingParams(temperature=0.0, max_new_tokens=96))
    params = SamplingParams(temperature=0.0, max_new_tokens=96, stop=(_stop_string_in(plain, small.tokenizer),),
                            max_context_len=90)
    caps = [96 - 7 * (i % 5) for i in range(len(MANY))]
    got, want = small.generate(MANY, params, caps), embedded.generate(MANY, params, caps)
    assert [(g.response_ids, g.finish_reason) for g in got] == [(w.response_ids, w.finish_reason) for w in want]
    assert any(g.finish_reason == "stop" and len(g.response_ids) < len(p.response_ids) for g, p in zip(got, plain))
    assert all(len(prompt) + len(g.response_ids) <= 90 for prompt, g in zip(MANY, got))
    assert_fast_path(small)


def test_health_and_abort_beside_a_running_call_on_the_gpu(tmp_path, monkeypatch):
    """health() and abort() from another thread while a call replays graphs (the unit test's checks)."""
    from tests.unit.test_engine_health import test_health_reports_progress_of_a_running_call_and_abort_stops_it

    engine = FastEngine(make_tiny_model(tmp_path / "m"), device="cuda", dtype="float32", max_batch_size=4)
    assert engine.health() == {"busy": False, "since_progress_s": 0.0}     # idle: a one-token generate
    test_health_reports_progress_of_a_running_call_and_abort_stops_it(engine, monkeypatch)
    assert_fast_path(engine)


def test_chunked_prefill_equals_the_unchunked_engine(model_path, fp32, bf16):
    # prompts of up to 100 tokens in pieces of 16 (one piece per decode step of the running ones), more
    # requests than slots. The fixtures compiled this model's pieces for both dtypes, the one-row piece
    # variant included: the chunked engines reuse them (a recompile here raises)
    long = [[4 + (7 * i + j) % 25 for j in range(n)] for i, n in enumerate((16, 17, 32, 47, 100))]
    prompts = long + MANY
    with torch._dynamo.config.patch(error_on_recompile=True):
        chunked = FastEngine(model_path, device="cuda", dtype="float32", max_batch_size=3, chunked_prefill_size=16)
        got = chunked.generate(prompts, GREEDY)
        chunked_bf16 = FastEngine(model_path, device="cuda", max_batch_size=3, chunked_prefill_size=16)
        got_bf16 = chunked_bf16.generate(prompts, GREEDY)
    assert chunked.last_stats["prefill_pieces"] == 2 + 2 + 3 + 7   # the 16-token prompt is one whole prefill
    model = hf(model_path)
    for prompt, g, w in zip(prompts, got, fp32.generate(prompts, GREEDY)):   # float32: exact, as unchunked
        assert g.response_ids == w.response_ids
        assert g.finish_reason == w.finish_reason
        assert (torch.tensor(g.logprobs) - torch.tensor(w.logprobs)).abs().max() < 1e-4
    for prompt, g in zip(long, got):
        assert g.response_ids == full_forward_logits(model, prompt, g.response_ids).argmax(-1).tolist()
    model = hf(model_path, torch.bfloat16)
    for prompt, g in zip(prompts, got_bf16):   # bf16: each greedy token the reference's argmax up to a near-tie
        logits = full_forward_logits(model, prompt, g.response_ids)
        chosen = logits.gather(-1, torch.tensor(g.response_ids, device="cuda")[:, None]).squeeze(-1)
        assert (logits.max(-1).values - chosen).max() < 0.25
    assert_fast_path(chunked)
    assert_fast_path(chunked_bf16)


def test_chunked_prefill_memory_is_the_pieces_not_the_prompts(tmp_path):
    # a 6,000-token prompt prefilled whole builds a [P, P] mask (144 MB in float32, and its 36 MB bool
    # source); in pieces of 512 under the implicit causal mask, the prefill's transients are a piece's
    # activations and the slot's K/V so far: a few MB for this tiny model. Same greedy answer.
    path = make_tiny_model(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    prompt = [4 + (7 * j) % 25 for j in range(6000)]
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    peaks, answers = [], []
    for size in (8192, 512):
        engine = FastEngine(path, device="cuda", dtype="float32", max_batch_size=2, max_context_len=6100,
                            torch_compile=False, chunked_prefill_size=size)
        engine.generate([prompt], params)      # graphs captured, allocator warm
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        answers.append(engine.generate([prompt], params)[0].response_ids)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        assert engine.last_stats["prefill_pieces"] == (0 if size == 8192 else 12)
        del engine
    assert answers[0] == answers[1]
    assert peaks[1] * 4 < peaks[0], peaks


def test_sampling_is_reproducible_on_the_gpu(bf16):
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=4)
    assert bf16.generate(MANY, params) == bf16.generate(MANY, params)
    assert bf16.generate(MANY, SamplingParams(temperature=1.0, max_new_tokens=20, seed=5)) != \
           bf16.generate(MANY, params)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.5, -1, 1.0), (1.5, -1, 1.0),
                                                      (1.0, 4, 1.0), (1.0, -1, 0.7), (0.8, 6, 0.9)])
def test_sampling_matches_the_distribution(model_path, fp32, temperature, top_k, top_p):
    # first tokens come from the prefill's logits, second tokens from a graph-replayed decode step
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=2, seed=1)
    p_first, p_second = sampling_p_values(fp32, hf(model_path), params, 20000)
    assert p_first > 1e-3 and p_second > 1e-3, (p_first, p_second)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_bf16_sampling_matches_the_engines_own_logprobs(bf16, temperature):
    # bf16 logits differ from any reference's in the last bits, so the expected distribution is
    # the engine's own: the logprob it reports for each token (first tokens: the prefill's logits;
    # second tokens, after the most common first token that did not stop: a graph-replayed decode
    # step). The CPU twin of this test shows it fails a sampler that reports other logprobs.
    gens = bf16.generate([[5, 6, 14]] * 10000, SamplingParams(temperature=temperature, max_new_tokens=2, seed=3))
    p_first, p_second = own_logprob_p_values(gens)
    assert p_first > 1e-3 and p_second > 1e-3, (temperature, p_first, p_second)


def test_update_weights_in_place_keeps_graphs_valid(model_path, fp32):
    engine = FastEngine(model_path, device="cuda", dtype="float32", max_batch_size=4)
    before = engine.generate(PROMPTS, GREEDY)            # graphs captured with the old weights
    graphs = engine._graphs.captured()
    assert (4, 64) in graphs                             # the first step's: all four slots busy
    model = hf(model_path)
    with torch.no_grad():
        for t in model_weights(model).values():
            t.add_(0.1 * torch.randn_like(t))
    engine.update_weights(model_weights(model), version=2)
    embedded = EmbeddedEngine(model_path, device="cuda", dtype="float32")
    embedded.update_weights(model_weights(model), version=2)
    assert engine.weights_checksum() == embedded.weights_checksum()
    after = engine.generate(PROMPTS, GREEDY)
    assert all(engine._graphs.captured()[k] is g for k, g in graphs.items())  # the same graphs replayed ...
    assert [g.response_ids for g in after] != [g.response_ids for g in before]
    for prompt, g in zip(PROMPTS, after):                # ... now computing with the new weights
        assert g.response_ids == full_forward_logits(model, prompt, g.response_ids).argmax(-1).tolist()
        assert g.weight_version == 2


def test_twenty_calls_leave_peak_memory_flat(model_path):
    # Each call's outputs take ~150 KB on the device (265 x 48 x 12 bytes): keeping them (a leak) would
    # grow memory by ~3 MB over 20 calls, six times the slack allowed here. Identical calls (one seed)
    # make identical allocations, so once the first has captured the graphs it needs, their peak must
    # not move. Calls that differ refill slots in other patterns (prefills of other sizes, graphs of
    # batch sizes not seen yet): their peak may differ by such transients, within 1% of the warm
    # peak, and what they leave allocated must not grow at all.
    engine = FastEngine(model_path, device="cuda", max_batch_size=64)
    prompts, same = MANY * 24, SamplingParams(temperature=1.0, max_new_tokens=48, seed=5)
    for _ in range(2):
        engine.generate(prompts, same)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.generate(prompts, same)
    torch.cuda.synchronize()
    warm_peak = torch.cuda.max_memory_allocated()
    for _ in range(20):
        engine.generate(prompts, same)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() <= warm_peak + (1 << 19)
    assert torch.cuda.memory_allocated() <= allocated + (1 << 19)
    for _ in range(20):
        engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=48))
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() <= warm_peak * 1.01
    assert torch.cuda.memory_allocated() <= allocated + (1 << 19)


def test_release_and_resume_memory_on_the_gpu(model_path):
    engine = FastEngine(model_path, device="cuda", max_batch_size=64, max_context_len=128)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=2)
    before = engine.generate(MANY, params)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    cache = engine._cache.nbytes
    engine.release_memory()
    assert torch.cuda.memory_allocated() <= held - cache
    engine.release_memory()
    engine.resume_memory()
    assert engine.generate(MANY, params) == before


def test_too_long_requests_and_too_much_memory_fail_clearly(model_path, bf16):
    embedded = EmbeddedEngine(model_path, device="cuda")
    too_long = [[5] * (embedded._max_positions - 8)]
    with pytest.raises(ValueError) as fast_err:
        bf16.generate(too_long, SamplingParams(max_new_tokens=16))
    with pytest.raises(ValueError) as embedded_err:
        embedded.generate(too_long, SamplingParams(max_new_tokens=16))
    assert str(fast_err.value) == str(embedded_err.value)
    small = FastEngine(model_path, device="cuda", max_context_len=40)
    with pytest.raises(ValueError, match="exceeds the KV cache's 40 positions"):
        small.generate([[5] * 30], SamplingParams(max_new_tokens=16))
    with pytest.raises(ValueError, match="--rollout-max-batch-size 10000000 x --rollout-max-context-len 100"):
        FastEngine(model_path, device="cuda", max_batch_size=10_000_000, max_context_len=100)
    with pytest.raises(ValueError, match="leaves .* lower --rollout-mem-fraction"):
        FastEngine(model_path, device="cuda", mem_fraction=0.9999)
