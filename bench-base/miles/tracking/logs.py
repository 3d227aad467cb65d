"""Structured logs of the run's processes, written into the run directory.

Each Ray actor of a run (engines, trainer, critic, rollout executor) writes JSON lines to
`<run_dir>/logs/<role>-<rank>.jsonl` (a restarted engine: `engine-0-r1.jsonl`). Every line carries
`run_id`, `role`, `rank`, `ts`, `level`, and the `rollout_id` of the call it came from, so
`grep '"rollout_id": 7' runs/x/logs/*.jsonl` shows what every actor did for rollout 7. Warnings and
errors also go to the process's stderr, which Ray forwards to the driver's terminal.

How it gets there: `RayCluster.actor` starts `logged_actor_class(cls, context)` instead of `cls`, a
subclass whose constructor configures structlog in the actor's own process before the component's
constructor runs (so `engine_ready` is in the file), and whose public methods taking a `rollout_id`
bind it for the duration of the call. Not Ray's job-level `worker_process_setup_hook`: it cannot
tell a trainer from an engine, and a host that started Ray itself for several runs shares one job
between runs whose logs belong in different directories. Components stay plain classes; tests and
hosts that construct them directly are untouched.

The CLI does the same for the driver (`configure_process_logging`, `driver-0.jsonl`): the CLI owns
its process, while library code never configures logging globally.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

import structlog

from miles.runtime.files import LineFile, WriteFailed

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_METHOD_LEVEL = {"warn": "warning", "exception": "error", "fatal": "critical", "msg": "info", "log": "info"}
_ACTOR_NAME = re.compile(r"^(?P<role>.+?)-(?P<rank>\d+)(?:-r(?P<restart>\d+))?$")
_open_file: "_LazyFile | None" = None       # this process's log file, replaced if configured again


@dataclass(frozen=True)
class LogContext:
    """Who is logging: bound to every line of one process."""

    run_id: str
    log_dir: str
    role: str
    rank: int = 0
    restart: int | None = None
    level: str = "info"

    @property
    def path(self) -> Path:
        suffix = f"-r{self.restart}" if self.restart is not None else ""
        return Path(self.log_dir) / f"{self.role}-{self.rank}{suffix}.jsonl"


def context_for_actor(name: str, *, run_id: str, log_dir: str | Path, level: str = "info") -> LogContext:
    """`engine-0` → role engine, rank 0; `engine-0-r2` → its second restart; `trainer` → rank 0."""
    m = _ACTOR_NAME.match(name)
    if m is None:
        return LogContext(run_id=run_id, log_dir=str(log_dir), role=name, level=level)
    restart = int(m["restart"]) if m["restart"] is not None else None
    return LogContext(run_id=run_id, log_dir=str(log_dir), role=m["role"], rank=int(m["rank"]),
                      restart=restart, level=level)


def configure_process_logging(context: LogContext, *, stderr: TextIO | None = None) -> Path:
    """Route this process's structlog output to `context.path` (JSON lines); warnings and above
    also to `stderr` (default: sys.stderr at the time of the call). Returns the file's path."""
    global _open_file
    if context.level not in LEVELS:
        raise ValueError(f"log level {context.level!r}: use one of {', '.join(LEVELS)}")
    path = context.path
    if _open_file is not None and not _open_file.closed:
        _open_file.close()
    _open_file = _LazyFile(path)
    bound = {"run_id": context.run_id, "role": context.role, "rank": context.rank}
    if context.restart is not None:
        bound["restart"] = context.restart
    chain = [
        _AtLeast(LEVELS[context.level]),
        structlog.contextvars.merge_contextvars,
        _static(bound),
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
        structlog.processors.format_exc_info,
        _Tee(stderr),
        structlog.processors.JSONRenderer(default=str),
        _WriteTo(_open_file),
    ]
    # In place, not `configure(processors=...)`: a logger bound at import time (the components'
    # module-level `log = structlog.get_logger().bind(role=...)`, imported when Ray unpickles the
    # actor class, before this runs) holds the default list itself, not a lookup of it. The level
    # filter and the file are in the chain for the same reason: such a logger keeps its old wrapper
    # class and logger. tests/unit/test_tracking_logs.py pins this.
    structlog.get_config()["processors"][:] = chain
    structlog.configure(cache_logger_on_first_use=False)
    return path


class _AtLeast:
    """Drop events below the level (by the logging method's name: info, warning, exception...)."""

    def __init__(self, level: int):
        self.level = level

    def __call__(self, _logger: Any, name: str, ev: dict[str, Any]) -> dict[str, Any]:
        if LEVELS.get(_METHOD_LEVEL.get(name, name), LEVELS["info"]) < self.level:
            raise structlog.DropEvent
        return ev


class _WriteTo:
    """The end of the chain: write the rendered line to the file, and stop there (the logger a
    module bound at import time would print it to stdout otherwise)."""

    def __init__(self, file: "_LazyFile"):
        self.file = file

    def __call__(self, _logger: Any, _name: str, line: str) -> Any:
        self.file.write_line(line)
        raise structlog.DropEvent


class _LazyFile:
    """Opened (folder and all) at the first line: a run that fails its checks leaves no directory.
    Each line is on disk when written, so a killed process loses nothing it logged. A log is the
    process's diagnostics, not the run's record: when it cannot be written (a full disk) the process
    says so once on stderr (file, reason, space left) and goes on without it (`lost`)."""

    def __init__(self, path: Path):
        self.path, self._file, self.closed = path, None, False
        self.lost: WriteFailed | None = None

    def write_line(self, line: str) -> None:
        if self.lost is not None or self.closed:
            return
        try:
            if self._file is None:
                try:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise WriteFailed("the log's folder", self.path.parent, exc)
                self._file = LineFile(self.path, "the log")
            self._file.write_line(line)
        except WriteFailed as exc:
            self.lost = exc
            _say(f"[warning] log_lost {exc}; this process's later log lines are not kept")

    def close(self) -> None:
        self.closed = True
        if self._file is not None:
            self._file.close()


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):       # no stderr either: nothing more to do
        pass


def _static(fields: dict[str, Any]) -> Callable[[Any, str, dict[str, Any]], dict[str, Any]]:
    def add(_logger: Any, _name: str, ev: dict[str, Any]) -> dict[str, Any]:
        for k, v in fields.items():
            ev.setdefault(k, v)
        return ev
    return add


class _Tee:
    """Warnings and errors also go to stderr, as one short line (Ray prefixes it with the actor)."""

    def __init__(self, stream: TextIO | None):
        self.stream = stream

    def __call__(self, _logger: Any, name: str, ev: dict[str, Any]) -> dict[str, Any]:
        # stderr=False: for the file only (the CLI's full traceback of a failure it summarised already)
        if ev.pop("stderr", True) and LEVELS.get(ev.get("level", ""), 0) >= LEVELS["warning"]:
            extra = " ".join(f"{k}={v}" for k, v in ev.items() if k not in ("event", "level", "ts", "run_id"))
            print(f"[{ev['level']}] {ev.get('event')} {extra}", file=self.stream or sys.stderr, flush=True)
        return ev


def logged_actor_class(cls: type, context: LogContext) -> type:
    """A subclass of `cls` that logs into the run directory: its constructor configures this
    process's logging first; its public methods with a `rollout_id` parameter bind it per call."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        configure_process_logging(context)
        log = structlog.get_logger()
        try:
            cls.__init__(self, *args, **kwargs)
        except Exception:
            log.exception("actor_init_failed", actor=cls.__qualname__, pid=os.getpid())
            raise
        log.info("actor_ready", actor=cls.__qualname__, pid=os.getpid())

    namespace: dict[str, Any] = {"__init__": __init__, "__doc__": cls.__doc__, "__module__": __name__}
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("_") and "rollout_id" in inspect.signature(fn).parameters:
            namespace[name] = _binding_rollout_id(fn)
    return type(cls.__name__, (cls,), namespace)


def _binding_rollout_id(fn: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(fn)

    def rollout_id_of(args: tuple, kwargs: dict) -> dict[str, Any]:
        try:
            rid = sig.bind_partial(*args, **kwargs).arguments.get("rollout_id")
        except TypeError:
            return {}            # a bad call: let the method itself raise the TypeError
        return {} if rid is None else {"rollout_id": rid}

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def bound_async(*args: Any, **kwargs: Any) -> Any:
            with structlog.contextvars.bound_contextvars(**rollout_id_of(args, kwargs)):
                return await fn(*args, **kwargs)
        return bound_async
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        return fn                # a generator outlives the call: binding here would leak into others

    @functools.wraps(fn)
    def bound(*args: Any, **kwargs: Any) -> Any:
        with structlog.contextvars.bound_contextvars(**rollout_id_of(args, kwargs)):
            return fn(*args, **kwargs)
    return bound


class process_logging:
    """`with process_logging(context):` route this process's structlog output into the run dir for
    the block, then put back the configuration there was (the CLI's driver; tests run it in-process)."""

    def __init__(self, context: LogContext):
        self.context = context
        self._saved: dict[str, Any] | None = None

    def __enter__(self) -> Path:
        self._saved = {**structlog.get_config()}
        self._saved["processors"] = list(self._saved["processors"])
        return configure_process_logging(self.context)

    def __exit__(self, *exc: Any) -> None:
        global _open_file
        assert self._saved is not None
        procs = self._saved.pop("processors")
        structlog.configure(**self._saved)
        structlog.get_config()["processors"][:] = procs     # in place, as configured (see above)
        if _open_file is not None and not _open_file.closed:
            _open_file.close()
        _open_file = None
