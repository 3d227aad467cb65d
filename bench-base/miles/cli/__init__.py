"""`miles <command>`: train, trace, machine, plot. Every command line of miles lives in this package.

Each command is a module here exposing `main(argv) -> int` (`train`, `trace`, `machine`, `plot`);
this file only dispatches, so `miles trace show` never imports torch or Ray. `python -m miles.cli`
is the same as the `miles` console script. Exit codes: 0 done, 1 failed, 2 bad config or input,
130 SIGINT, 143 SIGTERM.
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

COMMANDS = {
    "train": ("miles.cli.train", "run a training (sync, async, eval_only or your own machine)"),
    "trace": ("miles.cli.trace", "read a run's trace: show, plot, check, diff"),
    "machine": ("miles.cli.machine", "lifecycle machines: list, show (mermaid or png)"),
    "plot": ("miles.cli.plot", "plot a run's metrics to PNG"),
}


def usage() -> str:
    lines = ["usage: miles <command> [args]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`miles <command> --help` for a command's flags."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"miles: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)

