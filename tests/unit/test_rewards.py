"""Reward functions: math answer extraction and comparison, loading, and group scoring."""

from __future__ import annotations

import asyncio
import pickle
import sys
import textwrap
import threading
import time

import pytest

from miles.config import ConfigError
from miles.rollout.rewards import (
    RewardError, exact_match_reward, extract_answer, group_reward, load_reward_fn, math_reward,
    parse_number, score_group,
)
from miles.types import Prompt

PROMPT = Prompt(index=17, text="q", prompt_ids=(1,))


@pytest.mark.parametrize("response, answer", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} first, then \\boxed{2}", "2"),                     # the last box wins
    ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),                      # nested braces
    ("\\boxed{7} and then it got cut off \\boxed{8", "7"),          # unclosed box: the earlier one
    ("3 + 4 = 7, so 7 apples", "7"),
    ("it drops to -5 degrees", "-5"),
    ("10-3 = 7 ... 3-5", "5"),                                      # a minus between operands is no sign
    ("total: 1,234,567 units", "1,234,567"),
    ("pi is about 3.14.", "3.14"),
    ("three quarters, 3/4", "3/4"),
    ("no digits here", None),
])
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


@pytest.mark.parametrize("text, value", [
    ("42", 42.0), ("-7", -7.0), ("1,234", 1234.0), ("0.5", 0.5), ("3/4", 0.75),
    ("\\frac{3}{4}", 0.75), ("-\\dfrac{1}{8}", -0.125), ("$18$", 18.0), ("x = 5", 5.0),
    ("12\\%", 12.0), ("1/0", None), ("x+1", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("response, label, reward", [
    ("the answer is \\boxed{4}", "4", 1.0),
    ("the answer is \\boxed{5}", "4", 0.0),
    ("half: \\boxed{\\frac{1}{2}}", "0.5", 1.0),          # 1/2 == 0.5 numerically
    ("we get 1,000 in the end", "1000", 1.0),
    ("so 3/4", "\\boxed{0.75}", 1.0),                     # a boxed label is unboxed
    ("100001", "100000", 0.0),                            # |diff| 1 > 1e-6 * 100000 = 0.1
    ("0.3333333", "1/3", 1.0),                            # |diff| 3.3e-8 <= 1e-6 * 1/3 = 3.3e-7
    ("0.333", "1/3", 0.0),                                # |diff| 3.3e-4 > 3.3e-7
    ("\\boxed{x + 1}", "x+1", 1.0),                       # non-numeric: compared without spaces
    ("I don't know", "4", 0.0),
])
def test_math_reward(response, label, reward):
    assert asyncio.run(math_reward(PROMPT, response, label)) == reward


def test_math_reward_without_a_label_explains_the_fix():
    with pytest.raises(ValueError, match="needs a label.*--label-key"):
        asyncio.run(math_reward(PROMPT, "\\boxed{1}", None))


def test_exact_match_strips_whitespace():
    assert exact_match_reward(PROMPT, "  Paris\n", "Paris") == 1.0
    assert exact_match_reward(PROMPT, "paris", "Paris") == 0.0


# ---- loading ------------------------------------------------------------------------------------

@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(textwrap.dedent("""
        def length(prompt, response, label):
            return float(len(response))
        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_mod"
    sys.modules.pop("my_rewards_mod", None)


def test_builtin_reward_is_chosen_by_name():
    assert load_reward_fn("math", None) is math_reward
    assert load_reward_fn("exact_match", None) is exact_match_reward


def test_unknown_rm_type_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"--rm-type 'maths'.*'dapo', 'deepscaler', 'deterministic_random', 'exact_match', 'f1', 'gemma_math', 'gpqa', 'math'"):
        load_reward_fn("maths", None)


@pytest.mark.parametrize("sep", [":", "."])
def test_custom_rm_path_imports_the_function(custom_module, sep):
    fn = load_reward_fn("math", f"{custom_module}{sep}length")  # the custom path wins over rm_type
    assert fn(PROMPT, "abc", None) == 3.0


@pytest.mark.parametrize("path, match", [
    ("no_such_module_xyz:f", r"'no_such_module_xyz:f': cannot import module.*ModuleNotFoundError"),
    ("my_rewards_mod:missing", r"'my_rewards_mod:missing': .*has no 'missing' \(AttributeError"),
    ("my_rewards_mod:NOT_CALLABLE", r"is not callable \(a int\)"),
    ("justaname", r"must look like module:function"),
])
def test_custom_rm_path_failures_name_the_path_and_cause(custom_module, path, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_reward_fn("math", path)
    if "missing" in path or "no_such" in path:
        assert isinstance(info.value.__cause__, (ImportError, AttributeError))


# ---- scoring a group ----------------------------------------------------------------------------

def test_sync_reward_scores_each_response():
    scores = asyncio.run(score_group(math_reward, PROMPT, ["\\boxed{4}", "5", "4"], "4"))
    assert scores == [1.0, 0.0, 1.0]


def test_async_rewards_run_concurrently():
    n = 4
    started = 0
    all_started = asyncio.Event()

    async def judge(prompt, response, label):
        nonlocal started
        started += 1
        if started == n:
            all_started.set()
        await all_started.wait()  # only returns if every call is in flight at once
        return float(response == label)

    async def main():
        return await asyncio.wait_for(score_group(judge, PROMPT, ["a", "b", "a", "c"], "a"), timeout=2)

    assert asyncio.run(main()) == [1.0, 0.0, 1.0, 0.0]


def test_group_reward_sees_all_responses_at_once():
    calls = []

    @group_reward
    async def rank(prompt, responses, label):
        calls.append(list(responses))
        return [float(len(r)) / 10 for r in responses]

    assert asyncio.run(score_group(rank, PROMPT, ["a", "bbb"], None)) == [0.1, 0.3]
    assert calls == [["a", "bbb"]]


def test_group_reward_returning_the_wrong_length_is_an_error():
    @group_reward
    def short(prompt, responses, label):
        return [1.0]

    with pytest.raises(RewardError, match="must return a list of 2 scores"):
        asyncio.run(score_group(short, PROMPT, ["a", "b"], None))


@pytest.mark.parametrize("is_async", [False, True])
def test_a_failing_reward_names_function_prompt_and_response(is_async):
    def boom(prompt, response, label):
        if response.startswith("bad"):
            raise KeyError("oops")
        return 1.0

    async def aboom(prompt, response, label):
        return boom(prompt, response, label)

    fn = aboom if is_async else boom
    long_response = "bad" + "x" * 500
    with pytest.raises(RewardError) as info:
        asyncio.run(score_group(fn, PROMPT, ["good", long_response], None))
    err = info.value
    assert isinstance(err.__cause__, KeyError)
    assert err.prompt_index == 17 and err.response == long_response and err.fn_name.endswith(fn.__name__)
    message = str(err)
    assert f"{fn.__qualname__} failed on prompt 17" in message and "KeyError" in message
    assert "x" * 190 in message and "x" * 300 not in message  # the response is truncated


@pytest.mark.parametrize("value", ["1.0", None, float("nan")])
def test_a_reward_that_returns_a_non_number_is_an_error(value):
    with pytest.raises(RewardError, match="expected a finite float"):
        asyncio.run(score_group(lambda p, r, l: value, PROMPT, ["a"], None))


def test_reward_error_survives_pickling():
    # it crosses actor boundaries through Ray
    err = RewardError("m", fn_name="f", prompt_index=3, response="r")
    copy = pickle.loads(pickle.dumps(err))
    assert (str(copy), copy.fn_name, copy.prompt_index, copy.response) == ("m", "f", 3, "r")


# ---- --reward-timeout: a call past it fails its sample, not the rollout -------------------------

NEVER = threading.Event()          # never set: a reward waiting on it never returns


@pytest.mark.parametrize("is_async", [False, True])
def test_a_reward_past_its_timeout_scores_0_and_the_others_are_scored(is_async):
    def stuck(prompt, response, label):
        if response == "hang":
            NEVER.wait()                                  # a blocking call: only a thread can bound it
        return float(response == label)

    async def astuck(prompt, response, label):
        if response == "hang":
            await asyncio.Event().wait()
        return float(response == label)

    timed_out: list[int] = []
    t0 = time.monotonic()
    scores = asyncio.run(score_group(astuck if is_async else stuck, PROMPT, ["a", "hang", "b"], "a",
                                     timeout_s=0.3, on_timeout=timed_out.append))
    assert scores == [1.0, 0.0, 0.0] and timed_out == [1]
    assert time.monotonic() - t0 < 2.0            # the hung call was abandoned, not awaited


def test_a_group_reward_past_its_timeout_fails_every_sample_of_the_group():
    @group_reward
    def stuck(prompt, responses, label):
        NEVER.wait()

    timed_out: list[int] = []
    assert asyncio.run(score_group(stuck, PROMPT, ["a", "b"], None, timeout_s=0.2,
                                   on_timeout=timed_out.append)) == [0.0, 0.0]
    assert timed_out == [0, 1]


def test_a_timeout_the_reward_raises_itself_is_a_reward_error_not_a_timeout():
    def judge(prompt, response, label):
        raise TimeoutError("the judge server did not answer")

    with pytest.raises(RewardError, match="judge server"):
        asyncio.run(score_group(judge, PROMPT, ["a"], None, timeout_s=5, on_timeout=lambda i: None))
