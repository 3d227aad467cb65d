"""The in-flight weight swap (--fully-async, SupportsInFlightWeightSwap) of the embedded engine and of the
fast engine (on the CPU: eager, float32, the code path the GPU runs minus graphs), without Ray: a swap
during a running generate pauses its requests at a token boundary, loads the weights, and the requests
go on; each token records the version whose forward gave its logits; no request is lost. With a checksum
asked for (--check-weight-update-equal under --fully-async), the swap records at its token boundary the
checksums that the push compares with the trainer's, without waiting for the requests in flight."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.phases.fully_async import check_swapped_weights
from miles.phases.weights import WeightSyncMismatch
from miles.rollout.engines.embedded.engine import EmbeddedEngine
from miles.rollout.engines.fast.engine import FastEngine
from miles.rollout.engines.registry import ENGINES
from miles.rollout.protocol import SupportsInFlightWeightSwap
from miles.training.torch.trainer import Trainer
from miles.types import SamplingParams
from miles.weights import fp8
from miles.weights.checksum import state_dict_checksum
from miles.weights.hf import load_causal_lm, load_weights, model_weights
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


def _generate_with_swap(engine, monkeypatch, prompts, params, new_weights, version, at: int = 5,
                        checksum: bool = False):
    """engine.generate(prompts, params) on a thread, with `swap_weights(new_weights, version, checksum)` once
    the call has run `at` token steps; returns (the generations, what swap_weights returned)."""
    reached = _slowed(engine, monkeypatch, at)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("g", engine.generate(prompts, params)), daemon=True)
    t.start()
    assert reached.wait(10)
    swapped = engine.swap_weights(new_weights, version, checksum)
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


def _full_rows(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The log-softmax rows [len(response), V] a full forward gives each response position."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1)


def _full_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    rows = _full_rows(model, prompt, response)
    return rows.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


def _new_norm(old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`old` with the final norm's weight scaled per channel (the logits change; the K/V do not)."""
    g = torch.Generator().manual_seed(0)
    new = dict(old)
    new[NORM] = old[NORM] * (1.0 + 0.8 * torch.randn(old[NORM].shape, generator=g)).to(old[NORM].device)
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


# --- the weight check under the producer (--check-weight-update-equal with --fully-async) -----------------

@pytest.fixture(scope="module")
def trainer(model_path):
    """The torch trainer on the same tiny model, its weights moved off the initial ones (a trained step's)."""
    t = Trainer(model_path, train=TrainConfig(), algorithm=AlgorithmConfig(), rollout=RolloutConfig(batch_size=2), device="cpu")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in t._model.parameters():
            p.add_(1e-2 * torch.randn(p.shape, generator=g))
    return t


def _corrupt(engine, name: str = NORM) -> None:
    """Change one value of the weights the engine holds, in place (a corruption after a push)."""
    named = model_weights(engine._model) if isinstance(engine, EmbeddedEngine) else engine._weights.named
    with torch.inference_mode():
        named[name].view(-1)[0] += 0.5


def test_the_checksum_recorded_at_a_swap_in_flight_is_the_trainers_of_those_weights(engine, trainer, monkeypatch):
    v0, old = engine.weight_version(), _weights(engine)
    dtype = engine.weights_dtype()
    old_sum = state_dict_checksum(old, dtype=dtype)
    _no_eos(engine, monkeypatch)
    _, swapped = _generate_with_swap(engine, monkeypatch, [[5, 6], [7]], SamplingParams(temperature=1.0,
                                     max_new_tokens=30, seed=1), trainer.weights(), v0 + 1, checksum=True)
    expected = trainer.weights_checksum(dtype)                # the trainer's side of the sync machines' check
    assert expected != old_sum
    got = engine.swapped_weights_checksum(v0 + 1, timeout_s=1)
    assert swapped["paused_requests"] == 2 and got["paused_requests"] == 2
    assert got["version"] == v0 + 1 and got["checksum"] == expected
    assert got["before"] == {"version": v0, "checksum": old_sum}           # what it held until the boundary
    assert engine.weights_checksum() == expected                           # the sync machines' read-back agrees
    check_swapped_weights(["engine-0"], v0 + 1, expected, {"engine-0": (v0, old_sum)}, [got])      # passes
    engine.swap_weights(old, v0 + 2, checksum=True)                        # idle: recorded at once
    back = engine.swapped_weights_checksum(v0 + 2, timeout_s=1)
    assert back["paused_requests"] == 0 and back["checksum"] == old_sum
    assert back["before"] == {"version": v0 + 1, "checksum": expected}
    check_swapped_weights(["engine-0"], v0 + 2, old_sum, {"engine-0": (v0 + 1, expected)}, [back])


def test_a_corrupted_engine_or_other_weights_fail_the_check_with_the_sync_machines_message(engine, trainer):
    v0, old = engine.weight_version(), _weights(engine)
    dtype = engine.weights_dtype()
    old_sum, expected = state_dict_checksum(old, dtype=dtype), trainer.weights_checksum(dtype)
    engine.swap_weights(trainer.weights(), v0 + 1, checksum=True)
    check_swapped_weights(["engine-0"], v0 + 1, expected, {"engine-0": (v0, old_sum)},
                          [engine.swapped_weights_checksum(v0 + 1)])
    _corrupt(engine)                                # after the push: found at the next swap's boundary
    engine.swap_weights(old, v0 + 2, checksum=True)
    recorded = engine.swapped_weights_checksum(v0 + 2)
    assert recorded["checksum"] == old_sum          # the new weights loaded fine; what it held before did not
    with pytest.raises(WeightSyncMismatch) as exc:
        check_swapped_weights(["engine-0"], v0 + 2, old_sum, {"engine-0": (v0 + 1, expected)}, [recorded])
    assert str(exc.value) == (f"before the next update to v{v0 + 1}: engine-0 holds weights with checksum "
                              f"{recorded['before']['checksum'][:12]}, the trainer's v{v0 + 1} is {expected[:12]}")
    other = {**old, NORM: old[NORM] + 1e-3}         # an engine given (or loading) other weights than the trainer's
    engine.swap_weights(other, v0 + 3, checksum=True)
    recorded = engine.swapped_weights_checksum(v0 + 3)
    good = {"version": v0 + 3, "checksum": old_sum, "paused_requests": 0,
            "before": {"version": v0 + 2, "checksum": old_sum}}          # a second engine that took them right
    with pytest.raises(WeightSyncMismatch) as exc:
        check_swapped_weights(["engine-0", "engine-1"], v0 + 3, old_sum,
                              {"engine-0": (v0 + 2, old_sum), "engine-1": (v0 + 2, old_sum)}, [good, recorded])
    assert str(exc.value) == (f"after the in-flight push of v{v0 + 3}: engine-1 holds weights with checksum "
                              f"{recorded['checksum'][:12]}, the trainer's v{v0 + 3} is {old_sum[:12]}")
    engine.swap_weights(old, v0 + 4)


def test_the_checksum_of_a_swap_does_not_wait_for_a_long_request(engine, monkeypatch):
    """Asked for v before the swap: the answer comes once a request still running takes v at its next
    token, without the model lock it holds, and the request goes on under v."""
    v0, old = engine.weight_version(), _weights(engine)
    new = _new_norm(old)
    _no_eos(engine, monkeypatch)
    reached = _slowed(engine, monkeypatch, at=3)
    out: dict = {}
    gen = threading.Thread(target=lambda: out.setdefault("g", engine.generate(
        [[5, 6, 7]], SamplingParams(temperature=1.0, max_new_tokens=200, seed=2))), daemon=True)
    gen.start()
    assert reached.wait(10)
    asked: dict = {}
    asker = threading.Thread(target=lambda: asked.setdefault("r", engine.swapped_weights_checksum(v0 + 1, 30)),
                             daemon=True)
    asker.start()
    time.sleep(0.1)
    assert asker.is_alive()                          # v is not applied yet: it waits (bounded)
    swapper = threading.Thread(target=lambda: engine.swap_weights(new, v0 + 1, checksum=True), daemon=True)
    swapper.start()
    asker.join(10)
    assert not asker.is_alive() and asked["r"]["checksum"] == state_dict_checksum(new, dtype=engine.weights_dtype())
    assert asked["r"]["paused_requests"] == 1
    assert gen.is_alive() and engine._lock.locked()  # the request still runs, holding the model lock
    engine.abort()                                   # (200 slowed tokens: no need to wait for them)
    gen.join(30)
    swapper.join(10)
    monkeypatch.undo()
    g = out["g"][0]
    assert g.finish_reason == "abort" and g.token_versions[-1] == v0 + 1 and g.token_versions[0] == v0
    with pytest.raises(TimeoutError, match=f"no swap to weight version {v0 + 7} with a checksum"):
        engine.swapped_weights_checksum(v0 + 7, timeout_s=0.05)
    engine.swap_weights(old, v0 + 2)


DEMO = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "base_model"


@pytest.mark.parametrize("kind", list(STEP))
def test_an_fp8_engines_swap_checksum_is_the_trainers_fp8_checksum(kind):
    """An FP8 engine quantizes the plain weights a fully-async push sends; what it records at the swap is
    the trainer's `weights_checksum(dtype, fp8=True)` of them (its quantized weights)."""
    weights = model_weights(load_causal_lm(str(DEMO), device=torch.device("cpu"), dtype=torch.float32))
    with torch.no_grad():
        for t in weights.values():
            t.mul_(1.01)
    engine = (EmbeddedEngine(str(DEMO), device="cpu", quantization="fp8") if kind == "embedded" else
              FastEngine(str(DEMO), device="cpu", max_batch_size=2, max_context_len=32, quantization="fp8"))
    dtype = engine.weights_dtype()
    engine.swap_weights(weights, 1, checksum=True)
    want = state_dict_checksum(fp8.Fp8Weights(weights, dtype), dtype=dtype)      # Trainer.weights_checksum(dtype, True)
    got = engine.swapped_weights_checksum(1, timeout_s=1)
    assert got["checksum"] == want and engine.weights_checksum() == want
    assert got["checksum"] != state_dict_checksum(weights, dtype=dtype)
    engine.dispose()
