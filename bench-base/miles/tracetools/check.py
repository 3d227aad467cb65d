"""Conformance of a trace to the machine definition it names: `miles trace check`.

The checker replays the trace against the definition, the way Temporal replays an event history
against workflow code: each `transition` must leave the state the replay is in, by a trigger the
definition allows there, to a destination it allows; when the event records the guards' values
(`guards: {name: bool}`), the destination must be the first transition whose guards held, as
`transitions` chooses. The phase events must agree with the transitions (a phase runs in the state
the replay is in; the trigger fired is the one the phase returned, `stop` after `stop_honoured`,
`fail` after `error`). The run must end in `shutdown`, and the disposer must have torn down every
registered resource exactly once, in reverse registration order, after the run reached `shutdown`.
`seq` must be gapless.

A teardown that raised or timed out is not a violation: the runtime did what it must (it ran the
teardown and reported the outcome); it is listed as a warning. A trace that stops without `run_end`
(the driver was `kill -9`ed, or is still running) is reported as cut short, with the state it was in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

from miles.runtime.machine import FAIL, STOP, MachineDef, TransitionDef
from miles.runtime.trace import Trace, TraceEvent


@dataclass(frozen=True)
class Violation:
    code: str                   # illegal_transition, guard_mismatch, teardown_order, ... (see below)
    message: str
    seq: int | None = None      # the event that shows it (None: the trace as a whole)


@dataclass
class CheckReport:
    machine: str
    machine_hash: str           # the definition's
    trace_hash: str             # what the trace recorded
    violations: list[Violation] = field(default_factory=list)
    warnings: list[Violation] = field(default_factory=list)
    cut_short: bool = False

    @property
    def ok(self) -> bool:
        return not self.violations

    def codes(self) -> list[str]:
        return [v.code for v in self.violations]


def check_trace(trace: Trace, definition: MachineDef) -> CheckReport:
    events = trace.events
    trace_hash = next((e.machine_hash for e in events if e.machine_hash), "")
    report = CheckReport(definition.name, definition.hash, trace_hash)
    if trace_hash and trace_hash != definition.hash:
        report.warnings.append(Violation(
            "definition_changed", f"the trace was written by machine {definition.name!r} with hash "
            f"{trace_hash}; the definition checked against ({definition.source}) has hash "
            f"{definition.hash}: the definition changed since the run"))
    for line in trace.bad_lines:
        report.violations.append(Violation("unparsable_line", f"line {line} is not valid JSON"))
    if not events:
        report.cut_short = True
        report.violations.append(Violation(
            "cut_short", "the trace has no complete event: the driver was killed (or the file was "
            "emptied) before its first event was written"))
        return report
    _check_seq(events, report)
    replay = _Replay(definition, report)
    for e in events:
        replay.feed(e)
    replay.finish(events, trace.truncated)
    _check_teardown(events, replay.shutdown_seq, report)
    return report


def _check_seq(events: list[TraceEvent], report: CheckReport) -> None:
    if events[0].seq != 1:
        report.violations.append(Violation(
            "seq_gap", f"the first event has seq {events[0].seq}, expected 1: the start of the trace "
            "is missing", events[0].seq))
    for a, b in pairwise(events):
        if b.seq != a.seq + 1:
            what = "missing" if b.seq > a.seq + 1 else "repeated or out of order"
            report.violations.append(Violation(
                "seq_gap", f"seq {a.seq} is followed by seq {b.seq}: events {what}", b.seq))


class _Replay:
    """Walks the events, keeping the state the definition says the run is in."""

    def __init__(self, definition: MachineDef, report: CheckReport):
        self.d, self.report = definition, report
        self.state: str | None = None
        self.phase: TraceEvent | None = None          # the open phase_start
        self.pending: tuple[str, TraceEvent] | None = None   # the trigger the next transition must fire
        self.shutdown_seq: int | None = None
        self.run_end: TraceEvent | None = None

    def violation(self, code: str, message: str, e: TraceEvent | None) -> None:
        self.report.violations.append(Violation(code, message, e.seq if e is not None else None))

    def feed(self, e: TraceEvent) -> None:
        handler = getattr(self, f"_on_{e.event}", None)
        if handler is not None:                       # unknown kinds (metrics, ...) are not ours
            handler(e)

    def _on_run_start(self, e: TraceEvent) -> None:
        if self.state is not None:
            self.violation("run_start", "a second run_start in one trace", e)
        elif e.state != self.d.initial:
            self.violation("run_start", f"the run started in {e.state!r}; machine {self.d.name} starts "
                           f"in {self.d.initial!r}", e)
        self.state = e.state

    def _on_phase_start(self, e: TraceEvent) -> None:
        self._need_started(e)
        if self.phase is not None:
            self.violation("phase_order", f"phase {e.state!r} started while phase {self.phase.state!r} "
                           f"(seq {self.phase.seq}) had not ended", e)
        if e.state != self.state:
            self.violation("phase_state", f"phase {e.state!r} ran while the machine was in {self.state!r}", e)
        if e.state in self.d.final_states:
            self.violation("phase_state", f"a phase ran in the final state {e.state!r}", e)
        self.phase, self.pending = e, None

    def _on_phase_end(self, e: TraceEvent) -> None:
        if self.phase is None or e.state != self.phase.state:
            self.violation("phase_order", f"phase_end of {e.state!r} without its phase_start", e)
        self.phase = None
        self.pending = (e.trigger or "", e)

    def _on_stop_honoured(self, e: TraceEvent) -> None:
        self.pending = (STOP, e)

    def _on_error(self, e: TraceEvent) -> None:
        self.phase = None
        self.pending = (FAIL, e)

    def _on_transition(self, e: TraceEvent) -> None:
        self._need_started(e)
        src, trig, dst = e.src or "", e.trigger or "", e.dst or ""
        if src != self.state:
            self.violation("illegal_transition", f"transition {src} -{trig}-> {dst} leaves {src!r}, "
                           f"but the run was in {self.state!r}", e)
        if self.pending is None:
            self.violation("phase_order", f"transition {src} -{trig}-> {dst} with no phase_end or "
                           "error before it", e)
        elif self.pending[0] != trig:
            self.violation("trigger_mismatch", f"transition fired {trig!r} but event seq "
                           f"{self.pending[1].seq} ({self.pending[1].event}) calls for {self.pending[0]!r}", e)
        self._check_move(e, src, trig, dst)
        self.state, self.pending = dst, None
        if dst in self.d.final_states and self.shutdown_seq is None:
            self.shutdown_seq = e.seq

    def _check_move(self, e: TraceEvent, src: str, trig: str, dst: str) -> None:
        options = self.d.transitions_from(src, trig)
        if not options:
            allowed = sorted({t.trigger for t in self.d.transitions_from(src)})
            self.violation("illegal_transition", f"{src} -{trig}-> {dst}: machine {self.d.name} has no "
                           f"{trig!r} from {src!r} (allowed: {', '.join(allowed) or 'none'})", e)
            return
        if dst not in [t.dest for t in options]:
            self.violation("illegal_transition", f"{src} -{trig}-> {dst}: {trig!r} from {src!r} goes to "
                           f"{' or '.join(t.dest for t in options)}, never {dst!r}", e)
            return
        guards = e.get("guards")
        if isinstance(guards, dict):
            self._check_guards(e, options, guards, dst)

    def _check_guards(self, e: TraceEvent, options: list[TransitionDef], guards: dict, dst: str) -> None:
        missing = sorted({g for t in options for g in (*t.conditions, *t.unless)} - guards.keys())
        if missing:
            self.violation("guard_mismatch", f"{e.src} -{e.trigger}-> {dst}: the event records no value "
                           f"for guard(s) {', '.join(missing)}", e)
            return
        chosen = first_allowed(options, guards)
        if chosen is None:
            self.violation("guard_mismatch", f"{e.src} -{e.trigger}-> {dst}: with the recorded guards "
                           f"{guards} no transition is allowed", e)
        elif chosen.dest != dst:
            self.violation("guard_mismatch", f"{e.src} -{e.trigger}-> {dst}: with the recorded guards "
                           f"{guards} the machine goes to {chosen.dest!r} (line {chosen.line})", e)

    def _on_run_end(self, e: TraceEvent) -> None:
        self.run_end = e

    def _need_started(self, e: TraceEvent) -> None:
        if self.state is None:
            self.violation("run_start", f"{e.event} before run_start", e)
            self.state = self.d.initial

    def finish(self, events: list[TraceEvent], truncated: bool) -> None:
        last = events[-1]
        if self.run_end is None:
            self.report.cut_short = True
            where = f"in state {self.state!r}" + (f", inside phase {self.phase.state!r} (started at seq "
                                                   f"{self.phase.seq})" if self.phase is not None else "")
            cut = "its last line is cut off mid-write; " if truncated else ""
            self.violation("cut_short", f"the trace was cut short: {cut}it ends at seq {last.seq} {where} "
                           "without run_end (the driver was killed, e.g. kill -9, or is still running)", last)
            return
        if self.state != "shutdown":
            self.violation("no_shutdown", f"the run ended in {self.state!r}, not 'shutdown'", self.run_end)
        elif self.run_end.state not in (None, self.state):
            self.violation("no_shutdown", f"run_end says {self.run_end.state!r} but the transitions reached "
                           f"{self.state!r}", self.run_end)
        self._check_outcome(events)

    def _check_outcome(self, events: list[TraceEvent]) -> None:
        outcome = self.run_end.get("outcome") if self.run_end else None
        errors = [e for e in events if e.event == "error"]
        teardown_failed = any(e.event == "disposed" and e.get("outcome") != "ok" for e in events)
        if outcome in ("ok", "stopped") and errors:
            self.violation("outcome", f"run_end says {outcome} but seq {errors[0].seq} is an error", self.run_end)
        if outcome in ("failed", "cancelled") and not errors and not teardown_failed:
            self.violation("outcome", f"run_end says {outcome} but no error or failed teardown is recorded",
                           self.run_end)


def first_allowed(options: list[TransitionDef], guards: dict[str, bool]) -> TransitionDef | None:
    """The transition `transitions` takes: the first, in definition order, whose guards hold."""
    for t in options:
        if all(guards.get(g) for g in t.conditions) and not any(guards.get(g) for g in t.unless):
            return t
    return None


def _check_teardown(events: list[TraceEvent], shutdown_seq: int | None, report: CheckReport) -> None:
    registered = [e for e in events if e.event == "registered"]
    by_pos = {e.get("position"): e for e in registered}
    for i, e in enumerate(registered):
        if e.get("position") != i:
            report.violations.append(Violation(
                "registration", f"{e.get('resource')} registered at position {e.get('position')}, "
                f"expected {i}", e.seq))
    seen: dict[int, TraceEvent] = {}
    previous: TraceEvent | None = None
    for e in (e for e in events if e.event == "disposed"):
        _check_disposal(e, previous, by_pos, seen, shutdown_seq, report)
        previous = e
        seen.setdefault(e.get("position"), e)
    if not report.cut_short:          # a killed driver never unwound: that is the cut, not a leak
        for pos, e in sorted(by_pos.items()):
            if pos not in seen:
                report.violations.append(Violation(
                    "not_disposed", f"{e.get('resource')} (position {pos}, registered at seq {e.seq}) "
                    "was never disposed", e.seq))


def _check_disposal(e: TraceEvent, previous: TraceEvent | None, by_pos: dict, seen: dict,
                    shutdown_seq: int | None, report: CheckReport) -> None:
    pos, name = e.get("position"), e.get("resource")
    add = report.violations.append
    if pos not in by_pos:
        add(Violation("teardown_unknown", f"{name} (position {pos}) was disposed but never registered", e.seq))
    elif pos in seen:
        add(Violation("teardown_twice", f"{name} (position {pos}) was disposed twice (first at seq "
                      f"{seen[pos].seq})", e.seq))
    elif previous is not None and isinstance(previous.get("position"), int) and pos > previous.get("position"):
        add(Violation("teardown_order", f"{name} (position {pos}) was torn down after "
                      f"{previous.get('resource')} (position {previous.get('position')}); reverse "
                      f"registration order tears down {name} first", e.seq))
    if shutdown_seq is None or e.seq < shutdown_seq:
        when = ("but the run never reached shutdown" if shutdown_seq is None
                else f"before the run reached shutdown (seq {shutdown_seq})")
        add(Violation("teardown_early", f"{name} was disposed {when}", e.seq))
    if e.get("outcome") not in ("ok", None):
        err = e.error or {}
        report.warnings.append(Violation(
            "teardown_failed", f"teardown of {name} ended {e.get('outcome')!r}"
            + (f": {err.get('type')}: {err.get('message')}" if err else ""), e.seq))
