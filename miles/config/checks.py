"""The check registry: every rule a run's config must pass, each written once, all run by
`miles.config.validate.validate` before Ray starts (a bad config exits 2 in its first second).

A check is `fn(cfg: RunConfig, problems: list[str]) -> None` (`Check`): it appends one line per problem,
naming the flag, the value and the fix. An engine's or a train backend's own check (`EngineSpec.check`,
`TrainBackendSpec.check`) is the same kind of callable, run by its registry's shared check; `lazy`
makes one whose module is heavy. Config's own rules (`miles.config.validate`) and each backend's and
concern's (the engines and trainers, the rewards, the GPU plan, the fault injector, the tracking
sinks) register with `@check` in their own module. `CONTRIBUTORS` names those modules by import path,
as a machine names its phases: `run_checks` imports them when it runs, so `miles.config` imports
nothing of the code that reads it, and each contributor keeps its check beside the code it protects.
A contributor's module must stay light to import (no torch, no Ray): it is loaded on every parse.

A rule that needs a fact known only later names it as a keyword-only parameter: `fn(cfg, problems, *,
machine)` runs once the lifecycle machine is picked (`validate(cfg, machine=MachineDef)`, before the run
dir exists), `fn(cfg, problems, *, num_engines)` once the placement knows the engine count (init, before
any actor). `run_checks(cfg, **facts)` runs the checks that need exactly the facts given: parse time
runs those that need none. One registry, one entry point (`miles.config.validate.validate`).
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any, Callable

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
    "miles.api.faults",             # --inject-fault
    "miles.metrics.sinks",          # metrics sinks whose package is not installed
    "miles.rollout.producer",       # --fully-async: the engine must swap weights in flight
)

def lazy(path: str) -> Check:
    """The check "module:function", its module imported when it first runs: a spec's `check` that sits
    beside heavy code (torch) stays a `Check` without loading that code on every parse."""
    def run(cfg: RunConfig, problems: list[str]) -> None:
        module, _, name = path.partition(":")
        getattr(importlib.import_module(module), name)(cfg, problems)
    run.__qualname__ = run.__name__ = path
    return run


CHECKS: dict[str, Check] = {}       # "module:function" -> check, in registration order
NEEDS: dict[str, frozenset[str]] = {}   # "module:function" -> the later facts it needs (its keyword-only parameters)


def check(fn: Check) -> Check:
    """Register `fn` (a decorator). Registering the same function again replaces it, so a module
    reloaded by a test does not run its checks twice."""
    key = f"{fn.__module__}:{fn.__qualname__}"
    CHECKS[key] = fn
    NEEDS[key] = frozenset(name for name, p in inspect.signature(fn).parameters.items()
                           if p.kind is inspect.Parameter.KEYWORD_ONLY)
    return fn


def run_checks(cfg: RunConfig, **facts: Any) -> list[str]:
    """The problems of every registered check that needs exactly `facts` (none: the parse-time checks),
    config's own first, then the contributors', in order."""
    for module in CONTRIBUTORS:
        importlib.import_module(module)
    problems: list[str] = []
    for key, fn in list(CHECKS.items()):
        if NEEDS[key] == set(facts):
            fn(cfg, problems, **facts)
    return problems
