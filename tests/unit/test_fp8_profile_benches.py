"""The FP8 profiling benches' plumbing on the CPU (issue 58): fp8_rollout_gpu.py's --profile-steps windows,
decode_attention_gpu.py (the engine's Triton kernel swept, and the split-K kernel checked against SDPA,
under Triton's interpreter), fp8_quantize_gpu.py and fp8_gemm_gpu.py, each at its --tiny shape. Their
numbers are the GPU's; the Triton cases skip where triton is not installed (CI)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_script(name: str, args: list[str], tmp_path: Path, interpret: bool) -> dict:
    """The script in a process of its own (Triton's interpreter is chosen when its kernels are defined)."""
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args, "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_kernel_names_fall_into_the_categories():
    bench = load("fp8_rollout_gpu")
    cat = bench.categorize
    assert cat("decode_attention_kernel") == "attention"
    assert cat("fmha_cutlassF_bf16_aligned_64x128_rf_sm80") == "attention"      # not a GEMM for saying cutlass
    assert cat("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN") == "bf16_gemm"
    assert cat("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize64x64x128") == "fp8_gemm"
    # a GEMM whose name says nothing of FP8 is FP8 when one fp8_blockwise_mm call launched it
    assert cat("nvjet_qqb_64x8_128x4", frozenset({"nvjet_qqb_64x8_128x4"})) == "fp8_gemm"
    assert cat("nvjet_qqb_64x8_128x4") == "bf16_gemm"
    assert cat("triton_red_fused__to_copy_abs_amax_clamp_div_mean_mul_pow_rsqrt_0") == "quantize"
    # inductor says _to_copy for every cast it fuses: a norm is fused elementwise work, not a copy
    assert cat("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1") == "fused_elementwise"
    assert cat("triton_red_fused_argmax_div_log_logsumexp_sub_2") == "sampling"
    assert cat("void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, 4>") \
        == "sampling"
    assert cat("Memcpy DtoH (Device -> Pinned)") == "copies"
    assert cat("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>>") == "copies"
    assert cat("aten::mm") == "bf16_gemm" and cat("aten::mul") == "other"


def test_a_window_summary_is_per_step_and_sorted():
    bench = load("fp8_rollout_gpu")
    events = [("decode_attention_kernel", 30.0)] * 4 + [("nvjet_hsh_a", 50.0)] * 2 + [("Memset (Device)", 2.0)]
    got = bench.summarize(events, steps=2, top=2)
    assert got["kernels"] == 7 and got["distinct"] == 3
    assert got["device_ms_per_step"] == pytest.approx((120 + 100 + 2) / 1e3 / 2)
    att = got["categories"]["attention"]
    assert att == dict(ms_per_step=0.06, share=round(120 / 222, 4), calls_per_step=2.0)
    assert got["categories"]["bf16_gemm"]["ms_per_step"] == 0.05
    assert got["categories"]["copies"]["calls_per_step"] == 0.5
    assert [t["name"] for t in got["top"]] == ["decode_attention_kernel", "nvjet_hsh_a"]
    assert sum(c["share"] for c in got["categories"].values()) == pytest.approx(1.0, abs=1e-3)


def test_the_rollout_bench_profiles_windows_of_decode_steps(tmp_path, monkeypatch):
    bench = load("fp8_rollout_gpu")
    out, traces = tmp_path / "r.json", tmp_path / "traces"
    monkeypatch.setattr(sys, "argv", ["fp8_rollout_gpu.py", "--tiny", "--variants", "both", "--skip-sync",
                                      "--profile-steps", "2", "--profile-modes", "graphs,eager",
                                      "--profile-context", "6,3", "--profile-dir", str(traces), "--out", str(out)])
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    bench.main()
    report = json.loads(out.read_text())
    v = report["variants"]["both"]
    assert list(v["profile"]) == ["6", "3"]          # one profiled call per context, in the order given
    prof = v["profile"]["6"]
    assert prof["context"] == 6 and prof["slots"] == v["slots"] and prof["steps_per_window"] == 2
    assert prof["timed_ms_per_step"] > 0 and prof["weight_gib"] > 0 and prof["bound_ms_per_step"] > 0
    assert set(prof["windows"]) == {"profiled", "profiled_eager"}
    for w in prof["windows"].values():
        assert w["mode"] == "eager" and w["host_per_step"]["source"] == "cpu_aten_ops"     # no graphs on the CPU
        cats = w["categories"]
        assert set(cats) == set(bench.CATEGORY_NAMES)
        # every layer's attention and the projections' matmuls (FP8 emulated: dequantized, then aten::mm)
        assert cats["attention"]["calls_per_step"] >= 2 and cats["bf16_gemm"]["calls_per_step"] >= 2 * 4
        assert w["device_ms_per_step"] == pytest.approx(sum(c["ms_per_step"] for c in cats.values()), rel=1e-2)
        totals = [t["total_ms"] for t in w["top"]]
        assert totals == sorted(totals, reverse=True) and len(totals) <= 25
        trace = Path(w["trace"])
        assert trace.parent == traces and trace.suffix == ".gz" and trace.stat().st_size < bench.TRACE_LIMIT
        assert "traceEvents" in json.loads(gzip.decompress(trace.read_bytes()))
    assert {t.name for t in traces.iterdir()} == {f"both-{c}-{w}.json.gz" for c in (6, 3)
                                                  for w in ("profiled", "profiled_eager")}
    side = report["profile_comparison"]["by_context"]["6"]
    assert side["slots"] == {"both": v["slots"]} and side["timed_ms_per_step"] == {"both": prof["timed_ms_per_step"]}
    attention = prof["windows"]["profiled"]["categories"]["attention"]["ms_per_step"]
    assert side["windows"]["profiled"]["attention"] == {"both": attention}
    # two contexts: ms/step = fixed + per-1k-context x context through both points
    fit = report["profile_comparison"]["fit"]["both"]
    for c in ("6", "3"):
        p = v["profile"][c]
        got = fit["ms_per_step_fixed"] + fit["ms_per_step_per_1k_context"] * p["context"] / 1e3
        assert got == pytest.approx(p["timed_ms_per_step"], abs=5e-3)


def test_the_attention_bench_checks_the_split_k_kernel_against_sdpa(tmp_path):
    pytest.importorskip("triton")
    r = run_script("decode_attention_gpu", ["--tiny"], tmp_path, interpret=True)
    assert set(r["checks"]) == {"bf16", "fp8"}
    for checks in r["checks"].values():
        assert any(n.startswith("split_k") for n in checks) and any(n.startswith("engine ") for n in checks)
        assert any(n.startswith("engine_paged") for n in checks)     # the kernel through a shuffled page table
        assert any(n.startswith("engine ") and n.endswith("v_as_a") for n in checks)   # P V as (V^T P^T)^T
        assert any(n.startswith("engine_paged") and n.endswith("v_as_a") for n in checks)
        # float32 in IEEE precision: the kernels compute what SDPA does, split over 3 chunks of 16 keys at most
        assert all(isinstance(e, float) and e < 1e-4 for e in checks.values()), checks
    assert [(x["dtype"], x["context"]) for x in r["results"]] == [("bf16", 5), ("bf16", 40), ("fp8", 5), ("fp8", 40)]
    shape = r["shape"]
    for row in r["results"]:
        elem = 4 if row["dtype"] == "bf16" else 1       # --tiny: float32 compute; the FP8 cache is e4m3
        assert row["kv_bytes"] == row["batch"] * row["context"] * shape["kv_heads"] * shape["head_dim"] * 2 * elem
        assert row["default"]["block"] == 64 and row["default"]["stages"] is None
        assert row["best"]["kind"] == "engine" and row["best_split_k"]["kind"] == "split_k"
        assert row["best"]["ms"] <= row["default"]["ms"] and row["sdpa"]["ms"] > 0
        assert row["default"]["ms_per_step"] == pytest.approx(row["default"]["ms"] * 2, abs=2e-3)    # --tiny: 2 layers
        assert all(c.get("checked") for c in row["configs"].values())


def test_the_quantize_bench_splits_the_fp8_sync(tmp_path):
    try:
        import triton  # noqa: F401
        interpret = True
    except ImportError:
        interpret = False
    r = run_script("fp8_quantize_gpu", ["--tiny"], tmp_path, interpret=interpret)
    assert r["linear_tensors"] == 2 * 7 and r["tensors"] == 2 * 11 + 2
    # bf16 buckets hold every tensor in bf16 (plus alignment); the FP8 ones a byte per Linear weight and scales
    fill16 = r["bf16_fill"]
    assert fill16["bucket_bytes"] >= r["bf16_bytes"] and fill16["bytes"] == 2 * fill16["bucket_bytes"]
    assert r["fp8_fill"]["bucket_bytes"] < 0.6 * r["bf16_fill"]["bucket_bytes"]
    assert r["fp8_vs_bf16_fill"] > 0
    # from float32 weights (the torch trainer's) each fill reads 2 more bytes per element
    assert r["bf16_fill_from_fp32"]["bytes"] - r["bf16_fill"]["bytes"] == r["bf16_bytes"]
    assert r["fp8_fill_from_fp32"]["bytes"] - r["fp8_fill"]["bytes"] == r["bf16_bytes"]
    for path in ("quantize_torch", "copy_bf16") + (("quantize_triton",) if interpret else ()):
        p = r[path]
        assert p["seconds"] > 0 and p["kernels_per_tensor"] >= 1 and p["host_enqueue_seconds"] <= p["seconds"]
        assert sum(s["tensors"] for s in p["per_shape"].values()) == r["linear_tensors"]
    assert r["copy_bf16"]["bytes"] == 2 * r["linear_bf16_bytes"]
    assert r["quantize_torch"]["kernels_per_tensor"] > r["copy_bf16"]["kernels_per_tensor"]
    if interpret:
        assert r["bits_equal"]["scales_differ"] == 0 and r["bits_equal"]["values_meaningful"] is False
    else:
        assert "skipped" in r["quantize_triton"]


def test_the_gemm_bench_times_each_projection_both_ways(tmp_path, monkeypatch):
    bench = load("fp8_gemm_gpu")
    out = tmp_path / "g.json"
    monkeypatch.setattr(sys, "argv", ["fp8_gemm_gpu.py", "--tiny", "--out", str(out)])
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    bench.main()
    r = json.loads(out.read_text())
    assert r["fp8_kernel"] == "dequant_matmul" and r["compiled"] is False       # the CPU: FP8 emulated, eager
    assert [(x["proj"], x["m"]) for x in r["results"]] == [(p, m) for p in bench.TINY for m in (3, 8)]
    for row in r["results"]:
        n, k = row["n"], row["k"]
        assert row["bf16"]["bytes"] == n * k * 4                                   # --tiny computes in float32
        assert row["fp8_linear"]["bytes"] == n * k + (n // 128) * (k // 128) * 4
        assert all(row[e]["us"] > 0 for e in bench.ENTRIES if e != "fp8_w8a16")
        assert row["fp8_w8a16"]["tiles"][:2] == list(bench.tile_config(row["m"], n, 132)[:2])
        if bench.triton_ready():      # TRITON_INTERPRET=1 with triton: the kernel runs under the interpreter
            assert row["fp8_w8a16"]["us"] > 0
        else:                         # CI's CPU run: no Triton
            assert "Triton" in row["fp8_w8a16"]["skipped"]
        assert row["fp8_vs_bf16"] == pytest.approx(row["bf16"]["us"] / row["fp8_linear"]["us"], abs=1e-3)
    for m, step in r["per_step"].items():
        rows = [x for x in r["results"] if x["m"] == int(m)]
        assert step["bf16"] == pytest.approx(sum(x["bf16"]["us"] for x in rows) * 2 / 1e3, abs=2e-3)
