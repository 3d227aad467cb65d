"""The in-flight weight swap (--fully-async, SupportsInFlightWeightSwap) of the embedded engine and of the
fast engine (on the CPU: eager, float32, the code path the GPU runs minus graphs), without Ray: a swap
during a running generate pauses its requests at a token boundary, loads the weights, and the requests
go on; each token records the version whose forward gave its logits; no request is lost."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.rollout.engines.embedded.engine import EmbeddedEngine
from miles.rollout.engines.fast.engine import FastEngine
from miles.rollout.engines.registry import ENGINES
from miles.rollout.protocol import SupportsInFlightWeightSwap
from miles.types import SamplingParams
from miles.weights.hf import load_weights, model_weights
from tests.tiny_model import make_tiny_model

NORM = "model.norm.weight"      # the final norm: changes the logits, not the K/V a forward writes


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m"))


# the engine, and its method that runs once per token step (slowed so that a swap lands mid-call)
STEP = {"embedded": "_forward", "fast": "_decode"}


@pytest.fixture(scope="module", params=list(STEP))
def engine(request, model_path):
    torch.set_num_threads(1)
    if request.param == "embedded":
        return EmbeddedEngine(model_path, device="cpu", dtype="float32", seed=0, max_batch_size=4)
    return FastEngine(model_path, device="cpu", dtype="float32", seed=0, max_batch_size=4)


def _weights(engine, scale: float = 1.0) -> dict[str, torch.Tensor]:
    named = model_weights(engine._model) if isinstance(engine, EmbeddedEngine) else engine._weights.named
    return {k: v.detach().clone() * scale for k, v in named.items()}


def _no_eos(engine, monkeypatch) -> None:
    monkeypatch.setattr(engine, "_eos_ids", set())      # no request stops early: all are in flight at the swap


def _slowed(engine, monkeypatch, at: int) -> threading.Event:
    """Slow the engine's token step; the event is set at its `at`-th call."""
    step, calls, reached = getattr(engine, STEP[_kind(engine)]), {"n": 0}, threading.Event()

    def slowed(*args, **kw):
        calls["n"] += 1
        if calls["n"] == at:
            reached.set()
        time.sleep(0.02)
        return step(*args, **kw)

    monkeypatch.setattr(engine, STEP[_kind(engine)], slowed)
    return reached


def _kind(engine) -> str:
    return "embedded" if isinstance(engine, EmbeddedEngine) else "fast"


def _generate_with_swap(engine, monkeypatch, prompts, params, new_weights, version, at: int = 5):
    """engine.generate(prompts, params) on a thread, with `swap_weights(new_weights, version)` once the
    call has run `at` token steps; returns (the generations, what swap_weights returned)."""
    reached = _slowed(engine, monkeypatch, at)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("g", engine.generate(prompts, params)), daemon=True)
    t.start()
    assert reached.wait(10)
    swapped = engine.swap_weights(new_weights, version)
    t.join(60)
    assert not t.is_alive()
    monkeypatch.undo()
    return out["g"], swapped


def test_the_specs_declare_it():
    assert ENGINES["embedded"].supports(SupportsInFlightWeightSwap)
    assert ENGINES["fast"].supports(SupportsInFlightWeightSwap)
    assert issubclass(EmbeddedEngine, SupportsInFlightWeightSwap) and issubclass(FastEngine, SupportsInFlightWeightSwap)
    assert ENGINES["fast"].actor_threads >= 3       # health, abort and the swap beside a running generate
    assert not ENGINES["sglang"].supports(SupportsInFlightWeightSwap)


def test_idle_engine_swaps_at_once(engine):
    before = engine.weight_version()
    out = engine.swap_weights(_weights(engine), before + 1)
    assert out["paused_requests"] == 0 and out["version"] == before + 1
    assert engine.weight_version() == before + 1
    g = engine.generate([[5, 6]], SamplingParams(temperature=1.0, max_new_tokens=4, seed=3))[0]
    assert g.weight_version == before + 1 and g.token_versions is None


def test_a_swap_mid_call_pauses_the_requests_and_later_tokens_carry_the_new_version(engine, monkeypatch):
    v0 = engine.weight_version()
    _no_eos(engine, monkeypatch)
    gens, swapped = _generate_with_swap(engine, monkeypatch, [[5, 6], [7]],
                                        SamplingParams(temperature=1.0, max_new_tokens=60, seed=1), _weights(engine),
                                        v0 + 1)
    assert swapped["paused_requests"] == 2 and engine.weight_version() == v0 + 1
    for g in gens:
        assert g.weight_version == v0 and len(g.response_ids) == 60
        assert g.token_versions is not None and len(g.token_versions) == 60
        k = g.token_versions.index(v0 + 1)            # the first token of the new weights
        assert 0 < k < 60
        assert set(g.token_versions[:k]) == {v0} and set(g.token_versions[k:]) == {v0 + 1}


def test_no_request_is_lost_and_the_queued_ones_run_wholly_on_the_new_weights(engine, monkeypatch):
    """More requests than the engine decodes at once (4): the first four are in flight at the swap, the
    rest still wait; every request comes back whole, the waiting ones entirely under the new version."""
    v0 = engine.weight_version()
    _no_eos(engine, monkeypatch)
    prompts = [[5 + i, 6] for i in range(7)]
    gens, swapped = _generate_with_swap(engine, monkeypatch, prompts,
                                        SamplingParams(temperature=1.0, max_new_tokens=30, seed=2), _weights(engine),
                                        v0 + 1, at=4)
    assert swapped["paused_requests"] == 4
    assert len(gens) == 7 and all(len(g.response_ids) == 30 and g.finish_reason == "length" for g in gens)
    for g in gens[:4]:
        assert g.weight_version == v0 and set(g.token_versions) == {v0, v0 + 1}
    for g in gens[4:]:
        assert g.weight_version == v0 + 1 and g.token_versions is None


def _reference(model_path: str, weights: dict[str, torch.Tensor]):
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    load_weights(model, weights)
    return model


def _full_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


def _new_norm(old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`old` with the final norm's weight scaled per channel (the argmax changes; the K/V do not)."""
    g = torch.Generator().manual_seed(0)
    new = dict(old)
    new[NORM] = old[NORM] * (1.0 + 0.8 * torch.randn(old[NORM].shape, generator=g))
    return new


def test_each_tokens_rollout_logprob_is_the_one_of_the_weights_that_sampled_it(engine, model_path, monkeypatch):
    """What makes TIS exact across a swap: every token's logprob is that of the distribution it was drawn
    from. The swap here changes only the final norm (the logits, not the KV cache), so each token's
    logprob must equal a full forward's under the version its `token_versions` names."""
    v0 = engine.weight_version()
    old = _weights(engine)
    new = _new_norm(old)
    _no_eos(engine, monkeypatch)
    prompt = [5, 6, 7]
    [g], _ = _generate_with_swap(engine, monkeypatch, [prompt], SamplingParams(temperature=1.0, max_new_tokens=30,
                                                                               seed=4), new, v0 + 1, at=6)
    engine.swap_weights(old, v0 + 2)            # idle: at once (the module's engine goes on with the old weights)
    assert set(g.token_versions) == {v0, v0 + 1}
    under_old = _full_logprobs(_reference(model_path, old), prompt, g.response_ids)
    under_new = _full_logprobs(_reference(model_path, new), prompt, g.response_ids)
    for i, (lp, v) in enumerate(zip(g.logprobs, g.token_versions)):
        expected = under_new[i] if v == v0 + 1 else under_old[i]
        assert abs(lp - expected) < 1e-4, (i, v, lp, expected)
    assert any(abs(a - b) > 1e-3 for a, b in zip(under_new, under_old))      # the two versions differ


def test_greedy_swapped_mid_answer_is_old_tokens_then_the_new_weights_continuation(engine, monkeypatch):
    """Greedy, swapped mid-answer: the tokens before the swap are what the old weights alone give, and
    the tokens after it are the new weights' greedy continuation of the prompt and those tokens (the
    swap changes the final norm only, so the K/V the old weights wrote are the new weights' too)."""
    v0 = engine.weight_version()
    old = _weights(engine)
    new = _new_norm(old)
    _no_eos(engine, monkeypatch)
    prompt, n = [5, 6, 7, 8], 40
    greedy = SamplingParams(temperature=0.0, max_new_tokens=n)
    only_old = engine.generate([prompt], greedy)[0].response_ids
    [g], swapped = _generate_with_swap(engine, monkeypatch, [prompt], greedy, new, v0 + 1, at=8)
    assert swapped["paused_requests"] == 1
    k = g.token_versions.index(v0 + 1)
    assert 0 < k < n and set(g.token_versions[k:]) == {v0 + 1}
    assert g.response_ids[:k] == only_old[:k]                                   # (a)
    _no_eos(engine, monkeypatch)
    continuation = engine.generate([prompt + g.response_ids[:k]], SamplingParams(temperature=0.0,
                                                                                  max_new_tokens=n - k))[0]
    monkeypatch.undo()
    engine.swap_weights(old, v0 + 2)
    assert g.response_ids[k:] == continuation.response_ids                      # (b)
    assert g.response_ids != only_old           # the new weights did change the answer


def test_fast_a_long_prompt_prefilled_in_pieces_across_the_swap_is_the_new_versions(model_path, monkeypatch):
    """The fast engine prefills a long prompt one piece per decode step of the others: a swap between its
    pieces leaves the earlier pieces' K/V as the old weights wrote them, and its tokens, all sampled after
    the swap, are the new version's; each token's logprob is the one of the weights that sampled it."""
    engine = FastEngine(model_path, device="cpu", dtype="float32", seed=0, max_batch_size=4, chunked_prefill_size=3)
    v0, old = engine.weight_version(), _weights(engine)
    new = _new_norm(old)
    _no_eos(engine, monkeypatch)
    short, long = [5, 6], [(3 * i) % 20 + 4 for i in range(14)]       # 14 tokens: 5 pieces of 3
    gens, swapped = _generate_with_swap(engine, monkeypatch, [short, long],
                                        SamplingParams(temperature=1.0, max_new_tokens=20, seed=5), new, v0 + 1, at=2)
    assert swapped["paused_requests"] == 2                            # one decoding, one being prefilled
    first, second = gens
    assert set(first.token_versions) == {v0, v0 + 1}
    assert second.weight_version == v0 + 1 and second.token_versions is None and len(second.response_ids) == 20
    refs = {v0: _reference(model_path, old), v0 + 1: _reference(model_path, new)}
    for prompt, g in ((short, first), (long, second)):
        versions = g.token_versions or [g.weight_version] * len(g.response_ids)
        full = {v: _full_logprobs(m, prompt, g.response_ids) for v, m in refs.items()}
        for i, (lp, v) in enumerate(zip(g.logprobs, versions)):
            assert abs(lp - full[v][i]) < 1e-4, (prompt is long, i, v)
