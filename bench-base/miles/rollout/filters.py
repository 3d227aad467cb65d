"""Dynamic-sampling filters (DAPO, Yu et al. 2025): which prompt groups of a rollout to train on.

A filter is `fn(group: list[Sample]) -> bool`, True to keep the group: the n scored samples of one
prompt (rewards filled, before any reward shaping). With `--dynamic-sampling-filter-path`, the
executor samples rounds of `--over-sampling-batch-size` prompts until `--rollout-batch-size` groups
pass (see `RolloutExecutor`). Custom filters load like custom rewards: `module:function` or
`path/to/file.py:function`.
"""

from __future__ import annotations

from typing import Callable

import torch

from miles.algorithms import group_reward_std
from miles.user_code import check_signature, import_user_function
from miles.types import Sample

GroupFilter = Callable[[list[Sample]], bool]


def check_reward_nonzero_std(group: list[Sample]) -> bool:
    """Keep a group unless all its rewards are equal: such a group (all right or all wrong) has
    group-relative advantage 0 everywhere, so it adds nothing but noise and compute to the step."""
    rewards = torch.tensor([s.reward for s in group], dtype=torch.float64)
    return bool(group_reward_std(rewards, len(group))[0] > 0)


def load_filter(path: str) -> GroupFilter:
    """The filter at `path` (module:function or file.py:function); ConfigError naming the flag otherwise."""
    flag = "--dynamic-sampling-filter-path"
    fn = import_user_function(path, flag)
    check_signature(fn, flag, path, 1, "filter(group: list[Sample]) -> bool")
    return fn
