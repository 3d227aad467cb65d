"""Deterministic data for the arithmetic example: two-digit addition, and a sloppy teacher.

Every problem is `a+b=` with 0 <= a, b <= 99 (10,000 problems). A seeded shuffle puts 500 in
`eval.jsonl` and the other 9,500 in `train.jsonl` (the RL prompts, `label` = the true sum), so eval
is disjoint from train. `sft.jsonl` holds the same 9,500 train prompts answered by a *sloppy
teacher*: it adds column by column and forgets each carry with probability FORGET_CARRY.

Why a sloppy teacher: the warm start imitates it, so the base model knows how to add but prefers to
drop carries. Its greedy answer is right mostly on carry-free problems (a third of them), while the
right answer to the others is still among its samples. That is the situation RL with a verifiable
reward fixes quickly: GRPO only has to move probability from the dropped carry to the kept one.

    python examples/arithmetic/make_data.py [OUT_DIR]    # default: examples/arithmetic/data
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 1234
MAX_OPERAND = 99
NUM_EVAL = 500
FORGET_CARRY = 0.7          # P(the teacher drops a carry); above 0.5 so dropping is its habit


def prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def sloppy_sum(a: int, b: int, rng: random.Random, forget: float) -> int:
    """Column addition from the units up that drops each carry with probability `forget`."""
    total, carry, place = 0, 0, 1
    while a or b or carry:
        column = a % 10 + b % 10 + carry
        total += (column % 10) * place
        carry = column // 10 if rng.random() >= forget else 0
        a, b, place = a // 10, b // 10, place * 10
    return total


def make_splits(seed: int = SEED) -> dict[str, list[dict[str, str]]]:
    """The three files' rows, a pure function of `seed`."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    eval_pairs, train_pairs = pairs[:NUM_EVAL], pairs[NUM_EVAL:]
    teacher = random.Random(seed + 1)
    return {
        "train": [{"input": prompt(a, b), "label": str(a + b)} for a, b in train_pairs],
        "eval": [{"input": prompt(a, b), "label": str(a + b)} for a, b in eval_pairs],
        "sft": [{"input": prompt(a, b), "response": str(sloppy_sum(a, b, teacher, FORGET_CARRY))}
                for a, b in train_pairs],
    }


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str]) -> None:
    out = Path(argv[0]) if argv else Path(__file__).parent / "data"
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in make_splits().items():
        write_jsonl(out / f"{name}.jsonl", rows)
        print(f"{out / name}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main(sys.argv[1:])
