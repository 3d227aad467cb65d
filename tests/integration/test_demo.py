"""The main job as the README runs it: GRPO on the arithmetic demo from the committed base model,
raising greedy accuracy on the 500 held-out problems by at least 15 points."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles.config.flags import parse_flags
from miles.api.launch import train
from miles.runtime import read_trace, with_disposer
from miles.traceview.check import check_trace
from miles.runtime import load_machine

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_demo_recipe_learns(ray_cluster, tmp_path):
    cfg, _ = parse_flags(["--config", str(ROOT / "examples/arithmetic/grpo.yaml"), "--run-dir", str(tmp_path / "run"),
                          "--save", str(tmp_path / "ck"), "--save-interval", "20", "--trace-console", "off"])
    result = asyncio.run(with_disposer(train, cfg))
    trace, _ = assert_learns_arithmetic(result)
    for name in ("trace.jsonl", "metrics.jsonl", "config.yaml"):
        assert (result.run_dir / name).is_file()
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(tmp_path / "ck" / "iter_0000039" / "hf")


def assert_learns_arithmetic(result):
    """The recipe's bar: greedy accuracy on the held-out problems up 15 points or more over its 40
    rollouts, and a conforming trace. Returns the trace and the last eval's accuracy."""
    evals = [r for r in result.metrics if r.get("kind") == "eval"]
    before, after = evals[0]["eval/arith/pass@1"], evals[-1]["eval/arith/pass@1"]
    assert [r["step"] for r in evals] == [0, 10, 20, 30, 40]
    assert after - before >= 0.15, (before, after)
    trace = read_trace(result.run_dir)
    assert check_trace(trace, load_machine("sync")).ok
    return trace, after
