"""The run's trace: one JSON object per line in `<run_dir>/trace.jsonl`, written through structlog.

Each run in a run directory writes a segment of its own: the first `trace.jsonl`, a resume into the
same directory `trace.2.jsonl`, then `trace.3.jsonl`, ... (`segment_paths` lists them in order), so
every segment is one run's whole story, with its own `run_start`, gapless `seq` and `run_end`.

Each `Tracer` owns its own structlog pipeline (`structlog.wrap_logger`, no global configuration), so
two runs in one process never see each other's events. Every event carries `seq` (gapless,
monotonic), `ts` (UTC ISO), `mono` (seconds since the tracer started), `run_id`, `machine` and
`machine_hash`; `emit` returns the event's `seq` so later events can name it as their `cause`.

A trace that cannot be written (its disk is full) never raises out of `emit`: the line that did not fit
is cut back out (the file ends in whole lines), the file is closed, `write_error` says which file, why
and the space left, and the later events still reach the console and the listeners. The runner fails
a run whose trace broke while it ran; one that broke during the teardown has lost only its last events
(`lost`). What else a run loses without failing (Ray's logs on a full disk) is a `lost` event
(`note_lost`), kept in `lost` for the final report.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import structlog

from .files import LineFile, WriteFailed

TRACE_FILE = "trace.jsonl"
_SEGMENT = re.compile(r"trace\.(\d+)\.jsonl")
CORE_FIELDS = (
    "seq", "ts", "mono", "run_id", "machine", "machine_hash", "event", "src", "dst", "trigger",
    "state", "rollout_id", "duration_s", "error", "cause",
)


def new_run_id() -> str:
    """`YYYYMMDD-HHMMSS-xxxxxx`: sortable by start time, unique enough for one machine's runs."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def error_record(exc: BaseException) -> dict[str, Any]:
    """The `error` field: type, message and formatted traceback of an exception (colour codes a
    library put in them removed), and `summary`: its root cause in one line (`error_summary`)."""
    return {
        "type": type(exc).__qualname__,
        "message": strip_ansi(str(exc)),
        "traceback": strip_ansi("".join(traceback.format_exception(exc))),
        "summary": error_summary(exc),
    }


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def root_cause(exc: BaseException) -> BaseException:
    """The exception a wrapper carries: Ray's RayTaskError keeps the one raised in the actor as
    `cause` (its own message is the remote traceback); anything else is its own root."""
    seen = {id(exc)}
    while isinstance(inner := getattr(exc, "cause", None), BaseException) and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    return exc


def error_summary(exc: BaseException) -> str:
    """`Type: message` of the root cause, on one line: what a person reads first."""
    root = root_cause(exc)
    problems = getattr(root, "problems", None)          # a ConfigError lists its problems
    lines = [str(p) for p in problems] if isinstance(problems, list) and problems else \
        [line.strip() for line in strip_ansi(str(root)).splitlines() if line.strip()][:1]
    return f"{type(root).__name__}: {'; '.join(lines)}" if lines else type(root).__name__


class _Sink:
    """The structlog 'logger' at the end of the pipeline: writes the rendered line to the trace file."""

    def __init__(self, file: LineFile | None):
        self.file = file

    def msg(self, line: str) -> None:
        if self.file is not None:
            self.file.write_line(line)

    info = msg


class Tracer:
    """Writes the trace of one run. Thread-safe; cheap enough to call on every transition."""

    def __init__(
        self,
        path: str | os.PathLike | None,
        *,
        run_id: str,
        machine: str = "",
        machine_hash: str = "",
        console: str = "off",          # auto | pretty | plain | off
        listeners: list[Callable[[dict[str, Any]], None]] | None = None,
    ):
        self.path = Path(path) if path is not None else None
        self.run_id, self.machine, self.machine_hash = run_id, machine, machine_hash
        self._lock = threading.Lock()
        self._seq = 0
        self._t0 = time.monotonic()
        self._listeners = list(listeners or [])
        self.write_error: WriteFailed | None = None   # the trace file failed (and was closed) at `broke_at`
        self.broke_at: int | None = None               # the seq of the first event not written
        self.lost: list[dict[str, Any]] = []           # what the run lost without failing (note_lost)
        file = None
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise WriteFailed("the trace's folder", self.path.parent, exc)
            file = LineFile(self.path, "the trace")
        self._file = file
        self._console = _console_renderer(console)
        self._log = structlog.wrap_logger(
            _Sink(file),
            processors=[self._stamp, self._to_console, structlog.processors.JSONRenderer(default=str)],
        )

    # -- structlog processors -------------------------------------------------------------------
    def _stamp(self, _logger: Any, _name: str, ev: dict[str, Any]) -> dict[str, Any]:
        stamped = {"seq": ev.pop("seq"), "ts": ev.pop("ts"), "mono": ev.pop("mono"),
                   "run_id": self.run_id, "machine": self.machine, "machine_hash": self.machine_hash,
                   "event": ev.pop("event")}
        stamped.update((k, v) for k, v in ev.items() if v is not None)
        return stamped

    def _to_console(self, _logger: Any, _name: str, ev: dict[str, Any]) -> dict[str, Any]:
        if self._console is not None:
            self._console(ev)
        return ev

    # -- API -----------------------------------------------------------------------------------
    def add_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call `fn(event_dict)` for every later event (embedding hosts, progress displays)."""
        with self._lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    def emit(self, event: str, **fields: Any) -> int:
        """Write one event; returns its seq. `error=` may be an exception (it is rendered)."""
        if isinstance(fields.get("error"), BaseException):
            fields["error"] = error_record(fields["error"])
        with self._lock:
            self._seq += 1
            seq = self._seq
            now = time.monotonic()
            fields.update(seq=seq, ts=datetime.now(timezone.utc).isoformat(timespec="microseconds"),
                          mono=round(now - self._t0, 6))
            if self._file is not None and not self._file.closed:
                self._write(event, fields)
            elif self._console is not None:
                self._console(self._stamp(None, "", {**fields, "event": event}))
            listeners = list(self._listeners)
        if listeners:
            record = {"event": event, **{k: v for k, v in fields.items() if v is not None},
                      "run_id": self.run_id}
            for fn in listeners:
                fn(record)
        return seq

    def _write(self, event: str, fields: dict[str, Any]) -> None:
        """One line to the file (under the lock); a failed write breaks the file (see the docstring)."""
        try:
            self._log.info(event, **fields)
        except WriteFailed as exc:              # the console showed it already (a processor before the file)
            self.write_error, self.broke_at = exc, fields["seq"]
            self._file.close()

    def note_lost(self, what: str, *, error: BaseException | str, **fields: Any) -> int:
        """Record something the run lost without failing (`what`: "Ray's logs"): a `lost` event, kept in
        `lost` for the run's final report."""
        record = {"what": what, "error": str(error), **fields}
        self.lost.append(record)
        return self.emit("lost", **record)

    def losses(self) -> list[dict[str, Any]]:
        """Everything the run lost without failing: the `lost` records, and the trace's own last events."""
        return [*self.lost, *filter(None, [self.trace_lost()])]

    def trace_lost(self) -> dict[str, Any] | None:
        """What the trace itself lost (its events from `broke_at` on), or None when it is whole."""
        if self.write_error is None:
            return None
        return {"what": "the trace's last events", "error": str(self.write_error), "from_seq": self.broke_at,
                "last_seq": self._seq, "path": str(self.path)}

    @property
    def last_seq(self) -> int:
        return self._seq

    def close(self) -> None:
        """Close the file. The tracer is the run's; the listeners belong to whoever added them."""
        with self._lock:
            if self._file is not None and not self._file.closed:
                self._file.close()


def _console_renderer(mode: str) -> Callable[[dict[str, Any]], None] | None:
    if mode == "off" or (mode == "auto" and not sys.stderr.isatty()):
        return None
    if mode not in ("auto", "pretty", "plain"):
        raise ValueError(f"trace console mode {mode!r}: use auto, pretty, plain or off")
    pretty = mode == "pretty" or (mode == "auto" and sys.stderr.isatty())
    renderer = structlog.dev.ConsoleRenderer(colors=pretty)

    def show(ev: dict[str, Any]) -> None:
        view = {k: v for k, v in ev.items() if k not in ("run_id", "machine", "machine_hash", "ts")}
        if isinstance(view.get("error"), dict):
            view["error"] = f"{view['error']['type']}: {view['error']['message']}"
        print(renderer(None, "info", view), file=sys.stderr, flush=True)

    return show


# -- reading ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceEvent:
    """One trace line as a typed record; fields outside the schema are kept in `extra`."""

    seq: int
    event: str
    ts: str = ""
    mono: float = 0.0
    run_id: str = ""
    machine: str = ""
    machine_hash: str = ""
    src: str | None = None
    dst: str | None = None
    trigger: str | None = None
    state: str | None = None
    rollout_id: int | None = None
    duration_s: float | None = None
    error: dict[str, Any] | None = None
    cause: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in CORE_FIELDS else self.extra.get(key, default)


@dataclass
class Trace:
    events: list[TraceEvent]
    path: Path | None = None
    truncated: bool = False        # the last line was cut off (driver killed mid-write)
    bad_lines: list[int] = field(default_factory=list)  # 1-based numbers of unparsable lines

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self.events)

    def of(self, *kinds: str) -> list[TraceEvent]:
        return [e for e in self.events if e.event in kinds]


def segment_paths(run_dir: str | os.PathLike) -> list[Path]:
    """The trace segments of a run directory, one per run, oldest first ([] when it has none)."""
    d = Path(run_dir)
    numbered = sorted((int(m.group(1)), p) for p in d.glob("trace.*.jsonl") if (m := _SEGMENT.fullmatch(p.name)))
    first = [d / TRACE_FILE] if (d / TRACE_FILE).exists() else []
    return first + [p for _, p in numbered]


def next_segment_path(run_dir: str | os.PathLike) -> Path:
    """Where the next run in `run_dir` writes its trace: `trace.jsonl`, else `trace.<n>.jsonl`."""
    d = Path(run_dir)
    existing = segment_paths(d)
    if not existing:
        return d / TRACE_FILE
    last = _SEGMENT.fullmatch(existing[-1].name)
    return d / f"trace.{int(last.group(1)) + 1 if last else 2}.jsonl"


def resolve_trace_path(path: str | os.PathLike) -> Path:
    """A run directory or a trace file → the trace file (a run directory's newest segment)."""
    p = Path(path)
    if not p.is_dir():
        return p
    segments = segment_paths(p)
    return segments[-1] if segments else p / TRACE_FILE


def read_trace(path: str | os.PathLike) -> Trace:
    """Parse a trace file (or a run dir). A cut-off last line is reported as `truncated`, not raised."""
    p = resolve_trace_path(path)
    if not p.exists():
        raise FileNotFoundError(f"no trace at {p}: pass a run directory or a trace.jsonl file")
    lines = p.read_text(encoding="utf-8").split("\n")
    ends_clean = lines[-1] == ""
    if ends_clean:
        lines.pop()
    events, bad, truncated = [], [], False
    for i, line in enumerate(lines, start=1):
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) and not ends_clean:
                truncated = True
            else:
                bad.append(i)
            continue
        events.append(_to_event(raw))
    return Trace(events=events, path=p, truncated=truncated, bad_lines=bad)


def _to_event(raw: dict[str, Any]) -> TraceEvent:
    known = {k: raw[k] for k in CORE_FIELDS if k in raw}
    extra = {k: v for k, v in raw.items() if k not in CORE_FIELDS}
    return TraceEvent(**known, extra=extra)
