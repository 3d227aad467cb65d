"""State diagrams of a machine definition: mermaid text and a PNG drawn with matplotlib.

Both come from the `MachineDef` the runner loads, so the picture cannot drift from what runs.
A transition written once with `source: "*"` expands to one edge per state; drawn as such it buries
the loop under a dozen identical arrows, so by default each one becomes a single "from every
other state" note (`expand=True` draws every edge). Labels read `trigger [guard]`; `[not g]` is an
`unless`, `[else]` the unguarded fallback after guarded siblings (the first whose guards hold wins).
The PNG layout is layered without graphviz: layers by longest path from the initial state over the
forward edges, final states (and states that only lead to them) last; back edges arc above the
row, forward edges that skip layers arc below it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from miles.runtime.machine import MachineDef, TransitionDef

WILDCARD_MIN_SOURCES = 3


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    label: str                  # "next [eval_due]"; several triggers joined by " / "


@dataclass(frozen=True)
class Wildcard:
    triggers: tuple[str, ...]
    dst: str
    sources: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{' / '.join(self.triggers)} from every other state"


def transition_label(definition: MachineDef, t: TransitionDef) -> str:
    guards = [*t.conditions, *(f"not {g}" for g in t.unless)]
    if guards:
        return f"{t.trigger} [{', '.join(guards)}]"
    earlier = definition.transitions_from(t.source, t.trigger)
    guarded_before = any(o.conditions or o.unless for o in earlier[:earlier.index(t)])
    return f"{t.trigger} [else]" if guarded_before else t.trigger


def graph(definition: MachineDef, *, expand: bool = False) -> tuple[list[Edge], list[Wildcard]]:
    """The edges to draw (labels merged per state pair) and the collapsed wildcard notes."""
    by_line: dict[tuple[int, str, str], list[TransitionDef]] = {}
    for t in definition.transitions:
        by_line.setdefault((t.line, t.trigger, t.dest), []).append(t)
    wild: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    labels: dict[tuple[str, str], list[str]] = {}
    for (_, trigger, dst), group in by_line.items():
        if not expand and len(group) >= WILDCARD_MIN_SOURCES:
            wild.setdefault(dst, []).append((trigger, tuple(t.source for t in group)))
            continue
        for t in group:
            labels.setdefault((t.source, t.dest), []).append(transition_label(definition, t))
    edges = [Edge(s, d, " / ".join(ls)) for (s, d), ls in labels.items()]
    wildcards = [Wildcard(tuple(trig for trig, _ in items), dst,
                          tuple(sorted({s for _, srcs in items for s in srcs}))) for dst, items in wild.items()]
    return edges, wildcards


def to_mermaid(definition: MachineDef, *, expand: bool = False) -> str:
    edges, wildcards = graph(definition, expand=expand)
    lines = [f"%% machine {definition.name} ({definition.hash}), from {Path(definition.source).name}",
             "stateDiagram-v2", "    direction LR"]
    for s in definition.states.values():
        if s.phase:
            lines.append(f"    {s.name} : {s.phase.rpartition(':')[2]}()")
    lines.append(f"    [*] --> {definition.initial}")
    lines += [f"    {e.src} --> {e.dst} : {e.label}" for e in edges]
    lines += [f"    {f} --> [*]" for f in sorted(definition.final_states)]
    lines += [f"    note left of {w.dst} : {w.label}" for w in wildcards]
    return "\n".join(lines) + "\n"


# -- layout ----------------------------------------------------------------------------------------


def layers(definition: MachineDef, edges: list[Edge]) -> dict[str, int]:
    """Layer of each state: longest path over forward edges; sinks and final states go last."""
    succ: dict[str, list[str]] = {s: [] for s in definition.states}
    for e in edges:
        if e.dst != e.src:
            succ[e.src].append(e.dst)
    order, seen, on_stack, back = [], set(), set(), set()

    def dfs(v: str) -> None:
        seen.add(v)
        on_stack.add(v)
        for w in succ[v]:
            if w in on_stack:
                back.add((v, w))
            elif w not in seen:
                dfs(w)
        on_stack.discard(v)
        order.append(v)

    for s in [definition.initial, *definition.states]:
        if s not in seen:
            dfs(s)
    layer = {s: 0 for s in definition.states}
    for v in reversed(order):                      # topological order of the forward edges
        for w in succ[v]:
            if (v, w) not in back:
                layer[w] = max(layer[w], layer[v] + 1)
    finals = definition.final_states
    enders = {s for s in definition.states if s not in finals and succ[s] and set(succ[s]) <= finals}
    body = max([layer[s] for s in definition.states if s not in finals | enders] or [0])
    for s in enders:
        layer[s] = body + 1
    for s in finals:
        layer[s] = body + (2 if enders else 1)
    return layer


def positions(definition: MachineDef, layer: dict[str, int], dx: float = 2.3,
              dy: float = 1.25) -> dict[str, tuple[float, float]]:
    """Top to bottom, one row per layer; states sharing a layer side by side, in declaration order."""
    rows: dict[int, list[str]] = {}
    for s in definition.states:
        rows.setdefault(layer[s], []).append(s)
    pos = {}
    for row, names in rows.items():
        for i, s in enumerate(names):
            pos[s] = ((i - (len(names) - 1) / 2) * dx, -row * dy)
    return pos


# -- PNG -------------------------------------------------------------------------------------------


def render_png(definition: MachineDef, out: str | Path, *, expand: bool = False) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges, wildcards = graph(definition, expand=expand)
    layer = layers(definition, edges)
    pos = positions(definition, layer)
    fig = plt.figure(dpi=120)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.axis("off")
    boxes = {s: _node(ax, definition, s, pos[s]) for s in definition.states}
    _initial_marker(ax, boxes[definition.initial], pos[definition.initial])
    extent = [BOX_W, BOX_W]                        # how far left / right of x=0 the drawing reaches
    for e in edges:
        bulge = _edge(ax, e, pos, layer, boxes)
        extent[bulge > 0] = max(extent[bulge > 0], abs(bulge) + 1.8)
    for i, w in enumerate(wildcards):
        extent[1] = max(extent[1], _wildcard(ax, w, pos[w.dst], boxes[w.dst], i))
    xs, ys = [x for x, _ in pos.values()], [y for _, y in pos.values()]
    x0, x1 = min(xs) - extent[0], max(xs) + extent[1]
    y0, y1 = min(ys) - 0.7, max(ys) + 2.0
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    fig.set_size_inches((x1 - x0) * SCALE_IN, (y1 - y0) * SCALE_IN)
    ax.text(x0 + 0.1, y1 - 0.1, f"machine {definition.name}\n{Path(definition.source).name} · {definition.hash}",
            ha="left", va="top", fontsize=9, color="#333333")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, facecolor="white")
    plt.close(fig)
    return out


BOX_W, BOX_H = 1.7, 0.62
SCALE_IN = 0.62                 # inches per layout unit: a box holds "weight_sync" at 10 pt
BACK_EXTRA = 1.1                # back edges pass right of the labels of straight edges (~1.8 units)


def _node(ax, definition: MachineDef, name: str, xy: tuple[float, float]):
    from matplotlib.patches import FancyBboxPatch

    s = definition.states[name]
    final = s.final
    box = FancyBboxPatch((xy[0] - BOX_W / 2, xy[1] - BOX_H / 2), BOX_W, BOX_H,
                         boxstyle="round,pad=0.02,rounding_size=0.15", linewidth=2.2 if final else 1.2,
                         facecolor="#222222" if final else "#eef3fb", edgecolor="#222222", zorder=3)
    ax.add_patch(box)
    ax.text(xy[0], xy[1] + (0.08 if s.phase else 0), name, ha="center", va="center", zorder=4,
            fontsize=10, fontweight="bold", color="white" if final else "#111111")
    if s.phase:
        ax.text(xy[0], xy[1] - 0.17, s.phase.rpartition(":")[2] + "()", ha="center", va="center",
                fontsize=7, color="#555555", zorder=4)
    return box


def _initial_marker(ax, box, xy: tuple[float, float]) -> None:
    from matplotlib.patches import Circle, FancyArrowPatch

    dot = Circle((xy[0], xy[1] + BOX_H / 2 + 0.45), 0.08, color="#222222", zorder=3)
    ax.add_patch(dot)
    ax.add_patch(FancyArrowPatch(dot.center, xy, patchA=dot, patchB=box, arrowstyle="-|>",
                                 mutation_scale=12, color="#222222"))


def bulge_for(span: int) -> float:
    """How far an arc over `span` rows must swing sideways to clear the boxes it passes.

    The curve's sideways offset at fraction t of its length is 4·h·t·(1-t); the nearest box it
    passes sits at t = 1/span and must be cleared by half a box plus a margin. Adjacent back edges
    (span 1) just need to stand off the straight forward edge.
    """
    if span <= 1:
        return 0.7
    t = 1 / span
    return (BOX_W / 2 + 0.25) / (4 * t * (1 - t))


def _edge(ax, e: Edge, pos, layer, boxes) -> float:
    """Draw one edge; return its sideways bulge (negative: to the left)."""
    from matplotlib.patches import FancyArrowPatch

    (x1, y1), (x2, y2) = pos[e.src], pos[e.dst]
    label_style = dict(fontsize=7.5, zorder=5, bbox=dict(boxstyle="round,pad=0.15", facecolor="white",
                                                         edgecolor="none", alpha=0.9))
    if e.src == e.dst:                             # a self-loop: written beside the box, not drawn
        ax.text(x1 + BOX_W / 2 + 0.1, y1, f"↺ {e.label}", ha="left", va="center", **label_style)
        return BOX_W
    span = layer[e.dst] - layer[e.src]
    chord = max(((x2 - x1) ** 2 + (y2 - y1) ** 2) ** 0.5, 1e-6)
    if span == 1 and x1 == x2:
        rad, bulge = 0.0, 0.0
    else:                                          # back edges swing right, skips left (arc3, rad > 0)
        bulge = bulge_for(abs(span)) if x1 == x2 else 0.35 * chord
        if span <= 0 and x1 == x2:
            bulge += BACK_EXTRA                    # clear the labels of the straight edges
        rad = 2 * bulge / chord
    back = span <= 0
    ax.add_patch(FancyArrowPatch((x1, y1), (x2, y2), patchA=boxes[e.src], patchB=boxes[e.dst],
                                 connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>", mutation_scale=12,
                                 color="#7a4b9a" if back else "#333333", linewidth=1.1, zorder=2))
    # arc3's control point is the chord midpoint plus rad * (dy, -dx); the curve's midpoint is halfway
    mx = (x1 + x2) / 2 + 0.5 * rad * (y2 - y1)
    my = (y1 + y2) / 2 - 0.5 * rad * (x2 - x1)
    if rad == 0.0 or x1 != x2:
        ax.text(mx + 0.1, my, e.label, ha="left", va="center", **label_style)
    else:                                          # outside the arc, away from the boxes
        ax.text(mx + (0.08 if back else -0.08), my, e.label, ha="left" if back else "right",
                va="center", **label_style)
    return bulge if back else -bulge


def _wildcard(ax, w: Wildcard, xy: tuple[float, float], box, i: int) -> float:
    """A note right of the destination for a collapsed `source: "*"`; returns its right edge."""
    from matplotlib.patches import FancyArrowPatch

    note_xy = (xy[0] + BOX_W / 2 + 1.9, xy[1] + 0.55 * i)
    ax.text(*note_xy, w.label.replace(" from", "\nfrom"), ha="center", va="center", fontsize=7.5,
            style="italic", zorder=5, bbox=dict(boxstyle="round,pad=0.3", facecolor="#fff4e0",
                                                edgecolor="#c07000", linestyle="--"))
    ax.add_patch(FancyArrowPatch((note_xy[0] - 1.0, note_xy[1]), xy, patchB=box, arrowstyle="-|>",
                                 mutation_scale=12, color="#c07000", linestyle="--"))
    return BOX_W / 2 + 3.2
