"""Deterministic data of the tool-use example: two-digit multiplication, to be answered with a calculator.

Every problem is `a*b` with 10 <= a, b <= 99 (8,100 problems); a seeded shuffle puts 300 in
`eval.jsonl` and the other 7,800 in `train.jsonl` (`{"input": "37*48", "label": "1776"}`). With
`--apply-chat-template` the prompt the model sees is `37*48=`.

The warm start (`make_base_model.py`) imitates a *teacher* that calls the calculator on a fraction
`TOOL_RATE` of the problems and otherwise guesses, never right (the true product plus an offset).
So the base model knows how to call the tool and read its answer, but prefers to guess; RL with a
correctness reward has to teach it to call the tool (`teacher_rows`).

    python examples/tool_use/make_data.py [OUT_DIR]     # default: examples/tool_use/data
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 4321
LOW, HIGH = 10, 99
NUM_EVAL = 300
TOOL_RATE = 0.3             # the teacher calls the calculator on this share of the problems
MAX_GUESS_OFFSET = 60       # a guess is the product moved by 1..60 either way


def make_splits(seed: int = SEED) -> dict[str, list[dict[str, str]]]:
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(seed).shuffle(pairs)
    rows = [{"input": f"{a}*{b}", "label": str(a * b)} for a, b in pairs]
    return {"eval": rows[:NUM_EVAL], "train": rows[NUM_EVAL:]}


def teacher_rows(rows: list[dict[str, str]], seed: int = SEED + 1) -> list[dict[str, object]]:
    """The teacher's answer to each row: `{"tool": True}` (it calls the calculator), or
    `{"tool": False, "guess": "<a wrong product>"}`."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        if rng.random() < TOOL_RATE:
            out.append({**row, "tool": True})
        else:
            offset = rng.randint(1, MAX_GUESS_OFFSET) * rng.choice((-1, 1))
            out.append({**row, "tool": False, "guess": str(int(row["label"]) + offset)})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "data"
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in make_splits().items():
        write_jsonl(out / f"{name}.jsonl", rows)
    print(f"wrote {out}")
