"""Qwen3 and Llama 3 through a whole run on the CPU, as the demo runs the Llama model
(tests/integration/test_demo.py): GRPO on the arithmetic task from the committed base model of that
family (examples/arithmetic/make_base_model.py --family qwen3 / llama3), with the torch and the
megatron backends; greedy accuracy on the 500 held-out problems rises by at least 15 points.

The HF export of the last save is what the engine ran: its weights' checksum is the one the last
weight sync checked on the engine, and transformers' own greedy decoding of the export scores what
the run's last eval (greedy, on the engine) scored.

All four are `extended` (bash scripts/test.sh -m extended; 2-7 min each on 2 cores): the demo learns
in the default run (test_demo.py), the families' forward equals transformers' in
tests/unit/test_model_families.py, and two FSDP ranks run end to end in
test_custom_config_env_eval_e2e.py. The Qwen3 torch run uses 2 ranks (FSDP2 over gloo,
--actor-num-gpus-per-node 2 on the CPU): its weights reach the engine gathered bucket by bucket and
its export is made from them; the other three run on one rank.

Qwen3-MoE (base_model_qwen3_moe) runs the recipe with rollout routing replay (R3) and the router losses,
on one process, on 2 FSDP2 ranks and on --train-backend megatron (extended too; docs/moe.md).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from miles.api.launch import train
from miles.config.flags import parse_flags
from miles.runtime import with_disposer
from miles.training.megatron.checks import installed
from tests.integration.test_demo import assert_learns_arithmetic

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/arithmetic"
NEEDS_MEGATRON = pytest.mark.skipif(not installed("megatron.core"), reason="needs megatron-core")


@pytest.mark.parametrize("family,backend,ranks", [
    pytest.param("qwen3", "torch", 2, marks=pytest.mark.extended),
    pytest.param("llama3", "torch", 1, marks=pytest.mark.extended),
    pytest.param("qwen3", "megatron", 1, marks=[pytest.mark.extended, NEEDS_MEGATRON]),
    pytest.param("llama3", "megatron", 1, marks=[pytest.mark.extended, NEEDS_MEGATRON]),
])
def test_family_learns_arithmetic_and_its_export_is_the_engine_s_model(ray_cluster, tmp_path, family, backend, ranks):
    cfg, _ = parse_flags(["--config", str(EXAMPLE / "grpo.yaml"), "--hf-checkpoint", str(EXAMPLE / f"base_model_{family}"),
                          "--train-backend", backend, "--run-dir", str(tmp_path / "run"), "--save", str(tmp_path / "ck"),
                          "--save-interval", "40", "--trace-console", "off", "--check-weight-update-equal",
                          "--actor-num-gpus-per-node", str(ranks)])
    result = asyncio.run(with_disposer(train, cfg))
    trace, after = assert_learns_arithmetic(result)
    if ranks > 1:       # the trainer that ran is the FSDP group of that many ranks, each with its own shards
        ready = [json.loads(line) for line in (result.run_dir / "logs" / "trainer-0.jsonl").open()
                 if '"trainer_ready"' in line]
        assert [r.get("ranks") for r in ready] == [ranks]
        assert sorted(p.name for p in (tmp_path / "ck" / "iter_0000039" / "trainer" / "rng").iterdir()) == [
            f"rank_{r}.pt" for r in range(ranks)]
    picked, = trace.of("engine_picked")
    assert picked.get("family") == {"qwen3": "qwen3", "llama3": "llama"}[family]
    last_sync = trace.of("weights_synced")[-1]
    assert last_sync.get("version") == 40

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.weights.checksum import state_dict_checksum
    from miles.weights.hf import model_weights

    export = tmp_path / "ck" / "iter_0000039" / "hf"
    model = AutoModelForCausalLM.from_pretrained(export)
    assert type(model).__name__ == {"qwen3": "Qwen3ForCausalLM", "llama3": "LlamaForCausalLM"}[family]
    assert state_dict_checksum(model_weights(model)) == last_sync.get("checksum")   # the engine's weights, bit for bit
    sys.path.insert(0, str(EXAMPLE))
    from task import greedy_accuracy, load_jsonl

    accuracy = greedy_accuracy(model, AutoTokenizer.from_pretrained(export), load_jsonl(EXAMPLE / "data/eval.jsonl"),
                               max_new_tokens=6)
    # the same greedy tokens as the engine's last eval, up to a float near-tie flipping one or two of
    # the 500 answers (the engine batches its prompts differently)
    assert abs(accuracy - after) <= 2 / 500, (accuracy, after)


@pytest.mark.extended   # whole runs (CI budget): bash scripts/test.sh -m extended; the parts are tests/unit/test_moe.py
@pytest.mark.parametrize("backend,ranks,engine", [("torch", 1, "embedded"), ("torch", 2, "embedded"), ("torch", 1, "fast"),
                                                  pytest.param("megatron", 1, "embedded", marks=NEEDS_MEGATRON)],
                         ids=["torch", "torch-fsdp2", "torch-fast", "megatron"])
def test_qwen3_moe_learns_arithmetic_with_rollout_routing_replay(ray_cluster, tmp_path, backend, ranks, engine):
    """Qwen3-MoE (examples/arithmetic/base_model_qwen3_moe) on the embedded engine and the torch trainer (one
    process, or 2 FSDP2 ranks over gloo) or megatron-core's MoE layers (--train-backend megatron), or on the
    fast engine (its own MoE forward and routing capture, eager on the CPU), R3 on, with the load-balancing
    and z losses: the recipe's bar, every response token replayed, and the HF export is the engine's model
    (tests/unit/test_megatron_moe.py has the megatron parts, EP 2 among them)."""
    cfg, _ = parse_flags(["--config", str(EXAMPLE / "grpo.yaml"), "--hf-checkpoint", str(EXAMPLE / "base_model_qwen3_moe"),
                          "--run-dir", str(tmp_path / "run"), "--save", str(tmp_path / "ck"), "--save-interval", "40",
                          "--trace-console", "off", "--check-weight-update-equal", "--use-rollout-routing-replay",
                          "--moe-aux-loss-coeff", "1e-3", "--moe-z-loss-coeff", "1e-4", "--train-backend", backend,
                          "--actor-num-gpus-per-node", str(ranks), "--rollout-engine", engine])
    result = asyncio.run(with_disposer(train, cfg))
    trace, after = assert_learns_arithmetic(result)
    trains = [r for r in result.metrics if "moe/routing_replayed" in r]
    assert len(trains) == 40
    assert all(r["moe/routing_replayed"] == 1.0 and r["moe/moe_aux_loss"] > 0 and r["moe/moe_z_loss"] > 0 for r in trains)
    picked, = trace.of("engine_picked")
    assert picked.get("family") == "qwen3_moe" and picked.get("cls") == {"embedded": "EmbeddedEngine",
                                                                        "fast": "FastEngine"}[engine]
    last_sync = trace.of("weights_synced")[-1]

    from transformers import AutoModelForCausalLM

    from miles.weights.checksum import state_dict_checksum
    from miles.weights.hf import model_weights

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ck" / "iter_0000039" / "hf")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert state_dict_checksum(model_weights(model)) == last_sync.get("checksum")
