"""A grading process: is an answer mathematically equal to its label? (math-verify, one per line).

`python -m miles.rollout.math_verify_worker SECONDS` reads JSON lines `{"gold": ..., "answer": ...}`
on stdin and writes one JSON line per request, `{"equal": true | false | null}` (null: past SECONDS,
the per-answer limit), until stdin closes (as it does when the run that started it dies). The limit
is a SIGALRM timer around the whole answer (parsing both sides and comparing); math-verify's own
timers are off, so there is one clock. An expression stuck in C code that a signal cannot interrupt
(a huge integer power) is the parent's to kill (`miles.rollout.math_grading`).

Imports only the standard library and math-verify, not miles, so that it starts fast.
"""

from __future__ import annotations

import json
import logging
import signal
import sys


class _Late(BaseException):
    """The answer ran past its limit (a BaseException: math-verify's `except Exception` lets it by)."""


def _on_alarm(signum: int, frame: object) -> None:
    raise _Late()


def _delimited(text: str) -> str:
    """`text` as inline LaTeX, which math-verify's LaTeX extraction reads whole."""
    return "$" + text.strip().strip("$").strip() + "$"


def equivalent(gold: str, answer: str) -> bool:
    from math_verify import parse, verify

    parsed_gold = parse(_delimited(gold), parsing_timeout=None)  # type: ignore[arg-type]
    parsed_answer = parse(_delimited(answer), parsing_timeout=None)  # type: ignore[arg-type]
    if not parsed_gold or not parsed_answer:
        return False
    return bool(verify(parsed_gold, parsed_answer, timeout_seconds=None))


def serve(limit_s: float, stdin=sys.stdin, stdout=sys.stdout) -> None:
    signal.signal(signal.SIGALRM, _on_alarm)
    for line in stdin:
        request = json.loads(line)
        verdict: bool | None
        try:
            signal.setitimer(signal.ITIMER_REAL, limit_s)
            try:
                verdict = equivalent(str(request["gold"]), str(request["answer"]))
            except Exception:
                verdict = False      # an expression math-verify cannot read is not an equal one
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Late:
            verdict = None
        stdout.write(json.dumps({"equal": verdict}) + "\n")
        stdout.flush()


def main() -> None:
    # math-verify warns on every timer it does not set and every expression it cannot parse
    logging.disable(logging.WARNING)
    import math_verify  # noqa: F401  (imported before the first request, which then costs only its grading)

    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    serve(float(sys.argv[1]))


if __name__ == "__main__":
    main()
