"""Measure what survives `kill -9` of a miles driver mid-rollout, and for how long.

Starts `scripts/train.py` (its own local Ray cluster) with a hang injected at rollout 3, SIGKILLs
it once it hangs, then polls every process the driver had spawned (and the run's actor pids from
the trace) until none is left or --wait seconds pass. Prints JSON.

Usage: python scripts/bench/kill9_survivors.py --model DIR --data FILE [--wait 180]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from miles.runtime.procs import pid_running  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "examples/arithmetic/base_model"))
    p.add_argument("--data", default=str(ROOT / "examples/arithmetic/data/train.jsonl"))
    p.add_argument("--wait", type=float, default=180.0)
    a = p.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="kill9-"))
    argv = [sys.executable, str(ROOT / "scripts/train.py"), "--hf-checkpoint", a.model, "--prompt-data", a.data,
            "--label-key", "label", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "8", "--num-rollout", "10", "--run-dir", str(run_dir),
            "--trace-console", "off", "--inject-fault", "rollout:hang:3"]
    driver = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    trace = run_dir / "trace.jsonl"
    while not (trace.exists() and "fault_injected" in trace.read_text()):
        time.sleep(0.1)
    events = [json.loads(x) for x in trace.read_text().splitlines()]
    actors = next(e["pids"] for e in events if e["event"] == "components_ready")
    spawned = {q.pid: q.name() for q in psutil.Process(driver.pid).children(recursive=True)}
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    t0, timeline, actors_gone_s = time.monotonic(), [], None
    while time.monotonic() - t0 < a.wait:
        alive = {pid: n for pid, n in spawned.items() if pid_running(pid)}
        if actors_gone_s is None and not any(pid_running(pid) for pid in actors.values()):
            actors_gone_s = round(time.monotonic() - t0, 1)
        timeline.append((round(time.monotonic() - t0, 1), sorted(set(alive.values()))))
        if not alive:
            break
        time.sleep(1.0)
    changes = [t for i, t in enumerate(timeline) if i == 0 or t[1] != timeline[i - 1][1]]
    print(json.dumps({"spawned": len(spawned), "actors": actors, "actors_gone_after_s": actors_gone_s,
                      "all_gone_after_s": timeline[-1][0] if not timeline[-1][1] else None,
                      "survivors_over_time": changes}, indent=1))


if __name__ == "__main__":
    main()
