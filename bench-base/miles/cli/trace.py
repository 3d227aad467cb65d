"""`miles trace show | plot | check | diff`: understand a run from its trace alone.

Each command takes a run directory or a trace file. A run directory that was resumed holds one trace
segment per run (`trace.jsonl`, `trace.2.jsonl`, ...): `show` and `check` take each in turn (`check`
conforms when every segment does), `diff` compares segment with segment, `plot` draws the newest. Exit codes: 0 done (for `check`: conforms;
for `diff`: same state sequence), 1 violations found or the runs differ, 2 bad input (no such file,
an unknown machine).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from miles.runtime.machine import MachineDef, MachineDefinitionError, builtin_machines, load_machine
from miles.runtime.trace import Trace, read_trace, resolve_trace_path, segment_paths

from miles.tracetools.check import check_trace
from miles.tracetools.diff import diff_traces, state_sequence
from miles.tracetools.render import write_blocks
from miles.tracetools.report import check_blocks, diff_blocks, show_blocks
from miles.tracetools.timeline import build_timeline

OK, FOUND, BAD_INPUT = 0, 1, 2


class BadInput(Exception):
    """A path or a machine the command cannot use; the message says what to pass instead."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles trace", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="{show,plot,check,diff}")
    output = argparse.ArgumentParser(add_help=False)
    output.add_argument("--format", choices=["auto", "rich", "plain"], default="auto",
                        help="rich tables on a terminal, plain text otherwise (default: auto)")

    show = sub.add_parser("show", parents=[output], help="timeline, failure, teardown, time per state")
    show.add_argument("run", help="run directory or trace.jsonl")
    show.add_argument("--all", action="store_true", help="list every phase, even in long runs")

    plot = sub.add_parser("plot", help="PNG Gantt chart of the run")
    plot.add_argument("run", help="run directory or trace.jsonl")
    plot.add_argument("-o", "--out", help="PNG path (default: trace.png next to the trace)")
    plot.add_argument("--title", help="chart title (default: machine, run id, outcome)")

    check = sub.add_parser("check", parents=[output], help="conformance to the machine definition")
    check.add_argument("run", help="run directory or trace.jsonl")
    check.add_argument("--machine", help="check against this machine (name or YAML path) instead of "
                       "the one the trace names")

    diff = sub.add_parser("diff", parents=[output], help="first transition where two runs differ")
    diff.add_argument("a", help="run directory or trace.jsonl")
    diff.add_argument("b", help="run directory or trace.jsonl")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except BadInput as exc:
        print(f"miles trace {args.command}: {exc}", file=sys.stderr)
        return BAD_INPUT


def load(path: str) -> Trace:
    p = resolve_trace_path(path)
    if not p.exists():
        raise BadInput(f"no trace at {p}: pass a run directory (holding trace.jsonl) or a trace file")
    if p.is_dir():
        raise BadInput(f"{p} is a directory: pass a run directory holding trace.jsonl, or the file")
    return read_trace(p)


def load_segments(path: str) -> list[Trace]:
    """A run directory's segments, one per run, oldest first; a trace file alone."""
    p = Path(path)
    if p.is_dir() and len(segments := segment_paths(p)) > 1:
        return [read_trace(s) for s in segments]
    return [load(path)]


def _segment_heading(traces: list[Trace], i: int) -> None:
    if len(traces) > 1:
        run_id = next((e.run_id for e in traces[i].events if e.run_id), "?")
        print(f"{'' if i == 0 else chr(10)}== segment {i + 1}/{len(traces)}: {traces[i].path} (run {run_id})")


def cmd_show(args: argparse.Namespace) -> int:
    traces = load_segments(args.run)
    for i, trace in enumerate(traces):
        _segment_heading(traces, i)
        write_blocks(show_blocks(build_timeline(trace), all_rows=args.all), mode=args.format)
    return OK


def cmd_plot(args: argparse.Namespace) -> int:
    from miles.tracetools.gantt import plot_timeline

    trace = load(args.run)
    if not trace.events:
        raise BadInput(f"{trace.path} has no events to plot")
    assert trace.path is not None
    out = Path(args.out) if args.out else trace.path.with_suffix(".png")
    plot_timeline(build_timeline(trace), out, title=args.title)
    print(out)
    return OK


def cmd_check(args: argparse.Namespace) -> int:
    traces = load_segments(args.run)
    ok = True
    for i, trace in enumerate(traces):
        _segment_heading(traces, i)
        ok = _check_one(trace, args) and ok
    return OK if ok else FOUND


def _check_one(trace: Trace, args: argparse.Namespace) -> bool:
    if not trace.events and args.machine is None:   # nothing names a machine; it is cut short anyway
        print(f"{trace.path}: the trace is cut short: it has no complete event (the driver was killed "
              "before its first event was written)")
        return False
    definition = machine_for(trace, args.machine)
    report = check_trace(trace, definition)
    write_blocks(check_blocks(report, str(trace.path), {e.seq: e for e in trace.events}), mode=args.format)
    return report.ok


def cmd_diff(args: argparse.Namespace) -> int:
    as_, bs = load_segments(args.a), load_segments(args.b)
    for i, (a, b) in enumerate(zip(as_, bs)):
        d = diff_traces(a, b)
        if d is not None or i == len(as_) - 1 == len(bs) - 1:
            if len(as_) > 1 or len(bs) > 1:
                print(f"segment {i + 1}: {a.path} vs {b.path}")
            write_blocks(diff_blocks(d, str(a.path), str(b.path), len(state_sequence(a)), len(state_sequence(b))),
                         mode=args.format)
            if d is not None:
                return FOUND
    if len(as_) != len(bs):
        print(f"the runs differ in how many times they ran: {args.a} has {len(as_)} trace segments, "
              f"{args.b} {len(bs)}; the first {min(len(as_), len(bs))} walk the same states")
        return FOUND
    return OK


COMMANDS = {"show": cmd_show, "plot": cmd_plot, "check": cmd_check, "diff": cmd_diff}


def machine_for(trace: Trace, explicit: str | None) -> MachineDef:
    """The definition to check against: `--machine`, else the one the trace names.

    A copy saved in the run directory (`machine.yaml` or `<name>.yaml`) is preferred when its hash
    is the trace's: it is the definition the run really used, even if the built-in one changed since.
    """
    try:
        if explicit is not None:
            return load_machine(explicit)
        name = next((e.machine for e in trace.events if e.machine), "")
        want = next((e.machine_hash for e in trace.events if e.machine_hash), "")
        if not name:
            raise BadInput(f"{trace.path} names no machine: pass --machine NAME_OR_PATH")
        assert trace.path is not None
        for copy in (trace.path.parent / "machine.yaml", trace.path.parent / f"{name}.yaml"):
            if copy.is_file():
                d = load_machine(copy)
                if d.hash == want:
                    return d
        if name not in builtin_machines():
            raise BadInput(f"the trace names machine {name!r}, which is not built in "
                           f"({', '.join(builtin_machines())}): pass --machine path/to/{name}.yaml")
        return load_machine(name)
    except MachineDefinitionError as exc:
        raise BadInput(str(exc)) from exc
