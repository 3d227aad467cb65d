"""FastEngine on a tiny random Qwen3-MoE (CPU, float32, eager): tokens, logprobs and recorded routing against
transformers' forward and router; the grouped-matmul experts and the sorted-token loop against a per-expert
reference; weight updates under HF names; the spec's acceptance of Qwen3-MoE and refusal of other MoE
families (miles/rollout/engines/fast/moe.py, docs/moe.md)."""

import pickle

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from miles.rollout.engines.embedded.engine import EmbeddedEngine
from miles.rollout.engines.fast import model as fast_model
from miles.rollout.engines.fast import moe as fast_moe
from miles.rollout.engines.fast.engine import FastEngine
from miles.rollout.engines.fast.moe import (MoeArch, MoeLayerWeights, experts_grouped, experts_loop, route,
                                            sparse_layers)
from miles.types import SamplingParams, routing_as_lists, routing_copy, routing_join
from miles.weights.hf import model_weights
from tests.tiny_model import make_tiny_family
from tests.unit.test_moe import hf, moe_path  # noqa: F401  (the tiny Qwen3-MoE fixtures, shared)
from tests.unit.test_fast_engine import MANY, PROMPTS, forward_logprobs, reference_greedy

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def engine(moe_path):
    return FastEngine(moe_path, device="cpu", seed=0, max_batch_size=4)


@torch.no_grad()
def hf_routing(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), MoE layers, k]: the experts transformers' routers pick at each position (their own output)."""
    picked = []
    hooks = [m.register_forward_hook(lambda mod, args, out: picked.append(out[2]))
             for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    try:
        model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(picked, dim=1)


def lists(routed) -> list:
    """A Generation's routing as nested lists (the fast engine's is one numpy array, the embedded's lists)."""
    return [np.asarray(tok).tolist() for tok in routed]


def assert_routing_is_transformers(model, prompt: list[int], gen) -> None:
    """Each response token's experts are those transformers' routers pick at the position whose logits sampled
    it (the prompt's last token for the first, then each response token for the next), per MoE layer; the
    request's routing one uint8 numpy array [tokens, MoE layers, k] (up to 256 experts) that owns its memory
    (not a view of the call's whole buffer, which a sample kept across steps would hold alive)."""
    want = hf_routing(model, prompt + gen.response_ids)[len(prompt) - 1:-1]
    routed = gen.routed_experts
    assert isinstance(routed, np.ndarray) and routed.dtype == np.uint8 and routed.base is None
    assert routed.shape == want.shape == (len(gen.response_ids), 2, 2)
    assert lists(gen.routed_experts) == want.tolist()


def test_greedy_tokens_logprobs_and_routing_equal_transformers(engine, hf):
    gens = engine.generate(PROMPTS, GREEDY)
    assert any(len(g.response_ids) > 4 for g in gens)
    assert engine.moe_experts == "loop"          # the CPU's experts
    for prompt, g in zip(PROMPTS, gens):
        ids, lps = reference_greedy(hf, prompt, GREEDY.max_new_tokens)
        assert g.response_ids == ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, lps)) < 1e-5
        assert_routing_is_transformers(hf, prompt, g)


def test_sampled_logprobs_and_routing_equal_a_full_forward(engine, hf):
    params = SamplingParams(temperature=0.8, max_new_tokens=10, seed=2)
    gens = engine.generate(PROMPTS * 2, params)
    for prompt, g in zip(PROMPTS * 2, gens):
        ref = forward_logprobs(hf, prompt, g.response_ids, 0.8)
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref)) < 1e-4
        assert_routing_is_transformers(hf, prompt, g)


def test_routing_is_the_embedded_engines_record(moe_path, engine):
    fast = engine.generate(PROMPTS, GREEDY)
    embedded = EmbeddedEngine(moe_path, device="cpu").generate(PROMPTS, GREEDY)
    assert [g.response_ids for g in fast] == [g.response_ids for g in embedded]
    assert [lists(g.routed_experts) for g in fast] == [g.routed_experts for g in embedded]     # the lists of before


def test_batching_compaction_and_chunked_prefill_keep_each_tokens_routing(moe_path):
    # 11 prompts through 3 slots (refills, compaction at the tail), and prompts prefilled in pieces of 4
    # tokens (the last piece's position routes the first token): each answer's routing is what it is alone
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    alone = FastEngine(moe_path, device="cpu", max_batch_size=1)
    batched = FastEngine(moe_path, device="cpu", max_batch_size=3).generate(MANY, params)
    chunked = FastEngine(moe_path, device="cpu", max_batch_size=3, chunked_prefill_size=4).generate(MANY, params)
    for prompt, b, c in zip(MANY, batched, chunked):
        single, = alone.generate([prompt], params)
        assert b.response_ids == c.response_ids == single.response_ids
        assert lists(b.routed_experts) == lists(c.routed_experts) == lists(single.routed_experts)
        assert len(b.routed_experts) == len(b.response_ids)


def test_stop_strings_cut_the_routing_with_the_tokens(engine):
    plain = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12))
    text = engine.decode(plain[0].response_ids[2:4])
    cut = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12, stop=[text]))
    assert len(cut[0].response_ids) < len(plain[0].response_ids)
    for c, p in zip(cut, plain):
        assert len(c.routed_experts) == len(c.response_ids)
        assert lists(c.routed_experts) == lists(p.routed_experts[:len(c.response_ids)])


def test_routed_to_host_gives_each_request_one_array_of_its_own():
    from miles.rollout.engines.fast.sampling import CallOutputs

    out = CallOutputs(2, 5, torch.device("cpu"), routing=(3, 2, 128))      # 3 MoE layers, top-2 of 128 experts
    out.routed.copy_(torch.arange(out.routed.numel()).view(out.routed.shape) % 128)
    calls = out.routed.numpy()                   # [3 (2 requests + the spare), 5, 3, 2], the call's own
    first, second = out.routed_to_host([4, 0])
    assert first.shape == (4, 3, 2) and second.shape == (0, 3, 2) and first.dtype == np.uint8
    assert first.tolist() == calls[0, :4].tolist()
    # the request's own copy: a sample kept across steps keeps no more of the call
    assert first.base is None and not np.shares_memory(first, calls)
    # one array pickles as one buffer, not one object per token (every hop between actors)
    assert len(pickle.dumps(first, protocol=5)) < first.nbytes + 200


def test_routing_joins_arrays_into_one_and_mixed_parts_into_a_list():
    a = np.arange(12, dtype=np.uint8).reshape(2, 3, 2)
    b = np.arange(6, dtype=np.int16).reshape(1, 3, 2) + 300
    ab = routing_join(a, b)
    assert isinstance(ab, np.ndarray) and ab.dtype == np.int16 and ab.tolist() == [*a.tolist(), *b.tolist()]
    assert routing_join([], a) is a and routing_join(a, a[:0]) is a          # an empty side: the other as it is
    mixed = routing_join(a, [[], [[1, 2], [3, 4], [5, 6]]])                  # a tool token, an embedded engine's
    assert isinstance(mixed, list) and len(mixed) == 4 and mixed[2] == [] and mixed[1].tolist() == a[1].tolist()
    assert routing_as_lists(mixed) == [*a.tolist(), [], [[1, 2], [3, 4], [5, 6]]]
    assert routing_as_lists(a) == a.tolist()
    c = routing_copy(a)
    c[0, 0, 0] = 99
    assert a[0, 0, 0] == 0


def test_a_weight_update_under_hf_names_changes_outputs_in_place(moe_path, hf):
    fast, embedded = FastEngine(moe_path, device="cpu"), EmbeddedEngine(moe_path, device="cpu")
    assert fast.weights_checksum() == embedded.weights_checksum()
    names = set(fast._weights.named)
    assert {f"model.layers.{i}.mlp.{n}" for i in (1, 2)
            for n in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")} <= names
    assert names == set(model_weights(hf))
    before = fast.generate(PROMPTS, GREEDY)
    live = [t.data_ptr() for t in fast._weights.named.values()]
    g = torch.Generator().manual_seed(0)
    new = {n: t.detach() + (0.3 * torch.randn(t.shape, generator=g) if ".mlp." in n and "layers.0." not in n else 0)
           for n, t in model_weights(hf).items()}     # only the routers and experts change
    fast.update_weights(new, version=2)
    embedded.update_weights(new, version=2)
    assert fast.weights_checksum() == embedded.weights_checksum()
    assert [t.data_ptr() for t in fast._weights.named.values()] == live     # in place: captured graphs stay valid
    after = fast.generate(PROMPTS, GREEDY)
    assert [lists(g.routed_experts) for g in after] != [lists(g.routed_experts) for g in before]
    assert [g.response_ids for g in after] != [g.response_ids for g in before]
    reference = embedded.generate(PROMPTS, GREEDY)
    assert [g.response_ids for g in after] == [g.response_ids for g in reference]
    assert [lists(g.routed_experts) for g in after] == [g.routed_experts for g in reference]


def test_decoder_sparse_step_and_mlp_only_layers_pick_the_sparse_layers(tmp_path):
    # layers 1 and 3 sparse by the step, 3 made dense by mlp_only_layers: only layer 1 has experts
    path = make_tiny_family(tmp_path / "m", "qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2,
                            mlp_only_layers=[3], seed=3)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    sparse = [i for i, layer in enumerate(model.model.layers) if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"]
    assert sparse_layers(model.config) == tuple(sparse) == (1,)
    engine = FastEngine(path, device="cpu")
    for prompt, g in zip(PROMPTS, engine.generate(PROMPTS, GREEDY)):
        assert g.response_ids == reference_greedy(model, prompt, GREEDY.max_new_tokens)[0]
        assert {len(tok) for tok in g.routed_experts} == {1}     # one MoE layer
    unnormalised = make_tiny_family(tmp_path / "u", "qwen3_moe", norm_topk_prob=False, num_experts_per_tok=3, seed=4)
    model = AutoModelForCausalLM.from_pretrained(unnormalised).eval()
    for prompt, g in zip(PROMPTS, FastEngine(unnormalised, device="cpu").generate(PROMPTS, GREEDY)):
        ids, lps = reference_greedy(model, prompt, GREEDY.max_new_tokens)
        assert g.response_ids == ids and max(abs(a - b) for a, b in zip(g.logprobs, lps)) < 1e-5


# --- the experts: grouped matmuls and the sorted-token loop against a per-expert reference ------------

def reference_experts(h, ids, weights, w: MoeLayerWeights) -> torch.Tensor:
    """transformers' loop: per expert, its tokens through its SwiGLU (float32), weighted, summed per token."""
    out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    for e in range(w.gate_up.shape[0]):
        tok, slot = torch.where(ids == e)
        if len(tok):
            gate, up = (h[tok].float() @ w.gate_up[e].float().T).chunk(2, dim=-1)
            y = (torch.nn.functional.silu(gate) * up) @ w.down[e].float().T
            out.index_add_(0, tok, y * weights[tok, slot, None].float())
    return out


def emulated_grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """torch._grouped_mm's documented semantics for a 2-D mat_a [M, K] and a 3-D mat_b [G, K, N]: rows
    offs[g-1]..offs[g] of mat_a times mat_b[g] (offs: int32 ends), rows past offs[-1] left unwritten."""
    assert mat_a.dim() == 2 and mat_b.dim() == 3 and offs.dtype == torch.int32 and offs.shape == (mat_b.shape[0],)
    assert mat_a.shape[1] == mat_b.shape[1] and bias is None
    out = torch.zeros((mat_a.shape[0], mat_b.shape[2]), dtype=mat_a.dtype)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = mat_a[start:end] @ mat_b[g]
        start = end
    return out


def cpu_grouped_mm() -> bool:
    try:
        torch._grouped_mm(torch.ones(2, 16), torch.ones(1, 16, 16), offs=torch.tensor([2], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def layer(n_experts: int, hidden: int, inter: int, dtype, seed: int) -> MoeLayerWeights:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(shape, generator=g) * 0.2).to(dtype)

    return MoeLayerWeights(router=rand(n_experts, hidden), gate_up=rand(n_experts, 2 * inter, hidden),
                           down=rand(n_experts, hidden, inter))


CASES = [(1, 4, 2), (7, 4, 2), (40, 8, 3), (33, 5, 5)]   # tokens, experts, top-k (k == E: every expert)


@pytest.mark.parametrize("tokens,n_experts,k", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_and_loop_experts_equal_the_per_expert_reference(tokens, n_experts, k, dtype, monkeypatch):
    if not cpu_grouped_mm():       # this torch has no CPU kernel: the documented semantics stand in
        monkeypatch.setattr(torch, "_grouped_mm", emulated_grouped_mm, raising=False)
    moe = MoeArch(n_experts=n_experts, top_k=k, norm_topk_prob=True, intermediate=16, layers=(0,))
    w = layer(n_experts, 32, 16, dtype, seed=tokens)
    h = torch.randn((tokens, 32), generator=torch.Generator().manual_seed(1)).to(dtype)
    weights, ids = route(h, w.router, moe)
    if tokens == 40:            # some expert gets no token at all: an empty group in the middle
        ids = ids.clamp(max=n_experts - 2)
        ids[:, 0] = torch.where(ids[:, 0] == 3, 2, ids[:, 0])
        ids[:, 1:] = torch.where(ids[:, 1:] == 3, 4, ids[:, 1:])
        assert not (ids == 3).any() and not (ids == n_experts - 1).any()
    want = reference_experts(h, ids, weights, w)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    scale = want.abs().max()
    for f in (experts_grouped, experts_loop):
        got = f(h, ids, weights, w)
        assert got.dtype == dtype and got.shape == h.shape
        assert (got.float() - want).abs().max() / scale < tol, f.__name__


def test_the_emulation_is_torchs_grouped_mm_where_it_runs_on_the_cpu():
    if not cpu_grouped_mm():
        pytest.skip("this torch has no CPU torch._grouped_mm")
    a = torch.randn(10, 32)
    b = torch.randn(4, 32, 48)
    offs = torch.tensor([3, 3, 7, 10], dtype=torch.int32)
    assert torch.allclose(torch._grouped_mm(a, b, offs=offs), emulated_grouped_mm(a, b, offs), atol=1e-5)


def test_the_sort_gives_each_experts_group_end_on_the_device():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    order, ends = fast_moe.sort_by_expert(ids, 4)
    assert ends.dtype == torch.int32 and ends.tolist() == [2, 3, 6, 6]       # expert 3: an empty last group
    assert ids.reshape(-1)[order].tolist() == [0, 0, 1, 2, 2, 2]
    assert order.tolist() == [1, 4, 3, 0, 2, 5]                              # stable: token order within a group


def test_the_grouped_kernel_is_chosen_only_where_it_runs():
    moe = MoeArch(n_experts=8, top_k=2, norm_topk_prob=True, intermediate=768, layers=(0,))
    assert "CUDA" in fast_moe.grouped_eligible(torch.device("cpu"), torch.bfloat16, moe, 2048)
    odd = MoeArch(n_experts=8, top_k=2, norm_topk_prob=True, intermediate=24, layers=(0,))
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        assert fast_moe.grouped_eligible(torch.device("cuda"), torch.bfloat16, moe, 2048) is None
        assert "multiples of 16" in fast_moe.grouped_eligible(torch.device("cuda"), torch.bfloat16, odd, 2048)
        assert "bfloat16" in fast_moe.grouped_eligible(torch.device("cuda"), torch.float32, moe, 2048)


# --- compile, spec -------------------------------------------------------------------------------

def test_the_compiled_moe_pieces_serve_every_size_without_recompiling(monkeypatch, moe_path):
    # dynamo's guards do not depend on the backend: "eager" shows on CPU that the router piece (with its
    # MoeArch constants) compiles once for every batch and prompt size, as the dense pieces do
    monkeypatch.setattr(fast_model, "COMPILE_BACKEND", "eager")
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=0)
    engine = FastEngine(moe_path, device="cpu", max_batch_size=8)
    engine._use_compiled(True)
    with torch._dynamo.config.patch(recompile_limit=2):
        engine._compile_shapes()
        with torch._dynamo.config.patch(error_on_recompile=True):
            gens = engine.generate(MANY, params)
    eager = FastEngine(moe_path, device="cpu", max_batch_size=8).generate(MANY, params)
    assert engine._forward.compiled
    assert [lists(g.routed_experts) for g in gens] == [lists(g.routed_experts) for g in eager]


def test_fast_accepts_qwen3_moe_and_refuses_other_moe_families_by_name(moe_path):
    from transformers import MixtralConfig, Qwen2MoeConfig

    assert fast_model.supports(AutoConfig.from_pretrained(moe_path)) is None
    base = dict(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=64)
    reason = fast_model.supports(Qwen2MoeConfig(**base, num_experts=4, shared_expert_intermediate_size=16))
    assert "model_type 'qwen2_moe' is a mixture-of-experts family" in reason and "shared experts" in reason
    assert "built: qwen3_moe (Qwen3-MoE) on the embedded and fast engines" in reason
    reason = fast_model.supports(MixtralConfig(**base, num_local_experts=4))
    assert "model_type 'mixtral' is a mixture-of-experts family" in reason


def test_run_config_with_rollout_engine_fast_accepts_qwen3_moe_with_r3(moe_path, tmp_path):
    from miles.config.flags import parse_flags

    data = tmp_path / "p.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    cfg, _ = parse_flags(["--hf-checkpoint", moe_path, "--prompt-data", str(data), "--rollout-batch-size", "2",
                          "--n-samples-per-prompt", "2", "--num-rollout", "1", "--rollout-max-response-len", "8",
                          "--rollout-engine", "fast", "--use-rollout-routing-replay"])
    assert cfg.rollout.engine == "fast" and cfg.train.use_rollout_routing_replay


def test_expert_ids_past_255_are_recorded_whole(tmp_path):
    # the outputs keep ids in one byte up to 256 experts, in two bytes past that
    path = make_tiny_family(tmp_path / "wide", "qwen3_moe", num_experts=300, num_experts_per_tok=4, seed=5)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    gens = FastEngine(path, device="cpu").generate(PROMPTS, GREEDY)
    assert max(e for g in gens for tok in g.routed_experts for layer in tok for e in layer) > 255
    for prompt, g in zip(PROMPTS, gens):
        want = hf_routing(model, prompt + g.response_ids)[len(prompt) - 1:-1]
        assert g.routed_experts.dtype == np.int16
        assert lists(g.routed_experts) == want.tolist()


def test_an_expert_layout_other_than_gate_up_rows_is_refused_by_name(moe_path):
    from miles.rollout.engines.fast.model import Arch, pack_weights

    model = AutoModelForCausalLM.from_pretrained(moe_path)
    model.model.layers[2].mlp.experts.is_transposed = True
    with pytest.raises(ValueError, match="model.layers.2.mlp.experts stores its weights transposed"):
        pack_weights(model, Arch.from_config(model.config), torch.device("cpu"))


def load_bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "moe_rollout_gpu.py"
    spec = importlib.util.spec_from_file_location("moe_rollout_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchs_bandwidth_bound_counts_the_experts_each_decode_step_touched():
    from miles.types import Generation

    bench = load_bench()
    # 2 sequences x 3 tokens, 2 MoE layers, top-2 of 4 experts. Token 0 came from the prefill (not a decode
    # step); decode step 0 made token 1, step 1 token 2
    a = [[[0, 1], [2, 3]], [[0, 1], [0, 1]], [[3, 2], [1, 0]]]
    b = [[[3, 2], [3, 2]], [[1, 2], [0, 1]], [[3, 2], [2, 3]]]
    gens = [Generation([5, 6, 7], [0.0] * 3, "length", 0, r) for r in (a, b)]
    counts = dict(expert_bytes=10, non_expert_bytes=1000, kv_bytes_per_position=1)
    got = bench.bound(gens, prompt_len=4, n_experts=4, counts=counts, bw=1.0)
    # step 0: layer 0 {0, 1, 2}, layer 1 {0, 1}: 5 experts; step 1: layer 0 {2, 3}, layer 1 {0, 1, 2, 3}: 6
    experts = (5 + 6) * 10
    kv = 2 * (4 + 1) + 2 * (4 + 2)           # both sequences' positions so far, at each step
    assert got["decode_steps"] == 2 and got["mean_distinct_experts_per_layer"] == 2.8
    assert got["bound_s"] == pytest.approx(experts + kv + 2 * 1000, rel=1e-3)     # 3 significant digits


def test_the_bench_runs_end_to_end_on_a_tiny_model(tmp_path, monkeypatch):
    import json
    import sys

    bench = load_bench()
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["moe_rollout_gpu.py", "--tiny", "--prompts", "3", "--prompt-len", "5",
                                      "--new-tokens", "6", "--hf-generate-prompts", "2", "--hf-new-tokens", "3",
                                      "--out", str(out)])
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    bench.main()
    report = json.loads(out.read_text())
    assert report["prompts_run"] == 3 and report["fast"]["tokens"] == 3 * 6 and report["fast"]["decode_steps"] == 5
    assert report["fast_engine"]["moe_experts"] == "loop" and report["generate"]["tokens"] == 2 * 3
    assert report["fast"]["bound_s"] > 0 and 0 < report["fast"]["mean_distinct_experts_per_layer"] <= 8
