"""`miles machine list | show NAME | paths NAME`: the lifecycle machines as data and as diagrams.

`show` prints mermaid text (paste it into a Markdown file or mermaid.live) or writes a PNG drawn
with matplotlib; both come from the YAML the runner loads. `paths` lists the simple paths a
model-based test should drive. Exit codes: 0 done, 2 an unknown machine or an invalid definition.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from miles.runtime.machine import MachineDefinitionError, builtin_machines, load_machine

from miles.tracetools.diagram import render_png, to_mermaid
from miles.tracetools.paths import covering_paths, unreachable_edges


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles machine", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="{list,show,paths}")
    sub.add_parser("list", help="the built-in machines")
    show = sub.add_parser("show", help="state diagram: mermaid text or PNG")
    show.add_argument("name", help="built-in machine name (sync, eval_only, ...) or a YAML path")
    show.add_argument("--format", choices=["mermaid", "png"], default="mermaid")
    show.add_argument("-o", "--out", help="output file (PNG default: machine-NAME.png; mermaid: stdout)")
    show.add_argument("--expand", action="store_true",
                      help="draw every edge of a `source: \"*\"` transition instead of one note")
    paths = sub.add_parser("paths", help="simple paths from the initial state to a final state")
    paths.add_argument("name", help="built-in machine name or a YAML path")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "list":
        for name in builtin_machines():
            d = load_machine(name)
            print(f"{name:<12} {d.hash}  {len(d.states)} states, {len(d.transitions)} transitions")
        return 0
    try:
        definition = load_machine(args.name)
    except MachineDefinitionError as exc:
        print(f"miles machine {args.command}: {exc}", file=sys.stderr)
        return 2
    if args.command == "paths":
        for i, path in enumerate(covering_paths(definition), start=1):
            print(f"{i:3d}  {definition.initial} " + " ".join(f"-{s.trigger}-> {s.dst}" for s in path))
        for t in unreachable_edges(definition):
            print(f"warning: line {t.line}: {t.source} -{t.trigger}-> {t.dest} can never be taken "
                  "(an earlier transition with the same trigger has no guard)", file=sys.stderr)
        return 0
    if args.format == "png":
        out = render_png(definition, args.out or f"machine-{definition.name}.png", expand=args.expand)
        print(out)
        return 0
    text = to_mermaid(definition, expand=args.expand)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0
