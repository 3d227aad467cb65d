"""FastEngine's paged KV cache (--rollout-page-size) on CPU (float32, eager): answers equal the slot cache's,
also when the pages run out and sequences are preempted and prefilled again; the page allocator never
gives one page to two sequences; the paged decode kernel equals the stock call; the plan and the flag
refuse what cannot run (miles/rollout/engines/fast/cache.py, engine.py)."""

from pathlib import Path

import numpy as np
import pytest
import structlog
import torch

from miles.rollout.engines.fast import engine as fast_engine
from miles.rollout.engines.fast import model as fast_model
from miles.rollout.engines.fast.attention import decode_attention, gather_pages, sdpa_decode_attention
from miles.rollout.engines.fast.cache import SINK, PagedKVCache, plan_pages
from miles.rollout.engines.fast.engine import FastEngine, _Call
from miles.types import SamplingParams
from tests.tiny_model import EOS_ID, make_tiny_model
from tests.unit.test_fast_engine import MANY, kernel_device, make_tiny_llama
from tests.unit.test_moe import hf, moe_path  # noqa: F401  (the tiny Qwen3-MoE fixtures, shared)

PAGE = 16
SHORT = [m[:8] for m in MANY]      # prompts of one page with the admission's look-ahead
# 40 tokens each, none stopping early: 11 sequences of up to 48 positions (3 pages) in 12 pages, 8 slots
LONG = SamplingParams(temperature=0.0, max_new_tokens=40, min_new_tokens=40)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_path(request, tmp_path_factory):
    torch.set_num_threads(1)
    make = make_tiny_model if request.param == "qwen2" else make_tiny_llama
    return make(tmp_path_factory.mktemp(request.param))


def small_pool(path: str, pages: int, monkeypatch, **kw) -> FastEngine:
    """A paged engine whose cache has `pages` pages of PAGE positions, the sink included."""
    monkeypatch.setattr(fast_engine, "free_memory", lambda device: 1 << 30)
    probe = FastEngine(path, device="cpu", max_batch_size=1, page_size=PAGE, max_context_len=PAGE)
    per_position = probe.arch.kv_bytes_per_position(probe.cache_dtype)
    engine = FastEngine(path, device="cpu", page_size=PAGE, mem_fraction=(pages * PAGE * per_position + 1) / (1 << 30),
                        **kw)
    assert engine.kv_pages == pages
    return engine


def checked_pages(monkeypatch) -> list[int]:
    """Check the allocator at every flush: no page held twice or the sink held, each row's device table its
    held pages then the sink. Returns the list of free-page counts seen (the pool's pressure)."""
    seen, flush = [], PagedKVCache.flush

    def check(self):
        flush(self)
        held = [p for row in self.held for p in row]
        assert len(held) == len(set(held)) and SINK not in held
        assert len(held) + self.free_pages == self.pages - 1
        for row, pages in zip(self.table.tolist(), self.held):
            assert row[:len(pages)] == pages and set(row[len(pages):]) <= {SINK}
        seen.append(self.free_pages)

    monkeypatch.setattr(PagedKVCache, "flush", check)
    return seen


def test_paged_answers_equal_the_slot_caches(model_path, monkeypatch):
    # 11 prompts through 3 slots (refills, compaction moving table rows), stop strings freeing slots early
    seen = checked_pages(monkeypatch)
    slots = FastEngine(model_path, device="cpu", max_batch_size=3)
    paged = FastEngine(model_path, device="cpu", max_batch_size=3, page_size=PAGE)
    for params in (SamplingParams(temperature=0.0, max_new_tokens=24),
                   SamplingParams(temperature=0.0, max_new_tokens=24, stop=["a"]),
                   SamplingParams(temperature=1.0, max_new_tokens=24, seed=4)):
        want, got = slots.generate(MANY, params), paged.generate(MANY, params)
        assert [g.response_ids for g in got] == [g.response_ids for g in want]
        assert [g.finish_reason for g in got] == [g.finish_reason for g in want]
        assert max(max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) for g, w in zip(got, want)) < 1e-5
    assert len({len(g.response_ids) for g in want}) > 2 and seen
    assert paged.last_stats["preemptions"] == 0
    # the pool holds no more than every slot at max_len (the CPU's free memory would be half its RAM)
    assert paged.kv_pages == 3 * -(-paged.max_len // PAGE) + 1


def test_preempted_sequences_resume_with_the_tokens_they_had(model_path, monkeypatch):
    seen = checked_pages(monkeypatch)
    engine = small_pool(model_path, 13, monkeypatch, max_batch_size=8, max_context_len=48)
    want = FastEngine(model_path, device="cpu", max_batch_size=3).generate(SHORT, LONG)
    with structlog.testing.capture_logs() as logs:
        got = engine.generate(SHORT, LONG)
    assert engine.last_stats["preemptions"] > 0 and min(seen) < 3
    said = [e for e in logs if e["event"] == "kv_preemptions"]     # the engine's log says so, once a call
    assert len(said) == 1 and said[0]["preempted"] == engine.last_stats["preemptions"]
    assert [g.response_ids for g in got] == [g.response_ids for g in want]
    assert all(len(g.response_ids) == 40 and g.finish_reason == "length" for g in got)
    assert max(max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) for g, w in zip(got, want)) < 1e-4


def test_sampled_answers_across_a_preemption_have_the_models_logprobs(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "m")
    engine = small_pool(path, 13, monkeypatch, max_batch_size=8, max_context_len=48)
    params = SamplingParams(temperature=0.9, max_new_tokens=40, min_new_tokens=40, seed=5)
    gens = engine.generate(SHORT, params)
    assert engine.last_stats["preemptions"] > 0
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    for prompt, g in zip(SHORT, gens):
        assert len(g.response_ids) == len(g.logprobs) == 40
        # min_new_tokens bars the stop token: the logprobs are of the distribution without it
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + g.response_ids])).logits[0, len(prompt) - 1:-1] / 0.9
        logits[:, EOS_ID] = float("-inf")
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.response_ids)[:, None])[:, 0]
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref.tolist())) < 1e-4
    again = small_pool(path, 13, monkeypatch, max_batch_size=8, max_context_len=48).generate(SHORT, params)
    assert [g.response_ids for g in again] == [g.response_ids for g in gens]      # reproducible


def test_long_prompts_prefilled_in_pieces_into_pages(model_path, monkeypatch):
    checked_pages(monkeypatch)
    long = [[(3 * i + j) % 28 + 4 for j in range(20 + 7 * i)] for i in range(5)]   # 20..48 tokens, pieces of 8
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    want = FastEngine(model_path, device="cpu", max_batch_size=2).generate(long + MANY, params)
    engine = FastEngine(model_path, device="cpu", max_batch_size=2, page_size=PAGE, chunked_prefill_size=8)
    got = engine.generate(long + MANY, params)
    assert engine.last_stats["prefill_pieces"] > 5
    assert [g.response_ids for g in got] == [g.response_ids for g in want]


def test_a_preempted_moe_sequence_keeps_each_tokens_routing(moe_path, monkeypatch):  # noqa: F811
    want = FastEngine(moe_path, device="cpu", max_batch_size=3).generate(SHORT, LONG)
    engine = small_pool(moe_path, 13, monkeypatch, max_batch_size=8, max_context_len=48)
    got = engine.generate(SHORT, LONG)
    assert engine.last_stats["preemptions"] > 0
    for g, w in zip(got, want):
        assert g.response_ids == w.response_ids
        assert g.routed_experts.shape == (40, *w.routed_experts.shape[1:])
        assert np.array_equal(g.routed_experts, w.routed_experts)


def test_token_versions_count_from_each_start():
    # started at step 3, preempted with 5 tokens and started again at step 20 (its prefill gives token 5);
    # a swap at step 6 then one at step 21
    call = _Call([[1, 2]], [12], None, None, type("Out", (), {"lengths": torch.zeros(2)})())
    call.started[0] = [(3, 0), (20, 5)]
    call.swaps = [(6, 1), (21, 2)]
    # token 0 at 3 (prefill), j = 1..4 at 3 + j - 1 = 3..6; token 5 at 20 (prefill), j = 6.. at 20 + j - 6
    assert call.token_versions(0, 9, 0) == [0, 0, 0, 0, 1, 1, 1, 2, 2]


def test_the_pool_grows_releases_and_moves_rows():
    cache = PagedKVCache(layers=1, rows=3, pages=6, page=4, kv_heads=1, max_len=12, head_dim=2,
                         dtype=torch.float32, device=torch.device("cpu"))
    assert cache.grow(0, 5) and cache.grow(1, 4) and cache.free_pages == 2
    assert not cache.grow(2, 12) and cache.held[2] == []        # three pages wanted, two free: none taken
    cache.flush()
    assert cache.table.tolist() == [[1, 2, 0], [3, 0, 0], [0, 0, 0]]
    assert cache.grow(0, 100) and len(cache.held[0]) == 3       # capped at max_len's three pages
    cache.move([0], [2], span=9)
    cache.release(1)
    assert cache.table.tolist() == [[0, 0, 0], [0, 0, 0], [1, 2, 4]] and cache.free_pages == 2
    assert cache.held == [[], [], [1, 2, 4]]


def test_plan_pages_holds_one_sequence_or_names_the_flags():
    gib = 1 << 30
    assert plan_pages(free_bytes=4 * gib, mem_fraction=0.5, page=64, bytes_per_position=1024, max_len=4096,
                      workspace_bytes=gib) == 2 * gib // (64 * 1024)
    with pytest.raises(ValueError, match="less than one sequence of 4096.*--rollout-max-response-len"):
        plan_pages(free_bytes=gib, mem_fraction=0.001, page=64, bytes_per_position=1024, max_len=4096,
                   workspace_bytes=0)
    with pytest.raises(ValueError, match="lower --rollout-mem-fraction"):
        plan_pages(free_bytes=gib, mem_fraction=0.9, page=64, bytes_per_position=1024, max_len=64,
                   workspace_bytes=gib // 2)


def test_gather_pages_reads_each_rows_positions_in_order():
    c = torch.arange(5 * 4, dtype=torch.float32).view(5, 1, 4, 1)          # page p holds 4p..4p+3
    table = torch.tensor([[3, 1, 0], [2, 4, 0]])
    assert gather_pages(c, table, 6)[:, 0, :, 0].tolist() == [[12, 13, 14, 15, 4, 5], [8, 9, 10, 11, 16, 17]]


@pytest.mark.parametrize("page", [16, 64, 128])
def test_the_paged_kernel_equals_the_stock_call_over_gathered_pages(page, monkeypatch):
    device = kernel_device(monkeypatch)
    kv_heads, group, dim, max_len = 2, 3, 32, 150
    g = torch.Generator().manual_seed(0)
    per_seq = -(-max_len // page)
    table = torch.randperm(6 * per_seq, generator=g).view(6, per_seq).to(device)    # pages out of order
    q = torch.randn((4, kv_heads, group, dim), generator=g).to(device)
    kc, vc = (torch.randn((6 * per_seq, kv_heads, page, dim), generator=g).to(device) for _ in range(2))
    pos = torch.tensor([0, 15, 64, 149], device=device)
    valid = torch.arange(max_len, device=device) <= pos[:, None]
    mask = torch.zeros(valid.shape, device=device).masked_fill_(~valid, float("-inf"))[:, None, None]
    want = sdpa_decode_attention(q, kc, vc, pos, dim ** -0.5, max_len, mask, table)
    got = decode_attention(q, kc, vc, pos, dim ** -0.5, table)
    assert (got - want).abs().max() < 1e-4
    # row 0 attends to its first key only: the value at offset 0 of its first page
    assert torch.allclose(got[0], vc[table[0, 0], :, :1].expand(kv_heads, group, dim), atol=1e-4)


def test_compiled_paged_pieces_do_not_recompile(monkeypatch, tmp_path):
    monkeypatch.setattr(fast_model, "COMPILE_BACKEND", "eager")
    engine = FastEngine(make_tiny_model(tmp_path / "m"), device="cpu", max_batch_size=8, page_size=PAGE,
                        chunked_prefill_size=4)
    engine._use_compiled(True)
    engine._compile_shapes()
    with torch._dynamo.config.patch(error_on_recompile=True):
        gens = engine.generate(MANY, SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    assert engine._forward.compiled and len(gens) == len(MANY)


def test_the_flag_reaches_the_engine_and_bad_values_are_refused(tmp_path):
    from miles.config.flags import parse_flags
    from miles.config.schema import ConfigError
    from miles.rollout.engines.fast.spec import options

    data = tmp_path / "p.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    base = ["--hf-checkpoint", make_tiny_model(tmp_path / "model"), "--prompt-data", str(data),
            "--rollout-batch-size", "1", "--num-rollout", "1", "--n-samples-per-prompt", "2"]
    cfg, _ = parse_flags(base + ["--rollout-engine", "fast", "--rollout-page-size", "64"])
    assert options(cfg)["page_size"] == 64
    assert "page_size" not in options(parse_flags(base + ["--rollout-engine", "fast"])[0])
    with pytest.raises(ConfigError, match="--rollout-page-size 8: use 16 or more"):
        parse_flags(base + ["--rollout-engine", "fast", "--rollout-page-size", "8"])
    with pytest.raises(ConfigError, match="--rollout-page-size 0: must be a positive integer"):
        parse_flags(base + ["--rollout-engine", "fast", "--rollout-page-size", "0"])
    with pytest.raises(ConfigError, match="the fast engine's paged KV cache; add --rollout-engine fast"):
        parse_flags(base + ["--rollout-engine", "embedded", "--rollout-page-size", "64"])


def test_the_long_tail_bench_runs_both_caches_on_one_budget(tmp_path, monkeypatch):
    import runpy
    import sys

    out = tmp_path / "paged.json"
    monkeypatch.setattr(sys, "argv", ["paged_kv_bench.py", "--prompts", "4", "--samples", "4", "--mean-len", "16",
                                      "--max-len", "96", "--kv-positions", "512", "--max-batch-size", "16",
                                      "--page-size", "16", "--out", str(out)])
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts/bench/paged_kv_bench.py"), run_name="__main__")
    import json

    r = json.loads(out.read_text())
    slot, paged = r["results"]
    assert slot["lengths_equal_caps"] and paged["lengths_equal_caps"] and slot["tokens"] == paged["tokens"]
    # the slot cache holds 512 // (32 + 96) = 4 sequences; the paged one starts as many as fit their positions
    assert slot["slots"] == 4 and paged["slots"] == 16 and paged["decode_steps"] < slot["decode_steps"]


def test_a_swap_between_a_preemption_and_its_resume_gives_each_token_its_version(monkeypatch, tmp_path):
    # the preempted answers stop at ~25 tokens (step ~24), the swap lands at step 30, they resume at ~41: their
    # tokens before the preemption are the old version's, from the resume on the new one's (counted from each
    # start: counting from the first start alone would date token 25 at step 24, before the swap)
    from tests.unit.test_inflight_swap import _full_logprobs, _generate_with_swap, _new_norm, _no_eos, _reference

    path = make_tiny_model(tmp_path / "m")
    engine = small_pool(path, 13, monkeypatch, max_batch_size=8, max_context_len=48)
    old = {k: v.detach().clone() for k, v in engine._weights.named.items()}
    new = _new_norm(old)
    _no_eos(engine, monkeypatch)
    gens, _ = _generate_with_swap(engine, monkeypatch, SHORT, SamplingParams(temperature=1.0, max_new_tokens=40,
                                                                             seed=1), new, 1, at=30)
    assert engine.last_stats["preemptions"] > 0
    resumed = [g for g in gens if g.token_versions and g.token_versions[20:30] == [0] * 5 + [1] * 5]
    assert resumed, [g.token_versions for g in gens]      # a preempted answer: old tokens, then new at its resume
    models = {0: _reference(path, old), 1: _reference(path, new)}
    for prompt, g in zip(SHORT, gens):
        assert len(g.response_ids) == 40
        versions = g.token_versions or [g.weight_version] * 40
        expected = {v: _full_logprobs(m, prompt, g.response_ids) for v, m in models.items()}
        assert all(abs(lp - expected[v][i]) < 1e-4 for i, (lp, v) in enumerate(zip(g.logprobs, versions)))
