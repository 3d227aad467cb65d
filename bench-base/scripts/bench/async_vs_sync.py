"""Benchmark (not a test): wall time per rollout of the async machine against sync, in one run.

Both machines run the same flags, one after the other, on one local Ray cluster this script starts
(so neither pays for the cluster's start); async adds --use-tis unless the flags already pick an
off-policy correction. Per machine, read from its trace:
  loop_s_per_rollout   from the end of `init` to the start of `draining`, divided by the rollouts
  train_s, rollout_s   mean duration of the train and rollout phases (async's rollout phase only
                       waits for the batch generated ahead, so it shrinks when the overlap works)
  gen_s                mean generation time (sync: the rollout phase; async: the prefetch span)
and the speedup: sync's median loop time per rollout over async's. With --repeat K each machine runs
K times, in alternating order (sync first, then async first, ...), so load from other processes on
the machine weighs on both alike.

Usage:
  python scripts/bench/async_vs_sync.py [--repeat K] [--runs-dir DIR] [--tiny] [-- miles flags ...]
Without flags it runs the CPU demo: --config examples/arithmetic/grpo.yaml --num-rollout 8.
--tiny uses the tests' tiny random model and addition task instead (no demo needed).
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

DEMO_FLAGS = ["--config", str(ROOT / "examples/arithmetic/grpo.yaml"), "--num-rollout", "8"]


def tiny_flags(root: Path) -> list[str]:
    from tests.conftest import write_addition_task
    from tests.tiny_model import make_tiny_model

    model = make_tiny_model(root / "model")
    train, _ = write_addition_task(root, n_train=256)
    return ["--hf-checkpoint", str(model), "--prompt-data", str(train), "--label-key", "label",
            "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "24",
            "--num-rollout", "8", "--lr", "1e-4", "--global-batch-size", "32", "--micro-batch-size", "8"]


def run_machine(machine: str, flags: list[str], run_dir: Path) -> dict:
    from miles.config.flags import parse_flags
    from miles.api.launch import train
    from miles.runtime import read_trace, with_disposer

    extra = []
    if machine == "async" and not {"--use-tis", "--use-rollout-logprobs"} & set(flags):
        extra = ["--use-tis"]
    cfg, _ = parse_flags([*flags, *extra, "--run-dir", str(run_dir), "--trace-console", "off"])
    t0 = time.monotonic()
    asyncio.run(with_disposer(train, cfg, machine=machine))
    wall = time.monotonic() - t0
    return summarize(read_trace(run_dir), machine, wall)


def summarize(trace, machine: str, wall: float) -> dict:
    ends = trace.of("phase_end")
    init_end = next(e.mono for e in ends if e.state == "init")
    drain_start = next(e.mono for e in trace.of("phase_start") if e.state == "draining")
    rollouts = sum(e.state == "train" for e in ends)

    def mean(xs: list[float]) -> float | None:
        return round(statistics.fmean(xs), 4) if xs else None

    phase = {s: [e.duration_s for e in ends if e.state == s] for s in ("rollout", "train", "weight_sync")}
    gen = ([e.duration_s for e in trace.of("prefetch_end") if e.get("outcome") == "ok"] if machine == "async"
           else phase["rollout"])
    loop = drain_start - init_end
    return {"machine": machine, "rollouts": rollouts, "wall_s": round(wall, 2), "loop_s": round(loop, 3),
            "loop_s_per_rollout": round(loop / max(rollouts, 1), 4), "gen_s": mean(gen),
            "rollout_s": mean(phase["rollout"]), "train_s": mean(phase["train"]),
            "weight_sync_s": mean(phase["weight_sync"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-dir", type=Path, default=None, help="keep the two runs here (default: a temp dir)")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny model and addition task")
    p.add_argument("--repeat", type=int, default=1, help="runs per machine, alternating which goes first")
    args, flags = p.parse_known_args()
    flags = [f for f in flags if f != "--"]
    import ray
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper", "true")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.runs_dir or Path(tmp)
        if args.tiny:
            flags = tiny_flags(root / "tiny") + flags
        elif not flags:
            flags = DEMO_FLAGS
        ray.init(include_dashboard=False, logging_level="WARNING", namespace="miles-bench")
        try:
            results = []
            for i in range(args.repeat):
                order = ("sync", "async") if i % 2 == 0 else ("async", "sync")
                results += [run_machine(m, flags, root / f"{m}-{i}") for m in order]
        finally:
            ray.shutdown()
    median = {m: statistics.median(r["loop_s_per_rollout"] for r in results if r["machine"] == m)
              for m in ("sync", "async")}
    out = {"flags": flags, "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2), "results": results,
           "median_loop_s_per_rollout": median, "speedup_per_rollout": round(median["sync"] / median["async"], 3)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
