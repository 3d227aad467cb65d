"""Benchmark (GPU machine, not a test): colocated GRPO at scale on one GPU, one workload per call.

The workloads (random-init Qwen3-shaped bf16 models, a character tokenizer, 64-character prompts,
one optimizer step per rollout), each with its goal:

  1.7b-1k   Qwen3-1.7B, 32 prompts x 8 x 1,024 new tokens; TRL 1.16's step in the same run.
            Goal: iteration <= 2x the ideal (rollout at the bandwidth bound + train at 989 TFLOP/s).
  4b-4k     Qwen3-4B, 32 x 8 x 4,096. Goal: rollout >= 35% of the bandwidth bound, train MFU >= 45%.
  4b-16k    Qwen3-4B, 8 x 8 x 16,384. Goal: runs; peak memory flat over 5 iterations (within 2%).
  8b-2k     Qwen3-8B (untied), 16 x 8 x 2,048, --offload-train. Goal: runs; time per phase, peak memory.
  30b-a3b-12l  Qwen3-30B-A3B's shape (Qwen3-MoE: hidden 2048, 32 heads, 4 KV heads, head_dim 128, 128
            experts of 768, top-8 renormalised, vocab 151,936, untied) cut to 12 of its 48 layers: 8.10 B
            parameters, 1.305 B active (attention, routers, norms, 8 of 128 experts, and the embedding and
            lm_head both, as the dense MFU formula counts an untied pair; `grpo_step_gpu.active_params`),
            32 x 8 x 1,024, --offload-train; TRL 1.16's step in the same run (the policy in bf16, 8 samples
            per micro-batch: `TRL_ARGS`; the load-balancing loss off on both sides). Goals: iteration
            <= 2.5x the ideal (rollout at the MoE bandwidth bound + train at 989 TFLOP/s on the active
            parameters), peak memory flat over the last 3 iterations (within 2%); per-phase times, MFU.
            `--r3-effect`: the R3 comparison too (below).

The MoE bandwidth bound (`moe_rollout_gpu.bound`'s terms, with the bytes from the config: `moe_counts`):
per decode step the non-expert weights (attention, routers, norms, lm_head; the untied embedding is a
gather), the experts the step touches, and the live K/V, read once at the GPU's bandwidth
(`moe_rollout_gpu.bandwidth`: H100 SXM 3.35 TB/s, H200 4.8 TB/s from the device name). The verdict's
`rollout_bound_s` takes every expert of every layer as touched (256 sequences x top-8 of 128 leave an
expert out with probability 7e-8 under a near-uniform router); the --r3-effect run saves its rollouts
(--save-debug-rollout-data) and `rollout_bound_from_routing` counts the experts each decode step of its
last rollout actually touched, from the routing the engine recorded on every sample.

R3's effect (`--r3-effect`, an MoE workload): miles runs twice, as the workload's flags say and then with
--use-rollout-routing-replay; `r3_effect` holds each rollout's `logprob_diff_rollout` (mean |trainer -
rollout| logprob of the sampled tokens), `logprob_diff_rollout_max`, `train_rollout_k3_kl`,
`moe/routing_mismatch` (the share of (token, MoE layer) pairs whose trainer top-k differs from the
rollout's; with R3 it is what the replay overrode), `moe/routing_mismatch_tokens` and
`moe/routing_replayed` (1.0 under R3), per side and their means.

Memory of 30b-a3b-12l (miles' own start-up plan, `miles.training.torch.memory_plan.startup_problems`,
which refuses a step that cannot fit before Ray starts): float32 weights 30.2 GiB + float32 gradients
30.2 + bf16 compute copies 15.1 + the fast engine's bf16 weights (kept on the GPU while the trainer
trains) 15.1 + activations 0.5 (--recompute-activations) + 2 CUDA contexts 2.0 = 93.0 GiB; AdamW's
moments (60.3 GiB) stay in host memory under --offload-train (without it: 153 GiB). That fits an H200
(139.8 GiB; the engine's KV cache for 256 x 1,152 positions, 6.75 GiB, is released while the trainer
trains) and not an H100 80GB (79.6 GiB): there miles refuses it at start-up (exit 2, the message names
what makes room). Nothing but more GPUs or an engine that drops its weights shrinks the trainer below
12 B/param; on an H100 run `--layers 8` (5.61 B parameters, 1.08 B active; the plan says 65.1 GiB) and
report it as that cut. TRL in bf16: weights, gradients and AdamW's moments 8 B/param = 60.3 GiB, plus
its generation's K/V (256 x 1,088 positions, 6.4 GiB) and a micro-batch's logits; in TRL's default
float32 it would be 121 GiB before activations, more than either GPU holds beside them.

Everything else is `grpo_step_gpu.py`'s machinery (model and data building, the bounded miles and
TRL subprocesses, the trace's per-phase times, MFU, nvidia-smi memory sampling), reused, not copied;
this script adds the shapes, the bandwidth bound of each rollout (`rollout_gpu.bound_seconds`, with
every answer at its cap: a random model almost never stops; the trace's generated tokens say how
close that is), the ideal iteration time and a verdict per goal.

Printed JSON: the workload, its goal verdicts, then `grpo_step_gpu`'s miles / trl sections.

Usage (on the GPU machine, from the checkout, after installing the .whl wheels):
  PYTHONPATH=$PWD python3 scripts/bench/grpo_scale_gpu.py --workload 1.7b-1k [--miles-iters 4] [--out DIR]
      [--miles-flags "..." | --add-miles-flags "..."] [--no-recompute] [--skip-trl] [--side-timeout-s 550]
A CPU smoke test of the script only: --workload smoke --device cpu --model FOLDER --skip-trl, FOLDER a
model of at least 72 positions (64-token prompts + 8), e.g. the tests' tiny model
(`python -c "from tests.tiny_model import make_tiny_model; make_tiny_model('/tmp/tiny')"`; the demo's has 64).
The MoE path's smoke builds its own tiny Qwen3-MoE (2 layers, 8 experts, top-2), R3 comparison included
(about 2 minutes on a 2-core VM; `tests/unit/test_grpo_scale_bench.py`, extended, runs it):
  PYTHONPATH=$PWD python3 scripts/bench/grpo_scale_gpu.py --workload smoke-moe --device cpu --skip-trl \
      --r3-effect --miles-iters 2 [--out DIR]
(without --skip-trl and with --trl-site DIR, TRL's side runs too: see grpo_step_gpu's docstring).

The MoE GPU run (one H200: pass needs_h200 to the device tool, or on an H100 add --layers 8) is longer
than one call's 10 minutes, so it runs in the background over two calls (`bgscale`, then `waitscale` while
the machine is warm); a side its bound cuts still reports what it finished (TRL its steps, even a step's
generation; miles its iterations, each rollout's metrics). The budget, from the 8b-2k runs at the same
parameter count (init about 90 s, a first iteration of 135 s that compiles the trainer, then 55 s): the
model build (about a minute: 16 GB written), the plain miles run <= 380 s (init, the compiling first
iteration, then as many of --miles-iters 4 as fit: memory flat over the last 3), the R3 run <= 230 s
(--r3-iters 1: its one rollout is the plain run's first, from the same weights, so the two runs' first
rollouts compare like with like; it saves it, 80 MB of expert ids, for `rollout_bound_from_routing`). TRL
is left out (on an H200 on Dec 7 it was still generating its first step's 256 x 1,024 tokens at 120 s):
its step is a run of its own, `--skip-miles --trl-steps 1 --trl-timeout-s 500` (`.whl/` built with
EXTRA="trl==1.16.0 datasets dill multiprocess"). After the GPU tests the run leans on and
`script:moe_rollout_gpu` in the same call:
  TESTS_S=150 S_moe_rollout_gpu=170 SCALE_S_30b_a3b_12l=800 SCALE_ARGS_30b_a3b_12l="--r3-effect --miles-iters 4 \
      --r3-iters 1 --skip-trl --side-timeout-s 380 --r3-timeout-s 230" BG_WAIT_S=220 bash scripts/gpu_call.sh \
      tests:tests/gpu/test_offload_cuda.py,tests/gpu/test_moe_gpu.py script:moe_rollout_gpu bgscale:30b-a3b-12l
  WAIT_S=570 bash scripts/gpu_call.sh waitscale:30b-a3b-12l
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_step_gpu as step  # noqa: E402  (the machinery this bench reuses)
import moe_rollout_gpu as moe  # noqa: E402  (the MoE shape, its bandwidth bound and the GPU's bandwidth)
from rollout_gpu import BANDWIDTH, bound_seconds  # noqa: E402

QWEN3 = dict(vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
             num_key_value_heads=8, head_dim=128)
step.SHAPES.setdefault(("qwen3", "4b"), dict(QWEN3, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                                             intermediate_size=9728, tie_word_embeddings=True))
step.SHAPES.setdefault(("qwen3", "8b"), dict(QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                                             intermediate_size=12288, tie_word_embeddings=False))
# Qwen3-30B-A3B's shape cut to 12 of its 48 layers; the smoke's tiny Qwen3-MoE (a vocabulary above the
# character tokenizer's 99 ids)
step.SHAPES.setdefault(("qwen3_moe", "30b-a3b-12l"), dict(moe.SHAPE_30B_A3B, num_hidden_layers=12))
step.SHAPES.setdefault(("qwen3_moe", "tiny"), dict(moe.SHAPE_TINY, vocab_size=128))

# --max-prompt-len: the engine sizes its slots to the K/V of the longest prompt + answer (prompts are 64 tokens)
BASE_FLAGS = "--colocate --rollout-engine fast --use-dynamic-batch-size --recompute-activations --max-prompt-len 128"
WORKLOADS = {
    # name: (family, size, prompts, samples, new tokens, micro-batch, TRL in the same run, extra miles flags)
    "1.7b-1k": ("qwen3", "1.7b", 32, 8, 1024, 64, True, "--max-tokens-per-gpu 16384"),
    "4b-4k": ("qwen3", "4b", 32, 8, 4096, 64, False, "--max-tokens-per-gpu 32768"),
    "4b-16k": ("qwen3", "4b", 8, 8, 16384, 64, False, "--max-tokens-per-gpu 32768"),
    "8b-2k": ("qwen3", "8b", 16, 8, 2048, 64, False, "--max-tokens-per-gpu 16384 --offload-train"),
    "30b-a3b-12l": ("qwen3_moe", "30b-a3b-12l", 32, 8, 1024, 64, True, "--max-tokens-per-gpu 16384 --offload-train"),
    "smoke": ("qwen2", "0.5b", 2, 2, 8, 4, False, "--max-tokens-per-gpu 512"),
    "smoke-moe": ("qwen3_moe", "tiny", 2, 2, 8, 4, True, "--max-tokens-per-gpu 512"),
}
# TRL's side where it differs from its defaults: the policy in bf16 (float32 weights, gradients and AdamW
# moments of 8.1 B parameters are 130 GB) and 8 samples per micro-batch (its logits: 8 x 1,088 x 151,936)
TRL_ARGS = {"30b-a3b-12l": ["--trl-dtype", "bfloat16", "--trl-micro-batch", "8"],
            "smoke-moe": ["--trl-dtype", "bfloat16", "--trl-micro-batch", "2"]}
R3_KEYS = ("logprob_diff_rollout", "logprob_diff_rollout_max", "train_rollout_k3_kl", "moe/routing_mismatch",
           "moe/routing_mismatch_tokens", "moe/routing_replayed")
ENGINE_BATCH = 256          # --rollout-max-batch-size's default: the decode batch the bound assumes


def kv_bytes_per_position(shape: dict) -> int:
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * \
        shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"]) * 2


def rollout_bound_s(shape: dict, params: int, prompts: int, samples: int, gen_tokens: int) -> float:
    """Seconds a rollout needs at the bandwidth bound (`rollout_gpu`'s formula), every answer of
    gen_tokens / (prompts x samples) tokens."""
    n = prompts * samples
    per = max(1, round(gen_tokens / n))
    return bound_seconds([[0] * step.PROMPT_CHARS] * n, [per] * n, min(ENGINE_BATCH, n), 2 * params,
                         kv_bytes_per_position(shape))


def moe_counts(model: Path) -> dict:
    """The bf16 bytes a decode step of the MoE model in `model` reads (`moe_rollout_gpu.bound`'s counts,
    from the config rather than an engine): the non-expert weights (an untied embedding is a gather,
    not read whole), one expert's three projections, one position's K/V; and the MoE layers' count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    named = dict(m.named_parameters())
    experts = sum(p.numel() for n, p in named.items() if ".mlp.experts." in n)
    embed = 0 if cfg.tie_word_embeddings else named["model.embed_tokens.weight"].numel()
    moe_layers = len({n.split(".mlp.experts.")[0] for n in named if ".mlp.experts." in n})
    shape = {k: getattr(cfg, k) for k in ("num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_size",
                                          "num_attention_heads")}
    return dict(non_expert_bytes=2 * (sum(p.numel() for p in named.values()) - experts - embed),
                expert_bytes=2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size,
                kv_bytes_per_position=kv_bytes_per_position(shape), moe_layers=moe_layers,
                num_experts=cfg.num_experts)


def moe_bound_every_expert(counts: dict, prompts: int, samples: int, gen_tokens: int, bw: float) -> float:
    """`moe_rollout_gpu.bound` when each decode step touches every expert of every MoE layer (a batch of 256
    sequences x top-8 of 128 experts under a near-uniform router leaves an expert out with probability
    (120/128)^256 = 7e-8), all answers gen_tokens / (prompts x samples) tokens in lockstep (the first
    from the prefill)."""
    n = prompts * samples
    per = max(1, round(gen_tokens / n))
    step_bytes = counts["non_expert_bytes"] + counts["moe_layers"] * counts["num_experts"] * counts["expert_bytes"]
    kv = sum(n * (step.PROMPT_CHARS + t) for t in range(1, per)) * counts["kv_bytes_per_position"]
    return ((per - 1) * step_bytes + kv) / bw


def moe_bound_from_routing(rollouts: Path, counts: dict, bw: float) -> dict:
    """`moe_rollout_gpu.bound` over the experts the engine recorded, per decode step, in the last rollout
    saved under `rollouts` (--save-debug-rollout-data): the experts each step actually touched."""
    import torch

    files = sorted(rollouts.glob("rollout_*.pt"), key=lambda f: int(f.stem.split("_")[1]))
    if not files:
        return {"error": f"no saved rollout under {rollouts}"}
    # the file this run's miles wrote: read with the C unpickler (weights_only's is 5x slower on the
    # 25 M expert ids of a 256 x 1,024-token rollout of 12 layers x top-8)
    raw = torch.load(files[-1], weights_only=False)
    gens = [SimpleNamespace(routed_experts=s["rollout_routed_experts"]) for s in raw["samples"]
            if s.get("rollout_routed_experts")]
    if not gens:
        return {"error": "the saved samples carry no routed experts"}
    out = moe.bound(gens, step.PROMPT_CHARS, counts["num_experts"], counts, bw)
    return {"rollout_id": int(raw["rollout_id"]), "sequences": len(gens), **out}


def verdicts(name: str, a: argparse.Namespace, miles: dict, trl: dict, params: int,
             bound_s: Callable[[int], float]) -> dict:
    """The workload's goal, checked on the steady iterations (after the first). `params`: those the
    train step's FLOPs count (an MoE's active ones); `bound_s(generated tokens)`: the rollout's bound."""
    if "steady_iteration_s" not in miles:
        return {"ran": False, "why": miles.get("error") or miles.get("log_tail", "")[-2000:]}
    last = miles.get("trainer_metrics_last", {})
    gen = int(last.get("gen_tokens") or a.prompts * a.samples * a.new_tokens)
    bound = bound_s(gen)
    rollout = miles["steady_phase_s"]["rollout"]
    tokens = a.prompts * a.samples * step.PROMPT_CHARS + gen
    train_ideal = 6 * params * tokens / (step.PEAK_TFLOPS * 1e12)
    out = {"ran": True, "generated_tokens_per_iteration": gen, "generated_tokens_per_s": round(gen / rollout),
           "rollout_bound_s": round(bound, 3), "bandwidth_bound_fraction": round(bound / rollout, 4),
           "train_ideal_s": round(train_ideal, 3), "ideal_iteration_s": round(bound + train_ideal, 3),
           "iteration_over_ideal": round(miles["steady_iteration_s"] / (bound + train_ideal), 3),
           # the last iteration alone, beside the median of every one after the first
           "last_iteration_over_ideal": round(miles["iteration_s"][-1] / (bound + train_ideal), 3),
           "train_mfu": miles.get("steady_train_mfu"), "weight_sync_s": miles.get("weight_sync_s"),
           "gpu_mem_peak_mib": miles.get("gpu_mem_peak_mib"),
           "tokens_computed_per_real": last.get("tokens_computed_per_real")}
    if trl.get("steady_step_s"):
        out["trl_step_over_miles_iteration"] = round(trl["steady_step_s"] / miles["steady_iteration_s"], 3)
    peaks = miles.get("gpu_mem_peak_mib_per_iteration") or []
    if name == "1.7b-1k":
        out["goal_iteration_within_2x_ideal"] = out["iteration_over_ideal"] <= 2.0
    elif name == "4b-4k":
        out["goal_rollout_35pct_of_bound"] = out["bandwidth_bound_fraction"] >= 0.35
        out["goal_train_mfu_45pct"] = (out["train_mfu"] or 0) >= 0.45
    elif name == "4b-16k":
        spread = step._spread(peaks[1:])
        out["goal_memory_flat_over_5"] = len(peaks) >= 5 and spread is not None and spread <= 1.02
        out["gpu_mem_peak_max_over_min_after_first"] = spread
    elif name in ("30b-a3b-12l", "smoke-moe"):
        out["goal_iteration_within_2_5x_ideal"] = out["iteration_over_ideal"] <= 2.5
        spread = step._spread(peaks[-3:])         # the last 3 iterations' peaks (nvidia-smi; none on a CPU)
        out["goal_memory_flat_over_3"] = len(peaks) >= 3 and spread is not None and spread <= 1.02
        out["gpu_mem_peak_max_over_min_last_3"] = spread
    return out


def r3_side(run_dir: Path) -> dict:
    """The trainer-vs-rollout logprob gap and the routing disagreement of each rollout (its `train` row)."""
    rows = [m for m in step.read_jsonl(run_dir / "metrics.jsonl") if m.get("kind") == "train" or "train_time_s" in m]
    return {key: [m.get(key) for m in rows] for key in R3_KEYS}


def r3_effect(plain: dict, replayed: dict) -> dict:
    """Both runs' R3_KEYS per rollout, and the means over the rollouts, side by side."""
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return round(statistics.fmean(xs), 8) if xs else None
    return {"without_r3": plain, "with_r3": replayed,
            "mean": {key: {"without_r3": mean(plain.get(key, [])), "with_r3": mean(replayed.get(key, []))}
                     for key in R3_KEYS}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    p.add_argument("--out", type=Path, default=None, help="keep the model, data, logs and runs here (default: temp)")
    p.add_argument("--miles-iters", type=int, default=4, help="miles rollouts (the first warms up)")
    p.add_argument("--trl-steps", type=int, default=3, help="TRL steps (the first warms up)")
    p.add_argument("--miles-flags", default=None, help="replace the workload's miles flags")
    p.add_argument("--add-miles-flags", default="", help="append to the workload's miles flags, e.g. the FP8 KV cache: "
                   "--add-miles-flags=--kv-cache-dtype=fp8_e4m3 (one word: gpu_call.sh splits SCALE_ARGS on spaces)")
    p.add_argument("--side-timeout-s", type=float, default=550.0, help="wall-clock bound of each side")
    p.add_argument("--no-recompute", action="store_true",
                   help="train without --recompute-activations (and so packed: see the packing section of the docs)")
    p.add_argument("--trl-timeout-s", type=float, default=None, help="the TRL side's bound (default: --side-timeout-s)")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--skip-miles", action="store_true",
                   help="TRL's side alone (a TRL step longer than the budget of a run that has both)")
    p.add_argument("--trl-site", type=Path, default=None, help="grpo_step_gpu's --trl-site (TRL's stack in a folder)")
    p.add_argument("--r3-effect", action="store_true",
                   help="an MoE workload: miles twice, without and with --use-rollout-routing-replay (the second "
                        "saves its rollouts: the bound from the experts each decode step touched), after TRL "
                        "unless --skip-trl")
    p.add_argument("--r3-iters", type=int, default=None,
                   help="--r3-effect: the R3 run's rollouts (default: --miles-iters); the plain run keeps --miles-iters")
    p.add_argument("--r3-timeout-s", type=float, default=None, help="--r3-effect: the R3 run's bound "
                   "(default: --side-timeout-s)")
    p.add_argument("--layers", type=int, default=None, help="an MoE workload: cut the shape to this many layers")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", type=Path, default=None, help="use this HF folder instead of building the shape")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    s = parse_args(argv)
    family, size, prompts, samples, new_tokens, micro, with_trl, extra = WORKLOADS[s.workload]
    if (s.r3_effect or s.layers) and family != "qwen3_moe":
        raise SystemExit(f"--r3-effect and --layers are for the MoE workloads, not {s.workload}")
    if s.skip_miles and (s.r3_effect or s.skip_trl):
        raise SystemExit("--skip-miles runs TRL's side alone: without --r3-effect and --skip-trl")
    flags = f"{s.miles_flags if s.miles_flags is not None else f'{BASE_FLAGS} {extra}'} {s.add_miles_flags}".strip()
    if s.no_recompute:
        flags = " ".join(f for f in flags.split() if f != "--recompute-activations")
    a = step.parse_args(["--prompts", str(prompts), "--samples", str(samples), "--new-tokens", str(new_tokens),
                         "--micro-batch", str(micro), "--global-batch", str(prompts * samples),
                         "--miles-iters", str(s.miles_iters), "--trl-steps", str(s.trl_steps),
                         "--model-family", family, "--size", size, "--miles-flags", flags,
                         "--side-timeout-s", str(s.side_timeout_s), "--device", s.device, *TRL_ARGS.get(s.workload, []),
                         *(["--trl-timeout-s", str(s.trl_timeout_s)] if s.trl_timeout_s else []),
                         *(["--trl-site", str(s.trl_site)] if s.trl_site else [])])
    shape = step.SHAPES[(family, size)]
    if s.layers:
        shape = dict(shape, num_hidden_layers=s.layers)
    with tempfile.TemporaryDirectory() as tmp:
        root = s.out or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        model = s.model or root / "model"
        if not s.model:
            built_model(model, family, size, shape)
        params, active = step.active_params(model)
        setup_s = round(time.monotonic() - t0, 1)
        data, reward, a.prompt_tokens = step.write_data(root, prompts)
        if family == "qwen3_moe":
            counts = moe_counts(model)
            bw, bw_source = moe.bandwidth(argparse.Namespace(bandwidth=None))
            bound_s = lambda gen: moe_bound_every_expert(counts, prompts, samples, gen, bw)  # noqa: E731
        else:
            counts, bw, bw_source = None, BANDWIDTH, "rollout_gpu.BANDWIDTH"
            bound_s = lambda gen: rollout_bound_s(shape, params, prompts, samples, gen)  # noqa: E731
        trl = {"skipped": "not this workload's comparison"} if not with_trl else \
            {"skipped": "--skip-trl"} if s.skip_trl else step.run_trl(a, root, model, data, reward, active)
        miles = {"skipped": "--skip-miles", "error": "--skip-miles"} if s.skip_miles else \
            step.run_miles(a, root, model, data, reward, active)
        report = {"workload": s.workload, "goals": verdicts(s.workload, a, miles, trl, active, bound_s),
                  "setup": {"params": params, "active_params": active, "model": f"{family} {size}",
                            "layers": shape["num_hidden_layers"], "prompts": prompts, "samples": samples,
                            "new_tokens": new_tokens, "micro_batch": micro, "miles_flags": flags,
                            "trl_args": TRL_ARGS.get(s.workload, []), "bandwidth_bytes_per_s": bw,
                            "bandwidth_source": bw_source, "peak_tflops_bf16": step.PEAK_TFLOPS,
                            "model_setup_s": setup_s},
                  "miles": miles, "trl": trl}
        if counts:
            report["setup"]["moe_bytes"] = counts
        if s.r3_effect:
            a.miles_flags = (f"{flags} --use-rollout-routing-replay "
                             f"--save-debug-rollout-data {root / 'r3' / 'rollouts'}")
            a.miles_iters = s.r3_iters or s.miles_iters
            a.side_timeout_s = s.r3_timeout_s or s.side_timeout_s
            (root / "r3").mkdir(exist_ok=True)
            replayed = step.run_miles(a, root / "r3", model, data, reward, active)
            report["r3_effect"] = r3_effect(r3_side(root / "miles-run"), r3_side(root / "r3" / "miles-run"))
            kept = ("steady_iteration_s", "steady_phase_s", "gpu_mem_peak_mib", "run", "error", "log_tail")
            report["r3_effect"]["with_r3_run"] = {k: replayed[k] for k in kept if k in replayed}
            try:
                routed = moe_bound_from_routing(root / "r3" / "rollouts", counts, bw)
            except step._Stopped:           # the call's bound came: the report still prints
                routed = {"error": "SIGTERM while reading the saved rollout"}
            report["rollout_bound_from_routing"] = routed
            if "bound_s" in routed and "steady_phase_s" in miles:
                # the plain run's steady rollout against the bound of the experts the R3 run's rollout touched
                report["rollout_bound_from_routing"]["plain_rollout_fraction"] = round(
                    routed["bound_s"] / miles["steady_phase_s"]["rollout"], 4)
        report["setup"]["total_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps(report, indent=2, default=str))
        if s.out:
            (root / f"scale_{s.workload}{'_r3' if s.r3_effect else ''}.json").write_text(
                json.dumps(report, indent=2, default=str))
        return report


def built_model(folder: Path, family: str, size: str, shape: dict) -> None:
    """`grpo_step_gpu.build_model`, or the model an earlier call left in `folder` (a warm GPU machine keeps
    /tmp: the 16 GB of the 30b-a3b-12l shape are not written twice) when its shape is this one."""
    marker = folder / "bench_shape.json"
    want = json.dumps(shape, sort_keys=True)
    if marker.is_file() and marker.read_text() == want:
        return
    marker.unlink(missing_ok=True)
    step.build_model(folder, family, size, shape)
    marker.write_text(want)


if __name__ == "__main__":
    main()
