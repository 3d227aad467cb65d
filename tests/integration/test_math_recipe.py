"""The math recipe's CPU run (examples/math/cpu.yaml) end to end: the recipe's prompts through the
chat template, a tiny model that writes the recipe's answer format (and no right answers, mostly),
--rm-type deepscaler graded by math-verify in its worker processes, training, and the pass@k eval.

Extended: a whole run of over a minute on the 2-core CI machine (the CI budget); run it with
`bash scripts/test.sh -m extended tests/integration/test_math_recipe.py`.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import psutil
import pytest

from miles.api.launch import train
from miles.config.flags import parse_flags
from miles.rollout.rewards import deepscaler_reward
from miles.runtime import with_disposer
from miles.rollout.debug_data import load_rollout_data

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.extended]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "math"


def _graders() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if "miles.rollout.math_verify_worker" in (p.info["cmdline"] or [])]


def test_the_math_recipe_runs_on_a_cpu(ray_cluster, tmp_path):
    sys.path.insert(0, str(EXAMPLE))
    from make_tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model")
    cfg, _ = parse_flags(["--config", str(EXAMPLE / "cpu.yaml"), "--hf-checkpoint", model,
                          "--run-dir", str(tmp_path / "run"), "--trace-console", "off",
                          "--save-debug-rollout-data", str(tmp_path / "rollouts" / "{rollout_id}.pt")])
    result = asyncio.run(with_disposer(train, cfg))

    evals = [r for r in result.metrics if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(f"eval/math-eval/pass@{k}" in evals[-1] for k in (1, 2, 3, 4))     # --log-passrate: pass@1..n
    # the run's rewards are deepscaler's verdicts, and the verifier graded some of them (a box after </think>)
    graded = 0
    for rollout_id in (0, 1):
        saved = load_rollout_data(tmp_path / "rollouts" / f"{rollout_id}.pt")
        assert len(saved.samples) == 8 * 4
        for s in saved.samples:
            again = asyncio.run(deepscaler_reward(s.prompt, s.response_text, s.prompt.label))
            assert s.reward == again, (s.response_text, s.prompt.label)
            graded += "</think>" in s.response_text and "\\boxed{" in s.response_text.rsplit("</think>", 1)[1]
    assert graded >= 8, graded
    assert _graders() == [] or all(p.ppid() == psutil.Process().pid for p in _graders())   # none left by the run
    from miles.rollout import math_grading
    if math_grading._POOL is not None:          # the pool this test's own grading started
        math_grading._POOL.close()
        math_grading._POOL = None
