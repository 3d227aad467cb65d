"""`scripts/gpu_call.sh gpuP gpuS` is how a session runs the whole of tests/gpu on the GPU machine
(three parallel lanes, then the memory-reading files alone): a new GPU test file that no lane names
would never run there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_calls_lanes_name_every_gpu_test_file():
    script = (ROOT / "scripts" / "gpu_call.sh").read_text()
    lanes = "\n".join(re.findall(r'^(?:LANE\d|SERIAL)="([^"]*)"', script, flags=re.M | re.S))
    named = set(re.findall(r"tests/gpu/(test_\w+\.py)", lanes))
    files = {p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
    assert files - named == set(), "add these to a lane of scripts/gpu_call.sh"
    assert named - files == set(), "scripts/gpu_call.sh names test files that do not exist"
