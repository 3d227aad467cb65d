"""`miles trace plot`: a run's timeline as a PNG Gantt chart (matplotlib, Agg backend).

Top panel: one lane per state over time, one lane per kind of work in flight beside the phases
(async: `prefetch`, the rollout generating ahead, and `eval (bg)`; each bar labelled with its
rollout and the weight version it read), one lane for the teardown, the failure marked by a red
line. Bottom panel: the time each rollout spent in each state, stacked, so a slow rollout shows as
a tall bar. Both stay readable from 3 rollouts to thousands: phases closer together than a pixel
are merged into one bar per lane (so the chart draws at most about `width_px` rectangles per lane),
rollout labels appear only when bars are wide enough to hold them, and beyond `MAX_ROLLOUT_BARS`
rollouts the bottom panel shows the mean per bin of consecutive rollouts.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from .render import fmt_s
from .timeline import BACKGROUND_LANES, BackgroundSpan, PhaseSpan, Timeline

MAX_ROLLOUT_BARS = 150
WIDTH_IN, DPI = 12.0, 110
STATE_COLORS = {
    "init": "#8c8c8c", "weight_sync": "#9467bd", "eval": "#17becf", "rollout": "#1f77b4",
    "train": "#ff7f0e", "save": "#2ca02c", "draining": "#bcbd22",
}
OUTCOME_COLORS = {"ok": "#555555", "error": "#d62728", "forced": "#ff7f0e", "timeout": "#8b0000",
                  "force_failed": "#8b0000"}
NOT_PER_ROLLOUT = {"init", "draining"}     # run-level states: their time belongs to no rollout
FAIL_COLOR = "#d62728"


def _color(state: str, i: int) -> str:
    from matplotlib import colormaps
    return STATE_COLORS.get(state) or colormaps["tab10"](i % 10)


def time_unit(duration_s: float) -> tuple[float, str]:
    if duration_s >= 3 * 3600:
        return 3600.0, "h"
    if duration_s >= 180:
        return 60.0, "min"
    if duration_s >= 2:
        return 1.0, "s"
    return 1e-3, "ms"


def merge_bars(spans: list[tuple[float, float]], resolution: float) -> list[tuple[float, float]]:
    """(start, width) bars, sorted, with bars closer than `resolution` merged; each at least that wide."""
    merged: list[list[float]] = []
    for start, width in sorted(spans):
        end = start + max(width, resolution)
        if merged and start - merged[-1][1] < resolution:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b - a) for a, b in merged]


def plot_timeline(tl: Timeline, out: str | Path, *, title: str | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    lanes = lanes_of(tl)
    per_rollout = len(tl.rollouts) >= 2
    height = 1.3 + 0.42 * len(lanes) + (2.3 if per_rollout else 0)
    fig = plt.figure(figsize=(WIDTH_IN, height), dpi=DPI)
    ratios = [0.42 * len(lanes), 2.0] if per_rollout else [1]
    grid = fig.add_gridspec(len(ratios), 1, height_ratios=ratios, hspace=0.45)
    ax = fig.add_subplot(grid[0])
    _draw_lanes(ax, tl, lanes)
    if per_rollout:
        _draw_per_rollout(fig.add_subplot(grid[1]), tl, lanes)
    fig.suptitle(title or _title(tl), fontsize=11, x=0.01, ha="left")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out


def lanes_of(tl: Timeline) -> list[str]:
    """Top to bottom: the states the run visited, the kinds of work in flight it had, the teardown."""
    background = [lane for lane, _ in BACKGROUND_LANES.values() if any(b.lane == lane for b in tl.background)]
    return [s for s in tl.states if any(sp.state == s for sp in tl.spans)] + background + ["teardown"]


def _title(tl: Timeline) -> str:
    n = len(tl.rollouts)
    outcome = "cut short (no run_end)" if tl.outcome == "incomplete" else tl.outcome
    return (f"{tl.machine or '?'} run {tl.run_id or '?'}: {outcome}, {fmt_s(tl.duration_s)}, "
            f"{n} rollout{'s' if n != 1 else ''}")


def _draw_lanes(ax, tl: Timeline, lanes: list[str]) -> None:
    end = max([tl.duration_s, *(s.end_s for s in tl.spans), *(t.start_s + t.duration_s for t in tl.teardown)])
    unit, unit_name = time_unit(end)
    res = end / (WIDTH_IN * DPI)            # seconds per pixel, roughly
    y = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    for i, state in enumerate(lanes[:-1]):
        if any(b.lane == state for b in tl.background):
            _draw_background(ax, [b for b in tl.background if b.lane == state], y[state], res, unit)
            continue
        ok = [(s.start_s, s.duration_s) for s in tl.spans if s.state == state and s.outcome == "ok"]
        bars = merge_bars(ok, res)
        ax.broken_barh([(a / unit, w / unit) for a, w in bars], (y[state] - 0.35, 0.7),
                       facecolors=_color(state, i), edgecolor="none")
        for s in tl.spans:
            if s.state == state and s.outcome != "ok":
                _draw_abnormal(ax, s, y[state], res, unit)
    _label_rollouts(ax, tl, y, res, unit)
    summary = _draw_teardown(ax, tl, y["teardown"], res, unit)
    _mark_failure(ax, tl, unit, len(lanes))
    ax.set_yticks(list(y.values()), [*lanes[:-1], f"teardown\n{summary}" if summary else "teardown"])
    if summary and not summary.endswith("all ok"):
        ax.get_yticklabels()[-1].set_color(FAIL_COLOR)
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.set_xlim(-0.01 * end / unit, end * 1.01 / unit)
    ax.set_xlabel(f"time since the run started ({unit_name})")
    ax.grid(axis="x", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def _draw_abnormal(ax, s: PhaseSpan, y: float, res: float, unit: float) -> None:
    width = max(s.duration_s, 4 * res)          # the phase that failed must be visible at any scale
    # hatched and outlined, in colours no state uses: red for an error, white-on-red for a cancel
    style = {"error": (FAIL_COLOR, "black", "xx"), "cancelled": ("white", FAIL_COLOR, "//"),
             "open": ("#dddddd", "#555555", "//")}
    face, edge, hatch = style.get(s.outcome, (FAIL_COLOR, "black", ""))
    ax.broken_barh([(s.start_s / unit, width / unit)], (y - 0.35, 0.7), facecolors=face,
                   edgecolor=edge, hatch=hatch, linewidth=0.8)


def _draw_background(ax, spans: list[BackgroundSpan], y: float, res: float, unit: float) -> None:
    """Thinner bars than the phases' (the work is beside them, not a state); a cancelled or failed
    one hatched like an abnormal phase; 'r<id> v<version>' inside bars wide enough (about 60 px)."""
    style = {"ok": ("#7f7f7f", "none", ""), "error": (FAIL_COLOR, "black", "xx"),
             "cancelled": ("white", FAIL_COLOR, "//"), "open": ("#dddddd", "#555555", "//")}
    for b in spans:
        face, edge, hatch = style.get(b.outcome, style["error"])
        ax.broken_barh([(b.start_s / unit, max(b.duration_s, res) / unit)], (y - 0.25, 0.5), facecolors=face,
                       edgecolor=edge, hatch=hatch, linewidth=0.8)
        if b.duration_s >= 60 * res and b.rollout_id is not None:
            ax.text((b.start_s + b.duration_s / 2) / unit, y, f"r{b.rollout_id} v{b.weight_version}",
                    ha="center", va="center", fontsize=7, color="white" if b.outcome == "ok" else "black")


def _label_rollouts(ax, tl: Timeline, y: dict[str, float], res: float, unit: float) -> None:
    """Rollout ids inside bars wide enough to hold them (about 30 px); none on long runs."""
    for s in tl.spans:
        if s.rollout_id is not None and s.duration_s >= 30 * res and s.state == "rollout" and s.outcome == "ok":
            ax.text((s.start_s + s.duration_s / 2) / unit, y[s.state], f"r{s.rollout_id}",
                    ha="center", va="center", fontsize=7, color="white")


def _draw_teardown(ax, tl: Timeline, y: float, res: float, unit: float) -> str:
    """One bar per disposed resource, coloured by outcome; returns the lane's one-line summary."""
    for step in tl.teardown:
        ax.broken_barh([(step.start_s / unit, max(step.duration_s, res) / unit)], (y - 0.35, 0.7),
                       facecolors=OUTCOME_COLORS.get(step.outcome, FAIL_COLOR), edgecolor="white",
                       linewidth=0.5)
    if not tl.teardown and not tl.registered:
        return ""
    if not tl.teardown:
        return f"not reached, {len(tl.registered)} registered"
    outcomes = Counter(s.outcome for s in tl.teardown if s.outcome != "ok")
    summary = f"{len(tl.teardown)} in {fmt_s(sum(s.duration_s for s in tl.teardown))}, "
    summary += ", ".join(f"{n} {o}" for o, n in outcomes.items()) if outcomes else "all ok"
    missing = len(tl.registered) - len(tl.teardown)
    return summary + (f", {missing} never disposed" if missing > 0 else "")


def _mark_failure(ax, tl: Timeline, unit: float, n_lanes: int) -> None:
    f = tl.failure
    if f is not None:
        ax.axvline(f.at_s / unit, color=FAIL_COLOR, linestyle="--", linewidth=1.2)
        rollout = f" (rollout {f.rollout_id})" if f.rollout_id is not None else ""
        verb = "cancelled" if f.cancelled else f"{f.error.get('type')}"
        left = f.at_s < 0.6 * max(tl.duration_s, 1e-12)
        ax.annotate(f"{verb} in {f.state}{rollout} at {fmt_s(f.at_s)}", (f.at_s / unit, n_lanes - 0.45),
                    xytext=(4 if left else -4, 0), textcoords="offset points", color=FAIL_COLOR,
                    fontsize=8, va="top", ha="left" if left else "right")
    if tl.outcome == "incomplete":
        ax.axvline(tl.duration_s / unit, color="#555555", linestyle=":", linewidth=1.2)
        ax.annotate("trace cut short", (tl.duration_s / unit, -0.6), xytext=(-4, 0),
                    textcoords="offset points", ha="right", fontsize=8, color="#555555")


def _draw_per_rollout(ax, tl: Timeline, lanes: list[str]) -> None:
    rollouts = tl.rollouts
    states = [s for s in lanes[:-1] if s not in NOT_PER_ROLLOUT
              and any(sp.state == s and sp.rollout_id is not None for sp in tl.spans)]
    lo, n = rollouts[0], rollouts[-1] - rollouts[0] + 1
    per = {s: [0.0] * n for s in states}
    for sp in tl.spans:
        if sp.rollout_id is not None and sp.state in per:
            per[sp.state][sp.rollout_id - lo] += sp.duration_s
    bin_size = max(1, math.ceil(n / MAX_ROLLOUT_BARS))
    xs = list(range(lo, lo + n, bin_size))
    unit, unit_name = time_unit(max(sum(v[i] for v in per.values()) for i in range(n)))
    bottom = [0.0] * len(xs)
    for i, state in enumerate(states):
        vals = [sum(per[state][j - lo:j - lo + bin_size]) / len(per[state][j - lo:j - lo + bin_size]) / unit
                for j in xs]
        ax.bar(xs, vals, width=bin_size * 0.85, bottom=bottom, color=_color(state, i), label=state,
               align="edge" if bin_size > 1 else "center")
        bottom = [b + v for b, v in zip(bottom, vals)]
    if bin_size > 1:                           # a mean hides a slow rollout; its bin's maximum does not
        totals = [sum(v[i] for v in per.values()) / unit for i in range(n)]
        peaks = [max(totals[j - lo:j - lo + bin_size]) for j in xs]
        ax.scatter([x + bin_size * 0.425 for x in xs], peaks, marker="_", color="black", s=25,
                   linewidths=1, label="slowest in bin", zorder=3)
        bottom = [max(b, p) for b, p in zip(bottom, peaks)]
    f = tl.failure
    if f is not None and f.rollout_id is not None:
        ax.annotate("✗", (f.rollout_id, max(bottom) if bin_size > 1 else bottom[(f.rollout_id - lo)]),
                    xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                    color=FAIL_COLOR, fontsize=12, fontweight="bold")
    what = "per rollout" if bin_size == 1 else f"per rollout, mean over bins of {bin_size} rollouts"
    ax.set_ylabel(unit_name)
    ax.set_xlabel("rollout id")
    ax.set_title(f"time {what}", fontsize=9, loc="left")
    if n <= 20:
        ax.set_xticks(rollouts)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
