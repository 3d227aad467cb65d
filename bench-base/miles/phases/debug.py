"""Half runs for debugging, as miles has them: roll out without training, or train without engines.

- `--debug-rollout-only` (machine `rollout_only`): engines and the executor, no trainer. Each
  rollout is generated, scored and logged (a metrics row of kind "rollout"); the weights stay the
  initial ones. With `--save-debug-rollout-data PATH`, each rollout's samples go to disk.
- `--load-debug-rollout-data PATH` (machine `train_only`): the trainer and no engines. The `rollout`
  phase reads rollout r from PATH instead of generating it; `train` and `save` are the usual ones.
  Replaying the rollouts of a run that trained on them gives the same losses, step for step.

`miles train` picks the machine from the flag; `check_debug_flags` refuses a machine that does not
fit (a `sync` run cannot train from disk: it would still start engines and sync weights).
"""

from __future__ import annotations

import ray

from miles.config import ConfigError, RunConfig
from miles.phases.context import TrainingContext
from miles.phases.rollout import rollout
from miles.phases.watch import watch_reward_variance
from miles.tracking.rollout_data import load_rollout_data, rollout_data_path

MACHINES = {"load_debug_rollout_data": ("train_only", "--load-debug-rollout-data"),
            "debug_rollout_only": ("rollout_only", "--debug-rollout-only")}


def debug_machine(cfg: RunConfig) -> str | None:
    """The machine a debug flag implies (None: no debug flag)."""
    picked = [machine for field, (machine, _) in MACHINES.items() if getattr(cfg, field)]
    return picked[0] if len(picked) == 1 else None


def check_debug_flags(cfg: RunConfig, machine: str) -> None:
    """A debug flag needs its machine, and its machine needs the flag."""
    problems = []
    given = [(machine_for, flag) for field, (machine_for, flag) in MACHINES.items() if getattr(cfg, field)]
    if len(given) > 1:
        problems.append("--load-debug-rollout-data and --debug-rollout-only exclude each other: "
                        "one trains without engines, the other rolls out without a trainer")
    for machine_for, flag in given:
        if machine != machine_for:
            problems.append(f"{flag} runs on --machine {machine_for}, not {machine!r} (miles train picks it "
                            "when --machine is not given)")
    for field, (machine_for, flag) in MACHINES.items():
        if machine == machine_for and not getattr(cfg, field):
            problems.append(f"--machine {machine_for} needs {flag}")
    if cfg.debug_rollout_data_path and machine == "async":     # its rollouts come from the prefetcher
        flag = "--save-debug-rollout-data" if cfg.save_debug_rollout_data else "--dump-details"
        problems.append(f"{flag} is not supported by --machine async yet; use sync")
    if cfg.debug_rollout_only and (cfg.checkpoint.load or cfg.checkpoint.save):
        problems.append("--debug-rollout-only has no trainer to --save or --load; drop those flags")
    if problems:
        raise ConfigError(problems)


async def load_rollout(ctx: TrainingContext) -> str:
    """train_only's `rollout`: rollout r from disk, into the object store for the trainer."""
    ctx.rollout_id = rid = ctx.next_rollout
    path = rollout_data_path(ctx.cfg.load_debug_rollout_data, rid)
    saved = load_rollout_data(path, expect_rollout_id=rid)
    ctx.batch_ref = ray.put(saved.samples)
    ctx.last_metrics = {}
    ctx.record(rid, saved.metrics)
    ctx.tracer.emit("rollout_done", rollout_id=rid, reward_mean=saved.metrics.get("reward_mean"),
                    samples=len(saved.samples), loaded_from=str(path))
    return "next"


async def rollout_only(ctx: TrainingContext) -> str:
    """rollout_only's `rollout`: the usual rollout (saved when asked), logged, and nothing trains on it."""
    trigger = await rollout(ctx)
    rid = ctx.rollout_id
    ctx.batch_ref = None
    ctx.next_rollout = rid + 1
    ctx.record(rid, {"kind": "rollout"})
    ctx.c.metrics.log(rid, ctx.last_metrics)
    ctx.metrics_history.append(dict(ctx.last_metrics))
    ctx.tracer.emit("metrics", rollout_id=rid, reward_mean=ctx.last_metrics.get("reward_mean"),
                    **watch_reward_variance(ctx, ctx.last_metrics))
    return trigger
