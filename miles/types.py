"""Typed records that cross component (actor) boundaries.

Engines speak token ids: a prompt goes in as ids, a response comes out as ids plus the engine's
per-token log-probabilities, so nothing is detokenized and retokenized between rollout and training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One dataset row, templated and tokenized once when the dataset is loaded."""

    index: int                      # row number in the source file (0-based), stable across epochs
    text: str                       # the prompt text after the chat template, if any
    prompt_ids: tuple[int, ...]     # tokenized `text`
    label: str | None = None        # --label-key value, as a string (None when absent)
    metadata: dict[str, Any] = field(default_factory=dict)  # --metadata-key value


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                 # -1: off
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()   # besides the tokenizer's EOS
    stop: tuple[str, ...] = ()      # stop strings: a response ends at the token whose text completes one
    max_context_len: int | None = None  # prompt + response tokens at most (each prompt's budget is the rest)
    seed: int | None = None         # makes a generate() call reproducible on the same engine


@dataclass
class Generation:
    """What an engine returns for one request."""

    response_ids: list[int]         # generated ids, EOS included when it stopped on EOS
    logprobs: list[float]           # log p(response_ids[i]) under the sampling distribution's model, len == len(response_ids)
    finish_reason: str              # "stop" (EOS / stop token) or "length"
    weight_version: int             # version of the weights that produced it


@dataclass
class Sample:
    """One response to one prompt, scored. `group` ties the n samples of a prompt together."""

    prompt: Prompt
    group: int                      # index of the prompt within its rollout batch
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    weight_version: int
    response_text: str = ""
    reward: float = 0.0
    advantage: float = 0.0          # filled by the advantage estimator (GRPO: per-sequence scalar)
    reward_timed_out: bool = False  # the reward call ran past --reward-timeout: the sample scored 0.0

    @property
    def response_length(self) -> int:
        return len(self.response_ids)


@dataclass
class RolloutBatch:
    """All samples of one rollout, grouped: samples[i * n : (i + 1) * n] answer the same prompt."""

    rollout_id: int
    samples: list[Sample]
    n_samples_per_prompt: int
    metrics: dict[str, float] = field(default_factory=dict)
