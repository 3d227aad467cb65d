"""Benchmark (not a test): what grading a math answer costs (miles.rollout.math_grading), as JSON.

Three kinds of answer, each graded against the math recipe's labels (examples/math/data):
  inline     the answer is the label itself, or a plain number against a plain-number label: settled by the
             inline check on the event loop, no verifier (the demo's answers are all of this kind)
  verifier   an equal answer in another form (\\dfrac for \\frac, `\\frac{2n}{2}` for n, x^2+bx+c reordered,
             `1\\cdot X`) graded by math-verify in the worker processes (the pool is called directly, so
             every answer is the verifier's, as those the inline check cannot settle are in a run)
  hung       `9^{9^{9^{9}}}` against a label: the per-answer limit (ANSWER_TIME_LIMIT_S) ends it
and for each: answers, wall seconds, ms per answer. `verifier` runs the whole label set through
--processes worker processes (default: the pool's own choice for this machine) after they have started;
`start_s` is what starting them cost.

Usage: python scripts/bench/math_grading.py [--processes N] [--repeat K]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from pathlib import Path

from miles.rollout import math_grading
from miles.rollout.math_grading import VerifierPool, quick_verdict

DATA = Path(__file__).resolve().parents[2] / "examples" / "math" / "data"


def labels() -> list[str]:
    return [json.loads(line)["label"] for name in ("train.jsonl", "eval.jsonl") for line in open(DATA / name)]


def other_form(label: str) -> str:
    """An equal answer in another form."""
    s = label.replace("\\frac", "\\dfrac")
    m = re.fullmatch(r"x\^2\+(\d+)x\+(\d+)", s)
    if m:
        return f"{m.group(2)}+{m.group(1)}x+x^2"
    if s.isdigit():
        return f"\\frac{{{2 * int(s)}}}{{2}}"
    return s.replace(",", ", ") if "\\dfrac" in s or "," in s else f"1\\cdot {s}"


async def main(args: argparse.Namespace) -> dict:
    gold = labels()
    t0 = time.perf_counter()
    inline = [quick_verdict(x, x) for x in gold] + [quick_verdict("12", "12.0") for _ in gold]
    inline_s = time.perf_counter() - t0
    assert all(inline)

    pool = VerifierPool(processes=args.processes)
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(pool.equivalent("1", "1") for _ in range(pool.processes)))
        start_s = time.perf_counter() - t0
        answers = [other_form(x) for x in gold]
        runs = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            verdicts = await asyncio.gather(*(pool.equivalent(g, a) for g, a in zip(gold, answers)))
            runs.append(time.perf_counter() - t0)
        wrong = [(g, a) for g, a, v in zip(gold, answers, verdicts) if v is not True]
        t0 = time.perf_counter()
        hung = await pool.equivalent("5", "9^{9^{9^{9}}}")
        hung_s = time.perf_counter() - t0
    finally:
        pool.close()
    best = min(runs)
    return {
        "machine": f"{os.cpu_count()} CPUs", "processes": pool.processes,
        "answer_time_limit_s": math_grading.ANSWER_TIME_LIMIT_S, "start_s": round(start_s, 3),
        "inline": {"answers": len(inline), "wall_s": round(inline_s, 4),
                   "ms_per_answer": round(1000 * inline_s / len(inline), 4)},
        "verifier": {"answers": len(gold), "wall_s": [round(r, 3) for r in runs],
                     "ms_per_answer": round(1000 * best / len(gold), 2),
                     "ms_per_answer_per_process": round(1000 * best * pool.processes / len(gold), 2),
                     "not_equal": wrong[:5]},
        "hung": {"verdict": hung, "wall_s": round(hung_s, 3)},
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=None)
    p.add_argument("--repeat", type=int, default=3)
    print(json.dumps(asyncio.run(main(p.parse_args())), indent=2))
