"""--partial-rollout: the groups a dynamic-sampling rollout aborted, kept and continued by the next one.

With dynamic sampling (`--dynamic-sampling-filter-path`), once `--rollout-batch-size` groups have
passed the filter the executor aborts the engine calls still running (`SupportsAbort`). Without
--partial-rollout their groups are dropped; with it they go into this buffer as they stopped: each
sample keeps the response ids and the engine's logprobs generated so far (finish_reason "abort"), or
its whole response when it had finished before the abort. The next rollout's first sampling round
takes its groups from the buffer (`--buffer-filter-path`'s choice, else the oldest first) before
drawing fresh prompts, and continues each unfinished sample from prompt + partial response with the
tokens left of --rollout-max-response-len.

A continued sample records what produced it (miles' fields): `metadata["weight_versions"]`, one
weight version per engine call in order, and `metadata["start_rollout_id"]`, the rollout that first
aborted it; `Sample.weight_version` is the oldest of them (the staleness metrics read it). Its
rollout logprobs are the engines' of each part, so `--use-tis` / `--use-rollout-logprobs` correct the
old part with its own. `--mask-offpolicy-in-partial-rollout` trains only the tokens of the last
engine call: the earlier ones get loss mask 0 (a sample that had finished before the abort is then
not trained at all, while it still counts in its group's advantage statistics), as in miles.

A buffer filter is `fn(ctx, rollout_id, buffer, num_groups) -> list[list[Sample]]` (miles' signature,
`ctx` in place of `args`; miles passes None as the rollout id, this build the rollout's): it returns
at most `num_groups` groups of the buffer and removes them from it (a group it returns and leaves in
is removed here); a group it removes and does not return is dropped (a staleness policy).

Each round makes one engine call per engine (an engine answers a call's requests together), so a
run needs two engines or more (`miles.config.validate`, once the placement counts them): with one, nothing would ever be cut short.

The buffer is part of the executor's checkpointed state (`rollout.json`, with the data position), so
a resumed run continues the same groups; miles keeps it in memory only and a resume drops it.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Callable

from miles.config import ConfigError, RolloutConfig
from miles.rollout.hooks import HookContext
from miles.types import Prompt, Sample, routing_as_lists, routing_copy
from miles.config.user_functions import signature
from miles.user_code import check_signature, display_name, import_user_function

BUFFER_FILTER_FLAG = "--buffer-filter-path"
BufferFilter = Callable[[HookContext, int, list[list[Sample]], int], list[list[Sample]]]


class BufferFilterError(RuntimeError):
    """The buffer filter returned something the rollout cannot take; the message names the flag."""


def pop_first(ctx: HookContext, rollout_id: int, buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
    """miles' default: the oldest groups first."""
    taken = buffer[:num_groups]
    del buffer[:num_groups]
    return taken


def load_buffer_filter(path: str) -> BufferFilter:
    fn = import_user_function(path, BUFFER_FILTER_FLAG)
    check_signature(fn, BUFFER_FILTER_FLAG, path, 4, signature(BUFFER_FILTER_FLAG))
    return fn


class PartialBuffer:
    """The aborted groups waiting for a rollout to continue them, oldest first."""

    def __init__(self, rollout: RolloutConfig):
        self._n = rollout.n_samples_per_prompt
        self._pick: BufferFilter = load_buffer_filter(rollout.buffer_filter_path) if rollout.buffer_filter_path \
            else pop_first
        self._groups: list[list[Sample]] = []

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, groups: list[list[Sample]]) -> None:
        self._groups.extend(groups)

    def take(self, ctx: HookContext, num_groups: int) -> tuple[list[list[Sample]], int]:
        """At most `num_groups` groups, as the filter picks them, and how many it dropped."""
        if not self._groups or num_groups == 0:
            return [], 0
        before = {id(g): g for g in self._groups}
        buffer = list(self._groups)
        picked = self._pick(ctx, ctx.rollout_id, buffer, num_groups)
        self._check(picked, before, num_groups)
        chosen = {id(g) for g in picked}
        left = [g for g in buffer if id(g) in before and id(g) not in chosen]
        self._groups = left
        return list(picked), len(before) - len(left) - len(picked)

    def _check(self, picked: Any, before: dict[int, list[Sample]], num_groups: int) -> None:
        name = display_name(self._pick)
        if not isinstance(picked, list):
            raise BufferFilterError(f"{BUFFER_FILTER_FLAG} {name} returned {type(picked).__name__}; expected a list "
                                    "of groups taken from the buffer")
        if len(picked) > num_groups:
            raise BufferFilterError(f"{BUFFER_FILTER_FLAG} {name} returned {len(picked)} groups for {num_groups} "
                                    "asked; return at most num_groups")
        strangers = [i for i, g in enumerate(picked) if id(g) not in before]
        if strangers:
            raise BufferFilterError(f"{BUFFER_FILTER_FLAG} {name}: group {strangers[0]} of its answer is not one of "
                                    "the buffer's groups; return the buffer's own lists (a group of "
                                    f"{self._n} samples each), not copies")
        if len({id(g) for g in picked}) != len(picked):
            raise BufferFilterError(f"{BUFFER_FILTER_FLAG} {name} returned a group twice")

    # -- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> list[list[dict[str, Any]]]:
        """JSON-able: each sample's fields, its prompt by index (the dataset row)."""
        return [[_sample_state(s) for s in g] for g in self._groups]

    def load_state_dict(self, state: list[list[dict[str, Any]]], prompts: dict[int, Prompt]) -> None:
        missing = sorted({s["prompt"] for g in state for s in g} - set(prompts))
        if missing:
            raise ConfigError(f"the checkpoint's --partial-rollout buffer holds prompts {missing[:5]} that "
                              "--prompt-data does not have; resume with the run's own prompt data")
        self._groups = [[Sample(**{**s, "prompt": prompts[s["prompt"]]}) for s in g] for g in state]


def _sample_state(s: Sample) -> dict[str, Any]:
    out = {f.name: getattr(s, f.name) for f in fields(Sample)}
    out["prompt"] = s.prompt.index
    out["rollout_routed_experts"] = routing_as_lists(s.rollout_routed_experts)    # the fast engine's arrays
    return out


def continuation(sample: Sample, *, mask_old: bool) -> Sample:
    """A copy of a buffered sample to continue (the buffer's own stays as it is: a rollout retried
    after an engine restart continues the same one again). With `mask_old` its response so far gets
    loss mask 0."""
    mask = [0] * sample.response_length if mask_old else (None if sample.loss_mask is None else list(sample.loss_mask))
    return replace(sample, response_ids=list(sample.response_ids), rollout_logprobs=list(sample.rollout_logprobs),
                   loss_mask=mask, metadata=dict(sample.metadata), reward=0.0, advantage=0.0, error=None,
                   rollout_routed_experts=None if sample.rollout_routed_experts is None
                   else routing_copy(sample.rollout_routed_experts))


def unfinished(sample: Sample) -> bool:
    """Whether the sample was cut by the abort (or never started) and needs more engine calls."""
    return sample.finish_reason == "abort"
