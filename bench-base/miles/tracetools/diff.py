"""`miles trace diff A B`: the first transition where two runs' state sequences part.

Two runs of one machine and config should walk the same states; when they do not, the first
differing transition (with the event that caused it, e.g. the error) is where to look. Times,
rollout ids and events outside the state sequence (metrics, registrations) are not compared.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.runtime.trace import Trace, TraceEvent


@dataclass(frozen=True)
class Divergence:
    index: int                          # 0-based position in the transition sequences
    a: TraceEvent | None                # None: run A has no transition here (it ended sooner)
    b: TraceEvent | None
    a_cause: TraceEvent | None = None   # the event each differing transition names as its cause
    b_cause: TraceEvent | None = None
    common: tuple[TraceEvent, ...] = () # the transitions just before, shared by both (from A)


def state_sequence(trace: Trace) -> list[TraceEvent]:
    return trace.of("transition")


def step_key(e: TraceEvent) -> tuple[str | None, str | None, str | None]:
    return (e.src, e.trigger, e.dst)


def diff_traces(a: Trace, b: Trace, *, context: int = 3) -> Divergence | None:
    """None when both runs took the same transitions; else where they first differ."""
    sa, sb = state_sequence(a), state_sequence(b)
    for i in range(max(len(sa), len(sb))):
        ea = sa[i] if i < len(sa) else None
        eb = sb[i] if i < len(sb) else None
        if ea is None or eb is None or step_key(ea) != step_key(eb):
            return Divergence(i, ea, eb, _cause(a, ea), _cause(b, eb), tuple(sa[max(0, i - context):i]))
    return None


def _cause(trace: Trace, e: TraceEvent | None) -> TraceEvent | None:
    if e is None or e.cause is None:
        return None
    return next((x for x in trace.events if x.seq == e.cause), None)
