"""FastEngine's in-flight weight swap on CUDA, with its decode steps as captured CUDA graphs: the swap
copies into the weights in place, so the graphs captured before it compute with the new weights after
it (float32, where the argmax does not depend on the batch); and its KV-cache plan beside a resident
trainer (--colocate --no-offload-rollout) reads the GPU's total, not what is free. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from miles.rollout.engines.fast import engine as fast_engine
from miles.rollout.engines.fast.engine import FastEngine
from miles.types import SamplingParams
from tests.unit.test_inflight_swap import (_full_rows, _generate_with_swap, _new_norm, _no_eos, _reference,
                                          _weights)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MODEL = "examples/arithmetic/base_model_qwen3"


def test_greedy_swapped_mid_answer_under_cuda_graphs_is_old_tokens_then_the_new_continuation(monkeypatch):
    engine = FastEngine(MODEL, device="cuda", dtype="float32", max_batch_size=4, torch_compile=False)
    assert engine._graphs.enabled
    v0, old = engine.weight_version(), _weights(engine)
    new = _new_norm(old)
    _no_eos(engine, monkeypatch)
    prompt, n = [5, 6, 7, 8], 60
    greedy = SamplingParams(temperature=0.0, max_new_tokens=n)
    only_old = engine.generate([prompt], greedy)[0].response_ids      # captures the decode graphs
    assert engine.last_stats["graphs"] > 0
    [g], swapped = _generate_with_swap(engine, monkeypatch, [prompt], greedy, new, v0 + 1, at=10)
    assert swapped["paused_requests"] == 1
    k = g.token_versions.index(v0 + 1)
    assert 0 < k < n and g.response_ids[:k] == only_old[:k]
    # teacher-forced: every token after the swap is the new weights' (CPU float32 reference) choice and
    # logprob. Not a second greedy run from the prefix: its prefill and these decode steps differ in the
    # last bits, and this tiny model's near-ties then flip a token and everything after it.
    rows = _full_rows(_reference(MODEL, {n_: w.cpu() for n_, w in new.items()}), prompt, g.response_ids)
    for i in range(k, n):
        chosen = rows[i, g.response_ids[i]].item()
        assert abs(g.logprobs[i] - chosen) < 1e-3 and rows[i].max().item() - chosen < 1e-3, (i, g.logprobs[i], chosen)
    under_old = _full_rows(_reference(MODEL, {n_: w.cpu() for n_, w in old.items()}), prompt, g.response_ids)
    gaps = [abs(g.logprobs[i] - under_old[i, g.response_ids[i]].item()) for i in range(k, n)]
    assert max(gaps) > 1e-2, (max(gaps), g.response_ids == only_old)


def test_beside_a_resident_trainer_the_kv_cache_is_planned_from_the_gpus_total(monkeypatch):
    seen = {}
    plan = fast_engine.plan_positions

    def spy(**kw):
        seen.update(kw)
        return plan(**kw)

    monkeypatch.setattr(fast_engine, "plan_positions", spy)
    total = torch.cuda.mem_get_info()[1]
    hog = torch.empty(int(0.2 * total), dtype=torch.uint8, device="cuda")   # a trainer that got there first
    try:
        engine = FastEngine(MODEL, device="cuda", dtype="float32", max_batch_size=4, mem_fraction=0.05,
                            shared_gpu=True, torch_compile=False, cuda_graph=False)
        weights = sum(t.numel() * t.element_size() for t in engine._weights.named.values())
        assert seen["free_bytes"] == total - weights and engine.shared_gpu
    finally:
        del hog
