"""What the bench scripts beside this file share (a sibling import: each script puts this folder on sys.path):
the report's end (total time, JSON printed and written to --out) and the GPU's peak memory bandwidth."""

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


# peak HBM bandwidth by device name, in bytes/s (the most specific name first)
BANDWIDTHS = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12))


def hbm_gbs(given: float | None = None) -> float:
    """`given` (a --hbm-gbs) when set, else the CUDA device's peak bandwidth in GB/s by its name (H100 SXM's
    3,350 for an unknown device or none)."""
    if given:
        return given
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((bw for key, bw in BANDWIDTHS if key in name), 3.35e12) / 1e9
