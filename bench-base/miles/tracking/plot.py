"""A run's training curves as one PNG (`miles plot RUN_DIR [RUN_DIR ...]`, in miles/cli/plot.py).

Six panels against the rollout id: reward, eval accuracy (pass@1 of each eval set), response length,
KL, entropy, and step time (wall time between trained rollouts, from the trace, with its generation
and training parts from metrics.jsonl). Several run dirs are drawn over each other, one colour each,
to compare runs. Reads only the run directory: no torch, no Ray.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from miles.tracking.metrics import read_metrics

Series = dict[str, tuple[list[int], list[float]]]      # label -> (rollout ids, values)


def train_series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """`key` of each trained rollout (and of each rollout of a --debug-rollout-only run)."""
    xs, ys = [], []
    for r in rows:
        if r.get("kind", "train") in ("train", "rollout") and isinstance(r.get(key), (int, float)):
            xs.append(int(r["step"]))
            ys.append(float(r[key]))
    return xs, ys


def eval_series(rows: list[dict[str, Any]]) -> Series:
    """`eval/<set>/pass@1` of each eval row, per eval set (x: rollouts trained before the eval)."""
    out: Series = {}
    for r in rows:
        if r.get("kind") != "eval":
            continue
        for k, v in r.items():
            if k.startswith("eval/") and k.endswith("/pass@1") and isinstance(v, (int, float)):
                xs, ys = out.setdefault(k.split("/")[1], ([], []))
                xs.append(int(r["step"]))
                ys.append(float(v))
    return out


def step_times(run_dir: Path) -> tuple[list[int], list[float]]:
    """Wall seconds from one trained rollout to the next, from the trace's `metrics` events."""
    from miles.runtime.trace import read_trace

    if not (run_dir / "trace.jsonl").exists():
        return [], []
    marks = [(e.rollout_id, e.mono) for e in read_trace(run_dir).of("metrics") if e.rollout_id is not None]
    return [r for r, _ in marks[1:]], [b - a for (_, a), (_, b) in zip(marks, marks[1:])]


def panels(run_dir: Path) -> dict[str, Series]:
    """Every panel's series for one run (an empty series: nothing of that kind was logged)."""
    rows = read_metrics(run_dir)
    return {
        "reward (mean)": {"reward": train_series(rows, "reward_mean")},
        "eval accuracy (pass@1)": eval_series(rows),
        "response length (tokens)": {"mean": train_series(rows, "response_len_mean")},
        "KL to reference": {"kl": train_series(rows, "kl")},
        "entropy": {"entropy": train_series(rows, "entropy")},
        "step time (s)": {"wall": step_times(run_dir), "generate": train_series(rows, "gen_time_s"),
                          "train": train_series(rows, "train_time_s")},
    }


def plot_runs(run_dirs: Sequence[Path], out: Path, *, title: str | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_run = {d: panels(d) for d in run_dirs}
    names = list(next(iter(per_run.values())))
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    for ax, name in zip(axes.flat, names):
        drawn = 0
        for i, (run_dir, series) in enumerate(per_run.items()):
            for j, (label, (xs, ys)) in enumerate(series[name].items()):
                if not xs:
                    continue
                tag = label if len(run_dirs) == 1 else f"{run_dir.name}: {label}"
                ax.plot(xs, ys, styles[j % len(styles)], color=colors[i % len(colors)], marker="." if len(xs) < 30 else None,
                        label=tag)
                drawn += 1
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("rollout", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if drawn == 0:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        elif drawn > 1:
            ax.legend(fontsize=7)
    fig.suptitle(title or ", ".join(str(d) for d in run_dirs), fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
