"""The calculator tool of the example: `--generate-execute-tool-function-path examples/tool_use/tools.py:execute`.

`calc(expression)` evaluates `A op B` (non-negative integers, op one of `* + -`). A call the model
got wrong (another tool name, a malformed expression) is answered with an error message the model
sees, as a real tool would answer; only a broken tool raises (and fails its sample).
"""

from __future__ import annotations

import operator
import re

_EXPRESSION = re.compile(r"\s*(\d{1,6})\s*([*+-])\s*(\d{1,6})\s*")
_OPS = {"*": operator.mul, "+": operator.add, "-": operator.sub}


def calc(expression: str) -> str:
    match = _EXPRESSION.fullmatch(expression)
    if match is None:
        return "error"
    a, op, b = match.groups()
    return str(_OPS[op](int(a), int(b)))


async def execute(name: str, arguments: dict) -> str:
    if name != "calc":
        return "error"
    return calc(str(arguments.get("expression", "")))
