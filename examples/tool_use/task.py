"""The tool-use task's reward and its evaluation, shared by the recipe, the scripts and the tests.

The reward (`--custom-rm-path examples/tool_use/task.py:reward`) reads the model's final answer:
the text after the last tool response (the whole response when the model called no tool). It is
1.0 when that is exactly the label, else 0.0; a trajectory that ends on a tool response (it ran out
of turns) has no final answer and scores 0.0, so copying the calculator's output is not enough
without answering.
"""

from __future__ import annotations

import json
from pathlib import Path

RESPONSE_CLOSE = "</tool_response>"
CALL_OPEN = "<tool_call>"


def load_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def final_answer(response: str) -> str | None:
    """The text after the last tool response, stripped; None when the trajectory ends on a tool call
    or a tool response."""
    tail = response.rsplit(RESPONSE_CLOSE, 1)[-1].strip()
    return None if not tail or CALL_OPEN in tail else tail


def reward(prompt, response: str, label: str | None) -> float:
    return 1.0 if label is not None and final_answer(response) == label else 0.0
