"""Benchmark (GPU machine, not a test): colocated GRPO at scale on one GPU, one workload per call.

The workloads (random-init Qwen3-shaped bf16 models, a character tokenizer, 64-character prompts,
one optimizer step per rollout), each with its goal:

  1.7b-1k   Qwen3-1.7B, 32 prompts x 8 x 1,024 new tokens; TRL 1.16's step in the same run.
            Goal: iteration <= 2x the ideal (rollout at the bandwidth bound + train at 989 TFLOP/s).
  4b-4k     Qwen3-4B, 32 x 8 x 4,096. Goal: rollout >= 35% of the bandwidth bound, train MFU >= 45%.
  4b-16k    Qwen3-4B, 8 x 8 x 16,384. Goal: runs; peak memory flat over 5 iterations (within 2%).
  8b-2k     Qwen3-8B (untied), 16 x 8 x 2,048, --offload-train. Goal: runs; time per phase, peak memory.

Everything else is `grpo_step_gpu.py`'s machinery (model and data building, the bounded miles and
TRL subprocesses, the trace's per-phase times, MFU, nvidia-smi memory sampling), reused, not copied;
this script adds the shapes, the bandwidth bound of each rollout (`rollout_gpu.bound_seconds`, with
every answer at its cap: a random model almost never stops; the trace's generated tokens say how
close that is), the ideal iteration time and a verdict per goal.

Printed JSON: the workload, its goal verdicts, then `grpo_step_gpu`'s miles / trl sections.

Usage (on the GPU machine, from the checkout, after installing the .whl wheels):
  PYTHONPATH=$PWD python3 scripts/bench/grpo_scale_gpu.py --workload 1.7b-1k [--miles-iters 4] [--out DIR]
      [--miles-flags "..."] [--no-recompute] [--skip-trl] [--side-timeout-s 550]
A CPU smoke test of the script only: --workload smoke --device cpu --model FOLDER --skip-trl, FOLDER a
model of at least 72 positions (64-token prompts + 8), e.g. the tests' tiny model
(`python -c "from tests.tiny_model import make_tiny_model; make_tiny_model('/tmp/tiny')"`; the demo's has 64).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_step_gpu as step  # noqa: E402  (the machinery this bench reuses)
from rollout_gpu import BANDWIDTH, bound_seconds  # noqa: E402

QWEN3 = dict(vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
             num_key_value_heads=8, head_dim=128)
step.SHAPES.setdefault(("qwen3", "4b"), dict(QWEN3, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                                             intermediate_size=9728, tie_word_embeddings=True))
step.SHAPES.setdefault(("qwen3", "8b"), dict(QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                                             intermediate_size=12288, tie_word_embeddings=False))

# --max-prompt-len: the engine sizes its slots to the K/V of the longest prompt + answer (prompts are 64 tokens)
BASE_FLAGS = "--colocate --rollout-engine fast --use-dynamic-batch-size --recompute-activations --max-prompt-len 128"
WORKLOADS = {
    # name: (family, size, prompts, samples, new tokens, micro-batch, TRL in the same run, extra miles flags)
    "1.7b-1k": ("qwen3", "1.7b", 32, 8, 1024, 64, True, "--max-tokens-per-gpu 16384"),
    "4b-4k": ("qwen3", "4b", 32, 8, 4096, 64, False, "--max-tokens-per-gpu 32768"),
    "4b-16k": ("qwen3", "4b", 8, 8, 16384, 64, False, "--max-tokens-per-gpu 32768"),
    "8b-2k": ("qwen3", "8b", 16, 8, 2048, 64, False, "--max-tokens-per-gpu 16384 --offload-train"),
    "smoke": ("qwen2", "0.5b", 2, 2, 8, 4, False, "--max-tokens-per-gpu 512"),
}
ENGINE_BATCH = 256          # --rollout-max-batch-size's default: the decode batch the bound assumes


def rollout_bound_s(shape: dict, params: int, prompts: int, samples: int, gen_tokens: int) -> float:
    """Seconds a rollout needs at the bandwidth bound (`rollout_gpu`'s formula), every answer of
    gen_tokens / (prompts x samples) tokens."""
    n = prompts * samples
    per = max(1, round(gen_tokens / n))
    kv_bytes = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * \
        shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"]) * 2
    return bound_seconds([[0] * step.PROMPT_CHARS] * n, [per] * n, min(ENGINE_BATCH, n), 2 * params, kv_bytes)


def verdicts(name: str, a: argparse.Namespace, miles: dict, trl: dict, shape: dict, params: int) -> dict:
    """The workload's goal, checked on the steady iterations (after the first)."""
    if "steady_iteration_s" not in miles:
        return {"ran": False, "why": miles.get("error") or miles.get("log_tail", "")[-2000:]}
    last = miles.get("trainer_metrics_last", {})
    gen = int(last.get("gen_tokens") or a.prompts * a.samples * a.new_tokens)
    bound = rollout_bound_s(shape, params, a.prompts, a.samples, gen)
    rollout = miles["steady_phase_s"]["rollout"]
    tokens = a.prompts * a.samples * step.PROMPT_CHARS + gen
    train_ideal = 6 * params * tokens / (step.PEAK_TFLOPS * 1e12)
    out = {"ran": True, "generated_tokens_per_iteration": gen, "generated_tokens_per_s": round(gen / rollout),
           "rollout_bound_s": round(bound, 3), "bandwidth_bound_fraction": round(bound / rollout, 4),
           "ideal_iteration_s": round(bound + train_ideal, 3),
           "iteration_over_ideal": round(miles["steady_iteration_s"] / (bound + train_ideal), 3),
           # the last iteration alone, beside the median of every one after the first
           "last_iteration_over_ideal": round(miles["iteration_s"][-1] / (bound + train_ideal), 3),
           "train_mfu": miles.get("steady_train_mfu"), "weight_sync_s": miles.get("weight_sync_s"),
           "gpu_mem_peak_mib": miles.get("gpu_mem_peak_mib"),
           "tokens_computed_per_real": last.get("tokens_computed_per_real")}
    if name == "1.7b-1k":
        out["goal_iteration_within_2x_ideal"] = out["iteration_over_ideal"] <= 2.0
        if trl.get("steady_step_s"):
            out["trl_step_over_miles_iteration"] = round(trl["steady_step_s"] / miles["steady_iteration_s"], 3)
    elif name == "4b-4k":
        out["goal_rollout_35pct_of_bound"] = out["bandwidth_bound_fraction"] >= 0.35
        out["goal_train_mfu_45pct"] = (out["train_mfu"] or 0) >= 0.45
    elif name == "4b-16k":
        peaks = miles.get("gpu_mem_peak_mib_per_iteration") or []
        spread = step._spread(peaks[1:])
        out["goal_memory_flat_over_5"] = len(peaks) >= 5 and spread is not None and spread <= 1.02
        out["gpu_mem_peak_max_over_min_after_first"] = spread
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    p.add_argument("--out", type=Path, default=None, help="keep the model, data, logs and runs here (default: temp)")
    p.add_argument("--miles-iters", type=int, default=4, help="miles rollouts (the first warms up)")
    p.add_argument("--trl-steps", type=int, default=3, help="TRL steps (the first warms up)")
    p.add_argument("--miles-flags", default=None, help="replace the workload's miles flags")
    p.add_argument("--side-timeout-s", type=float, default=550.0, help="wall-clock bound of each side")
    p.add_argument("--no-recompute", action="store_true",
                   help="train without --recompute-activations (and so packed: see the packing section of the docs)")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", type=Path, default=None, help="use this HF folder instead of building the shape")
    return p.parse_args(argv)


def main() -> None:
    s = parse_args()
    family, size, prompts, samples, new_tokens, micro, with_trl, extra = WORKLOADS[s.workload]
    flags = s.miles_flags if s.miles_flags is not None else f"{BASE_FLAGS} {extra}"
    if s.no_recompute:
        flags = " ".join(f for f in flags.split() if f != "--recompute-activations")
    a = step.parse_args(["--prompts", str(prompts), "--samples", str(samples), "--new-tokens", str(new_tokens),
                         "--micro-batch", str(micro), "--global-batch", str(prompts * samples),
                         "--miles-iters", str(s.miles_iters), "--trl-steps", str(s.trl_steps),
                         "--model-family", family, "--size", size, "--miles-flags", flags,
                         "--side-timeout-s", str(s.side_timeout_s), "--device", s.device])
    shape = step.SHAPES[(family, size)]
    with tempfile.TemporaryDirectory() as tmp:
        root = s.out or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        model = s.model or root / "model"
        params = step.count_params(model) if s.model else step.build_model(model, family, size)
        data, reward, a.prompt_tokens = step.write_data(root, prompts)
        trl = {"skipped": "not this workload's comparison"} if not with_trl else \
            {"skipped": "--skip-trl"} if s.skip_trl else step.run_trl(a, root, model, data, reward, params)
        miles = step.run_miles(a, root, model, data, reward, params)
        report = {"workload": s.workload, "goals": verdicts(s.workload, a, miles, trl, shape, params),
                  "setup": {"params": params, "model": f"{family} {size}", "prompts": prompts, "samples": samples,
                            "new_tokens": new_tokens, "micro_batch": micro, "miles_flags": flags,
                            "bandwidth_bytes_per_s": BANDWIDTH, "peak_tflops_bf16": step.PEAK_TFLOPS,
                            "total_s": round(time.monotonic() - t0, 1)},
                  "miles": miles, "trl": trl}
        print(json.dumps(report, indent=2, default=str))
        if s.out:
            (root / f"scale_{s.workload}.json").write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
