"""Math and multiple-choice rewards graded by a verifier (miles.rollout.math_grading).

Pairs of the kinds DAPO-Math-17k, DeepScaleR, MATH and AIME hold (LaTeX fractions, roots, pi,
intervals, percentages, units, multiple-choice letters), a malformed and a hung expression, and the
verifier pool's limits. The pairs in OLD_MATCHER_GOT_WRONG are those the hand-written matcher that
graded --rm-type math before math-verify scored as wrong (issue 56): a policy writing them was
trained as if it were wrong.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from miles.rollout import math_grading
from miles.rollout.math_grading import VerifierPool, VerifierUnavailable
from miles.rollout.rewards import RM_TYPES, builtin_reward
from miles.types import Prompt

P = Prompt(index=0, text="q", prompt_ids=(1,))


@pytest.fixture(autouse=True, scope="module")
def _close_the_pool():
    yield
    if math_grading._POOL is not None:
        pids = math_grading._POOL.pids()
        math_grading._POOL.close()
        math_grading._POOL = None
        assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def reward(rm_type: str, response: str, label: str | None, prompt: Prompt = P) -> float:
    result = builtin_reward(rm_type)(prompt, response, label)
    return asyncio.run(result) if asyncio.iscoroutine(result) else result


# (answer, label): equal answers the old matcher scored 0.0
OLD_MATCHER_GOT_WRONG = [
    ("\\frac{\\pi}{4}", "\\dfrac{\\pi}{4}"),
    ("\\pi/2", "\\frac{\\pi}{2}"),
    ("\\sqrt{8}", "2\\sqrt{2}"),
    ("x^2+1", "1+x^2"),
    ("0.5", "\\frac12"),
    ("\\text{(B)}", "B"),
    ("10\\text{ cm}", "10"),                   # a unit in \text{}
    ("\\$20", "20"),                           # a dollar sign
    ("\\{1,2\\}", "\\{2,1\\}"),                # a set in another order
    ("2\\pi", "\\pi\\cdot 2"),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"),
    ("3\\sqrt{2}", "\\sqrt{18}"),
]
EQUAL = [
    ("50\\%", "50"), ("\\frac{3}{4}", "0.75"), ("(1,2]", "(1, 2]"), ("(-\\infty, 3)", "(-\\infty,3)"),
    ("90^\\circ", "90"), ("1/3", "\\frac{1}{3}"), ("x=5", "5"), ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("5", "\\boxed{5}"), ("1,000", "1000"), ("[2, 5)", "[2,5)"), ("\\frac{1}{2}\\pi", "\\frac{\\pi}{2}"),
]
NOT_EQUAL = [
    ("(1,2]", "[1,2]"),                        # an interval's ends matter
    ("3", "4"), ("\\frac{\\pi}{3}", "\\frac{\\pi}{4}"), ("0.333", "1/3"), ("2\\sqrt{3}", "\\sqrt{6}"),
    ("\\frac{1}{3", "\\frac13"),               # malformed: a brace never closed
    ("B", "C"),
]


@pytest.mark.parametrize("answer, label", OLD_MATCHER_GOT_WRONG + EQUAL)
def test_math_grades_equivalent_answers_right(answer, label):
    assert reward("math", f"so the answer is \\boxed{{{answer}}}.", label) == 1.0


@pytest.mark.parametrize("answer, label", NOT_EQUAL)
def test_math_grades_different_answers_wrong(answer, label):
    assert reward("math", f"\\boxed{{{answer}}}", label) == 0.0


def test_math_keeps_the_last_number_rule_and_boxed_math_needs_a_box():
    assert reward("math", "2 + 2 = 4", "4") == 1.0            # no box: the last number (the demo's answers)
    assert reward("math", "I don't know", "4") == 0.0
    assert reward("boxed_math", "2 + 2 = 4", "4") == 0.0      # no box: wrong
    assert reward("boxed_math", "\\boxed{\\frac{\\pi}{4}}", "\\dfrac{\\pi}{4}") == 1.0   # the whole box, not its last number
    assert reward("boxed_math", "\\boxed{x + 1}", "x+1") == 1.0


def test_deepscaler_grades_the_box_after_the_reasoning_only():
    think = "<think>maybe \\boxed{3}</think>"
    assert reward("deepscaler", think + " The answer is $\\boxed{\\dfrac{\\pi}{4}}$.", "\\frac{\\pi}{4}") == 1.0
    assert reward("deepscaler", think + " The answer is 4.", "4") == 0.0                  # no box after it
    assert reward("deepscaler", "no reasoning tags \\boxed{4}", "4") == 0.0             # no </think>: 0
    assert reward("deepscaler", "###Response so \\boxed{4}", "4") == 1.0
    assert reward("deepscaler", think + "\\boxed{4}", "\\boxed{4}") == 1.0              # a boxed label
    assert reward("deepscaler", think + "\\boxed{3}", "4") == 0.0
    assert reward("deepscaler", think + "\\boxed{3}", "") == 0.0                        # an empty label


def test_gemma_math_grades_after_the_last_channel_marker():
    assert reward("gemma_math", "<|channel>thought \\boxed{1}<channel|>So \\boxed{2\\sqrt{2}}", "\\sqrt{8}") == 1.0
    assert reward("gemma_math", "<|channel>thought \\boxed{8}<channel|>I am not sure", "8") == 0.0
    assert reward("gemma_math", "no thinking \\boxed{8}", "8") == 1.0


def test_dapo_scores_plus_or_minus_one_on_the_answer_line():
    assert reward("dapo", "work...\nAnswer: 34", "34") == 1.0
    assert reward("dapo", "Answer: $34$ dollars", "34.0") == 1.0          # DAPO's normalization; integer label
    assert reward("dapo", "Answer: 1,000", "1000") == 1.0
    assert reward("dapo", "Answer: 35", "34") == -1.0
    assert reward("dapo", "the answer is \\boxed{34}", "34") == -1.0       # no "Answer:" line
    assert reward("dapo", "Answer: 34\n" + "x" * 400, "34") == -1.0       # outside the last 300 characters
    assert reward("dapo", "Answer: \\frac{1}{2}", "0.5") == 1.0            # the verifier: equal


def test_gpqa_reads_the_chosen_letter():
    assert reward("gpqa", "<think>A looks wrong</think>The answer is (C).", "C") == 1.0
    assert reward("gpqa", "Final answer: B", "C") == 0.0
    assert reward("gpqa", "I pick D", "D") == 1.0                           # the last standalone letter
    choices = Prompt(index=1, text="q", prompt_ids=(1,), metadata={"choices": ["red", "green", "blue"]})
    assert reward("gpqa", "The answer is B", "green", choices) == 1.0       # the label is a choice's text
    assert reward("gpqa", "The answer is D", "green", choices) == 0.0       # D is no option: nothing chosen
    by_letter = Prompt(index=2, text="q", prompt_ids=(1,), metadata={"correct_letter": "A"})
    assert reward("gpqa", "Answer: A", None, by_letter) == 1.0


def test_the_new_types_are_rm_types_and_ifbench_is_refused_naming_the_way():
    assert {"deepscaler", "dapo", "gemma_math", "gpqa"} <= set(RM_TYPES)
    from miles.config.miles_flags import rm_type_problem
    line = rm_type_problem("ifbench", RM_TYPES)
    assert "IFBench" in line and "--custom-rm-path" in line


# ---- the pool ------------------------------------------------------------------------------------

def test_a_hung_expression_scores_wrong_within_the_limit_and_the_worker_is_reused():
    pool = VerifierPool(processes=1, limit_s=1.0)
    try:
        start = time.monotonic()
        assert asyncio.run(pool.equivalent("5", "9^{9^{9^{9}}}")) is None      # past the limit
        assert time.monotonic() - start < 1.0 + math_grading.KILL_GRACE_S + 2
        assert pool.timeouts == 1
        assert asyncio.run(pool.equivalent("\\frac{\\pi}{2}", "\\pi/2")) is True   # the same worker, still good
        assert pool.started == 1
    finally:
        pool.close()


STUCK_WORKER = [sys.executable, "-c", "import sys, time; print('{\"ready\": true}', flush=True); sys.stdin.readline(); "
                                      "time.sleep(600)"]


def test_a_worker_that_never_answers_is_killed_and_replaced():
    pool = VerifierPool(processes=1, limit_s=0.5, command=STUCK_WORKER)
    try:
        first = asyncio.run(pool.equivalent("1", "2"))
        assert first is None and pool.timeouts == 1 and pool.started == 0      # killed, not kept
        pool.command = math_grading._worker_command(1.0)
        assert asyncio.run(pool.equivalent("1", "1.0")) is True                # a fresh one takes over
    finally:
        pool.close()


def test_a_verifier_that_cannot_start_says_what_to_install():
    pool = VerifierPool(processes=1, command=[sys.executable, "-c", "import sys; sys.exit(1)"])
    with pytest.raises(VerifierUnavailable, match="pip install math-verify"):
        asyncio.run(pool.equivalent("1", "2"))
    pool.close()


def test_grading_runs_off_the_event_loop():
    """While a worker grinds on a hung expression, the loop keeps running other tasks."""
    pool = VerifierPool(processes=2, limit_s=1.0)

    async def main() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        await asyncio.gather(pool.equivalent("5", "9^{9^{9^{9}}}"), pool.equivalent("1", "(x+1)^{100000}"))
        task.cancel()
        return ticks

    try:
        assert asyncio.run(main()) >= 20         # ~100 would tick in the second the graders take
    finally:
        pids = pool.pids()
        pool.close()
    assert pids and not any(_alive(pid) for pid in pids)


def test_a_missing_verifier_stops_the_run_before_it_starts(monkeypatch):
    """The registered check (run by validate before Ray starts) names the package to install."""
    import importlib.util
    from types import SimpleNamespace

    from miles.config.checks import CHECKS

    check = CHECKS["miles.rollout.rewards:_verifier_installed"]

    def problems(rm_type: str, custom: str | None = None) -> list[str]:
        cfg = SimpleNamespace(rollout=SimpleNamespace(rm_type=rm_type, custom_rm_path=custom),
                              eval=SimpleNamespace(datasets=()))
        found: list[str] = []
        check(cfg, found)
        return found

    assert problems("deepscaler") == []
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    assert problems("deepscaler") == ["--rm-type deepscaler needs the 'math-verify' package (module 'math_verify'), "
                                      f"which is not installed in this Python ({sys.prefix}): pip install math-verify "
                                      "(its grader)"]
    assert problems("f1") == [] and problems("math", custom="m:f") == []
