"""FP8 rollout on CUDA (issue 58): the FP8 linear, which kernel ran, the FP8 KV cache, FP8 weight sync.

Skipped without a GPU. The block-scaled GEMM needs capability >= 9.0 (Hopper); the tests that need it
say so when it did not run. Run on the GPU machine (no Ray needed):
    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_fp8_gpu.py -x -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from miles.weights import fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEMO = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "base_model"
EVAL = DEMO.parent / "data" / "eval.jsonl"
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _eval_prompts(tokenizer, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in EVAL.read_text().splitlines()[:n]]
    return [tokenizer(r["input"], add_special_tokens=False)["input_ids"] for r in rows]


@pytest.fixture(params=[False, True], ids=["default", "w8a16"])
def w8a16(request):
    """fp8.W8A16 as the module sets it (off until measured), then on: the Triton W8A16 kernel for decode rows."""
    before = fp8.W8A16
    fp8.W8A16 = fp8.W8A16 or request.param
    yield fp8.W8A16
    fp8.W8A16 = before
    fp8.select_kernel(torch.device("cuda"), torch.bfloat16)


def test_kernel_selection_and_fp8_linear_close_to_bf16(w8a16):
    kernel = fp8.select_kernel(torch.device("cuda"), torch.bfloat16)
    print("fp8 kernel:", kernel, "torch", torch.__version__, torch.cuda.get_device_name())
    if HOPPER and not w8a16:
        assert kernel.startswith("scaled_mm_blockwise"), (
            f"capability {torch.cuda.get_device_capability()} has FP8 GEMMs but the block-scaled one was not "
            f"taken ({kernel}): torch {torch.__version__} lacks it or its probe disagreed")
    elif HOPPER:
        assert kernel.startswith("w8a16_triton") and "scaled_mm_blockwise" in kernel, (
            f"capability {torch.cuda.get_device_capability()} has FP8 GEMMs but the W8A16 kernel for decode rows "
            f"and the block-scaled GEMM above were not both taken ({kernel}): Triton or torch lacks one or its "
            f"probe disagreed")
    elif torch.cuda.get_device_capability() < (8, 9):
        assert kernel == "dequant_matmul"
    gen = torch.Generator(device="cuda").manual_seed(1)
    # with the W8A16 kernel on, rows above fp8.W8A16_MAX_M (the 2nd to last) take the block-scaled GEMM
    for m, n, k in ((1, 6144, 2560), (7, 2560, 4096), (256, 19456, 2560), (fp8.W8A16_MAX_M + 88, 6144, 2560),
                    (130, 2560, 9728)):
        x = torch.randn((m, k), generator=gen, device="cuda").bfloat16()
        w = (torch.randn((n, k), generator=gen, device="cuda") * 0.02).bfloat16()
        q = fp8.QuantWeight(*fp8.quantize_blocks(w))
        got = fp8.linear(x, q).float()
        ref = F.linear(x, w).float()
        err = ((got - ref).norm() / ref.norm()).item()
        assert got.shape == (m, n) and err < 0.06, f"{m}x{n}x{k}: relative error {err:.4f} vs bf16"
        emulated = F.linear(x.float(), fp8.dequantize_blocks(*q)).float()   # weights on the grid, x exact
        assert ((got - emulated).norm() / emulated.norm()).item() < 0.04


@pytest.mark.skipif(not HOPPER, reason="the W8A16 kernel is selected on capability >= 8.9; tested on Hopper")
def test_w8a16_kernel_is_the_dequantized_product_in_every_tile_shape_and_in_a_cuda_graph():
    """The Triton W8A16 kernel in bf16 against the float32 product of the dequantized weight (its only
    rounding is the output's), for the tile shapes `tile_config` picks and others, edge tiles in M and N;
    then replayed from a CUDA graph (how the engine runs it) with new inputs copied in."""
    from miles.weights.fp8_w8a16 import tile_config, w8a16_mm

    gen = torch.Generator(device="cuda").manual_seed(3)
    for m, n, k in ((1, 6144, 2560), (105, 2560, 9728), (219, 19456, 2560), (300, 1000, 384)):
        x = torch.randn((m, k), generator=gen, device="cuda").bfloat16()
        q, s = fp8.quantize_blocks(torch.randn((n, k), generator=gen, device="cuda") * 0.05)
        want = F.linear(x.float(), fp8.dequantize_blocks(q, s))
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for config in (None, (16, 16, 4, 3), (64, 32, 4, 4), (128, 64, 8, 3), tile_config(m, n, sms)):
            got = w8a16_mm(x, q, s, config).float()
            err = ((got - want).norm() / want.norm()).item()
            assert err < 5e-3, f"{m}x{n}x{k} tiles {config}: relative error {err:.2e}"
    x = torch.randn((64, 2560), generator=gen, device="cuda").bfloat16()
    q, s = fp8.quantize_blocks(torch.randn((6144, 2560), generator=gen, device="cuda") * 0.05)
    w8a16_mm(x, q, s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w8a16_mm(x, q, s)
    x.copy_(torch.randn((64, 2560), generator=gen, device="cuda").bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, w8a16_mm(x, q, s), rtol=0, atol=0)


def test_triton_block_quantization_gives_the_torch_paths_bits():
    """The CUDA quantizer (one Triton kernel) against the torch ops it replaces: the same e4m3 bits and
    scales, for bf16/fp16/fp32 weights, edge blocks, a transposed view and an all-zero block."""
    assert fp8._triton(), "triton is missing on a CUDA machine: FP8 syncs quantize by torch ops, 3x the bytes"
    gen = torch.Generator(device="cuda").manual_seed(2)
    for (n, k), dtype in (((2560, 9728), torch.bfloat16), ((300, 129), torch.bfloat16), ((128, 128), torch.float32),
                          ((1024, 2560), torch.float16)):
        w = (torch.randn((n, k), generator=gen, device="cuda") * 0.05).to(dtype)
        w[:128, :128] = 0
        for view in (w, w.t().contiguous().t()):
            got, want = fp8._quantize_blocks_triton(view), fp8._quantize_blocks_torch(view)
            assert torch.equal(got[1], want[1]), f"{n}x{k} {dtype}: scales differ"
            diff = (got[0].view(torch.uint8) != want[0].view(torch.uint8)).sum().item()
            assert diff == 0, f"{n}x{k} {dtype}: {diff} e4m3 values differ"
    # a float32 weight rounded to bf16/fp16 in the kernel (the FP8 sync's pass) and written into a given
    # tensor: the bits of casting first, then quantizing
    w = torch.randn((2560, 9728), generator=gen, device="cuda") * 0.05
    for round_to in (torch.bfloat16, torch.float16):
        out = torch.empty(w.shape, dtype=fp8.FP8, device="cuda")
        got = fp8._quantize_blocks_triton(w, round_to, out)
        want = fp8._quantize_blocks_torch(w.to(round_to))
        assert got[0] is out and torch.equal(got[1], want[1]), f"round_to {round_to}: scales differ"
        diff = (out.view(torch.uint8) != want[0].view(torch.uint8)).sum().item()
        assert diff == 0, f"round_to {round_to}: {diff} e4m3 values differ"


def test_a_bucket_of_fp8_weights_is_quantized_by_one_launch_with_the_per_weight_paths_bits():
    """`Fp8Weights.write_bucket` on CUDA: every Linear weight of a bucket quantized by one kernel launch
    (`quantize_group`), values and scales in place, a scale that falls in the next bucket carried there.
    Its buckets hold the bytes the per-weight path (`write_into`, one launch per weight) writes, from
    float32 weights rounded to bf16 in the pass, in a first fill, a second (the tables reused), and after a
    weight moved (its bucket's table made again)."""
    from miles.weights.transport import bucket_views, fill_bucket, plan_buckets

    gen = torch.Generator(device="cuda").manual_seed(3)
    shapes = {"self_attn.q_proj": (4096, 2560), "self_attn.k_proj": (1024, 2560), "self_attn.o_proj": (2560, 4096),
              "mlp.down_proj": (2560, 9728), "mlp.up_proj": (300, 129)}
    live = {}
    for layer in range(3):
        live[f"model.layers.{layer}.input_layernorm.weight"] = torch.randn(2560, generator=gen, device="cuda")
        for proj, shape in shapes.items():
            live[f"model.layers.{layer}.{proj}.weight"] = torch.randn(shape, generator=gen, device="cuda") * 0.05
    live["model.layers.1.mlp.down_proj.weight"][:256, :128] = 0.0
    weights = fp8.Fp8Weights(live, torch.bfloat16)
    for size in range(16 << 20, 64 << 20, 1 << 16):      # buckets at which some weight's scale is carried
        plans = plan_buckets(weights, dtype=torch.bfloat16, bucket_bytes=size)
        if any(p.metas[0].name.endswith(fp8.SCALE_SUFFIX) for p in plans):
            break
    assert any(p.metas[0].name.endswith(fp8.SCALE_SUFFIX) for p in plans)

    class PerWeight(dict):          # not a plain dict: write_bucket takes the per-weight path
        pass

    state: dict = {}
    for moved in (False, False, True):
        if moved:
            name = "model.layers.2.self_attn.o_proj.weight"
            live[name] = live[name].clone() * 1.5
        want_weights = fp8.Fp8Weights(PerWeight(live), torch.bfloat16)
        for plan in plans:
            got = bucket_views(plan, fill_bucket(plan, fp8.Fp8Weights(live, torch.bfloat16), device="cuda", state=state))
            want = bucket_views(plan, fill_bucket(plan, want_weights, device="cuda"))
            for name in got:
                assert torch.equal(got[name].reshape(-1).view(torch.uint8), want[name].reshape(-1).view(torch.uint8)), \
                    (name, moved)
        assert not state["carried"], list(state["carried"])       # every carried scale went into its bucket
    assert sum(isinstance(v, dict) and "table" in v for v in state.values()) >= 2


def _greedy(quantization, kv_cache_dtype, prompts, max_new_tokens=8, **kw):
    from miles.rollout.engines.fast.engine import FastEngine
    from miles.types import SamplingParams

    engine = FastEngine(str(DEMO), device="cuda", max_batch_size=64, max_context_len=64, quantization=quantization,
                        kv_cache_dtype=kv_cache_dtype, **kw)
    try:
        gens = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
        paths = dict(graphs=engine._graphs.enabled, compiled=engine._forward.compiled,
                     length_aware=engine._forward.length_aware)
        return [g.response_ids for g in gens], dict(engine.last_stats), paths
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def prompts():
    from miles.weights.hf import load_tokenizer

    return _eval_prompts(load_tokenizer(str(DEMO)), 200)


@pytest.fixture(scope="module")
def bf16_answers(prompts):
    return _greedy(None, "auto", prompts)[0]


@pytest.mark.parametrize("quantization,kv,w8a16", [("fp8", "auto", False), (None, "fp8_e4m3", False),
                                                   ("fp8", "fp8_e4m3", False), ("fp8", "auto", True),
                                                   ("fp8", "fp8_e4m3", True)])
def test_fast_engine_fp8_greedy_agrees_with_bf16(prompts, bf16_answers, quantization, kv, w8a16):
    """Greedy answers of the FP8 engines against bf16's; `w8a16`: with the Triton W8A16 kernel selected (the
    engine compiles it into its decode graphs and captures it)."""
    before = fp8.W8A16
    fp8.W8A16 = before or w8a16
    try:
        answers, stats, paths = _greedy(quantization, kv, prompts)
    finally:
        fp8.W8A16 = before
    assert stats["fp8_kernel"] == (fp8.kernel() if quantization else None)
    if w8a16 and HOPPER:
        assert stats["fp8_kernel"].startswith("w8a16_triton"), stats["fp8_kernel"]
    assert stats["kv_cache_dtype"] == ("torch.float8_e4m3fn" if kv != "auto" else "torch.bfloat16")
    assert paths["graphs"] and paths["compiled"], "CUDA graphs / torch.compile fell back (see the log)"
    same = sum(a == b for a, b in zip(answers, bf16_answers)) / len(answers)
    print(f"{quantization} kv={kv}: greedy answers equal to bf16's on {same:.1%} ({stats['fp8_kernel']})")
    assert same >= 0.9


def test_fp8_kv_cache_with_attention_kernel(prompts, bf16_answers):
    """The length-aware Triton kernel reads the e4m3 cache (its check against SDPA passed, so it ran)."""
    answers, _, paths = _greedy(None, "fp8_e4m3", prompts)
    assert paths["length_aware"], "the attention kernel was refused for the FP8 cache (see the log)"
    sdpa, _, _ = _greedy(None, "fp8_e4m3", prompts, attention_kernel=False)
    assert sum(a == b for a, b in zip(answers, sdpa)) / len(answers) >= 0.95


def test_weight_sync_moves_fp8_bytes():
    """A bucketed sync of FP8 weights: e4m3 bytes plus float32 scales, about half of bf16's bytes, and the
    engine then holds exactly the sender's quantized weights (the --check-weight-update-equal checksum)."""
    from miles.rollout.engines.fast.engine import FastEngine
    from miles.weights.checksum import state_dict_checksum
    from miles.weights.hf import load_causal_lm, model_weights
    from miles.weights.transport import WeightBucket, fill_bucket, plan_buckets

    trainer = load_causal_lm(str(DEMO), device=torch.device("cuda"), dtype=torch.float32)
    with torch.no_grad():
        for t in model_weights(trainer).values():
            t.add_(torch.randn_like(t) * 1e-3)
    engine = FastEngine(str(DEMO), device="cuda", max_batch_size=4, max_context_len=64, quantization="fp8")
    weights = fp8.Fp8Weights(model_weights(trainer), torch.bfloat16)
    plans = plan_buckets(weights, dtype=torch.bfloat16, bucket_bytes=1 << 20)
    metas = [m for p in plans for m in p.metas]
    assert any(m.dtype == fp8.FP8 for m in metas) and any(m.name.endswith(fp8.SCALE_SUFFIX) for m in metas)
    plain = sum(p.nbytes for p in plan_buckets(model_weights(trainer), dtype=torch.bfloat16, bucket_bytes=1 << 20))
    assert sum(p.nbytes for p in plans) < 0.8 * plain
    for i, plan in enumerate(plans):
        flat = fill_bucket(plan, weights, device="cuda")
        engine.load_weight_bucket(WeightBucket(index=i, count=len(plans), version=1, metas=plan.metas, payload=flat))
    assert engine.weight_version() == 1
    assert engine.weights_checksum() == state_dict_checksum(fp8.Fp8Weights(model_weights(trainer), torch.bfloat16),
                                                            dtype=torch.bfloat16)
    engine.dispose()
