"""Qwen3 and Llama 3 on the GPU: FastEngine's parity with transformers (CUDA graphs, compiled layers,
the decode-attention kernel, head_dim 128 as Qwen3-1.7B has), the embedded engine giving its memory
back, and a colocated GRPO run on the Qwen3 arithmetic model that the run itself colocated (one GPU,
no layout flags). Skipped without CUDA.

Run on the GPU machine, from the checkout, after installing the .whl wheels (ray among them):
    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_model_families_gpu.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.rollout.engines.embedded.engine import EmbeddedEngine
from miles.rollout.engines.fast.attention import matches_sdpa
from miles.rollout.engines.fast.engine import FastEngine
from miles.types import SamplingParams
from tests.gpu.test_fast_engine_gpu import assert_fast_path, full_forward_logits, hf
from tests.tiny_model import EOS_ID, make_tiny_family
from tests.unit.test_fast_engine import MANY, PROMPTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
# one tying each (the CPU tests cover both for both families): each case compiles its own layer pieces
CASES = [("qwen3", True), ("llama3", False)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def model_path(request, tmp_path_factory):
    family, tied = request.param
    return make_tiny_family(tmp_path_factory.mktemp(family), family, tied=tied)


def test_fp32_greedy_equals_the_full_forward_argmax(model_path):
    engine = FastEngine(model_path, device="cuda", dtype="float32", max_batch_size=8)
    model = hf(model_path)
    for prompt, g in zip(MANY, engine.generate(MANY, GREEDY)):
        logits = full_forward_logits(model, prompt, g.response_ids)
        assert g.response_ids == logits.argmax(-1).tolist()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.response_ids, device="cuda")[:, None])
        assert (lp.squeeze(-1).cpu() - torch.tensor(g.logprobs)).abs().max() < 1e-3
        assert g.finish_reason == ("stop" if g.response_ids[-1] == EOS_ID else "length")
    assert_fast_path(engine)


def test_bf16_on_the_fast_path_within_bf16_tolerance(model_path):
    engine = FastEngine(model_path, device="cuda", max_batch_size=8)
    model = hf(model_path, torch.bfloat16)
    check_bf16(engine, model)
    if engine.arch.head_dim >= 16:
        assert_fast_path(engine)
    else:       # the tiny Llama 3's head_dim 8: below what the attention kernel takes, by design (usable())
        assert engine._forward.compiled and engine._graphs.enabled and len(engine._graphs) > 0
        assert not engine._forward.length_aware


def check_bf16(engine: FastEngine, model) -> None:
    params = SamplingParams(temperature=0.8, max_new_tokens=24, seed=0)
    diffs = []
    for prompt, g in zip(PROMPTS * 4, engine.generate(PROMPTS * 4, params)):
        logits = full_forward_logits(model, prompt, g.response_ids)
        lp = torch.log_softmax(logits / 0.8, -1).gather(-1, torch.tensor(g.response_ids, device="cuda")[:, None])
        diffs += (lp.squeeze(-1).cpu() - torch.tensor(g.logprobs)).abs().tolist()
    assert sum(diffs) / len(diffs) < 0.05 and max(diffs) < 0.5, (sum(diffs) / len(diffs), max(diffs))
    for prompt, g in zip(PROMPTS, engine.generate(PROMPTS, GREEDY)):
        logits = full_forward_logits(model, prompt, g.response_ids)   # argmax up to a bf16 near-tie
        chosen = logits.gather(-1, torch.tensor(g.response_ids, device="cuda")[:, None]).squeeze(-1)
        assert (logits.max(-1).values - chosen).max() < 0.25


def test_head_dim_128_takes_the_kernel_and_the_graphs(tmp_path):
    # Qwen3-1.7B's attention: 16 query heads over 8 KV heads of 128 dims (a group of 2), here in a
    # two-layer model with the same head layout
    assert matches_sdpa(8, 2, 128, torch.bfloat16, torch.device("cuda"), max_len=1000)
    from transformers import AutoModelForCausalLM

    from tests.tiny_model import _tokenizer, tiny_config

    cfg = tiny_config("qwen3", hidden_size=256, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      intermediate_size=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.normal_(1.0, 0.1)
    model.save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    engine = FastEngine(str(tmp_path), device="cuda", max_batch_size=8)
    assert engine.arch.head_dim == 128 and engine._forward.length_aware
    check_bf16(engine, hf(str(tmp_path), torch.bfloat16))
    assert_fast_path(engine)


def test_embedded_engine_gives_its_memory_back_and_answers_the_same(tmp_path):
    path = make_tiny_family(tmp_path / "m", "qwen3")
    engine = EmbeddedEngine(path, device="cuda", dtype="float32", max_batch_size=256)
    params = SamplingParams(temperature=1.0, max_new_tokens=64, seed=1)
    prompts = MANY * 20
    first = engine.generate(prompts, params)
    torch.cuda.synchronize()
    weights = sum(t.numel() * t.element_size() for t in engine._model.state_dict().values())
    # what this process holds besides (earlier tests' engines and compiled code): measured, not assumed
    allocated, held = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    engine.release_memory(("weights", "kv_cache", "cuda_graph"))
    assert torch.cuda.memory_allocated() <= allocated - weights and torch.cuda.memory_reserved() < held
    assert engine.health() == {"busy": False, "since_progress_s": 0.0}
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate(prompts[:1], params)
    engine.resume_memory(("weights",))
    engine.resume_memory(("kv_cache", "cuda_graph"))
    assert engine.generate(prompts, params) == first


@pytest.mark.ray
def test_one_gpu_without_layout_flags_colocates_and_qwen3_learns(tmp_path):
    # the CLI as a user runs it: no --colocate, a cluster of its own (one GPU) -> colocated; the
    # Qwen3 arithmetic model learns as the Llama one does on the CPU (tests/integration/test_demo.py),
    # weights checked by checksum after every CUDA IPC sync, memory flat over 10 iterations
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "miles.cli", "train", "--config", str(ROOT / "examples/arithmetic/grpo.yaml"),
           "--hf-checkpoint", str(ROOT / "examples/arithmetic/base_model_qwen3"), "--device", "cuda",
           "--run-dir", str(run), "--trace-console", "off", "--progress", "plain", "--num-rollout", "10",
           "--eval-interval", "10", "--offload-train", "--check-weight-update-equal", "--use-dynamic-batch-size",
           "--max-tokens-per-gpu", "2048"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "colocating: the cluster this run started has one GPU" in done.stderr
    assert "engine: FastEngine for Qwen3ForCausalLM" in done.stderr
    trace = [json.loads(line) for line in (run / "trace.jsonl").read_text().splitlines() if line.strip()]
    of = lambda name: [e for e in trace if e.get("event") == name]   # noqa: E731
    placement, = of("placement")
    assert placement["colocate"] and placement["auto_colocate"] and placement["bundles"] == 1
    picked, = of("engine_picked")
    assert (picked["engine"], picked["family"]) == ("fast", "qwen3")
    assert of("weight_transport")[0]["transport"] == "cuda_ipc"
    synced = of("weights_synced")
    assert len(synced) == 11 and all(e.get("transport") == "cuda_ipc" and e.get("checksum") for e in synced)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    before, after = evals[0]["eval/arith/pass@1"], evals[-1]["eval/arith/pass@1"]
    assert after - before >= 0.15, (before, after)
    kept = [r["gpu_mem_allocated_gib"] for r in rows if "gpu_mem_allocated_gib" in r]
    assert len(kept) == 10 and max(kept[1:]) <= 1.05 * min(kept[1:]) and kept[-1] <= kept[0] * 1.05, kept
    peaks = [r["gpu_mem_peak_gib"] for r in rows if "gpu_mem_peak_gib" in r]
    assert max(peaks[1:]) <= 1.25 * min(peaks[1:]), peaks
