"""Benchmark: what the lifecycle runner and the trace cost per rollout, as a share of the step.

Two measurements, printed as one JSON object:
  synthetic  the sync machine with no-op phases (stub context, trace written to a file): the
             runner's and trace's own cost per rollout (6 phases, ~20 events), in microseconds;
  run        for each run directory given: wall time outside any phase (the runner, trace writes,
             guard evaluation between phases) per rollout, against the mean step time.

Usage: python scripts/bench/runtime_overhead.py [--rollouts 2000] [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from miles.runtime import read_trace  # noqa: E402
from tests.stub_phases import make_stub_run  # noqa: E402


def synthetic(rollouts: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        runner, _ = make_stub_run("sync", Path(d) / "trace.jsonl", num_rollout=rollouts,
                                  eval_interval=None, save_interval=None, resources=3)
        t0 = time.perf_counter()
        asyncio.run(runner.run())
        wall = time.perf_counter() - t0
        events = len(read_trace(d).events)
    return {"rollouts": rollouts, "wall_s": round(wall, 4), "events": events,
            "us_per_rollout": round(wall / rollouts * 1e6, 1), "us_per_event": round(wall / events * 1e6, 2)}


def from_run(run_dir: str) -> dict:
    trace = read_trace(run_dir)
    ends = trace.of("phase_end")
    rollouts = max(1, sum(e.state == "rollout" for e in ends))
    start = next(e.mono for e in trace.events if e.event == "run_start")
    unwind = next((e.mono for e in trace.events if e.event == "unwind_start"), trace.events[-1].mono)
    in_phases = sum(e.duration_s or 0.0 for e in ends if e.state not in ("init",))
    init = sum(e.duration_s or 0.0 for e in ends if e.state == "init")
    loop_wall = unwind - start - init
    outside = max(loop_wall - in_phases, 0.0)
    step = loop_wall / rollouts
    return {"run_dir": run_dir, "rollouts": rollouts, "loop_wall_s": round(loop_wall, 3),
            "step_s": round(step, 4), "runner_overhead_s_per_rollout": round(outside / rollouts, 6),
            "overhead_fraction": round(outside / loop_wall, 5) if loop_wall else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=2000)
    p.add_argument("run_dirs", nargs="*")
    args = p.parse_args()
    out = {"synthetic": synthetic(args.rollouts), "runs": [from_run(d) for d in args.run_dirs]}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
