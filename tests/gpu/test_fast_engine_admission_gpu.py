"""FastEngine's admission by K/V memory on CUDA (graphs and compiled layers on): with fewer slots
than requests because only that many sequences' K/V fit, every greedy answer is the one the
request gets alone (float32, where the argmax does not depend on the batch). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from miles.rollout.engines.fast import engine as fast_engine
from miles.rollout.engines.fast.engine import FastEngine
from miles.types import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MODEL = "examples/arithmetic/base_model_qwen3"
PROMPTS = [[(7 * i + j) % 20 + 4 for j in range(1 + (5 * i) % 11)] for i in range(19)]


def test_fewer_slots_than_requests_give_each_requests_own_answer(monkeypatch):
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    context = max(map(len, PROMPTS)) + params.max_new_tokens
    alone = FastEngine(MODEL, device="cuda", dtype="float32", max_batch_size=1)   # fp32: batch-size-proof argmax
    per_position = alone.arch.kv_bytes_per_position(alone.dtype)
    kv = int(3.5 * context * per_position)           # room for 3 sequences' K/V
    free = 2 * alone._workspace_bytes() + kv            # and the workspace the engine leaves beside it
    fraction = kv / free
    monkeypatch.setattr(fast_engine, "free_memory", lambda device: free)
    engine = FastEngine(MODEL, device="cuda", dtype="float32", max_batch_size=16, mem_fraction=fraction,
                        context_len=context)
    monkeypatch.undo()
    assert engine.max_batch_size == 3 and engine.max_len >= context
    batched = engine.generate(PROMPTS, params)
    for prompt, b in zip(PROMPTS, batched):
        single, = alone.generate([prompt], params)
        assert b.response_ids == single.response_ids, prompt
