"""What `miles trace show | check | diff` print, as blocks for `render.write_blocks`.

`show` answers, in this order: what happened (a header line), the timeline of phases, where and
why it failed, what was torn down and how, and where the time went.
"""

from __future__ import annotations

from miles.runtime.trace import TraceEvent

from .check import CheckReport
from .diff import Divergence
from .render import Block, Table, Text, fmt_s
from .timeline import FailureView, Timeline

HEAD_ROWS, TAIL_ROWS, MAX_ROWS = 20, 40, 200


def show_blocks(tl: Timeline, *, all_rows: bool = False) -> list[Block]:
    blocks: list[Block] = [Text([_headline(tl)], style="bold")]
    if tl.story:
        blocks.append(Text(tl.story, title="Resume and stop"))
    blocks.append(_timeline_table(tl, all_rows))
    if tl.failure is not None:
        blocks.append(_failure_text(tl.failure))
    if tl.truncated and tl.outcome == "incomplete":
        last = tl.spans[-1] if tl.spans else None
        where = f" in phase {last.state!r}" if last is not None and last.outcome == "open" else ""
        blocks.append(Text([f"The trace ends without run_end{where}, {fmt_s(tl.duration_s)} into the run: "
                            "the driver was killed (kill -9?) or is still running. Nothing after this "
                            "point was recorded, teardown included."], title="Cut short", style="yellow"))
    blocks.append(_teardown_table(tl))
    blocks.append(_totals_table(tl))
    return blocks


def _headline(tl: Timeline) -> str:
    rollouts = tl.rollouts
    span = f"rollouts {rollouts[0]}–{rollouts[-1]}" if rollouts else "no rollouts"
    return (f"run {tl.run_id or '?'} · machine {tl.machine or '?'} ({tl.machine_hash or 'no hash'}) · "
            f"{tl.outcome} · {fmt_s(tl.duration_s)} · {len(tl.spans)} phases, {span}")


def _timeline_table(tl: Timeline, all_rows: bool) -> Table:
    spans = list(enumerate(tl.spans, start=1))
    omitted = 0
    if not all_rows and len(spans) > MAX_ROWS:
        omitted = len(spans) - HEAD_ROWS - TAIL_ROWS
        spans = spans[:HEAD_ROWS] + [(0, None)] + spans[-TAIL_ROWS:]
    rows, styles = [], []
    for i, s in spans:
        if s is None:
            rows.append(["…", f"{omitted} phases omitted (--all shows them)", "", "", "", ""])
            styles.append("dim")
            continue
        trigger = s.trigger if s.trigger is not None else "(cut short)"
        if s.note:
            trigger += f"  ({s.note})"
        rows.append([str(i), s.state, "" if s.rollout_id is None else str(s.rollout_id),
                     fmt_s(s.start_s), fmt_s(s.duration_s), trigger])
        styles.append({"error": "red", "cancelled": "yellow", "open": "yellow"}.get(s.outcome))
    return Table("Timeline", ["#", "state", "rollout", "start", "duration", "trigger"], rows,
                 right={0, 2, 3, 4}, styles=styles)


def _failure_text(f: FailureView) -> Text:
    what = "cancelled" if f.cancelled else "failed"
    rollout = f" (rollout {f.rollout_id})" if f.rollout_id is not None else ""
    into = f", {fmt_s(f.in_phase_s)} into the phase" if f.in_phase_s is not None else ""
    lines = [f"{what} in {f.state}{rollout}, {fmt_s(f.at_s)} into the run{into} (seq {f.seq})",
             _error_line(f.error), "", "cause chain:"]
    for link in f.exceptions:
        lines.append(f"  {link.exception}")
        lines += [f"    note: {n}" for n in link.notes]
        if link.via:
            lines.append(f"    ↓ {link.via}")
    lines += [f"  → {_event_line(e)}" for e in f.consequences]
    for e in f.later_errors:
        lines.append(f"then, in {e.state} (seq {e.seq}): {_error_line(e.error or {})}")
    tb = (f.error.get("traceback") or "").rstrip()
    if tb:
        lines += ["", "traceback:", *("  " + ln for ln in tb.splitlines())]
    return Text(lines, title="Failure", style="red")


def _error_line(err: dict) -> str:
    """The root cause in one line when the trace has it (`summary`, not a Ray wrapper's remote
    traceback; that one is under "traceback:"), else the type and message."""
    if err.get("summary"):
        return err["summary"]
    message = err.get("message")
    return f"{err.get('type')}: {message}" if message else str(err.get("type"))


def _event_line(e: TraceEvent) -> str:
    if e.event == "transition":
        return f"seq {e.seq} transition {e.src} -{e.trigger}-> {e.dst}"
    return f"seq {e.seq} {e.event}" + (f" {e.state}" if e.state else "")


def _teardown_table(tl: Timeline) -> Table:
    total = sum(s.duration_s for s in tl.teardown)
    if not tl.registered:
        title = "Teardown: nothing was registered"
    elif not tl.teardown:
        title = f"Teardown: never started ({len(tl.registered)} resources registered)"
    else:
        title = f"Teardown: {len(tl.teardown)} of {len(tl.registered)} registered resources, {fmt_s(total)}"
    rows, styles = [], []
    for s in tl.teardown:
        detail = "; ".join(x for x in (s.escalation, _error_line(s.error) if s.error else "") if x)
        rows.append([str(s.order), s.resource, str(s.position), fmt_s(s.duration_s), s.outcome, detail])
        styles.append(None if s.outcome == "ok" else "red")
    disposed = {s.position for s in tl.teardown}
    for e in tl.registered:
        if e.get("position") not in disposed:
            rows.append(["-", str(e.get("resource")), str(e.get("position")), "-", "not disposed", ""])
            styles.append("yellow")
    return Table(title, ["order", "resource", "position", "duration", "outcome", "escalation / error"],
                 rows, right={0, 2, 3}, styles=styles)


def _totals_table(tl: Timeline) -> Table:
    totals = sorted(tl.totals(), key=lambda t: -t.time_s)
    rows = [[t.state, str(t.visits), fmt_s(t.time_s), fmt_s(t.time_s / t.visits), f"{100 * t.share:.1f}%"]
            for t in totals]
    rest = tl.duration_s - sum(t.time_s for t in totals)
    if totals and tl.duration_s > 0:
        # the runner's own time between phases, and the teardown: what the phases do not account for
        rows.append(["(outside phases)", "", fmt_s(rest), "", f"{100 * rest / tl.duration_s:.1f}%"])
    return Table(f"Time per state (run: {fmt_s(tl.duration_s)})",
                 ["state", "visits", "time", "mean", "share"], rows, right={1, 2, 3, 4})


# -- check -----------------------------------------------------------------------------------------


def check_blocks(report: CheckReport, source: str, events: dict[int, TraceEvent]) -> list[Block]:
    blocks: list[Block] = []
    if report.warnings:
        blocks.append(Text([f"warning: {w.message}" + (f" (seq {w.seq})" if w.seq else "")
                            for w in report.warnings], style="yellow"))
    if report.ok:
        blocks.append(Text([f"{source}: conforms to machine {report.machine} ({report.machine_hash})"],
                           style="green"))
        return blocks
    lines = []
    for v in report.violations:
        lines.append(f"[{v.code}] {v.message}")
        if v.seq is not None and v.seq in events:
            lines.append(f"    at seq {v.seq}: {_brief(events[v.seq])}")
    head = "the trace is cut short" if report.cut_short else "does not conform"
    blocks.append(Text(lines, title=f"{source}: {head} (machine {report.machine}, "
                       f"{len(report.violations)} violation(s))", style="red"))
    return blocks


def _brief(e: TraceEvent) -> str:
    fields = {"event": e.event, "state": e.state, "src": e.src, "dst": e.dst, "trigger": e.trigger,
              "rollout_id": e.rollout_id}
    extra = {k: e.extra[k] for k in ("resource", "position", "outcome", "guards") if k in e.extra}
    return " ".join(f"{k}={v}" for k, v in {**fields, **extra}.items() if v is not None)


# -- diff ------------------------------------------------------------------------------------------


def diff_blocks(d: Divergence | None, name_a: str, name_b: str, n_a: int, n_b: int) -> list[Block]:
    if d is None:
        return [Text([f"same state sequence: {n_a} transitions"], style="green")]
    lines = [f"the runs diverge at transition #{d.index + 1}:"]
    for label, e, cause in (("A", d.a, d.a_cause), ("B", d.b, d.b_cause)):
        if e is None:
            lines.append(f"  {label}: (no transition: the run's sequence ends here)")
            continue
        rid = f" rollout {e.rollout_id}" if e.rollout_id is not None else ""
        lines.append(f"  {label}: {e.src} -{e.trigger}-> {e.dst}{rid}  (seq {e.seq}, {fmt_s(e.mono)})")
        if cause is not None and cause.event == "error":
            lines.append(f"       after seq {cause.seq} error: {_error_line(cause.error or {})}")
    if d.common:
        lines += ["", "shared before that:"]
        lines += [f"  {e.src} -{e.trigger}-> {e.dst}" for e in d.common]
    return [Text([f"A: {name_a} ({n_a} transitions)", f"B: {name_b} ({n_b} transitions)"]),
            Text(lines, style="yellow")]
