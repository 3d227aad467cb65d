"""Benchmark (not a test): trained tokens per second of sync, async and fully_async on a long-tail workload.

The three machines run the same flags, one after the other, on one local Ray cluster this script starts
(async and fully_async add --use-tis; fully_async adds --fully-async and its bounds). The workload has a
long tail: answers end at a stop token drawn with a small probability per token (--rollout-stop-token-ids,
`--stop-ids` of them; the tiny model samples near-uniformly), so most answers are short and a few run to
the cap (--rollout-max-response-len); the metrics record each run's response lengths (mean and max).
Per machine, from its trace and metrics:
  trained_tokens_per_s   response tokens of the trained samples / the loop's time (end of init to the
                         start of draining)
  engine_idle_fraction   1 - the engines' generating time / the loop's time, averaged over the engines
                         (sync: the rollout phases; async: the rollout generating ahead; fully_async:
                         the producer's engine calls, per engine)
  trainer_idle_fraction  1 - the train phases' time / the loop's time
  train_s_per_step       the train phase's mean duration (on a CPU it shows what the engines generating
                         beside the trainer cost it: they share the cores)
  cpu_threads            a CPU run's torch threads per actor, from the trace's `placement` (the trainer
                         gets the cores the engines leave it when they overlap: cpu_thread_budget)
  layer_compiles         graphs the trainer compiled at each measured step (a GPU trainer's compiled
                         layers compile a variant the first time a micro-batch of a new kind comes, e.g.
                         a lone long answer: that step's train phase holds the compile)
and speedup_vs_sync: each machine's trained tokens per second over sync's (the issue's goal: fully_async
>= 1.5x). With --repeat K each machine runs K times in rotating order; the medians are compared.

Usage:
  python scripts/bench/fully_async_bench.py [--repeat K] [--device cpu|cuda] [--runs-dir DIR]
      [--max-len N] [--stop-ids K] [--steps N] [--engines E] [--fully-async-flags '...']
      [-- extra miles flags ...]
CPU by default (the tests' tiny model and addition task, built in a temp dir).

`--device cuda` (the GPU machine, one GPU): a random Qwen3-0.6B-shaped model (`--size 1.7b`: 1.7B), the
fast engine and the trainer on the one GPU, both resident (--colocate --no-offload-rollout; the engine's
KV cache --rollout-mem-fraction, default 0.5, of the GPU less its weights, the trainer the rest), one
engine, 16 prompts x 8 samples a step, answers of --mean-len tokens on average up to --max-len
(`gpu_workload`). The command (from the checkout, the wheels installed):
  PYTHONPATH=$PWD python3 scripts/bench/fully_async_bench.py --device cuda --size 0.6b --max-len 2048 \
      --mean-len 256 --steps 8 --engines 1 --repeat 1 --runs-dir /tmp/fa-bench --out fully_async_gpu.json
(three runs of 8 steps; extra miles flags after `--`). Run so on an H100 (Dec 7 2026) its first steps'
compiles were a third of each loop and the later machines found the first one's compile caches: measure
with `--steps 12 --warmup-steps 3 --repeat 2` (docs/performance.md, "Fully async on a long tail"). The start-up memory plan of that run on an 80 GB
H100: 0.6B fits at the default fraction (the engine's KV cache ~39 GiB); `--size 1.7b` needs about
84 GiB there and is refused before Ray starts, naming the flags; with `-- --rollout-mem-fraction 0.4` it
fits (checked on the CPU with `startup_problems(cfg, 1, gpu_bytes=81559 MiB)`, Dec 7 2026).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MACHINES = ("sync", "async", "fully_async")
TAIL_CUT = "fully_async_cut"    # --machines ...,fully_async_cut: fully_async with --async-tail-cut-share 0.25


def workload(root: Path, args: argparse.Namespace) -> list[str]:
    if args.device == "cuda":
        return gpu_workload(root, args)
    from tests.conftest import write_addition_task
    from tests.tiny_model import VOCAB_SIZE, make_tiny_model

    model = make_tiny_model(root / "model")
    train, _ = write_addition_task(root, n_train=512)
    stop_ids = [VOCAB_SIZE - 1 - i for i in range(args.stop_ids)]     # rare letters: a geometric length
    return ["--hf-checkpoint", str(model), "--prompt-data", str(train), "--label-key", "label",
            "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--rollout-max-response-len", str(args.max_len),
            "--rollout-stop-token-ids", *map(str, stop_ids), "--num-rollout", str(args.steps), "--lr", "1e-4",
            "--global-batch-size", "64", "--micro-batch-size", "16", "--rollout-num-engines", str(args.engines),
            "--rollout-max-batch-size", "16"]


# --- the GPU machine (--device cuda): one GPU, engine and trainer both resident ---------------------------
VOCAB = 151936      # the Qwen3 shapes' vocabulary (scripts/bench/grpo_step_gpu.py)


def gpu_workload(root: Path, args: argparse.Namespace) -> list[str]:
    """A random Qwen3-shaped bf16 model (`--size`, built as scripts/bench/grpo_step_gpu.py builds it, with
    its character tokenizer, digits prompts and digits-share reward) on one GPU shared by the trainer and
    one fast engine, both resident (--colocate --no-offload-rollout: the layout all three machines take
    there, so they are compared on the same memory split). The long tail: the random model samples near
    uniformly over its 151,936 ids, so VOCAB / --mean-len stop ids end an answer after --mean-len tokens
    on average (a geometric length: of 128 samples a step the longest runs ~5x that, up to --max-len).
    --max-prompt-len (the 64-token prompts fit) sizes the engine's slots to prompt + --max-len positions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("grpo_step_gpu", ROOT / "scripts/bench/grpo_step_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = root / f"qwen3-{args.size}"
    if not (model / "config.json").exists():
        bench.build_model(model, "qwen3", args.size)
    prompts, reward, _ = bench.write_data(root, 1024)
    stop_ids = [VOCAB - 1 - i for i in range(max(1, round(VOCAB / args.mean_len)))]
    return ["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--input-key", "input",
            "--label-key", "label",
            "--custom-rm-path", f"{reward}:reward", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
            "--rollout-max-response-len", str(args.max_len), "--max-prompt-len", "96", "--rollout-temperature", "1.0",
            "--rollout-stop-token-ids", *map(str, stop_ids), "--num-rollout", str(args.steps), "--lr", "1e-6",
            "--global-batch-size", "128", "--micro-batch-size", "16", "--use-dynamic-batch-size",
            "--rollout-engine", "fast", "--rollout-num-engines", str(args.engines),
            "--colocate", "--no-offload-rollout", "--progress", "off"]


def machine_flags(machine: str) -> list[str]:
    if machine == "async":
        return ["--use-tis"]
    if machine in ("fully_async", TAIL_CUT):
        return ["--use-tis", "--fully-async", "--max-weight-staleness", "2", "--async-data-buffer-capacity-factor", "2",
                *(["--async-tail-cut-share", "0.25"] if machine == TAIL_CUT else [])]
    return []


def run_machine(machine: str, flags: list[str], run_dir: Path, fa_extra: list[str] = (), warmup_steps: int = 0) -> dict:
    from miles.api.launch import train
    from miles.config.flags import parse_flags
    from miles.runtime import read_trace, with_disposer

    own = [*machine_flags(machine), *(fa_extra if machine in ("fully_async", TAIL_CUT) else ())]
    cfg, _ = parse_flags([*flags, *own, "--run-dir", str(run_dir), "--trace-console", "off"])
    t0 = time.monotonic()
    asyncio.run(with_disposer(train, cfg, machine="fully_async" if machine == TAIL_CUT else machine))
    wall = time.monotonic() - t0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summarize(read_trace(run_dir), [r for r in rows if r.get("kind") == "train"], machine, wall, warmup_steps)


def _busy(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] the union of `spans` covers."""
    total, end = 0.0, lo
    for a, b in sorted(spans):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def summarize(trace, rows: list[dict], machine: str, wall: float, warmup_steps: int = 0) -> dict:
    """The loop is measured from the end of init, or with `warmup_steps` K from the end of the K-th train
    phase (the steps that compile and autotune left out), to the start of draining; its trained tokens are
    those of the steps after the K-th."""
    phases = {s: [(e.mono - e.duration_s, e.mono) for e in trace.of("phase_end") if e.state == s]
              for s in ("rollout", "train")}
    if warmup_steps >= len(phases["train"]):
        raise ValueError(f"--warmup-steps {warmup_steps}: the run trained {len(phases['train'])} steps; "
                         "measure at least one (raise --steps)")
    init_end = phases["train"][warmup_steps - 1][1] if warmup_steps else \
        next(e.mono for e in trace.of("phase_end") if e.state == "init")
    drain_start = next(e.mono for e in trace.of("phase_start") if e.state == "draining")
    loop = max(drain_start - init_end, 1e-9)
    rows = rows[warmup_steps:]
    if machine == "sync":
        engines = {"all": phases["rollout"]}
    elif machine == "async":
        engines = {"all": [(e.mono - e.duration_s, e.mono) for e in trace.of("prefetch_end")]}
    else:
        submits = {e.seq: e for e in trace.of("producer_submit")}
        engines = {}
        for e in trace.of("producer_groups", "producer_cut"):
            s = submits.get(e.cause)
            if s is not None:
                engines.setdefault(s.get("engine"), []).append((s.mono, e.mono))
    engine_busy = [_busy(spans, init_end, drain_start) / loop for spans in engines.values()] or [0.0]
    trained = sum(r["gen_tokens"] for r in rows)
    return {"machine": machine, "steps": len(rows), "wall_s": round(wall, 2), "loop_s": round(loop, 3),
            "trained_tokens": trained, "trained_tokens_per_s": round(trained / loop, 2),
            "response_len_mean": round(statistics.fmean(r["response_len_mean"] for r in rows), 2),
            "response_len_max": max(r["response_len_max"] for r in rows),
            "engine_idle_fraction": round(1 - statistics.fmean(engine_busy), 3),
            "trainer_idle_fraction": round(1 - _busy(phases["train"], init_end, drain_start) / loop, 3),
            "train_s_per_step": round(statistics.fmean(b - a for a, b in phases["train"][warmup_steps:]), 4),
            "warmup_steps": warmup_steps,
            "staleness_max": max(r.get("staleness_max", 0) for r in rows),
            # graphs the trainer compiled at each measured step (a step of a new micro-batch kind compiles)
            "layer_compiles": [r.get("layer_compiles", 0) for r in rows],
            "cpu_threads": next(iter(trace.of("placement"))).get("cpu_threads"),   # the placement's budget (CPU)
            "reward_mean_last": rows[-1]["reward_mean"] if rows else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-dir", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here (stdout has the runs' log lines too)")
    p.add_argument("--repeat", type=int, default=1, help="runs per machine, rotating which goes first")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--max-len", type=int, default=96, help="the response cap (--rollout-max-response-len)")
    p.add_argument("--stop-ids", type=int, default=1, help="stop token ids (more: shorter answers on average)")
    p.add_argument("--steps", type=int, default=6, help="--num-rollout of each run")
    p.add_argument("--warmup-steps", type=int, default=0, help="measure from the end of this many train steps "
                   "(a GPU run's first steps compile; its compile caches also favour the machines run later)")
    p.add_argument("--engines", type=int, default=2, help="--rollout-num-engines")
    p.add_argument("--machines", default=",".join(MACHINES), help="which machines, comma-separated; "
                   f"{TAIL_CUT}: fully_async with --async-tail-cut-share 0.25")
    p.add_argument("--size", default="0.6b", choices=("0.6b", "1.7b"), help="--device cuda: the Qwen3 shape")
    p.add_argument("--mean-len", type=int, default=256, help="--device cuda: the answers' mean length (stop ids)")
    p.add_argument("--fully-async-flags", default="", help="more flags for the fully_async machine alone, "
                   "e.g. '--async-max-concurrent-samples 128' (the others refuse them)")
    args, extra = p.parse_known_args()
    extra = [f for f in extra if f != "--"]
    import ray
    import torch

    if args.device == "cpu":
        torch.set_num_threads(1)
    os.environ.setdefault("RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper", "true")
    machines = args.machines.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.runs_dir or Path(tmp)
        flags = [*workload(root / "task", args), "--device", args.device, *extra]
        ray.init(include_dashboard=False, logging_level="WARNING", namespace="miles-bench")
        try:
            results = []
            for i in range(args.repeat):
                order = machines[i % len(machines):] + machines[:i % len(machines)]
                for m in order:
                    results.append(run_machine(m, flags, root / f"{m}-{i}", args.fully_async_flags.split(),
                                               args.warmup_steps))
                    print(json.dumps(results[-1]), file=sys.stderr, flush=True)   # kept if a bound cuts the rest
        finally:
            ray.shutdown()
    median = {m: statistics.median(r["trained_tokens_per_s"] for r in results if r["machine"] == m) for m in machines}
    base = median.get("sync")
    out = {"flags": flags, "fully_async_flags": args.fully_async_flags.split(), "device": args.device, "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
           "results": results, "median_trained_tokens_per_s": median,
           "speedup_vs_sync": {m: round(v / base, 3) for m, v in median.items()} if base else None}
    print(json.dumps(out, indent=2))
    if args.out:            # the run's own log lines also go to stdout: --out holds the JSON alone
        args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
