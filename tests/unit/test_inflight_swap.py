"""The embedded engine's in-flight weight swap (--fully-async, SupportsInFlightWeightSwap), without Ray:
a swap during a running generate pauses its rows at a token boundary, loads the weights, and the rows
go on; each token records the version whose forward gave its logits."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from miles.rollout.engines.embedded.engine import EmbeddedEngine
from miles.rollout.engines.registry import ENGINES
from miles.rollout.protocol import SupportsInFlightWeightSwap
from miles.types import SamplingParams
from miles.weights.hf import model_weights
from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return EmbeddedEngine(make_tiny_model(tmp_path_factory.mktemp("m")), device="cpu", dtype="float32", seed=0)


def _weights(engine, scale: float) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() * scale for k, v in model_weights(engine._model).items()}


def test_the_embedded_spec_declares_it_and_the_fast_one_does_not():
    assert ENGINES["embedded"].supports(SupportsInFlightWeightSwap)
    assert issubclass(EmbeddedEngine, SupportsInFlightWeightSwap)
    assert not ENGINES["fast"].supports(SupportsInFlightWeightSwap)
    assert not ENGINES["sglang"].supports(SupportsInFlightWeightSwap)


def test_idle_engine_swaps_at_once(engine):
    before = engine.weight_version()
    out = engine.swap_weights(_weights(engine, 1.0), before + 1)
    assert out["paused_requests"] == 0 and out["version"] == before + 1
    assert engine.weight_version() == before + 1
    g = engine.generate([[5, 6]], SamplingParams(temperature=1.0, max_new_tokens=4, seed=3))[0]
    assert g.weight_version == before + 1 and g.token_versions is None


def test_a_swap_mid_call_pauses_the_rows_and_later_tokens_carry_the_new_version(engine, monkeypatch):
    v0 = engine.weight_version()
    step = engine._forward
    calls = {"n": 0}
    reached = threading.Event()

    def slowed(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            reached.set()
        time.sleep(0.02)
        return step(*args, **kw)

    monkeypatch.setattr(engine, "_forward", slowed)
    params = SamplingParams(temperature=1.0, max_new_tokens=60, seed=1)
    params = SamplingParams(**{**params.__dict__, "stop_token_ids": ()})
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("g", engine.generate([[5, 6], [7]], params)), daemon=True)
    eos = engine._eos_ids
    engine._eos_ids = set()                     # no row stops early: both are in flight at the swap
    try:
        t.start()
        assert reached.wait(10)
        swapped = engine.swap_weights(_weights(engine, 1.0), v0 + 1)
        t.join(30)
    finally:
        engine._eos_ids = eos
    assert not t.is_alive()
    assert swapped["paused_requests"] == 2 and engine.weight_version() == v0 + 1
    for g in out["g"]:
        assert g.weight_version == v0 and len(g.response_ids) == 60
        assert g.token_versions is not None and len(g.token_versions) == 60
        k = g.token_versions.index(v0 + 1)            # the first token of the new weights
        assert 0 < k < 60
        assert set(g.token_versions[:k]) == {v0} and set(g.token_versions[k:]) == {v0 + 1}


def test_each_tokens_rollout_logprob_is_the_one_of_the_weights_that_sampled_it(engine, monkeypatch):
    """What makes TIS exact across a swap: every token's logprob is that of the distribution it was drawn
    from. The swap here changes only the final norm (the logits, not the KV cache), so each token's
    logprob must equal a full forward's under the version its `token_versions` names."""
    v0 = engine.weight_version()
    old = _weights(engine, 1.0)
    new = {k: (v * 2.0 if k.endswith("model.norm.weight") or k == "norm.weight" else v) for k, v in old.items()}
    assert any(not torch.equal(new[k], old[k]) for k in old)
    step, calls, reached = engine._forward, {"n": 0}, threading.Event()

    def slowed(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 6:
            reached.set()
        time.sleep(0.02)
        return step(*args, **kw)

    monkeypatch.setattr(engine, "_forward", slowed)
    eos, engine._eos_ids = engine._eos_ids, set()
    out: dict = {}
    prompt = [5, 6, 7]
    t = threading.Thread(target=lambda: out.setdefault("g", engine.generate(
        [prompt], SamplingParams(temperature=1.0, max_new_tokens=30, seed=4))), daemon=True)
    try:
        t.start()
        assert reached.wait(10)
        engine.swap_weights(new, v0 + 1)
        t.join(30)
    finally:
        engine._eos_ids = eos
    [g] = out["g"]
    assert set(g.token_versions) == {v0, v0 + 1}

    def full_logprobs() -> list[float]:
        ids = torch.tensor([prompt + g.response_ids])
        with torch.no_grad():
            logits = engine._model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.response_ids)[:, None]).squeeze(-1).tolist()

    under_new = full_logprobs()                 # the engine holds v0 + 1
    engine.swap_weights(old, v0 + 2)            # idle: at once
    under_old = full_logprobs()
    for i, (lp, v) in enumerate(zip(g.logprobs, g.token_versions)):
        expected = under_new[i] if v == v0 + 1 else under_old[i]
        assert abs(lp - expected) < 1e-4, (i, v, lp, expected)
    assert any(abs(a - b) > 1e-3 for a, b in zip(under_new, under_old))      # the two versions differ
