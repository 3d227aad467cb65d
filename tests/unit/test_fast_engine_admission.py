"""FastEngine's admission by K/V memory: given the positions every request may need (`context_len`),
the engine runs as many slots as hold them, so more sequences than slots queue and complete with
the same tokens as one by one, instead of long requests being refused."""

import pytest
import torch

from miles.rollout.engines.fast import engine as fast_engine
from miles.rollout.engines.fast.cache import plan_slots
from miles.rollout.engines.fast.engine import FastEngine
from miles.types import SamplingParams
from tests.tiny_model import make_tiny_model
from tests.unit.test_fast_engine import MANY


def test_plan_slots_fits_the_kv_of_each_sequence_or_names_the_flags():
    gib = 1 << 30
    plan = dict(free_bytes=10 * gib, bytes_per_position=1 << 20)
    # 0.5 of 10 GiB = 5120 positions of 1 MiB: 5 sequences of 1024
    assert plan_slots(mem_fraction=0.5, max_slots=256, context_len=1024, **plan) == 5
    assert plan_slots(mem_fraction=0.5, max_slots=4, context_len=1024, **plan) == 4
    with pytest.raises(ValueError, match=r"one sequence of 8192 positions .* needs 8.00 GiB.*--rollout-mem-fraction"):
        plan_slots(mem_fraction=0.5, max_slots=4, context_len=8192, **plan)


def test_more_sequences_than_fitting_slots_complete_as_one_by_one(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    path = make_tiny_model(tmp_path / "m")
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    context = max(map(len, MANY)) + params.max_new_tokens
    alone = FastEngine(path, device="cpu", max_batch_size=1)
    per_position = alone.arch.kv_bytes_per_position(torch.float32)
    fraction = 0.001            # the workspace beside the cache stays far larger than the cache
    monkeypatch.setattr(fast_engine, "free_memory", lambda device: int(2.5 * context * per_position / fraction))
    engine = FastEngine(path, device="cpu", max_batch_size=6, mem_fraction=fraction, context_len=context)
    assert engine.max_batch_size == 2 and engine.max_len >= context        # two sequences' K/V fit
    batched = engine.generate(MANY, params)                                 # 11 requests through 2 slots
    for prompt, b in zip(MANY, batched):
        single, = alone.generate([prompt], params)
        assert b.response_ids == single.response_ids and b.finish_reason == single.finish_reason
    monkeypatch.undo()
    roomy = FastEngine(path, device="cpu", max_batch_size=6, context_len=context)   # all fit: as before
    assert roomy.max_batch_size == 6


def test_the_run_sizes_slots_from_its_prompt_and_response_limits(tmp_path):
    from miles.config.flags import parse_flags
    from miles.rollout.engines.fast.spec import options

    data = tmp_path / "p.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    base = ["--hf-checkpoint", "examples/arithmetic/base_model", "--prompt-data", str(data), "--rollout-batch-size",
            "1", "--num-rollout", "1", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "300"]
    assert "context_len" not in options(parse_flags(base)[0])             # no prompt limit: the plan as before
    assert options(parse_flags(base + ["--max-prompt-len", "100"])[0])["context_len"] == 400
    assert options(parse_flags(base + ["--max-prompt-len", "100", "--eval-max-response-len", "500"])[0])[
        "context_len"] == 600
    # --rollout-max-context-len caps every request (the engine cuts each response by it): the smaller bound
    capped = ["--rollout-max-context-len", "350"]
    assert options(parse_flags(base + capped)[0])["context_len"] == 350
    assert options(parse_flags(base + capped + ["--max-prompt-len", "20"])[0])["context_len"] == 320
    # the evals' own limits: the slots hold the larger need, a rollout's or an eval's
    evals = ["--max-prompt-len", "20", "--eval-max-prompt-len", "50"]
    assert options(parse_flags(base + evals)[0])["context_len"] == 350
    assert options(parse_flags(base + evals + capped + ["--eval-max-context-len", "340"])[0])["context_len"] == 340
    assert options(parse_flags(base + evals + ["--eval-max-context-len", "100"])[0])["context_len"] == 320
