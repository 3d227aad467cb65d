"""Start one run: its directory, trace, context and runner, driven under the caller's disposer.

`train(cfg, disposer=d)` is the seed's driver shape (`asyncio.run(with_disposer(train, cfg))`). It
installs no signal handlers and never exits the process: the CLI (`miles/cli/train.py`) does that.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from miles.config import RunConfig, as_dict
from miles.phases.context import TrainingContext
from miles.phases.faults import parse_fault, with_faults
from miles.runtime import Disposer, Runner, Tracer, load_machine
from miles.runtime.runlock import FolderLock, describe_holder, lock_folders, run_folders
from miles.runtime.files import WriteFailed
from miles.runtime.trace import new_run_id, next_segment_path
from miles.config.validate import validate_for_machine


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    final_state: str
    metrics: list[dict[str, Any]] = field(default_factory=list)
    trace_path: Path | None = None          # this run's segment of the run dir's trace
    lost: list[dict[str, Any]] = field(default_factory=list)   # what it lost without failing (Ray's logs, ...)


def lock_run(cfg: RunConfig, run_id: str) -> list[FolderLock]:
    """The locks of the folders the run writes (miles.runtime.runlock); FolderLocked names a holder."""
    c = cfg.checkpoint
    return lock_folders(run_folders(cfg.trace.run_dir, run_id, save=c.save, critic_save=c.critic_save), run_id=run_id)


def prepare_run(cfg: RunConfig, *, machine: str = "sync", run_id: str | None = None,
                disposer: Disposer, listeners: list[Callable[[dict[str, Any]], None]] | None = None,
                stop: asyncio.Event | None = None, locks: list[FolderLock] | None = None) -> tuple[Runner, TrainingContext]:
    """Everything up to the first phase: the folders' locks (`locks`: taken by the caller already),
    run dir, config.yaml, trace segment, context and runner."""
    disposer.default_timeout, disposer.deadline = cfg.trace.teardown_timeout_s, cfg.trace.teardown_deadline_s
    for lock in locks or ():                     # first registered: released last, after everything else
        disposer.add(lock)
    definition = load_machine(machine)
    validate_for_machine(cfg, definition)        # before the run dir exists: bad input starts nothing
    handlers = definition.resolve_phases()       # so is a phase that does not import (a missing package)
    run_id = run_id or new_run_id()
    if locks is None:
        locks = lock_run(cfg, run_id)
        for lock in locks:
            disposer.add(lock)
    run_dir = Path(cfg.trace.run_dir or f"runs/{run_id}")
    _write_config(run_dir, {"machine": definition.name, **as_dict(cfg)})
    tracer = Tracer(next_segment_path(run_dir), run_id=run_id, machine=definition.name,
                    machine_hash=definition.hash, console=cfg.trace.console, listeners=listeners)
    disposer.bind_tracer(tracer)
    for lock in locks:
        if lock.taken_over is not None:
            tracer.emit("lock_taken_over", folder=str(lock.folder), flag=lock.what, holder=lock.taken_over,
                        message=f"{lock.what} {lock.folder} was locked by a run that is gone "
                                f"({describe_holder(lock.taken_over)}); taken over")
    ctx = TrainingContext(cfg, run_id=run_id, run_dir=run_dir, tracer=tracer, disposer=disposer)
    if stop is not None:
        ctx.stop_requested = stop
    if cfg.inject_faults:
        handlers = with_faults(handlers, [parse_fault(f) for f in cfg.inject_faults])
    r = cfg.reliability
    return Runner(definition, ctx, handlers=handlers, deadlines=definition.deadlines(r.deadline_overrides(definition.states)),
                  stop_timeout_s=r.stop_timeout_s), ctx


def _write_config(run_dir: Path, config: dict[str, Any]) -> None:
    """`<run_dir>/config.yaml`; a write error names the file and the space left (WriteFailed)."""
    path = run_dir / "config.yaml"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    except OSError as exc:
        error = WriteFailed("the run's config", path, exc)
        with suppress(OSError):
            path.unlink(missing_ok=True)      # not half a config
        raise error


async def train(cfg: RunConfig, *, disposer: Disposer, machine: str = "sync", run_id: str | None = None,
                stop: asyncio.Event | None = None,
                listeners: list[Callable[[dict[str, Any]], None]] | None = None,
                locks: list[FolderLock] | None = None) -> RunResult:
    """Run `machine` to its end. Raises the run's first failure after the teardown."""
    runner, ctx = prepare_run(cfg, machine=machine, run_id=run_id, disposer=disposer, listeners=listeners,
                              stop=stop, locks=locks)
    try:
        final = await runner.run()
    finally:
        ctx.tracer.close()
    return RunResult(run_id=ctx.run_id, run_dir=ctx.run_dir, final_state=final, metrics=ctx.metrics_history,
                     trace_path=ctx.tracer.path, lost=ctx.tracer.losses())
