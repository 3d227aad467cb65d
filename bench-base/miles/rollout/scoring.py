"""Which reward scores which sample, chosen once from the rollout's config, and scoring a rollout.

- `--custom-rm-path module:fn` scores every sample; with `--group-rm` (or the function marked
  `@group_reward`) it gets all responses to a prompt in one call.
- Otherwise `--rm-type` (a built-in, `boxed_<type>`, or `remote_rm` posting to `--rm-url`), unless a
  sample's `metadata["rm_type"]` names another type for that sample (miles' per-sample override;
  it comes from the row's `--metadata-key` dict, or a generate function sets it).
- `--reward-key KEY` picks one entry of dict-valued rewards.
- `--reward-timeout S` bounds each call: one past it fails its sample(s) (reward 0.0, `on_timeout`
  hears of each), not the rollout (`miles.rollout.rewards.score_group`).
- An eval dataset of `--eval-config` with its own `rm_type` scores with that one (`score(default=)`).

Only completed and truncated samples are scored: an aborted or failed sample keeps reward 0.0 and is
left out of its group's advantage statistics (`Sample.trainable`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from miles.config import ConfigError, RolloutConfig
from miles.rollout.meter import reward_call
from miles.rollout.remote_reward import RemoteReward, check_reachable
from miles.rollout.rewards import (REMOTE_RM, builtin_reward, group_reward, import_reward_fn, is_group_reward,
                                   score_group, with_reward_key)
from miles.types import Prompt, Sample

RM_TYPE_KEY = "rm_type"        # the metadata key of a per-sample reward type


class Rewards:
    """The run's reward functions. A plain object; the rollout executor owns it."""

    def __init__(self, cfg: RolloutConfig, *, timeout_s: float | None = None,
                 on_timeout: Callable[[Sample], None] | None = None):
        self._cfg = cfg
        self._timeout_s, self._on_timeout = timeout_s, on_timeout
        self._by_type: dict[str, Callable[..., Any]] = {}
        self._remote: list[RemoteReward] = []
        self._custom = self._load_custom(cfg) if cfg.custom_rm_path else None
        self._default = self._custom or self.for_type(cfg.rm_type, flag="--rm-type")

    def _load_custom(self, cfg: RolloutConfig) -> Callable[..., Any]:
        fn = import_reward_fn(cfg.custom_rm_path)
        if cfg.group_rm and not is_group_reward(fn):
            fn = group_reward(_GroupCall(fn))
        return with_reward_key(fn, cfg.reward_key) if cfg.reward_key else fn

    def for_type(self, rm_type: str, *, flag: str) -> Callable[..., Any]:
        """The reward of a type name (built once per name)."""
        if rm_type not in self._by_type:
            fn: Callable[..., Any] = self._make_remote() if rm_type == REMOTE_RM else builtin_reward(rm_type, flag=flag)
            self._by_type[rm_type] = with_reward_key(fn, self._cfg.reward_key) if self._cfg.reward_key else fn
        return self._by_type[rm_type]

    def _make_remote(self) -> RemoteReward:
        c = self._cfg
        if not c.rm_url:
            raise ConfigError("--rm-type remote_rm needs --rm-url URL: the reward service to post responses to")
        remote = RemoteReward(c.rm_url, timeout_s=c.rm_timeout_s, max_retries=c.rm_max_retries,
                              backoff_s=c.rm_retry_backoff_s)
        self._remote.append(remote)
        return remote

    def fn_for(self, sample: Sample, default: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """The function that scores `sample`: its metadata's type (unless a custom reward is set), else
        `default` (an eval dataset's rm_type), else the run's (--custom-rm-path, else --rm-type)."""
        rm_type = sample.metadata.get(RM_TYPE_KEY) if self._custom is None else None
        if rm_type:
            return self.for_type(str(rm_type), flag=f"metadata {RM_TYPE_KEY!r} of prompt {sample.prompt.index}")
        return default or self._default

    def check_prompts(self, prompts: Iterable[Prompt]) -> None:
        """Start-up check: every per-sample type the data names is a reward (ConfigError otherwise)."""
        if self._custom is not None:
            return
        for p in prompts:
            rm_type = p.metadata.get(RM_TYPE_KEY) if isinstance(p.metadata, dict) else None
            if rm_type:
                self.for_type(str(rm_type), flag=f"metadata {RM_TYPE_KEY!r} of prompt {p.index}")

    async def check_services(self) -> None:
        """Start-up check: every reward service the run will post to answers."""
        for remote in self._remote:
            await check_reachable(remote.url, timeout_s=min(remote.timeout_s, 10.0),
                                  attempts=self._cfg.rm_max_retries + 1, backoff_s=self._cfg.rm_retry_backoff_s)

    async def score(self, samples: list[Sample], n: int, *, default: Callable[..., Any] | None = None) -> None:
        """Fill `reward` of every scorable sample, group by group (groups of `n`, in order); `default`
        replaces the run's reward (see `fn_for`)."""
        calls = []
        for start in range(0, len(samples), n):
            group = [s for s in samples[start:start + n] if s.trainable]
            for fn, part in self._partition(group, default):
                calls.append(self._score_part(fn, part))
        await asyncio.gather(*calls)

    def _partition(self, group: list[Sample],
                   default: Callable[..., Any] | None) -> list[tuple[Callable[..., Any], list[Sample]]]:
        parts: dict[int, tuple[Callable[..., Any], list[Sample]]] = {}
        for s in group:
            fn = self.fn_for(s, default)
            parts.setdefault(id(fn), (fn, []))[1].append(s)
        return list(parts.values())

    async def _score_part(self, fn: Callable[..., Any], part: list[Sample]) -> None:
        prompt = part[0].prompt
        on_timeout = (lambda i: self._on_timeout(part[i])) if self._on_timeout is not None else None
        with reward_call(len(part)):               # counted for the progress line of a long phase
            scores = await score_group(fn, prompt, [s.response_text for s in part], prompt.label,
                                       timeout_s=self._timeout_s, on_timeout=on_timeout)
        for s, r in zip(part, scores):
            s.reward = float(r)

    async def close(self) -> None:
        for remote in self._remote:
            await remote.close()


class _GroupCall:
    """--group-rm on a plain function: it is called as fn(prompt, responses, label)."""

    def __init__(self, fn: Callable[..., Any]):
        self._fn = fn
        self.__module__, self.__qualname__ = getattr(fn, "__module__", ""), getattr(fn, "__qualname__", repr(fn))

    def __call__(self, prompt: Prompt, responses: list[str], label: str | None) -> Any:
        return self._fn(prompt, responses, label)
