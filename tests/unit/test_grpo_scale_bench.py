"""scripts/bench/grpo_scale_gpu.py's MoE parts (the 30b-a3b-12l workload's counting, bounds, verdicts and
the R3 comparison), on the CPU; its whole path at a tiny Qwen3-MoE shape is the extended test at the end."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.tiny_model import tiny_config

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("grpo_scale_gpu", BENCH / "grpo_scale_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A config-only tiny Qwen3-MoE folder: layer 0 dense, layers 1-2 four experts of 24 each, top-2, tied."""
    path = tmp_path_factory.mktemp("moe")
    tiny_config("qwen3_moe").save_pretrained(path)
    return path


def test_active_parameters_count_k_of_e_experts_and_everything_else_whole(bench, tiny_moe, tmp_path):
    total, active = bench.step.active_params(tiny_moe)
    experts = 2 * 4 * 3 * 32 * 24           # two MoE layers x 4 experts x (gate, up, down) x hidden x 24
    assert active == total - experts + experts * 2 // 4
    tiny_config("qwen3").save_pretrained(tmp_path)
    dense_total, dense_active = bench.step.active_params(tmp_path)
    assert dense_active == dense_total > 0


def test_the_moe_byte_counts_of_a_decode_step(bench, tiny_moe):
    total, _ = bench.step.active_params(tiny_moe)
    counts = bench.moe_counts(tiny_moe)
    assert counts["moe_layers"] == 2 and counts["num_experts"] == 4
    assert counts["expert_bytes"] == 2 * 3 * 32 * 24
    assert counts["kv_bytes_per_position"] == 2 * 3 * 2 * 16 * 2       # K and V x layers x KV heads x head_dim x bf16
    # tied: the embedding is the lm_head, read whole once; the experts are counted by the step's routing
    assert counts["non_expert_bytes"] == 2 * (total - 2 * 4 * 3 * 32 * 24)


def test_the_every_expert_bound_equals_the_routing_bound_when_each_step_touches_every_expert(bench):
    # 4 sequences x 5 tokens, 2 MoE layers, top-2 of 8: sequence i routes to experts 2i, 2i+1 in every layer
    routed = [[[[2 * i, 2 * i + 1]] * 2 for _ in range(5)] for i in range(4)]
    gens = [SimpleNamespace(routed_experts=r) for r in routed]
    counts = dict(non_expert_bytes=1000, expert_bytes=10, kv_bytes_per_position=3, moe_layers=2, num_experts=8)
    got = bench.moe.bound(gens, bench.step.PROMPT_CHARS, 8, counts, bw=1.0)
    assert got["mean_distinct_experts_per_layer"] == 8.0 and got["decode_steps"] == 4
    every = bench.moe_bound_every_expert(counts, prompts=2, samples=2, gen_tokens=20, bw=1.0)
    assert every == 4 * (1000 + 2 * 8 * 10) + sum(4 * (64 + t) for t in range(1, 5)) * 3
    assert got["bound_s"] == pytest.approx(every, rel=1e-3)         # the routing bound: 3 significant digits


def test_a_sequence_that_ended_early_is_read_only_while_it_runs(bench):
    # sequence a: 3 tokens; b: 2 (it stopped): decode step 1 reads a's experts and K/V alone
    a = [[[0, 1]], [[2, 3]], [[0, 2]]]
    b = [[[1, 2]], [[1, 3]]]
    counts = dict(expert_bytes=10, non_expert_bytes=100, kv_bytes_per_position=1)
    got = bench.moe.bound([SimpleNamespace(routed_experts=r) for r in (a, b)], 4, 4, counts, bw=1.0)
    # step 0 (token 1): {2, 3} | {1, 3} = 3 experts, K/V 2 x (4 + 1); step 1 (token 2): a's {0, 2}, K/V 4 + 2
    assert got["decode_steps"] == 2
    assert got["bound_s"] == pytest.approx((3 + 2) * 10 + 2 * 100 + 2 * 5 + 6, rel=1e-3)


def write_metrics(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_r3_effect_puts_both_runs_gap_and_disagreement_side_by_side(bench, tmp_path):
    plain = [{"kind": "train", "logprob_diff_rollout": 0.02, "moe/routing_mismatch": 0.10, "moe/routing_replayed": 0.0},
             {"kind": "rollout", "logprob_diff_rollout": 9.0},            # not a train row: not counted
             {"kind": "train", "logprob_diff_rollout": 0.04, "moe/routing_mismatch": 0.14, "moe/routing_replayed": 0.0}]
    replayed = [{"kind": "train", "logprob_diff_rollout": 0.01, "moe/routing_mismatch": 0.12,
                 "moe/routing_replayed": 1.0}]
    write_metrics(tmp_path / "plain", plain)
    write_metrics(tmp_path / "r3", replayed)
    got = bench.r3_effect(bench.r3_side(tmp_path / "plain"), bench.r3_side(tmp_path / "r3"))
    assert got["without_r3"]["logprob_diff_rollout"] == [0.02, 0.04]
    assert got["without_r3"]["train_rollout_k3_kl"] == [None, None]          # a key the rows lack: None per rollout
    assert got["mean"]["logprob_diff_rollout"] == {"without_r3": 0.03, "with_r3": 0.01}
    assert got["mean"]["moe/routing_mismatch"] == {"without_r3": 0.12, "with_r3": 0.12}
    assert got["mean"]["moe/routing_replayed"] == {"without_r3": 0.0, "with_r3": 1.0}
    assert got["mean"]["train_rollout_k3_kl"] == {"without_r3": None, "with_r3": None}


def test_the_moe_workloads_goals_iteration_against_the_ideal_and_flat_memory(bench):
    a = SimpleNamespace(prompts=32, samples=8, new_tokens=1024)
    params = 1_305_000_000
    gen = 32 * 8 * 1024
    train_ideal = 6 * params * (32 * 8 * 64 + gen) / 989e12
    miles = {"steady_iteration_s": 2.5 * (6.0 + train_ideal), "iteration_s": [60.0, 21.0, 20.0, 20.5],
             "steady_phase_s": {"rollout": 12.0, "train": 8.0, "weight_sync": 0.5},
             "gpu_mem_peak_mib_per_iteration": [90_000, 110_000, 111_000, 111_500],
             "trainer_metrics_last": {"gen_tokens": gen}}
    got = bench.verdicts("30b-a3b-12l", a, miles, {"steady_step_s": 200.0}, params, lambda g: 6.0)
    assert got["train_ideal_s"] == pytest.approx(train_ideal, abs=1e-3) and got["rollout_bound_s"] == 6.0
    assert got["iteration_over_ideal"] == 2.5 and got["goal_iteration_within_2_5x_ideal"]
    assert got["bandwidth_bound_fraction"] == 0.5
    # the last three peaks are within 2% (the first, before the trainer's state came, is not one of them)
    assert got["goal_memory_flat_over_3"] and got["gpu_mem_peak_max_over_min_last_3"] == round(111_500 / 110_000, 4)
    assert got["trl_step_over_miles_iteration"] == round(200.0 / miles["steady_iteration_s"], 3)
    grows = dict(miles, gpu_mem_peak_mib_per_iteration=[90_000, 100_000, 105_000, 110_000],
                 steady_iteration_s=miles["steady_iteration_s"] * 1.01)
    worse = bench.verdicts("30b-a3b-12l", a, grows, {}, params, lambda g: 6.0)
    assert not worse["goal_memory_flat_over_3"] and not worse["goal_iteration_within_2_5x_ideal"]
    assert "trl_step_over_miles_iteration" not in worse
    failed = bench.verdicts("30b-a3b-12l", a, {"error": "no complete iteration in the trace"}, {}, params,
                            lambda g: 6.0)
    assert failed == {"ran": False, "why": "no complete iteration in the trace"}


def test_a_model_folder_of_the_same_shape_is_reused_and_another_shape_rebuilt(bench, tmp_path):
    shape = bench.step.SHAPES[("qwen3_moe", "tiny")]
    folder = tmp_path / "model"
    bench.built_model(folder, "qwen3_moe", "tiny", shape)
    weights = folder / "model.safetensors"
    first, params = weights.stat().st_mtime_ns, bench.step.active_params(folder)[0]
    bench.built_model(folder, "qwen3_moe", "tiny", shape)              # a warm machine's second call
    assert weights.stat().st_mtime_ns == first
    bench.built_model(folder, "qwen3_moe", "tiny", dict(shape, num_hidden_layers=1))     # --layers 1
    assert weights.stat().st_mtime_ns != first
    assert bench.step.active_params(folder)[0] < params
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 1


def test_r3_effect_and_layers_are_refused_on_a_dense_workload(bench):
    with pytest.raises(SystemExit, match="for the MoE workloads, not smoke"):
        bench.main(["--workload", "smoke", "--r3-effect", "--device", "cpu"])


def test_skip_miles_is_refused_beside_what_needs_a_miles_run(bench):
    for extra in (["--r3-effect"], ["--skip-trl"]):
        with pytest.raises(SystemExit, match="TRL's side alone"):
            bench.main(["--workload", "smoke-moe", "--skip-miles", "--device", "cpu", *extra])


@pytest.mark.extended
def test_the_moe_smoke_runs_the_whole_path_with_the_r3_comparison(bench, tmp_path, monkeypatch, capsys):
    # the script as the GPU call runs it, at a tiny Qwen3-MoE shape on the CPU: two `miles train` runs
    monkeypatch.setenv("PYTHONPATH", str(BENCH.parents[1]))
    monkeypatch.setattr(sys, "argv", ["grpo_scale_gpu.py"])
    report = bench.main(["--workload", "smoke-moe", "--device", "cpu", "--skip-trl", "--r3-effect",
                         "--miles-iters", "2", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "scale_smoke-moe_r3.json").read_text()) == json.loads(json.dumps(report, default=str))
    goals, setup, miles = report["goals"], report["setup"], report["miles"]
    assert goals["ran"] and goals["generated_tokens_per_iteration"] == 2 * 2 * 8
    for key in ("rollout_bound_s", "train_ideal_s", "ideal_iteration_s", "iteration_over_ideal", "train_mfu",
                "goal_iteration_within_2_5x_ideal", "goal_memory_flat_over_3", "gpu_mem_peak_max_over_min_last_3"):
        assert key in goals
    assert 0 < setup["active_params"] < setup["params"] and setup["moe_bytes"]["moe_layers"] == 2
    assert len(miles["iteration_s"]) == 2 and set(miles["steady_phase_s"]) == {"weight_sync", "rollout", "train"}
    assert report["trl"] == {"skipped": "--skip-trl"}
    effect = report["r3_effect"]
    assert effect["with_r3_run"]["run"]["rc"] == 0
    assert effect["without_r3"]["moe/routing_replayed"] == [0.0, 0.0]
    assert effect["with_r3"]["moe/routing_replayed"] == [1.0, 1.0]
    for side in ("without_r3", "with_r3"):
        assert all(x is not None and x >= 0 for x in effect[side]["logprob_diff_rollout"])
        assert all(0 <= x <= 1 for x in effect[side]["moe/routing_mismatch"])
    routed = report["rollout_bound_from_routing"]
    assert routed["rollout_id"] == 1 and routed["sequences"] == 4 and routed["decode_steps"] == 7
    assert 0 < routed["mean_distinct_experts_per_layer"] <= 8 and routed["bound_s"] > 0


def test_the_model_built_in_a_child_process_is_the_one_built_here(bench, tmp_path):
    """`build_model(isolated=True)` (the default where CUDA is) writes the same model from a spawned child,
    so that the bench's own process keeps none of its host memory while the runs train."""
    from safetensors.torch import load_file

    shape = bench.step.SHAPES[("qwen3_moe", "tiny")]
    here = bench.step.build_model(tmp_path / "here", "qwen3_moe", "tiny", shape, isolated=False)
    child = bench.step.build_model(tmp_path / "child", "qwen3_moe", "tiny", shape, isolated=True)
    assert child == here > 0
    a, b = load_file(str(tmp_path / "here" / "model.safetensors")), load_file(str(tmp_path / "child" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert (tmp_path / "child" / "tokenizer.json").is_file()
