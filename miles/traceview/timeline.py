"""A run's trace folded into what a person asks of it: the phases, the failure, the teardown.

`build_timeline(trace)` turns the event stream into typed records: one `PhaseSpan` per phase the
runner awaited, one `TeardownStep` per disposed resource, a `FailureView` for the first error and
per-state totals. `show`, `plot` and `diff` all read the run through it, so they agree on what a
phase's start, duration and rollout are. Event kinds it does not know (`metrics`,
`weights_synced`, ...) are skipped: training phases add events without touching this module.
Work that runs beside the phases (the async machine's rollout generating ahead, background evals)
is traced as `<kind>_start` / `<kind>_end` pairs, the end naming its start as `cause`; each pair is
one `BackgroundSpan` in its own lane.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from miles.runtime.trace import Trace, TraceEvent

ESCALATIONS = {
    "ok": "",
    "error": "",
    "forced": "timed out → forced",
    "timeout": "timed out, no force",
    "force_failed": "timed out → force failed",
}


@dataclass(frozen=True)
class PhaseSpan:
    """One awaited phase: from its `phase_start` to its `phase_end` (or the error that ended it)."""

    state: str
    rollout_id: int | None
    start_s: float              # seconds since the run started
    duration_s: float
    trigger: str | None         # the trigger fired after it; None while still open (trace cut short)
    outcome: str                # ok | error | cancelled | open
    seq: int                    # seq of its phase_start
    note: str = ""              # e.g. "returned next; stop requested"

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True)
class BackgroundSpan:
    """Work in flight beside the phases: from its `*_start` to the `*_end` that names it as cause."""

    lane: str                   # one of BACKGROUND_LANES' names: prefetch | eval (bg)
    rollout_id: int | None
    weight_version: int | None  # the weights it read
    start_s: float
    duration_s: float
    outcome: str                # ok | error | cancelled | open (no end event)
    seq: int                    # seq of its start event

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


# start event -> (lane, end event)
BACKGROUND_LANES = {"prefetch_start": ("prefetch", "prefetch_end"), "eval_start": ("eval (bg)", "eval_end")}
# fully async: each engine call of the rollout producer, in a lane per engine ("engine-0", ...), from its
# `producer_submit` to the `producer_groups` (or `producer_cut`: aborted by a drain) that names it as cause
ENGINE_CALL_START, ENGINE_CALL_ENDS = "producer_submit", ("producer_groups", "producer_cut")


def engine_lanes(background: list[BackgroundSpan]) -> list[str]:
    """The per-engine lanes of a fully-async run's producer, in engine order."""
    return sorted({b.lane for b in background if b.lane.startswith("engine-")}, key=lambda s: int(s.split("-")[1]))


@dataclass(frozen=True)
class TeardownStep:
    """One `disposed` event, with what its `registered` event said about it."""

    order: int                  # 1 = first torn down
    position: int               # registration position (0 = registered first)
    resource: str
    start_s: float
    duration_s: float
    outcome: str                # ok | error | forced | timeout | force_failed
    error: dict[str, Any] | None
    seq: int
    timeout_s: float | None = None
    has_force: bool | None = None

    @property
    def escalation(self) -> str:
        return ESCALATIONS.get(self.outcome, self.outcome)


@dataclass(frozen=True)
class ChainLink:
    """One exception of a chained traceback, outermost last; `via` says how it joins the next."""

    exception: str              # "Type: message"
    via: str = ""               # "direct cause of" | "while handling" | ""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class FailureView:
    """The first error of the run: where, when, what, and what it led to."""

    state: str
    rollout_id: int | None
    at_s: float                 # seconds since the run started
    in_phase_s: float | None    # seconds into the phase that raised
    error: dict[str, Any]
    cancelled: bool
    seq: int
    exceptions: list[ChainLink]
    consequences: list[TraceEvent]     # events whose `cause` chain leads back to the error
    later_errors: list[TraceEvent]     # errors after the first (in draining, IllegalTransition)


@dataclass(frozen=True)
class StateTotal:
    state: str
    visits: int
    time_s: float
    share: float                # of the run's duration


@dataclass
class Timeline:
    run_id: str
    machine: str
    machine_hash: str
    states: list[str]                   # lane order: the machine's states as the run declared them
    spans: list[PhaseSpan]
    teardown: list[TeardownStep]
    registered: list[TraceEvent]
    failure: FailureView | None
    outcome: str                        # ok | failed | cancelled | incomplete
    duration_s: float
    end_state: str | None               # the state the transitions reached last
    truncated: bool
    markers: list[TraceEvent] = field(default_factory=list)   # stop_honoured and the like
    background: list[BackgroundSpan] = field(default_factory=list)   # async: prefetch, evals in flight
    story: list[str] = field(default_factory=list)   # where this segment resumed from, what stopped it, what it saved

    @property
    def rollouts(self) -> list[int]:
        return sorted({s.rollout_id for s in self.spans if s.rollout_id is not None})

    def totals(self) -> list[StateTotal]:
        total = self.duration_s or 1.0
        out = []
        for state in self.states:
            mine = [s for s in self.spans if s.state == state]
            if mine:
                t = sum(s.duration_s for s in mine)
                out.append(StateTotal(state, len(mine), t, t / total))
        return out


def build_timeline(trace: Trace) -> Timeline:
    events = trace.events
    start = next((e for e in events if e.event == "run_start"), None)
    t0 = start.mono if start is not None else (events[0].mono if events else 0.0)
    first = events[0] if events else TraceEvent(seq=0, event="")
    end = next((e for e in reversed(events) if e.event == "run_end"), None)
    transitions = [e for e in events if e.event == "transition"]
    last_mono = events[-1].mono if events else t0
    return Timeline(
        run_id=first.run_id, machine=first.machine, machine_hash=first.machine_hash,
        states=_lane_order(start, events),
        spans=_spans(events, t0, last_mono),
        teardown=_teardown(events, t0),
        registered=[e for e in events if e.event == "registered"],
        failure=_failure(events, t0),
        outcome=end.get("outcome", "failed") if end is not None else "incomplete",
        duration_s=end.duration_s if end is not None and end.duration_s is not None else last_mono - t0,
        end_state=transitions[-1].dst if transitions else (start.state if start else None),
        truncated=trace.truncated or end is None,
        markers=[e for e in events if e.event == "stop_honoured"],
        background=_background(events, t0, last_mono),
        story=_story(events, t0),
    )


def _lane_order(start: TraceEvent | None, events: list[TraceEvent]) -> list[str]:
    declared = list(start.get("states") or []) if start is not None else []
    seen = [s for s in dict.fromkeys(e.state for e in events if e.event == "phase_start") if s]
    return [s for s in declared if s in seen] + [s for s in seen if s not in declared]


def _spans(events: list[TraceEvent], t0: float, last_mono: float) -> list[PhaseSpan]:
    spans: list[PhaseSpan] = []
    open_: TraceEvent | None = None
    note = ""            # of the open phase: a train phase whose passes compiled graphs (its `metrics` event)
    for e in events:
        if e.event == "phase_start":
            open_, note = e, ""
        elif e.event == "metrics" and open_ is not None and e.get("layer_compiles"):
            note = f"compiled {e.get('layer_compiles'):g} graphs"
        elif e.event == "stop_honoured" and spans and spans[-1].state == e.state:
            # the phase's span was closed by its phase_end; the runner fired `stop` instead
            last = spans[-1]
            stopped = f"returned {e.get('ignored_trigger')}; stop requested"
            spans[-1] = PhaseSpan(last.state, last.rollout_id, last.start_s, last.duration_s, "stop",
                                  last.outcome, last.seq, f"{stopped}; {last.note}" if last.note else stopped)
        elif open_ is not None and e.event in ("phase_end", "error") and e.state == open_.state:
            failed = e.event == "error"
            rid = e.rollout_id if e.rollout_id is not None else open_.rollout_id
            dur = e.duration_s if not failed and e.duration_s is not None else e.mono - open_.mono
            outcome = ("cancelled" if e.get("cancelled") else "error") if failed else "ok"
            spans.append(PhaseSpan(open_.state or "?", rid, open_.mono - t0, max(dur, 0.0),
                                   "fail" if failed else e.trigger, outcome, open_.seq, note))
            open_ = None
    if open_ is not None:
        spans.append(PhaseSpan(open_.state or "?", _open_rollout(events, open_), open_.mono - t0,
                               max(last_mono - open_.mono, 0.0), None, "open", open_.seq))
    return spans


OPEN_ROLLOUT_FROM = ("phase_waiting", "rollout_done")   # events that carry the running phase's own rollout


def _open_rollout(events: list[TraceEvent], start: TraceEvent) -> int | None:
    """The rollout of a phase the trace ends in (no phase_end to say it): the newest that an event of
    the phase itself carries (its heartbeat, the rollout it made), else its phase_start's, right since
    the runner asks the context for it (an older trace's rollout phase_start carries the one before)."""
    inside = [e.rollout_id for e in events
              if e.seq > start.seq and e.event in OPEN_ROLLOUT_FROM and e.rollout_id is not None]
    return inside[-1] if inside else start.rollout_id


def _story(events: list[TraceEvent], t0: float) -> list[str]:
    """What a person resuming runs asks first: which checkpoint this segment resumed from (and which it
    passed over), what stopped it and what that stop saved; one line each, in trace order."""
    lines: list[str] = []
    saved = {e.rollout_id: e for e in events if e.event == "checkpoint_saved"}
    for e in events:
        if e.event == "checkpoint_skipped":
            problems = e.get("problems") or ["?"]
            lines.append(f"passed over {_folder(e.get('path'))} (rollout {e.rollout_id}, {e.get('check')} check): "
                         f"{problems[0]}")
        elif e.event == "resumed":
            checked = "its sha256 verified" if e.get("verified") else "not verified (--no-verify-load)"
            lines.append(f"resumed from {_folder(e.get('path'))} (rollout {e.rollout_id}, {checked}; {e.get('path')}); "
                         f"next rollout {e.get('next_rollout')}")
        elif e.event == "resume_skipped":
            lines.append(f"started fresh: {e.get('reason')} under --load {e.get('root')}")
        elif e.event == "stop_requested":
            who = e.get("why") or "a stop request (this trace does not record whose)"
            lines.append(f"stopped by {who} in {e.state}, {e.mono - t0:.1f} s into the run")
        elif e.event == "stop_save":
            if e.get("saved"):
                where = saved.get(e.rollout_id)
                lines.append(f"the stop saved rollout {e.rollout_id}"
                             + (f" ({_folder(where.get('path'))})" if where is not None else "")
                             + (f" in {e.duration_s:.2f} s" if e.duration_s is not None else ""))
            else:
                lines.append(f"the stop saved nothing: {e.get('reason')}")
    return lines


def _folder(path: Any) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1] if path else "?"


def _background(events: list[TraceEvent], t0: float, last_mono: float) -> list[BackgroundSpan]:
    starts = {e.seq: e for e in events if e.event in BACKGROUND_LANES}
    ends = {e.cause: e for e in events if e.cause in starts and e.event == BACKGROUND_LANES[starts[e.cause].event][1]}
    spans = []
    for seq, s in starts.items():
        end = ends.get(seq)
        stop = end.mono if end is not None else last_mono
        spans.append(BackgroundSpan(BACKGROUND_LANES[s.event][0], s.rollout_id, s.get("weight_version"),
                                    s.mono - t0, max(stop - s.mono, 0.0),
                                    end.get("outcome", "ok") if end is not None else "open", seq))
    calls = {e.seq: e for e in events if e.event == ENGINE_CALL_START}
    call_ends = {e.cause: e for e in events if e.event in ENGINE_CALL_ENDS and e.cause in calls}
    for seq, s in calls.items():
        end = call_ends.get(seq)
        stop = end.mono if end is not None else last_mono
        outcome = "open" if end is None else ("cancelled" if end.event == "producer_cut" else "ok")
        spans.append(BackgroundSpan(f"engine-{s.get('engine')}", None, s.get("weight_version"), s.mono - t0,
                                    max(stop - s.mono, 0.0), outcome, seq))
    return spans


def _teardown(events: list[TraceEvent], t0: float) -> list[TeardownStep]:
    reg = {e.get("position"): e for e in events if e.event == "registered"}
    steps = []
    for order, e in enumerate((e for e in events if e.event == "disposed"), start=1):
        r = reg.get(e.get("position"))
        dur = e.duration_s or 0.0
        steps.append(TeardownStep(
            order=order, position=e.get("position", -1), resource=e.get("resource", "?"),
            start_s=e.mono - t0 - dur, duration_s=dur, outcome=e.get("outcome", "?"), error=e.error,
            seq=e.seq, timeout_s=r.get("timeout_s") if r else None, has_force=r.get("has_force") if r else None))
    return steps


def _failure(events: list[TraceEvent], t0: float) -> FailureView | None:
    errors = [e for e in events if e.event == "error"]
    if not errors:
        return None
    err = errors[0]
    phase = next((e for e in reversed(events) if e.event == "phase_start" and e.seq < err.seq
                  and e.state == err.state), None)
    return FailureView(
        state=err.state or "?", rollout_id=err.rollout_id, at_s=err.mono - t0,
        in_phase_s=err.mono - phase.mono if phase is not None else None,
        error=err.error or {"type": "?", "message": "", "traceback": ""},
        cancelled=bool(err.get("cancelled")), seq=err.seq,
        exceptions=exception_chain((err.error or {}).get("traceback", "")),
        consequences=_consequences(events, err.seq), later_errors=errors[1:],
    )


def _consequences(events: list[TraceEvent], root: int) -> list[TraceEvent]:
    """Events that name `root` as their cause, directly or through other such events."""
    chain, linked = [], {root}
    for e in events:
        if e.cause in linked:
            chain.append(e)
            linked.add(e.seq)
    return chain


_SEPARATORS = {
    "The above exception was the direct cause of the following exception:": "direct cause of",
    "During handling of the above exception, another exception occurred:": "while handling",
}


def exception_chain(traceback_text: str) -> list[ChainLink]:
    """The exceptions of a formatted traceback, innermost first, each with its notes."""
    pattern = "|".join(re.escape(s) for s in _SEPARATORS)
    parts = re.split(f"({pattern})", traceback_text)
    links: list[ChainLink] = []
    for i in range(0, len(parts), 2):
        exc, notes = _exception_line(parts[i])
        if exc:
            via = _SEPARATORS[parts[i + 1]] if i + 1 < len(parts) else ""
            links.append(ChainLink(exc, via, notes))
    return links


def _exception_line(block: str) -> tuple[str, tuple[str, ...]]:
    """The unindented lines after a traceback's last frame: the exception line, then its notes."""
    lines = [ln for ln in block.strip("\n").splitlines() if ln.strip()]
    tail: list[str] = []
    for ln in reversed(lines):
        if ln.startswith((" ", "\t")) or ln.startswith("Traceback"):
            break
        tail.append(ln)
    tail.reverse()
    return (tail[0], tuple(tail[1:])) if tail else ("", ())
