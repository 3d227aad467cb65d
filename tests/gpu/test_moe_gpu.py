"""Qwen3-MoE on one GPU (docs/moe.md). The fast engine's experts: the grouped matmuls equal the per-expert
loop in bf16, a CUDA-graph decode gives the eager decode's tokens and routing, an fp32 engine (the loop,
decode eager) equals transformers. The trainer's layers compiled (--trainer-compile, opt-in for MoE) replay and step
as eager ones do. Then as a user runs it: the CLI, no layout flags (the run colocates),
the tiny MoE arithmetic model on `--rollout-engine embedded`, which on CUDA is the fast engine, and the
torch trainer in bf16, with R3: every response token replayed, the router losses on, the weights synced
and checked, and the recipe's bar met in 10 rollouts. Skipped without CUDA.

    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_moe_gpu.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
PROMPTS = [[5, 6, 14, 11, 18], [7, 8], [9, 4, 4, 4, 4, 4, 4, 4, 5], [21, 22, 20, 23], [3, 9, 12], [17] * 12]


def lists(routed) -> list:
    """A Generation's routing as nested lists (the fast engine gives one numpy array [MoE layers, k] a token)."""
    return [np.asarray(tok).tolist() for tok in routed]


@pytest.mark.skipif(not HOPPER, reason="the grouped kernel runs on compute capability >= 9.0")
@pytest.mark.parametrize("tokens", [1, 7, 256, 3000])
def test_grouped_experts_equal_the_loop_in_bf16(tokens):
    from miles.rollout.engines.fast.moe import (MoeArch, MoeLayerWeights, experts_grouped, experts_loop,
                                                grouped_eligible, route)

    moe = MoeArch(n_experts=32, top_k=4, norm_topk_prob=True, intermediate=256, layers=(0,))
    hidden = 512
    assert grouped_eligible(torch.device("cuda"), torch.bfloat16, moe, hidden) is None
    g = torch.Generator(device="cuda").manual_seed(tokens)

    def rand(*shape, std=0.05):
        return (torch.randn(shape, generator=g, device="cuda") * std).to(torch.bfloat16)

    w = MoeLayerWeights(router=rand(32, hidden), gate_up=rand(32, 512, hidden), down=rand(32, hidden, 256))
    h = rand(tokens, hidden, std=1.0)
    weights, ids = route(h, w.router, moe)
    from tests.unit.test_fast_engine_moe import reference_experts      # the CPU tests' oracle, on the GPU here

    want = reference_experts(h, ids, weights, w)
    grouped, loop = (f(h, ids, weights, w).float() for f in (experts_grouped, experts_loop))
    scale = want.abs().max()
    assert (loop - want).abs().max() / scale < 2e-2
    assert (grouped - want).abs().max() / scale < 2e-2
    assert (grouped - loop).abs().max() / scale < 2e-2


@pytest.fixture(scope="module")
def grouped_model(tmp_path_factory):
    # the tiny Qwen3-MoE with an expert width the grouped kernel takes (16-aligned), 8 experts, top-2
    from tests.tiny_model import make_tiny_family

    return make_tiny_family(tmp_path_factory.mktemp("moe"), "qwen3_moe", num_experts=8, moe_intermediate_size=32)


@pytest.mark.skipif(not HOPPER, reason="the grouped kernel runs on compute capability >= 9.0")
def test_graph_decode_gives_the_eager_decodes_tokens_and_routing(grouped_model):
    from miles.rollout.engines.fast.engine import FastEngine
    from miles.types import SamplingParams

    graphs = FastEngine(grouped_model, device="cuda", max_batch_size=8)
    eager = FastEngine(grouped_model, device="cuda", max_batch_size=8, cuda_graph=False)
    assert graphs.moe_experts == eager.moe_experts == "grouped"
    for params in (SamplingParams(temperature=0.0, max_new_tokens=24),
                   SamplingParams(temperature=1.0, max_new_tokens=24, seed=3)):
        a, b = graphs.generate(PROMPTS * 3, params), eager.generate(PROMPTS * 3, params)
        assert graphs._graphs.enabled and len(graphs._graphs) > 0, "decode was not captured (see cuda_graph_* logs)"
        assert [g.response_ids for g in a] == [g.response_ids for g in b]
        # the routing a captured step wrote into its static buffer is the eager step's
        assert [lists(g.routed_experts) for g in a] == [lists(g.routed_experts) for g in b]
        for g in a:
            assert len(g.routed_experts) == len(g.response_ids)
            assert all(len(layer) == 2 and len(set(layer)) == 2 for tok in g.routed_experts for layer in tok)
            assert {len(tok) for tok in g.routed_experts} == {2}         # MoE layers 1 and 2 (layer 0 is dense)


def test_fp32_engine_runs_the_loop_eagerly_and_equals_transformers(grouped_model):
    from transformers import AutoModelForCausalLM

    from miles.rollout.engines.fast.engine import FastEngine
    from miles.training.moe import Routing
    from miles.types import SamplingParams

    engine = FastEngine(grouped_model, device="cuda", dtype="float32", max_batch_size=8)
    assert engine.moe_experts == "loop" and not engine._graphs.enabled     # moe_decode_eager, logged
    model = AutoModelForCausalLM.from_pretrained(grouped_model, dtype=torch.float32).to("cuda").eval()
    routing = Routing(model)
    for prompt, g in zip(PROMPTS, engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=16))):
        with torch.no_grad():
            routing.begin()
            logits = model(input_ids=torch.tensor([prompt + g.response_ids], device="cuda")).logits[0].float()
        logits = logits[len(prompt) - 1:-1]
        assert g.response_ids == logits.argmax(-1).tolist()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.response_ids, device="cuda")[:, None])
        assert max(abs(a - b) for a, b in zip(g.logprobs, lp.squeeze(-1).tolist())) < 1e-4
        hf = routing.applied()[len(prompt) - 1:-1]
        assert lists(g.routed_experts) == hf.tolist()


def test_compiled_moe_layers_replay_and_train_as_eager_ones_on_the_gpu():
    # --trainer-compile on an MoE model (opt-in; eager by default): inductor-compiled layers with the routing
    # hooks inside replay every token's rollout experts exactly, and the step agrees with the eager trainer's
    # in bf16 (tests/unit/test_moe.py checks the same on the CPU with dynamo's counting backend)
    from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
    from miles.rollout.engines.fast.engine import FastEngine
    from miles.training.batch import make_train_batch
    from miles.training.torch.trainer import Trainer
    from miles.types import SamplingParams
    from tests.unit.test_moe import samples_of

    model = str(ROOT / "examples/arithmetic/base_model_qwen3_moe")
    engine = FastEngine(model, device="cuda", seed=0)
    prompts = PROMPTS * 2
    samples = samples_of(prompts, engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)))
    engine.dispose()
    runs = []
    for compiled in (False, True):
        t = Trainer(model, train=TrainConfig(lr=1e-3, micro_batch_size=8, use_rollout_routing_replay=True,
                                             compile_layers=compiled),
                    algorithm=AlgorithmConfig(loss_agg_mode="token_mean"),
                    rollout=RolloutConfig(batch_size=len(prompts) // 2, n_samples_per_prompt=2), device="cuda")
        assert t._compiled_layers is compiled
        batch = make_train_batch(samples, t.pad_id).to("cuda")
        with torch.no_grad():
            t._forward(t.model, batch, False, False)
        replayed = (batch.routed_experts[..., 0, 0] >= 0).reshape(-1).cpu()     # the response tokens
        applied = t._moe.routing.applied().cpu()[replayed]
        rollout = batch.routed_experts.reshape(-1, *batch.routed_experts.shape[2:]).cpu()[replayed]
        assert torch.equal(applied, rollout)             # every response token routed as the rollout was
        metrics = t.train(samples, rollout_id=0)
        runs.append(metrics)
    metrics, c_metrics = runs
    assert c_metrics["moe/routing_replayed"] == metrics["moe/routing_replayed"] == 1.0
    assert c_metrics["layer_compiles"] > 0 and metrics["layer_compiles"] == 0
    assert c_metrics["loss"] == pytest.approx(metrics["loss"], rel=2e-2, abs=2e-3)
    assert c_metrics["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=5e-2)


def test_qwen3_moe_learns_on_one_gpu_with_rollout_routing_replay(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "miles.cli", "train", "--config", str(ROOT / "examples/arithmetic/grpo.yaml"),
           "--hf-checkpoint", str(ROOT / "examples/arithmetic/base_model_qwen3_moe"), "--device", "cuda",
           "--run-dir", str(run), "--trace-console", "off", "--progress", "plain", "--num-rollout", "10",
           "--eval-interval", "10", "--check-weight-update-equal", "--use-rollout-routing-replay",
           "--moe-aux-loss-coeff", "1e-3", "--moe-z-loss-coeff", "1e-4", "--moe-router-dtype", "fp32"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stderr[-3000:]
    trace = [json.loads(line) for line in (run / "trace.jsonl").read_text().splitlines() if line.strip()]
    picked, = [e for e in trace if e.get("event") == "engine_picked"]
    assert picked.get("family") == "qwen3_moe" and picked.get("cls") == "FastEngine", picked
    synced = [e for e in trace if e.get("event") == "weights_synced"]
    assert len(synced) == 11 and all(e.get("checksum") for e in synced)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trains = [r for r in rows if "moe/routing_replayed" in r]
    assert len(trains) == 10
    assert all(r["moe/routing_replayed"] == 1.0 and r["moe/moe_aux_loss"] > 0 and r["moe/moe_z_loss"] > 0
               and 0.0 <= r["moe/routing_mismatch"] <= 1.0 for r in trains), trains[0]
    evals = [r for r in rows if r.get("kind") == "eval"]
    before, after = evals[0]["eval/arith/pass@1"], evals[-1]["eval/arith/pass@1"]
    assert after - before >= 0.15, (before, after)
