"""Terminal output for the trace commands: `rich` tables on a terminal, aligned plain text otherwise.

The commands build a list of blocks (`Table`, `Text`) and hand them to `write_blocks`; only this
module knows whether the output is rich or plain, so tests read the plain form and pipes get text
that `grep` and `diff` can use.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]
    right: set[int] = field(default_factory=set)     # indexes of right-aligned (numeric) columns
    styles: list[str | None] = field(default_factory=list)   # one rich style per row, optional


@dataclass
class Text:
    lines: list[str]
    title: str = ""
    style: str | None = None                          # rich style for the whole block


Block = Table | Text


def fmt_s(seconds: float | None) -> str:
    """A duration for people: 12 µs, 3.4 ms, 1.25 s, 4m 05s, 2h 03m."""
    if seconds is None:
        return "-"
    s = abs(seconds)
    sign = "-" if seconds < 0 else ""
    if s < 1e-3:
        return f"{sign}{s * 1e6:.0f} µs"
    if s < 1:
        return f"{sign}{s * 1e3:.1f} ms"
    if s < 60:
        return f"{sign}{s:.2f} s"
    if s < 3600:
        return f"{sign}{int(s // 60)}m {int(s % 60):02d}s"
    return f"{sign}{int(s // 3600)}h {int(s % 3600 // 60):02d}m"


def use_rich(stream: TextIO, mode: str = "auto") -> bool:
    if mode == "auto":
        return bool(getattr(stream, "isatty", lambda: False)())
    return mode == "rich"


def write_blocks(blocks: list[Block], stream: TextIO | None = None, *, mode: str = "auto") -> None:
    out = stream if stream is not None else sys.stdout
    if use_rich(out, mode):
        _write_rich(blocks, out)
    else:
        out.write(plain(blocks))


def plain(blocks: list[Block]) -> str:
    parts = []
    for b in blocks:
        head = [b.title, "-" * len(b.title)] if b.title else []
        body = _plain_table(b) if isinstance(b, Table) else b.lines
        parts.append("\n".join([*head, *body]))
    return "\n\n".join(parts) + "\n"


def _plain_table(t: Table) -> list[str]:
    widths = [max([len(c), *(len(r[i]) for r in t.rows)]) for i, c in enumerate(t.columns)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in t.right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(t.columns), *(line(r) for r in t.rows)]


def _write_rich(blocks: list[Block], out: TextIO) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table as RichTable
    from rich.text import Text as RichText

    console = Console(file=out, highlight=False)
    for b in blocks:
        if isinstance(b, Table):
            rt = RichTable(title=b.title or None, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                           title_style="bold")
            last = len(b.columns) - 1
            for i, c in enumerate(b.columns):
                # every column but the last keeps its width (names stay whole); the last one wraps
                width = min(max([len(c), *(len(r[i]) for r in b.rows)]), 48)
                rt.add_column(c, justify="right" if i in b.right else "left",
                              no_wrap=i < last, min_width=width if i < last else None,
                              overflow="fold")
            for i, r in enumerate(b.rows):
                rt.add_row(*r, style=b.styles[i] if i < len(b.styles) else None)
            console.print(rt)
        else:
            if b.title:
                console.print(RichText(b.title, style="bold"))
            console.print(RichText("\n".join(b.lines), style=b.style or ""))
            console.print()
