"""Print what the demo run did: greedy eval accuracy before and after GRPO, the time it took, and
where its trace, metrics, checkpoints and HF export are. Exit 1 if the run has no eval before and after.

Usage: python examples/arithmetic/summarize.py RUN_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(run_dir: str) -> int:
    root = Path(run_dir)
    rows = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    trace = [json.loads(x) for x in (root / "trace.jsonl").read_text().splitlines() if x.strip()]
    end = trace[-1]
    if len(evals) < 2:
        print(f"{run_dir}: fewer than two evals in metrics.jsonl; nothing to compare", file=sys.stderr)
        return 1
    key = next(k for k in evals[0] if k.endswith("/pass@1"))
    before, after = evals[0][key], evals[-1][key]
    saved = [e["path"] for e in trace if e["event"] == "checkpoint_saved"]
    print(f"run {end['run_id']}: {end['outcome']} in {end['duration_s']:.0f} s "
          f"({sum(r.get('kind') == 'train' for r in rows)} rollouts)")
    print(f"greedy accuracy on {key.split('/')[1]}: {before:.3f} before, {after:.3f} after "
          f"({100 * (after - before):+.1f} points)")
    print(f"trace:       {root / 'trace.jsonl'}")
    print(f"metrics:     {root / 'metrics.jsonl'}")
    if saved:
        print(f"checkpoint:  {saved[-1]}  (HF export in {saved[-1]}/hf)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/demo"))
