"""Typed records that cross component (actor) boundaries.

Engines speak token ids: a prompt goes in as ids, a response comes out as ids plus the engine's
per-token log-probabilities, so nothing is detokenized and retokenized between rollout and training.

A `Sample` carries a whole trajectory: the prompt's ids, then the response, which in a multi-turn
rollout interleaves the model's turns with what tools and the environment answered. `loss_mask`
says which response tokens are the model's (trained on) and which are not; the rollout logprobs are
the engine's on the model's tokens and 0.0 on the others. A single-turn sample is one span of model
tokens (`loss_mask` None: every response token is the model's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

# One token's routing in a mixture-of-experts model: its top-k expert ids per MoE layer, array-like
# [MoE layers][k]; an empty entry (`[]`: a tool / environment token) has none.
TokenExperts = list[list[int]] | np.ndarray
# A response's routing, one entry per token: either one numpy array [tokens, MoE layers, k] (the fast
# engine's: uint8, int16 past 256 experts; copying a call's ids into Python ints cost 8.3 s of a 42 s call
# on an H200, and a list of one small array per token pickles at ~5 us a token, 1.4 s for 256 x 1,024
# tokens, on every hop between actors) or a list of `TokenExperts` (the embedded and HTTP engines', a
# checkpoint's, and any response mixing tool tokens or both kinds). Read it as a sequence (`len`, `r[t]`,
# iteration: never its truth value); change it with `routing_join` / slicing, never in place.
Routing = list[TokenExperts] | np.ndarray


def routing_join(head: Routing, tail: Routing) -> Routing:
    """`head`'s entries, then `tail`'s: one array when both are arrays of the same per-token shape (or one
    side is empty), else a list of the entries (an array's rows as arrays)."""
    if len(tail) == 0:
        return head if isinstance(head, np.ndarray) else list(head)
    if len(head) == 0:
        return tail if isinstance(tail, np.ndarray) else list(tail)
    if isinstance(head, np.ndarray) and isinstance(tail, np.ndarray) and head.shape[1:] == tail.shape[1:]:
        return np.concatenate([head, tail])          # numpy's promotion: uint8 + int16 -> int16
    return [*head, *tail]


def routing_copy(routed: Routing) -> Routing:
    """A copy that shares nothing mutable with `routed`."""
    return routed.copy() if isinstance(routed, np.ndarray) else list(routed)


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
    min_new_tokens: int = 0         # EOS and stop_token_ids are barred before this many tokens (SGLang's)
    # the call returns once no request waits for a slot and at most this share of its batch still runs (its
    # batch: its requests, or the engine's slots when it has fewer); those end "abort" with what they
    # generated (the fully-async producer continues them in its next call). A share of the batch, not of
    # the call: a call of 64 requests on 16 slots is cut at 4 running, not at 16 (its batch still full). 0: never
    tail_cut_share: float = 0.0


def sampling_problems(*, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                      names: tuple[str, str, str] = ("temperature", "top_p", "top_k")) -> list[str]:
    """THE rule of the sampling knobs, for every place that takes them (the flags, the eval datasets, a
    generate call's `SamplingParams`): temperature >= 0 (0 is greedy), top-p in (0, 1], top-k -1 (off)
    or >= 1; None is not given. `names` are what the messages call them (the flags: "--rollout-top-p").
    A run that trains on its rollouts needs temperature > 0 besides: `miles.config.validate` says so."""
    out = []
    t, p, k = names
    if temperature is not None and temperature < 0:
        out.append(f"{t} {temperature}: must be >= 0 (0: greedy)")
    if top_p is not None and not 0 < top_p <= 1:
        out.append(f"{p} {top_p}: must be in (0, 1]")
    if top_k is not None and top_k != -1 and top_k < 1:
        out.append(f"{k} {top_k}: must be -1 (off) or >= 1")
    return out


@dataclass
class Generation:
    """What an engine returns for one request."""

    response_ids: list[int]         # generated ids, EOS included when it stopped on EOS
    logprobs: list[float]           # log p(response_ids[i]) under the sampling distribution's model, len == len(response_ids)
    finish_reason: str              # "stop" (EOS / stop token), "length", or "abort" (the engine was told to stop)
    weight_version: int             # version of the weights that produced it
    # a mixture-of-experts model's routing: per response token, per MoE layer, the top-k experts of the position
    # whose logits sampled it (miles.training.moe), a `Routing`: one numpy array [tokens, MoE layers, k] from
    # the fast engine, a list of nested lists from the other engines. None for a dense model
    routed_experts: Routing | None = None
    # per token, the weight version whose forward gave its logits, when the weights were swapped during the
    # call (--fully-async: SupportsInFlightWeightSwap); None: every token is `weight_version`'s
    token_versions: list[int] | None = None


# completed: the trajectory ended on its own (EOS, no further tool call); truncated: it ran out of
# tokens or turns; aborted: the framework cut it (a timeout, the rollout's deadline); failed: its
# generate function or a tool raised or hung (`Sample.error` says what). Aborted and failed samples
# are not scored (reward 0.0) and not trained on: the trainer zeroes their loss mask.
SampleStatus = Literal["completed", "truncated", "aborted", "failed"]
SAMPLE_STATUSES: tuple[SampleStatus, ...] = ("completed", "truncated", "aborted", "failed")
TRAINABLE_STATUSES: tuple[SampleStatus, ...] = ("completed", "truncated")


@dataclass
class Sample:
    """One trajectory for one prompt, scored. `group` ties the n samples of a prompt together.

    Per response token, three lists of equal length: `response_ids`, `rollout_logprobs` (the
    engine's, 0.0 where the model did not sample the token) and `loss_mask` (1 on the model's
    tokens, 0 on tool / environment tokens; None means all 1, the single-turn case).
    """

    prompt: Prompt
    group: int                      # index of the prompt within its rollout batch
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str              # the last engine call's: "stop", "length" or "abort"
    weight_version: int
    response_text: str = ""         # the whole response decoded (tool / environment text included)
    reward: float = 0.0
    advantage: float = 0.0          # filled by the advantage estimator (GRPO: per-sequence scalar)
    reward_timed_out: bool = False  # the reward call ran past --reward-timeout: the sample scored 0.0
    loss_mask: list[int] | None = None      # per response token: 1 trained (the model's), 0 not; None: all 1
    status: SampleStatus = "completed"
    metadata: dict[str, Any] = field(default_factory=dict)  # free-form; starts as a copy of the prompt's
    error: str | None = None        # why the sample failed or was aborted
    # set by a --rollout-sample-filter-path hook (miles' name): not trained on, yet still counted in its
    # group's advantage statistics
    remove_sample: bool = False
    # --use-opd --opd-type sglang: the teacher servers' logprob of each response token (None: not scored)
    teacher_logprobs: list[float] | None = None
    # a mixture-of-experts model's rollout routing (miles' name): per response token [MoE layers][top-k] expert
    # ids the engine used for the position that sampled it, a `Routing` (one array [tokens, layers, k] from the
    # fast engine; a list of nested lists from the embedded and HTTP engines and from checkpoints, and where a
    # response mixes kinds); [] on tokens the model did not sample (tool turns: the trainer routes them
    # itself). None: a dense model, or an engine that does not record it. `routing_as_lists` makes it plain
    # JSON-able lists (and comparable: `==` of two samples holding arrays raises numpy's "truth value is
    # ambiguous")
    rollout_routed_experts: Routing | None = None

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def tokens(self) -> list[int]:
        """The whole trajectory's ids: prompt, then response."""
        return [*self.prompt.prompt_ids, *self.response_ids]

    @property
    def trainable(self) -> bool:
        return self.status in TRAINABLE_STATUSES

    def mask(self) -> list[int]:
        """The loss mask over the response tokens (all 1 for a single-turn sample); all 0 when the
        sample is not trainable (aborted or failed) or a hook removed it (`remove_sample`)."""
        if not self.trainable or self.remove_sample:
            return [0] * len(self.response_ids)
        return [1] * len(self.response_ids) if self.loss_mask is None else list(self.loss_mask)

    @property
    def num_model_tokens(self) -> int:
        """Response tokens the model sampled (the trained ones of a trainable sample)."""
        return len(self.response_ids) if self.loss_mask is None else sum(1 for m in self.loss_mask if m)

    def append(self, ids: list[int], logprobs: list[float] | None = None, *, trained: bool,
               routed_experts: Routing | None = None) -> None:
        """Append a span to the response: the model's tokens with the engine's logprobs
        (`trained=True`, and the engine's routing of an MoE model: `Generation.routed_experts`), or tool /
        environment tokens (`trained=False`, logprobs 0.0, no routing)."""
        if trained and (logprobs is None or len(logprobs) != len(ids)):
            raise ValueError(f"the model's {len(ids)} tokens need as many logprobs, got "
                             f"{None if logprobs is None else len(logprobs)}")
        if routed_experts is not None and self.rollout_routed_experts is None and not self.response_ids:
            self.rollout_routed_experts = []
        if self.rollout_routed_experts is not None:
            self.rollout_routed_experts = routing_join(
                self.rollout_routed_experts, routed_experts if trained and routed_experts is not None else [[] for _ in ids])
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_ids)
        self.response_ids.extend(ids)
        self.rollout_logprobs.extend(logprobs if trained else [0.0] * len(ids))
        self.loss_mask.extend([1 if trained else 0] * len(ids))


def routing_as_lists(routed: Routing | None) -> list[list[list[int]]] | None:
    """`Sample.rollout_routed_experts` as plain nested lists (JSON, torch.load's weights_only): numpy arrays
    as lists of Python ints; list entries (and `[]`) as they are."""
    if routed is None:
        return None
    if isinstance(routed, np.ndarray):
        return routed.tolist()
    return [r.tolist() if isinstance(r, np.ndarray) else r for r in routed]


@dataclass
class RolloutBatch:
    """All samples of one rollout, grouped: samples[i * n : (i + 1) * n] answer the same prompt."""

    rollout_id: int
    samples: list[Sample]
    n_samples_per_prompt: int
    metrics: dict[str, float] = field(default_factory=dict)
