"""miles' rollout hooks, by import path: a filter over the rollout's samples, a hook over every sample
the rollout generated, and a reward post-process that replaces the group baseline.

The executor calls them as miles does, once per rollout, in this order:
1. `--rollout-sample-filter-path`: `fn(ctx, groups: list[list[Sample]]) -> None` on the rollout's
   groups (after dynamic sampling). It changes samples in place; `sample.remove_sample = True` takes a
   sample out of training (its loss mask becomes all 0) while it still counts in its group's
   statistics, as in miles. The groups themselves must stay as they are.
2. `--rollout-all-samples-process-path`: `fn(ctx, all_groups: list[list[Sample]]) -> None` on every
   group generated for the rollout, those dynamic sampling filtered out included (statistics, logging).
3. `--custom-reward-post-process-path`: `fn(ctx, samples: list[Sample]) -> (raw_rewards, rewards)`,
   two lists of one number per sample: `rewards` are the samples' advantages in place of the
   estimator's group baseline (reinforce_plus_plus_baseline then whitens them over the batch, as
   without the hook); `raw_rewards` are logged (`raw_reward_mean`).

Where miles passes its `args` namespace, a hook gets `ctx` (`HookContext`): the rollout id and the
run's rollout and algorithm configs. miles' all-samples hook also gets its data source, which has no
counterpart here (prompts come from --prompt-data, drawn by the executor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from miles.config import AlgorithmConfig, RolloutConfig
from miles.types import Sample
from miles.user_code import check_signature, display_name, import_user_function

SAMPLE_FILTER_FLAG = "--rollout-sample-filter-path"
ALL_SAMPLES_FLAG = "--rollout-all-samples-process-path"
REWARD_POST_PROCESS_FLAG = "--custom-reward-post-process-path"


@dataclass(frozen=True)
class HookContext:
    """What a rollout hook gets where miles passes `args`."""

    rollout_id: int
    rollout: RolloutConfig        # n_samples_per_prompt, batch_size, ... (the --rollout-* flags)
    algorithm: AlgorithmConfig    # advantage_estimator, ... (the loss and advantage flags)


GroupsHook = Callable[[HookContext, list[list[Sample]]], None]
RewardPostProcess = Callable[[HookContext, list[Sample]], tuple[Sequence[float], Sequence[float]]]


class HookError(RuntimeError):
    """A hook returned or did something the rollout cannot take; the message names the flag and the fix."""


def _load(flag: str, path: str, shape: str) -> Callable[..., object]:
    fn = import_user_function(path, flag)
    check_signature(fn, flag, path, 2, shape)
    return fn


def load_sample_filter(path: str) -> GroupsHook:
    return _load(SAMPLE_FILTER_FLAG, path, "fn(ctx, groups: list[list[Sample]]) -> None")


def load_all_samples_process(path: str) -> GroupsHook:
    return _load(ALL_SAMPLES_FLAG, path, "fn(ctx, all_groups: list[list[Sample]]) -> None")


def load_reward_post_process(path: str) -> RewardPostProcess:
    return _load(REWARD_POST_PROCESS_FLAG, path, "fn(ctx, samples: list[Sample]) -> (raw_rewards, rewards)")


def check_hooks(rollout: RolloutConfig) -> None:
    """Start-up check, on the driver: each hook set imports and takes two arguments (ConfigError otherwise)."""
    RolloutHooks.from_config(rollout)


def group(samples: list[Sample], n: int) -> list[list[Sample]]:
    """The rollout's samples as its groups of n (samples[i * n : (i + 1) * n] answer one prompt)."""
    return [samples[i:i + n] for i in range(0, len(samples), n)]


@dataclass(frozen=True)
class RolloutHooks:
    """The hooks a run set (None: not set), loaded once when the executor is built."""

    sample_filter: GroupsHook | None = None
    all_samples: GroupsHook | None = None
    reward_post_process: RewardPostProcess | None = None

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> RolloutHooks:
        r = rollout
        return cls(
            sample_filter=load_sample_filter(r.sample_filter_path) if r.sample_filter_path else None,
            all_samples=load_all_samples_process(r.all_samples_process_path) if r.all_samples_process_path else None,
            reward_post_process=(load_reward_post_process(r.reward_post_process_path)
                                 if r.reward_post_process_path else None))

    def process(self, ctx: HookContext, samples: list[Sample], all_groups: list[list[Sample]]) -> None:
        """Steps 1 and 2 of the module docstring on a rollout's samples (grouped by n_samples_per_prompt)."""
        if self.sample_filter is not None:
            groups = group(samples, ctx.rollout.n_samples_per_prompt)
            self.sample_filter(ctx, groups)
            after = [s for g in groups for s in g]
            if len(after) != len(samples) or any(a is not b for a, b in zip(after, samples)):
                raise HookError(f"{SAMPLE_FILTER_FLAG} {display_name(self.sample_filter)} changed the rollout's "
                                f"groups ({len(samples)} samples in, {len(after)} after): the batch keeps its "
                                "samples; set sample.remove_sample = True to leave one out of training, as in miles")
        if self.all_samples is not None:
            self.all_samples(ctx, all_groups)

    def advantages(self, ctx: HookContext, samples: list[Sample]) -> tuple[list[float], list[float]]:
        """Step 3: (raw_rewards, rewards) from the reward post-process, checked to be one finite number
        per sample."""
        assert self.reward_post_process is not None
        name = display_name(self.reward_post_process)
        out = self.reward_post_process(ctx, samples)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise HookError(f"{REWARD_POST_PROCESS_FLAG} {name} returned {type(out).__name__}; expected "
                            "(raw_rewards, rewards): two lists of one number per sample")
        raw, rewards = (_numbers(name, what, values, len(samples)) for what, values in zip(("raw_rewards", "rewards"), out))
        return raw, rewards


def _numbers(name: str, what: str, values: object, n: int) -> list[float]:
    try:
        out = [float(v) for v in values]  # type: ignore[union-attr]
    except (TypeError, ValueError) as e:
        raise HookError(f"{REWARD_POST_PROCESS_FLAG} {name}: its {what} are not numbers ({e})") from None
    if len(out) != n:
        raise HookError(f"{REWARD_POST_PROCESS_FLAG} {name} returned {len(out)} {what} for the rollout's {n} "
                        "samples; return one per sample, in the samples' order")
    bad = [i for i, v in enumerate(out) if not math.isfinite(v)]
    if bad:
        raise HookError(f"{REWARD_POST_PROCESS_FLAG} {name}: {what}[{bad[0]}] is {out[bad[0]]}; "
                        f"{len(bad)} of {n} are not finite")
    return out

