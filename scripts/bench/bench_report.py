"""What the bench scripts beside this file end with: the report's total time, its JSON printed and
written to --out (a sibling import: each script puts this folder on sys.path)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def emit(report: dict, out: str | None, started: float) -> None:
    """Set report["total_s"] (seconds since `started`, a `time.perf_counter()`), print the JSON, and write it
    to `out` when given."""
    report["total_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
