"""Start one run: its directory, trace, context and runner, driven under the caller's disposer.

`train(cfg, disposer=d)` is the seed's driver shape (`asyncio.run(with_disposer(train, cfg))`). It
installs no signal handlers and never exits the process: the CLI (`miles/cli/train.py`) does that.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from miles.config import RunConfig, as_dict
from miles.phases.context import TrainingContext
from miles.phases.faults import parse_fault, with_faults
from miles.runtime import Disposer, Runner, Tracer, load_machine
from miles.config.validate import validate_for_machine


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    final_state: str
    metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def trace_path(self) -> Path:
        return self.run_dir / "trace.jsonl"



def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def prepare_run(cfg: RunConfig, *, machine: str = "sync", run_id: str | None = None,
                disposer: Disposer, listeners: list[Callable[[dict[str, Any]], None]] | None = None,
                stop: asyncio.Event | None = None) -> tuple[Runner, TrainingContext]:
    """Everything up to the first phase: run dir, config.yaml, trace, context and runner."""
    definition = load_machine(machine)
    validate_for_machine(cfg, definition)        # before the run dir exists: bad input starts nothing
    run_id = run_id or new_run_id()
    run_dir = Path(cfg.trace.run_dir or f"runs/{run_id}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"machine": definition.name, **as_dict(cfg)}, sort_keys=False))
    tracer = Tracer(run_dir / "trace.jsonl", run_id=run_id, machine=definition.name,
                    machine_hash=definition.hash, console=cfg.trace.console, listeners=listeners)
    disposer.default_timeout, disposer.deadline = cfg.trace.teardown_timeout_s, cfg.trace.teardown_deadline_s
    disposer.bind_tracer(tracer)
    ctx = TrainingContext(cfg, run_id=run_id, run_dir=run_dir, tracer=tracer, disposer=disposer)
    if stop is not None:
        ctx.stop_requested = stop
    handlers = definition.resolve_phases()
    if cfg.inject_faults:
        handlers = with_faults(handlers, [parse_fault(f) for f in cfg.inject_faults])
    r = cfg.reliability
    return Runner(definition, ctx, handlers=handlers, deadlines=definition.deadlines(r.phase_timeout_overrides),
                  stop_timeout_s=r.stop_timeout_s), ctx


async def train(cfg: RunConfig, *, disposer: Disposer, machine: str = "sync", run_id: str | None = None,
                stop: asyncio.Event | None = None,
                listeners: list[Callable[[dict[str, Any]], None]] | None = None) -> RunResult:
    """Run `machine` to its end. Raises the run's first failure after the teardown."""
    runner, ctx = prepare_run(cfg, machine=machine, run_id=run_id, disposer=disposer, listeners=listeners,
                              stop=stop)
    try:
        final = await runner.run()
    finally:
        ctx.tracer.close()
    return RunResult(run_id=ctx.run_id, run_dir=ctx.run_dir, final_state=final, metrics=ctx.metrics_history)
