"""Reward functions: the built-ins, loading a custom one, and scoring one group of responses.

A reward function is `fn(prompt: Prompt, response_text: str, label: str | None) -> float`, sync or
async. A *group* reward function, marked with `@group_reward`, is instead
`fn(prompt, responses: list[str], label) -> list[float]` (sync or async) and sees every response
to a prompt at once (for rewards that rank or compare). The function is chosen once, at startup,
by `load_reward_fn`; `score_group` runs it on one group. `--reward-timeout` bounds each call: one
past it fails its sample (it scores 0.0, as a wrong answer does), not the rollout.

Built-ins (`--rm-type`; the rules are miles', equivalence is `miles.rollout.math_grading`'s: a
numeric or string check inline, else math-verify in worker processes, ANSWER_TIME_LIMIT_S an answer):
- `math`: the final answer is the content of the last `\\boxed{...}`, else the last number in the
  response (miles requires the box; the demo's model writes bare numbers). Equal to the label
  (the answer itself, or `\\boxed{...}`): 1.0, else 0.0.
- `boxed_math`: the whole content of the last box against the label (no box: 0.0).
- `deepscaler`: the text after the last `</think>` (or after `###Response`; neither: 0.0) must hold a
  box whose content equals the label: 1.0, else 0.0.
- `gemma_math`: as deepscaler, after Gemma 4's last `<channel|>` (the whole response without one).
- `dapo`: the last `Answer: X` line in the response's last 300 characters equal to the label after
  DAPO's normalization (or by the verifier): +1.0, else -1.0 (no such line included).
- `gpqa`: the option letter the response chooses (after `</think>`) against the label's letter (or
  `metadata["correct_letter"]`, or the choice in `metadata["choices"]` the label names): 1.0 or 0.0.
- `exact_match`: 1.0 when the response and the label are equal after stripping whitespace.
- `f1`: token-level F1 between the response and the label (SQuAD-style: lowercase, punctuation and
  articles dropped, whitespace tokens), in [0, 1].
- `random`: 0.0 or 1.0 at random; `deterministic_random`: 0.0 or 1.0 from a hash of the prompt index
  and the response, the same on every run (for tests).
- `remote_rm`: POST `{"prompt", "response", "label"}` to `--rm-url` (`miles.rollout.remote_reward`).
- `boxed_exact_match`, `boxed_f1`: `exact_match` / `f1` score the content of the response's last
  `\\boxed{...}` ("" when there is none) instead of the whole response.

A reward may return a dict of named scores; `--reward-key` picks the one to train on
(`with_reward_key`). Which function scores which sample (`--custom-rm-path`, `--rm-type`, a
sample's `metadata["rm_type"]`) is `miles.rollout.scoring`'s.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import math
import numbers
import random
import re
import string
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from miles.config import ConfigError, RunConfig
from miles.config.checks import check
from miles.config.miles_flags import rm_type_problem
from miles.config.packages import missing_package
from miles.rollout import math_grading
from miles.rollout.math_grading import MATH_REL_TOL, extract_answer, last_boxed, parse_number  # noqa: F401
from miles.runtime.threads import in_daemon_thread
from miles.types import Prompt
from miles.user_code import check_signature, display_name, import_user_function

RewardFn = Callable[[Prompt, str, str | None], float | Awaitable[float]]
GroupRewardFn = Callable[[Prompt, list[str], str | None], list[float] | Awaitable[list[float]]]
F = TypeVar("F", bound=Callable[..., Any])

_RESPONSE_PREVIEW_CHARS = 200


class RewardError(RuntimeError):
    """A reward function raised, or returned something other than a finite number.

    Keyword fields have defaults so that the error pickles (it crosses actor boundaries). It is the
    input's fault (the user's reward), so the CLI exits 2 on it (`input_fault`).
    """

    input_fault = True

    def __init__(self, message: str, *, fn_name: str = "", prompt_index: int = -1, response: str = ""):
        super().__init__(message)
        self.fn_name = fn_name
        self.prompt_index = prompt_index
        self.response = response


def _reward_error(fn: Callable[..., Any], prompt: Prompt, response: str, problem: str) -> RewardError:
    name = _name(fn)
    preview = response if len(response) <= _RESPONSE_PREVIEW_CHARS else response[:_RESPONSE_PREVIEW_CHARS] + "..."
    return RewardError(f"reward function {name} failed on prompt {prompt.index}, response {preview!r}: {problem}",
                       fn_name=name, prompt_index=prompt.index, response=response)


def group_reward(fn: F) -> F:
    """Mark `fn` as a group reward function: it scores all responses to a prompt in one call."""
    fn.group = True  # type: ignore[attr-defined]
    return fn


def is_group_reward(fn: Callable[..., Any]) -> bool:
    return getattr(fn, "group", False) is True


# ---- built-ins ----------------------------------------------------------------------------------

async def math_reward(prompt: Prompt, response: str, label: str | None) -> float:
    return await math_grading.math_score(response, _require_label(label, "math"))


async def boxed_math_reward(prompt: Prompt, response: str, label: str | None) -> float:
    return await math_grading.boxed_math_score(response, _require_label(label, "boxed_math"))


async def deepscaler_reward(prompt: Prompt, response: str, label: str | None) -> float:
    return await math_grading.deepscaler_score(response, _require_label(label, "deepscaler"))


async def gemma_math_reward(prompt: Prompt, response: str, label: str | None) -> float:
    return await math_grading.gemma_math_score(response, _require_label(label, "gemma_math"))


async def dapo_reward(prompt: Prompt, response: str, label: str | None) -> float:
    return await math_grading.dapo_score(response, _require_label(label, "dapo"))


def gpqa_reward(prompt: Prompt, response: str, label: str | None) -> float:
    if label is None and not prompt.metadata.get("correct_letter"):
        _require_label(label, "gpqa")
    return math_grading.gpqa_score(response, label, prompt.metadata)


def exact_match_reward(prompt: Prompt, response: str, label: str | None) -> float:
    return float(response.strip() == _require_label(label, "exact_match").strip())


def _require_label(label: str | None, rm_type: str) -> str:
    if label is None:
        raise ValueError(f"--rm-type {rm_type} needs a label, and this prompt has none; set --label-key "
                         "to the column that holds the reference answer")
    return label


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def _f1_tokens(text: str) -> list[str]:
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def f1_reward(prompt: Prompt, response: str, label: str | None) -> float:
    """Token-level F1 of the response against the label (SQuAD's normalization)."""
    got, want = _f1_tokens(response), _f1_tokens(_require_label(label, "f1"))
    same = sum((Counter(got) & Counter(want)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(got), same / len(want)
    return 2 * precision * recall / (precision + recall)


def random_reward(prompt: Prompt, response: str, label: str | None) -> float:
    return float(random.randint(0, 1))


def deterministic_random_reward(prompt: Prompt, response: str, label: str | None) -> float:
    """0.0 or 1.0 from a hash of (prompt index, response): random-looking, the same on every run."""
    digest = hashlib.sha256(f"{prompt.index}\0{response}".encode()).digest()
    return float(digest[0] & 1)


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "math": math_reward, "deepscaler": deepscaler_reward, "dapo": dapo_reward, "gemma_math": gemma_math_reward,
    "gpqa": gpqa_reward, "exact_match": exact_match_reward, "f1": f1_reward, "random": random_reward,
    "deterministic_random": deterministic_random_reward,
}
LABEL_FREE_REWARDS = ("random", "deterministic_random")   # the built-ins that read no label
VERIFIED_REWARDS = ("math", "deepscaler", "dapo", "gemma_math")   # graded by math-verify (math_grading)
REMOTE_RM = "remote_rm"             # built by miles.rollout.scoring from --rm-url and its options
BOXED_PREFIX = "boxed_"
BOXABLE = ("math", "exact_match", "f1")   # rule rewards that read the answer from the response text
BOXED_REWARDS: dict[str, RewardFn] = {"boxed_math": boxed_math_reward}   # the others score the box's content
RM_TYPES: tuple[str, ...] = (*REWARD_FUNCTIONS, REMOTE_RM, *(BOXED_PREFIX + name for name in BOXABLE))


def boxed(fn: RewardFn) -> RewardFn:
    """`fn` scoring the content of the response's last `\\boxed{...}` ("" when there is none)."""
    @functools.wraps(fn)
    def scored_on_box(prompt: Prompt, response: str, label: str | None) -> Any:
        return fn(prompt, math_grading.last_boxed(response) or "", label)

    scored_on_box.__qualname__ = f"{BOXED_PREFIX}{getattr(fn, '__qualname__', 'reward')}"
    return scored_on_box


def builtin_reward(rm_type: str, *, flag: str = "--rm-type") -> RewardFn:
    """The built-in reward `rm_type` (a `boxed_` prefix allowed); `remote_rm` is built from its
    flags by `miles.rollout.scoring`, so it is not one of these."""
    base = rm_type.removeprefix(BOXED_PREFIX)
    if rm_type in REWARD_FUNCTIONS or rm_type in BOXED_REWARDS:
        return REWARD_FUNCTIONS.get(rm_type) or BOXED_REWARDS[rm_type]
    if rm_type.startswith(BOXED_PREFIX) and base in BOXABLE:
        return boxed(REWARD_FUNCTIONS[base])
    raise ConfigError(f"{flag} {rm_type!r} is not a built-in reward; valid types are {sorted(RM_TYPES)}, "
                      "or pass --custom-rm-path module:function")


def with_reward_key(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
    """`fn` returning its dict-valued result's entry `key` (--reward-key); a plain number passes."""
    def pick(value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        if key not in value:
            raise ValueError(f"--reward-key {key!r}: the reward returned no such key; its keys are {sorted(value)}")
        return value[key]

    def pick_all(value: Any) -> Any:
        return [pick(v) for v in value] if is_group_reward(fn) and isinstance(value, (list, tuple)) else pick(value)

    async def picked(awaitable: Awaitable[Any]) -> Any:
        return pick_all(await awaitable)

    @functools.wraps(fn)
    def keyed(*args: Any) -> Any:
        result = fn(*args)
        return picked(result) if inspect.isawaitable(result) else pick_all(result)

    return keyed


# ---- choosing the function ----------------------------------------------------------------------

def load_reward_fn(rm_type: str, custom_rm_path: str | None = None) -> Callable[..., Any]:
    """The reward function of the run: `--custom-rm-path` when given, else the built-in `rm_type`
    (`miles.rollout.scoring.Rewards` adds remote_rm, --group-rm, --reward-key and per-sample types)."""
    if custom_rm_path:
        return import_reward_fn(custom_rm_path)
    return builtin_reward(rm_type)


def import_reward_fn(path: str, flag: str = "--custom-rm-path") -> Callable[..., Any]:
    """Import `module:function` (or `module.function`; `module:Class.method` works too), or load
    `path/to/file.py:function` from a file (see `miles.user_code`); check that it can be called as a
    reward: fn(prompt, response, label), or fn(prompt, responses, label) for a `@group_reward`."""
    fn = import_user_function(path, flag)
    shape = "a group reward fn(prompt, responses, label) -> list[float]" if is_group_reward(fn) else \
        "a reward fn(prompt, response_text, label) -> float (sync or async)"
    check_signature(fn, flag, path, 3, shape)
    return fn


# ---- scoring ------------------------------------------------------------------------------------

async def score_group(fn: Callable[..., Any], prompt: Prompt, responses: list[str], label: str | None, *,
                      timeout_s: float | None = None, on_timeout: Callable[[int], None] | None = None) -> list[float]:
    """Score every response to `prompt`: async calls run concurrently, sync ones inline.

    With `timeout_s`, each call (a group reward's one call) gets that long, and sync functions run in
    daemon threads so that a hung one blocks nothing; a call past it fails its sample(s), not the
    rollout: they score 0.0, as a wrong answer does, and `on_timeout(i)` hears of each one.
    """
    if is_group_reward(fn):
        return await _score_whole_group(fn, prompt, responses, label, timeout_s, on_timeout)
    if timeout_s is not None:
        return await _score_bounded(fn, prompt, responses, label, timeout_s, on_timeout)
    scores: list[float] = [0.0] * len(responses)
    pending: list[tuple[int, Awaitable[Any]]] = []
    try:
        for i, response in enumerate(responses):
            try:
                result = fn(prompt, response, label)
            except Exception as e:
                raise _reward_error(fn, prompt, response, f"{type(e).__name__}: {e}") from e
            if inspect.isawaitable(result):
                pending.append((i, result))
            else:
                scores[i] = _as_score(result, fn, prompt, response)
    except BaseException:
        _close_unawaited(aw for _, aw in pending)
        raise
    results = await asyncio.gather(*(aw for _, aw in pending), return_exceptions=True)
    for (i, _), result in zip(pending, results):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result  # cancellation and the like are not reward errors
            raise _reward_error(fn, prompt, responses[i], f"{type(result).__name__}: {result}") from result
        scores[i] = _as_score(result, fn, prompt, responses[i])
    return scores


async def _score_bounded(fn: Callable[..., Any], prompt: Prompt, responses: list[str], label: str | None,
                         timeout_s: float, on_timeout: Callable[[int], None] | None) -> list[float]:
    async def one(i: int, response: str) -> float:
        try:
            result = await call_within(fn, (prompt, response, label), timeout_s)
        except RewardTimeout:
            if on_timeout is not None:
                on_timeout(i)
            return 0.0
        except Exception as e:
            raise _reward_error(fn, prompt, response, f"{type(e).__name__}: {e}") from e
        return _as_score(result, fn, prompt, response)

    return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(responses))))


async def _score_whole_group(fn: Callable[..., Any], prompt: Prompt, responses: list[str], label: str | None,
                             timeout_s: float | None, on_timeout: Callable[[int], None] | None) -> list[float]:
    where = responses[0] if responses else ""
    try:
        result = await call_within(fn, (prompt, list(responses), label), timeout_s)
    except RewardTimeout:
        for i in range(len(responses)):
            if on_timeout is not None:
                on_timeout(i)
        return [0.0] * len(responses)
    except Exception as e:
        raise _reward_error(fn, prompt, where, f"group of {len(responses)}: {type(e).__name__}: {e}") from e
    if not isinstance(result, (list, tuple)) or len(result) != len(responses):
        raise _reward_error(fn, prompt, where, f"a group reward must return a list of {len(responses)} "
                                             f"scores, one per response; got {_describe(result)}")
    return [_as_score(r, fn, prompt, resp) for r, resp in zip(result, responses)]


class RewardTimeout(Exception):
    """A reward call ran past --reward-timeout (its own TimeoutError, if it raises one, is a reward error)."""


async def call_within(fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float | None) -> Any:
    """`fn(*args)`, awaited if it returns an awaitable; with `timeout_s`, raise RewardTimeout past it (a
    sync function runs in a daemon thread then, abandoned if it never returns)."""
    if timeout_s is None:
        result = fn(*args)
        return await result if inspect.isawaitable(result) else result
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    first = fn(*args) if inspect.iscoroutinefunction(fn) else in_daemon_thread(fn, *args, name="miles-reward")
    result = await _settle(asyncio.ensure_future(first), deadline - loop.time())
    if inspect.isawaitable(result):
        result = await _settle(asyncio.ensure_future(result), deadline - loop.time())
    return result


async def _settle(fut: asyncio.Future[Any], timeout: float) -> Any:
    done, _ = await asyncio.wait({fut}, timeout=max(timeout, 0.0))
    if not done:
        fut.cancel()                  # a coroutine is cancelled; a thread is abandoned (a daemon)
        raise RewardTimeout()
    return fut.result()


def _as_score(value: Any, fn: Callable[..., Any], prompt: Prompt, response: str) -> float:
    if isinstance(value, Mapping):
        raise _reward_error(fn, prompt, response, f"returned a dict {_describe(value)}; pick the score to train "
                                                  "on with --reward-key KEY")
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise _reward_error(fn, prompt, response, f"returned {_describe(value)}; expected a finite float")
    return float(value)


def _close_unawaited(awaitables: Any) -> None:
    # Coroutines created but never awaited would warn at garbage collection; close them instead.
    for aw in awaitables:
        close = getattr(aw, "close", None)
        if close is not None:
            close()


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{text[:80]}{'...' if len(text) > 80 else ''} ({type(value).__name__})"


def _name(fn: Callable[..., Any]) -> str:
    return display_name(fn)


@check
def _reward_types(cfg: RunConfig, problems: list[str]) -> None:
    """--rm-type, and each --eval-config dataset's rm_type, names a reward this module has."""
    r = cfg.rollout
    if r.rm_type not in RM_TYPES:
        problems.append(rm_type_problem(r.rm_type, RM_TYPES))
    for d in cfg.eval.datasets:
        if d.rm_type is not None and d.rm_type not in RM_TYPES:
            problems.append(f"--eval-config dataset {d.name!r}: rm_type {d.rm_type!r} is not a reward type here; use "
                            f"one of {', '.join(RM_TYPES)} or leave it out to use the run's reward (--custom-rm-path)")


@check
def _verifier_installed(cfg: RunConfig, problems: list[str]) -> None:
    """A reward graded by math-verify (--rm-type math, boxed_math, deepscaler, dapo, gemma_math, or an
    --eval-config dataset's rm_type) needs the package in this environment."""
    verified = (*VERIFIED_REWARDS, *BOXED_REWARDS)
    used = [t for t in (None if cfg.rollout.custom_rm_path else cfg.rollout.rm_type,
                        *(d.rm_type for d in cfg.eval.datasets)) if t in verified]
    if used and (missing := missing_package(f"--rm-type {used[0]}", "math_verify", math_grading.VERIFIER_PACKAGE)):
        problems.append(f"{missing} (its grader)")
