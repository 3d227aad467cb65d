"""Math and multiple-choice rewards: answer extraction, and equivalence by a real verifier.

Equivalence of an answer and its label is decided in two steps. A cheap check runs inline: both
plain numbers (`-1,234.5`, `3/4`, `\\frac{3}{4}`, `x = 5`) are compared numerically (relative
tolerance 1e-6), and strings equal once spaces, `$` and LaTeX spacing are dropped are equal. The
rest goes to math-verify (SymPy and latex2sympy: `\\dfrac{\\pi}{4}` = `\\frac{\\pi}{4}`, `\\sqrt{8}` =
`2\\sqrt{2}`, `x^2+1` = `1+x^2`, `0.5` = `\\frac12`, `50\\%` = `50`, intervals, sets, units in
`\\text{}`), run in worker processes (`VerifierPool`, `miles.rollout.math_verify_worker`) so that
the CPU work of grading thousands of answers does not hold the rollout's event loop, with a limit
per answer (`ANSWER_TIME_LIMIT_S`): an answer past it scores as wrong, and a worker that does not
come back from it is killed and replaced.

The extraction and scoring rules per --rm-type are miles' (radixark/miles `miles/rollout/rm_hub`);
see `miles.rollout.rewards` for the list.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import math
import os
import queue
import re
import select
import string
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MATH_REL_TOL = 1e-6
ANSWER_TIME_LIMIT_S = 3.0       # per answer: parsing both sides and comparing them
KILL_GRACE_S = 2.0              # past the limit, a worker that has not answered is killed
START_TIMEOUT_S = 120.0         # a worker's start: Python, SymPy and math-verify imported
MAX_PROCESSES = 8
VERIFIER_PACKAGE = "math-verify"


class VerifierUnavailable(RuntimeError):
    """math-verify cannot be started (not installed, or its process fails to start). The run's setup
    checks the package before anything starts; this is the same fault met later (exit 2)."""

    input_fault = True


# ---- extraction ---------------------------------------------------------------------------------

_NUM = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
# A sign counts only when it does not follow an operand ("3-5" is not -5); a number does not
# start inside a word or another number ("x2", "v1.2").
_NUMBER_IN_TEXT = re.compile(rf"(?:(?<![\w)\]}}])(?P<sign>-))?(?<![\w.])(?P<num>{_NUM})(?:\s*/\s*(?P<den>{_NUM}))?")
_NUMBER_ONLY = re.compile(rf"(?P<sign>-)?(?P<num>{_NUM})(?:/(?P<den>{_NUM}))?")
_FRAC = re.compile(r"(?P<sign>-)?\\[dt]?frac\{(?P<num>[^{}]+)\}\{(?P<den>[^{}]+)\}")
_TEXT_WRAPPER = re.compile(r"\\(?:text|mathrm|textbf|mathbf)\{([^{}]*)\}")
_LATEX_NOISE = ("$", "\\!", "\\,", "\\;", "\\ ", "\\left", "\\right", "\\%", "%", "^\\circ", "^{\\circ}")


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` / `\\fbox{...}` (braces balanced) or `\\boxed x`, else None."""
    for command in ("\\boxed", "\\fbox"):
        start = text.rfind(command)
        while start != -1:
            rest = text[start + len(command):]
            if rest.startswith("{"):
                depth = 0
                for i, ch in enumerate(rest):
                    depth += (ch == "{") - (ch == "}")
                    if depth == 0:
                        return rest[1:i]
            elif rest[:1] == " " and rest.strip():
                return rest.split()[0].rstrip(".$")
            start = text.rfind(command, 0, start)  # unclosed (a truncated response): try an earlier one
    return None


def extract_answer(response: str) -> str | None:
    """The final answer of a response: the last box's content, else the last number in the text."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    matches = list(_NUMBER_IN_TEXT.finditer(response))
    return matches[-1].group(0) if matches else None


def parse_number(text: str) -> float | None:
    """`text` as a number when it is one (`-1,234.5`, `3/4`, `\\frac{3}{4}`, `x = 5`), else None."""
    s = normalize(text)
    if "=" in s:
        s = s.rsplit("=", 1)[1]
    s = s.removeprefix("+").rstrip(".")
    match = _FRAC.fullmatch(s) or _NUMBER_ONLY.fullmatch(s)
    return _match_value(match) if match else None


def _match_value(match: re.Match[str]) -> float | None:
    num = _plain_number(match["num"])
    den = _plain_number(match["den"]) if match["den"] is not None else 1.0
    if num is None or den is None or den == 0:
        return None
    return (-num if match["sign"] else num) / den


def _plain_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def normalize(text: str) -> str:
    s = _TEXT_WRAPPER.sub(r"\1", text)
    for noise in _LATEX_NOISE:
        s = s.replace(noise, "")
    return "".join(s.split())


def unboxed_label(label: str) -> str:
    """A label given as `\\boxed{...}` (or a worked solution ending in one) is its box's content."""
    return (last_boxed(label) if "\\boxed" in label or "\\fbox" in label else None) or label


# ---- equivalence --------------------------------------------------------------------------------

def quick_verdict(answer: str, gold: str) -> bool | None:
    """Equal or not when a cheap check can tell (plain numbers; the same normalized string), else None."""
    if normalize(answer) == normalize(gold):
        return True
    if "%" not in answer and "%" not in gold:    # 50% = 0.5 is the verifier's to judge
        got, want = parse_number(answer), parse_number(gold)
        if got is not None and want is not None:
            return math.isclose(got, want, rel_tol=MATH_REL_TOL, abs_tol=1e-9)
    return None


async def equivalent(answer: str, gold: str) -> bool:
    """Is `answer` mathematically equal to `gold`? Past the per-answer limit: no."""
    verdict = quick_verdict(answer, gold)
    if verdict is not None:
        return verdict
    return await verifier_pool().equivalent(gold, answer) is True


# ---- the worker processes -----------------------------------------------------------------------

def _worker_command(limit_s: float) -> list[str]:
    return [sys.executable, "-m", "miles.rollout.math_verify_worker", str(limit_s)]


class _Worker:
    """One grading process and the bytes it has written that are not yet a whole line."""

    def __init__(self, command: list[str]) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])       # where `miles` is, for `-m`
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     stderr=subprocess.DEVNULL, bufsize=0, start_new_session=True)
        self._pending = b""

    def send(self, request: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def read_line(self, timeout_s: float) -> dict[str, Any] | None:
        """The next JSON line, or None when none comes within `timeout_s` (or the process ended)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class VerifierPool:
    """Up to `processes` math-verify processes, started as the load needs them; each call waits for a
    free one in a thread of its own (`processes` threads), so the event loop never blocks.

    A process that does not answer within `limit_s` + KILL_GRACE_S is killed and replaced: its
    answer scores as wrong (`timeouts` counts them). `close()` ends them all; so does the run's exit
    (atexit), and a process whose parent died ends when its stdin closes."""

    def __init__(self, processes: int | None = None, limit_s: float = ANSWER_TIME_LIMIT_S,
                 command: list[str] | None = None) -> None:
        self.processes = processes or max(1, min(MAX_PROCESSES, (os.cpu_count() or 2) // 2))
        self.limit_s = limit_s
        self.command = command or _worker_command(limit_s)
        self.timeouts = 0
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()
        self._threads: ThreadPoolExecutor | None = None
        self._closed = False

    async def equivalent(self, gold: str, answer: str) -> bool | None:
        """True or False; None past the limit."""
        with self._lock:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(self.processes, thread_name_prefix="miles-math-verify")
            threads = self._threads
        return await asyncio.get_running_loop().run_in_executor(threads, self.equivalent_blocking, gold, answer)

    def equivalent_blocking(self, gold: str, answer: str) -> bool | None:
        worker = self._take()
        try:
            worker.send({"gold": gold, "answer": answer})
            reply = worker.read_line(self.limit_s + KILL_GRACE_S)
        except OSError:
            reply = None
        if reply is None or reply.get("equal") is None:
            with self._lock:
                self.timeouts += 1
            if reply is None:             # stuck (or dead): never reused
                self._drop(worker)
                return None
        self._idle.put(worker)
        return reply.get("equal")

    def _take(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._closed:
                raise VerifierUnavailable("the math-verify pool is closed")
            if len(self._workers) < self.processes:
                worker = self._start()
                self._workers.add(worker)
                return worker
        return self._idle.get()

    def _start(self) -> _Worker:
        try:
            worker = _Worker(self.command)
        except OSError as e:
            raise VerifierUnavailable(f"could not start the math-verify process {self.command}: {e}") from e
        ready = worker.read_line(START_TIMEOUT_S)
        if not ready or not ready.get("ready"):
            worker.kill()
            raise VerifierUnavailable(
                f"the math-verify process did not start (exit code {worker.proc.returncode}); is the package "
                f"installed in this environment ({sys.executable})? pip install {VERIFIER_PACKAGE}")
        return worker

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._workers.discard(worker)

    @property
    def started(self) -> int:
        return len(self._workers)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._workers = list(self._workers), set()
            threads, self._threads = self._threads, None
        for worker in workers:
            worker.kill()
        if threads is not None:
            threads.shutdown(wait=False, cancel_futures=True)


_POOL: VerifierPool | None = None
_POOL_LOCK = threading.Lock()


def verifier_pool() -> VerifierPool:
    """This process's pool, started on the first answer the cheap check cannot settle."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = VerifierPool()
            atexit.register(_POOL.close)
        return _POOL


# ---- the rules of each reward type --------------------------------------------------------------

async def math_score(response: str, label: str) -> float:
    """`math`: the last box's content, else the last number, equal to the label: 1.0, else 0.0."""
    answer = extract_answer(response)
    return float(answer is not None and await equivalent(answer, unboxed_label(label)))


async def boxed_math_score(response: str, label: str) -> float:
    """`boxed_math`: the last box's content (the whole of it) equal to the label: 1.0, else 0.0."""
    answer = last_boxed(response)
    return float(answer is not None and await equivalent(answer, unboxed_label(label)))


async def _boxed_solution_score(solution: str, label: str) -> float:
    answer = last_boxed(solution)
    if answer is None or label.strip() == "":
        return 0.0
    return float(await equivalent(answer, unboxed_label(label)))


async def deepscaler_score(response: str, label: str) -> float:
    """`deepscaler` (DeepScaleR's rule): only the text after the reasoning is graded (after the last
    `</think>`, or after `###Response`; a response with neither scores 0.0), and its last box must
    equal the label: 1.0, else 0.0."""
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    return await _boxed_solution_score(solution, label)


async def gemma_math_score(response: str, label: str) -> float:
    """`gemma_math`: the text after Gemma 4's last `<channel|>` (the end of its thinking; all of it when
    there is none) must have a last box equal to the label: 1.0, else 0.0."""
    return await _boxed_solution_score(response.rsplit("<channel|>", 1)[-1], label)


DAPO_TAIL_CHARS = 300
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_DROP = ("\\ldots", "\\dots", "\\text{s}", "\\text{.}", "\\text{}^2", "\\text{}^3", "\\text{}", r"\mathrm{th}",
              r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "<|im_end|>", "<|endoftext|>")
_DAPO_UNITS = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "points", "feet",
               "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
               "multiples")


def dapo_normalize(text: str) -> str:
    """DAPO's (Minerva's) normalization of a final answer: the part after the last `=`, without
    spaces, `$`, units, `\\text{}` and `\\boxed{}` wrappers; `1,000` -> `1000`."""
    s = str(text).split("=")[-1].replace("\\$", "").replace("\\ ", "").replace(" ", "")
    s = s.replace("mbox", "text").replace(",\\text{and}", ",").replace("\\text{and}", ",")
    for junk in (*_DAPO_DROP, *_DAPO_UNITS):
        s = s.replace(junk, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", s)
    for command in ("text", "textbf", "overline"):
        s = re.sub(rf"(\\{command}\{{)(.*?)(\}})", r"\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", s)
    s = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", s)
    s = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def dapo_answer(response: str) -> str | None:
    """DAPO's extraction: the last `Answer: ...` line in the response's last 300 characters."""
    found = _DAPO_ANSWER.findall(response[-DAPO_TAIL_CHARS:])
    return found[-1] if found else None


async def dapo_score(response: str, label: str) -> float:
    """`dapo` (DAPO's rule): +1.0 when the last `Answer: X` line of the response's last 300 characters
    equals the label, else -1.0 (no such line included). Equal: the same after DAPO's normalization,
    or equivalent by the verifier. (miles returns {"score", "acc", "pred"}; `--reward-key score` takes
    this number as it is.)"""
    answer = dapo_answer(response)
    if answer is None:
        return -1.0
    got, want = dapo_normalize(answer), dapo_normalize(unboxed_label(label))
    number = parse_number(want)
    if number is not None and number == int(number):
        want = str(int(number))            # DAPO's labels are integers: "34.0" is 34
    if got == want:
        return 1.0
    return 1.0 if got and await equivalent(got, want) else -1.0


GPQA_LETTERS = tuple(string.ascii_uppercase[:8])
_GPQA_PATTERNS = (re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*\(?([A-Z])\b", re.IGNORECASE),
                  re.compile(r"\b([A-Z])\)?\s*(?:is\s*(?:the)?\s*correct)", re.IGNORECASE),
                  re.compile(r"final\s*(?:answer|option)\s*(?:is|:)?\s*\(?([A-Z])\b", re.IGNORECASE))


def _plain_words(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def gpqa_letter(response: str, letters: Iterable[str] = GPQA_LETTERS) -> str | None:
    """The option letter a response chooses (after its `</think>`): "answer is X", "X is correct",
    "final answer: X", else the last standalone capital letter that is an option; None if none."""
    text = response.rsplit("</think>", 1)[-1]
    valid = {letter.upper() for letter in letters}
    for pattern in _GPQA_PATTERNS:
        match = pattern.search(text)
        if match and match.group(1).upper() in valid:
            return match.group(1).upper()
    for letter in reversed(re.findall(r"\b([A-Z])\b", text)):
        if letter in valid:
            return letter
    return None


def gpqa_score(response: str, label: str | None, metadata: dict[str, Any]) -> float:
    """`gpqa`: the chosen option letter against the correct one: 1.0 or 0.0. The options are
    metadata["valid_letters"], else A.. for metadata["choices"], else A-H; the correct letter is
    metadata["correct_letter"], else the label when it is a letter (or an option's index), else the
    letter of the choice whose text is the label. A response naming no letter passes when it contains
    the correct choice's text."""
    choices = metadata.get("choices")
    choices = list(choices.values()) if isinstance(choices, dict) else list(choices) if choices else []
    letters = ([str(x).upper() for x in metadata["valid_letters"]] if metadata.get("valid_letters") else
               list(string.ascii_uppercase[:len(choices)]) if choices else list(GPQA_LETTERS))
    correct = str(metadata.get("correct_letter") or "").strip().upper() or None
    text = (label or "").strip()
    if correct is None and text.upper() in letters:
        correct = text.upper()
    if correct is None and text.isdigit() and int(text) < len(letters):
        correct = letters[int(text)]
    if correct is None and text and choices:
        matches = [i for i, c in enumerate(choices) if _plain_words(str(c)) == _plain_words(text)]
        correct = letters[matches[0]] if matches else None
    chosen = gpqa_letter(response, letters)
    if chosen is not None and correct is not None:
        return float(chosen == correct)
    targets = [str(choices[letters.index(correct)])] if correct in letters and letters.index(correct) < len(choices) \
        else []
    targets += [str(metadata[k]) for k in ("correct_answer", "answer_text") if metadata.get(k)]
    targets += [text] if text else []
    said = _plain_words(response.rsplit("</think>", 1)[-1])
    return float(any(t and t in said for t in map(_plain_words, targets)))
