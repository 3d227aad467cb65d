"""The check registry: every rule a run's config must pass, each written once, all run by
`miles.config.validate.validate` before Ray starts (a bad config exits 2 in its first second).

A check is `fn(cfg: RunConfig, problems: list[str]) -> None`: it appends one line per problem, naming
the flag, the value and the fix. Config's own rules (`miles.config.validate`) and each backend's and
concern's (the engines and trainers, the rewards, the GPU plan, the fault injector, the tracking
sinks) register with `@check` in their own module. `CONTRIBUTORS` names those modules by import path,
as a machine names its phases: `run_checks` imports them when it runs, so `miles.config` imports
nothing of the code that reads it, and each contributor keeps its check beside the code it protects.
A contributor's module must stay light to import (no torch, no Ray): it is loaded on every parse.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .schema import RunConfig

Check = Callable[["RunConfig", list[str]], None]

# the modules above config that register checks; each is imported once, by the first run_checks
CONTRIBUTORS: tuple[str, ...] = (
    "miles.rollout.engines.registry",   # the engines' specs: tensor parallelism, each engine's own checks
    "miles.rollout.rewards",        # reward types
    "miles.checkpoint.megatron_format",  # --load / --ref-load naming Megatron checkpoints
    "miles.training.moe_checks",    # mixture-of-experts checkpoints and flags
    "miles.training.protocol",      # the trainers' specs: names, critic, model parallelism, each backend's checks
    "miles.cluster.placement",      # the GPU plan (known for --device cuda; init checks --device auto's)
    "miles.phases.faults",          # --inject-fault
    "miles.tracking.sinks",         # metrics sinks whose package is not installed
)

CHECKS: dict[str, Check] = {}       # "module:function" -> check, in registration order


def check(fn: Check) -> Check:
    """Register `fn` (a decorator). Registering the same function again replaces it, so a module
    reloaded by a test does not run its checks twice."""
    CHECKS[f"{fn.__module__}:{fn.__qualname__}"] = fn
    return fn


def run_checks(cfg: RunConfig) -> list[str]:
    """Every registered check's problems, config's own first, then the contributors', in order."""
    for module in CONTRIBUTORS:
        importlib.import_module(module)
    problems: list[str] = []
    for fn in list(CHECKS.values()):
        fn(cfg, problems)
    return problems
