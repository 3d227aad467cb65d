"""`miles plot RUN_DIR [RUN_DIR ...]`: a run's metrics (reward, eval accuracy, lengths, KL, ...) as one PNG."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from miles.tracking.plot import plot_runs, read_metrics


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="miles plot", description="Plot a run's metrics (reward, eval accuracy, "
                                "response length, KL, entropy, step time) to one PNG.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (several: drawn over each other)")
    p.add_argument("-o", "--output", help="PNG to write (default: RUN_DIR/plots/metrics.png of the first run)")
    p.add_argument("--title", help="figure title (default: the run directories)")
    args = p.parse_args(argv)
    dirs = [Path(d) for d in args.run_dirs]
    for d in dirs:
        if not (d / "metrics.jsonl").is_file():
            print(f"miles plot: {d}: no metrics.jsonl here; pass a run directory (runs/<run id>)", file=sys.stderr)
            return 2
    if not any(read_metrics(d) for d in dirs):
        print(f"miles plot: {', '.join(map(str, dirs))}: metrics.jsonl is empty; no rollout was trained yet",
              file=sys.stderr)
        return 2
    out = plot_runs(dirs, Path(args.output) if args.output else dirs[0] / "plots" / "metrics.png", title=args.title)
    print(out)
    return 0

