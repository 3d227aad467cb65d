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

Two more run after the rollout's metrics (and the eval's) are computed, as miles' log functions do:
4. `--custom-rollout-log-function-path`: `fn(ctx, samples, metrics, rollout_time_s) -> bool | None`.
   `metrics` is the rollout's row (metrics.jsonl and the trackers); the function may add entries to it.
   Returning True means, as in miles, that its metrics replace the default ones: the row keeps what the
   function added or changed, plus `LOOP_METRICS`, which the training loop itself reads.
5. `--custom-eval-rollout-log-function-path`: `fn(ctx, data, metrics) -> bool | None` after each eval,
   `data` mapping each eval dataset's name to its samples; True keeps only what the function added or changed.
miles' log functions get miles' `rollout_extra_metrics` / `extra_metrics` and log themselves (to W&B);
here they write into `metrics`, which is what reaches every tracker.

Where miles passes its `args` namespace, a hook gets `ctx` (`HookContext`): the rollout id and the
run's rollout and algorithm configs, and, as attributes, the keys of --custom-config-path (miles'
`args.my_key` is `ctx.my_key`). miles' all-samples hook also gets its data source, which has no
counterpart here (prompts come from --prompt-data, drawn by the executor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from miles.config import AlgorithmConfig, RolloutConfig
from miles.types import Sample
from miles.user_code import CustomArgsAccess, check_signature, display_name, import_user_function

SAMPLE_FILTER_FLAG = "--rollout-sample-filter-path"
ALL_SAMPLES_FLAG = "--rollout-all-samples-process-path"
REWARD_POST_PROCESS_FLAG = "--custom-reward-post-process-path"
ROLLOUT_LOG_FLAG = "--custom-rollout-log-function-path"
EVAL_LOG_FLAG = "--custom-eval-rollout-log-function-path"
# the rollout metrics the training loop reads (the trace's rollout_done, the zero-variance and staleness
# watches): a log function that replaces the default metrics cannot take them out of the row
LOOP_METRICS = ("rollout_id", "reward_mean", "num_samples", "zero_std_group_ratio", "staleness_max",
                "weight_version_min")


@dataclass(frozen=True)
class HookContext(CustomArgsAccess):
    """What a rollout hook gets where miles passes `args`; `ctx.my_key` reads --custom-config-path's keys."""

    rollout_id: int
    rollout: RolloutConfig        # n_samples_per_prompt, batch_size, ... (the --rollout-* flags)
    algorithm: AlgorithmConfig    # advantage_estimator, ... (the loss and advantage flags)


GroupsHook = Callable[[HookContext, list[list[Sample]]], None]
RewardPostProcess = Callable[[HookContext, list[Sample]], tuple[Sequence[float], Sequence[float]]]
RolloutLog = Callable[[HookContext, list[Sample], dict[str, float], float], object]
EvalLog = Callable[[HookContext, dict[str, list[Sample]], dict[str, float]], object]


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


def load_rollout_log(path: str) -> RolloutLog:
    fn = import_user_function(path, ROLLOUT_LOG_FLAG)
    check_signature(fn, ROLLOUT_LOG_FLAG, path, 4, "fn(ctx, samples, metrics: dict, rollout_time_s) -> bool | None")
    return fn


def load_eval_log(path: str) -> EvalLog:
    fn = import_user_function(path, EVAL_LOG_FLAG)
    check_signature(fn, EVAL_LOG_FLAG, path, 3, "fn(ctx, data: dict[str, list[Sample]], metrics: dict) -> bool | None")
    return fn


def check_hooks(rollout: RolloutConfig, eval_log_path: str | None = None) -> None:
    """Start-up check, on the driver: each hook set imports and takes its arguments (ConfigError otherwise)."""
    RolloutHooks.from_config(rollout, eval_log_path)


def group(samples: list[Sample], n: int) -> list[list[Sample]]:
    """The rollout's samples as its groups of n (samples[i * n : (i + 1) * n] answer one prompt)."""
    return [samples[i:i + n] for i in range(0, len(samples), n)]


@dataclass(frozen=True)
class RolloutHooks:
    """The hooks a run set (None: not set), loaded once when the executor is built."""

    sample_filter: GroupsHook | None = None
    all_samples: GroupsHook | None = None
    reward_post_process: RewardPostProcess | None = None
    rollout_log: RolloutLog | None = None
    eval_log: EvalLog | None = None

    @classmethod
    def from_config(cls, rollout: RolloutConfig, eval_log_path: str | None = None) -> RolloutHooks:
        r = rollout
        return cls(
            sample_filter=load_sample_filter(r.sample_filter_path) if r.sample_filter_path else None,
            all_samples=load_all_samples_process(r.all_samples_process_path) if r.all_samples_process_path else None,
            reward_post_process=(load_reward_post_process(r.reward_post_process_path)
                                 if r.reward_post_process_path else None),
            rollout_log=load_rollout_log(r.log_function_path) if r.log_function_path else None,
            eval_log=load_eval_log(eval_log_path) if eval_log_path else None)

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

    def log_rollout(self, ctx: HookContext, samples: list[Sample], metrics: dict[str, float],
                    rollout_time_s: float) -> dict[str, float]:
        """Step 4: the rollout's metrics row after the log function (unchanged without one)."""
        if self.rollout_log is None:
            return metrics
        return _logged(ROLLOUT_LOG_FLAG, self.rollout_log, metrics, LOOP_METRICS,
                       lambda row: self.rollout_log(ctx, samples, row, rollout_time_s))

    def log_eval(self, ctx: HookContext, data: dict[str, list[Sample]], metrics: dict[str, float]) -> dict[str, float]:
        """Step 5: the eval's metrics row after the eval log function (unchanged without one)."""
        if self.eval_log is None:
            return metrics
        return _logged(EVAL_LOG_FLAG, self.eval_log, metrics, (), lambda row: self.eval_log(ctx, data, row))


def _logged(flag: str, fn: Callable[..., object], defaults: dict[str, float], kept: Sequence[str],
            call: Callable[[dict[str, float]], object]) -> dict[str, float]:
    """Run a log function on a copy of the default metrics; a true result keeps only its own entries
    (those it added or changed) and the `kept` defaults."""
    row = dict(defaults)
    replace = call(row)
    bad = [k for k, v in row.items() if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        raise HookError(f"{flag} {display_name(fn)} put {bad[0]!r} = {row[bad[0]]!r} into the metrics; "
                        "metrics are numbers under string names")
    if replace:     # truthy, as miles reads it
        own = {k: v for k, v in row.items() if k not in defaults or defaults[k] != v}
        row = {**{k: defaults[k] for k in kept if k in defaults}, **own}
    return row


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

