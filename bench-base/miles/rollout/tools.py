"""Tools for multi-turn generation: their specs, reading tool calls from the model's text, running
them, and the tokens of the tool turn the model sees next.

- Specs (`--generate-tool-specs-path`): OpenAI-style, a list of
  `{"type": "function", "function": {"name", "description", "parameters"}}`, from a `.json` file or a
  `module:attr` list. They go to the chat template (`tools=`) and say which tool names exist.
- Parsers (`--generate-tool-call-parser`): `qwen25` (alias `json`) reads every
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block, the format of Qwen2.5 and Hermes.
  `arguments` may also be a JSON string. A block that is not such JSON is still a call: its answer
  tells the model what was wrong, as an unknown tool name's does.
- The executor (`--generate-execute-tool-function-path`): `async fn(name, arguments) -> str`, called
  once per call, bounded by `--generate-tool-timeout`. If it raises or hangs, `ToolError`: the sample
  fails with the error recorded (the rollout goes on).
- The tool turn's tokens (`ToolKit.turn_ids`): the chat template renders a dummy conversation up to
  an assistant turn with tool calls, then the same plus the tool messages and the generation prompt;
  the text the second adds is tokenized and appended. The model's own tokens are never re-tokenized.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Awaitable

from miles.config import ConfigError

ToolExecutor = Callable[[str, dict[str, Any]], Awaitable[str]]

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_DUMMY_USER = {"role": "user", "content": "x"}


class ToolError(RuntimeError):
    """A tool call raised or ran past --generate-tool-timeout: its sample fails."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str | None = None        # why the block could not be read (the model is told)


def parse_tool_call_tags(text: str) -> list[ToolCall]:
    """Every `<tool_call>{json}</tool_call>` block of `text`, in order."""
    calls = []
    for block in _TOOL_CALL.findall(text):
        try:
            obj = json.loads(block)
            name, args = obj["name"], obj.get("arguments", {})
            args = json.loads(args) if isinstance(args, str) else args
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be a string and arguments an object")
            calls.append(ToolCall(name, args))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            calls.append(ToolCall("", {}, f"could not read the tool call {block.strip()[:80]!r}: {exc}"))
    return calls


TOOL_CALL_PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {
    "qwen25": parse_tool_call_tags,
    "json": parse_tool_call_tags,
}


def load_tool_specs(path: str) -> list[dict[str, Any]]:
    """The OpenAI-style tool specs at `path` (a .json file or module:attr), checked."""
    if path.endswith(".json"):
        try:
            specs = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--generate-tool-specs-path {path}: cannot read it as JSON ({exc})") from exc
    else:
        from miles.user_code import import_user_function

        holder = import_user_function(path, "--generate-tool-specs-path") if ":" in path else None
        specs = holder() if callable(holder) else holder
    problems = _spec_problems(specs)
    if problems:
        raise ConfigError(f"--generate-tool-specs-path {path}: {problems}; expected a list of "
                          '{"type": "function", "function": {"name": ..., "parameters": {...}}}')
    return specs


def _spec_problems(specs: Any) -> str | None:
    if not isinstance(specs, list) or not specs:
        return f"not a non-empty list (a {type(specs).__name__})"
    for i, spec in enumerate(specs):
        fn = spec.get("function") if isinstance(spec, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return f"entry {i} has no function.name"
    return None


class ToolKit:
    """The tools of a multi-turn run: parse calls, run them, render the tool turn's tokens."""

    def __init__(self, *, execute: ToolExecutor, parser: str = "qwen25", specs: list[dict[str, Any]] | None = None,
                 timeout_s: float = 60.0):
        if parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"--generate-tool-call-parser {parser}: use one of {', '.join(TOOL_CALL_PARSERS)}")
        self.specs, self.timeout_s, self._execute = specs, timeout_s, execute
        self._parse = TOOL_CALL_PARSERS[parser]
        self._names = {s["function"]["name"] for s in specs} if specs else None

    def parse(self, text: str) -> list[ToolCall]:
        return self._parse(text)

    async def run(self, call: ToolCall) -> dict[str, Any]:
        """The tool message answering `call`. The model's mistakes (an unreadable call, an unknown
        tool) are answered with an error message; the executor raising or hanging is a ToolError."""
        if call.error is not None:
            return _tool_message(call.name or "unknown", f"error: {call.error}")
        if self._names is not None and call.name not in self._names:
            return _tool_message(call.name, f"error: unknown tool {call.name!r}; the tools are {sorted(self._names)}")
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await self._execute(call.name, dict(call.arguments))
        except TimeoutError as exc:
            raise ToolError(f"tool {call.name}({_args(call)}) did not answer within --generate-tool-timeout "
                            f"{self.timeout_s:g}s") from exc
        except Exception as exc:  # noqa: BLE001 - the user's tool failed: its sample fails, with the error
            raise ToolError(f"tool {call.name}({_args(call)}) raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(result, str):
            raise ToolError(f"tool {call.name}({_args(call)}) returned {type(result).__name__}; the tool executor "
                            "must return the tool's answer as a string")
        return _tool_message(call.name, result)

    def turn_ids(self, tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
        """The ids of the tool turn (`messages`) plus the next assistant turn's generation prompt."""
        calls = [{"type": "function", "function": {"name": m["name"], "arguments": {}}} for m in messages]
        before = [_DUMMY_USER, {"role": "assistant", "content": "", "tool_calls": calls}]
        extra = {"tools": self.specs} if self.specs else {}
        text_before = tokenizer.apply_chat_template(before, tokenize=False, add_generation_prompt=False, **extra)
        text_after = tokenizer.apply_chat_template(before + messages, tokenize=False, add_generation_prompt=True,
                                                   **extra)
        if not text_after.startswith(text_before):
            raise ToolError("the chat template renders the conversation before the tool turn differently once "
                            "the tool turn is added, so the tool turn cannot be appended to the model's tokens; "
                            f"before: {text_before[-80:]!r}, after: {text_after[:len(text_before)][-80:]!r}")
        return list(tokenizer(text_after[len(text_before):], add_special_tokens=False)["input_ids"])


def _tool_message(name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "name": name, "content": content}


def _args(call: ToolCall) -> str:
    text = json.dumps(call.arguments)
    return text if len(text) <= 80 else text[:77] + "..."


def load_tool_kit(execute_path: str, *, specs_path: str | None, parser: str, timeout_s: float) -> ToolKit:
    """The run's ToolKit from its flags; every problem a ConfigError naming the flag."""
    from miles.user_code import import_async_function

    execute = import_async_function(execute_path, "--generate-execute-tool-function-path", 2,
                          "async fn(name, arguments) -> str")
    specs = load_tool_specs(specs_path) if specs_path else None
    return ToolKit(execute=execute, parser=parser, specs=specs, timeout_s=timeout_s)
