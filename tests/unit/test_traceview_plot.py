"""`miles trace plot` and `miles machine show`: PNGs are written, bounded at scale, true to the YAML."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles.runtime import load_machine, read_trace
from miles.traceview import build_timeline
from miles.cli.trace import main as trace_main
from miles.traceview.diagram import graph, layers, to_mermaid
from miles.traceview.gantt import MAX_ROLLOUT_BARS, merge_bars, plot_timeline
from miles.cli.machine import main as machine_main
from tests.stub_phases import make_stub_run

GOLDEN = Path(__file__).parents[1] / "fixtures" / "traces"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _agg():
    import matplotlib
    matplotlib.use("Agg")


@pytest.mark.parametrize("name", ["sync-failed-train", "sync-cut-short"])
def test_plot_writes_a_png(tmp_path, name, capsys):
    out = tmp_path / "g.png"
    assert trace_main(["plot", str(GOLDEN / f"{name}.jsonl"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC and capsys.readouterr().out.strip() == str(out)


def test_merge_bars_joins_what_a_pixel_cannot_separate():
    # resolution 1: [0,2) and [2.5,3.5) touch within a pixel; [10, 10.2) is widened to 1
    assert merge_bars([(2.5, 1.0), (0.0, 2.0), (10.0, 0.2)], 1.0) == [(0.0, 3.5), (10.0, 1.0)]


def test_a_thousand_rollouts_draw_a_bounded_chart(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Rectangle

    runner, _ = make_stub_run("sync", tmp_path / "trace.jsonl", num_rollout=1000, eval_interval=100,
                              save_interval=100)
    asyncio.run(runner.run())
    tl = build_timeline(read_trace(tmp_path))
    assert len(tl.spans) > 3000
    counted = {}
    real_close = plt.close

    def count_then_close(fig):
        top, bottom = fig.axes[0], fig.axes[1]
        counted["lane_rects"] = sum(len(c.get_paths()) for c in top.collections if isinstance(c, PolyCollection))
        counted["texts"] = len(top.texts)
        counted["bars"] = sum(isinstance(p, Rectangle) for p in bottom.patches)
        real_close(fig)

    monkeypatch.setattr(plt, "close", count_then_close)
    plot_timeline(tl, tmp_path / "g.png")
    assert 7 <= counted["lane_rects"] <= 8 * 1400    # a bar per lane at least; at most one per pixel
    assert counted["texts"] <= 5                     # no per-rollout labels at this scale
    assert 0 < counted["bars"] <= 5 * MAX_ROLLOUT_BARS  # bins x (weight_sync, eval, rollout, train, save)


def test_mermaid_is_the_yaml():
    text = to_mermaid(load_machine("sync"))
    assert text.splitlines()[1] == "stateDiagram-v2"
    for line in ("[*] --> init", "init --> weight_sync : ready", "weight_sync --> eval : next [eval_due]",
                 "weight_sync --> draining : next [else]", "train --> save : next [save_due]",
                 "draining --> shutdown : finish / fail", "shutdown --> [*]",
                 "note left of draining : fail / stop from every other state"):
        assert f"    {line}" in text.splitlines(), line
    expanded = to_mermaid(load_machine("sync"), expand=True)
    assert "    rollout --> draining : fail / stop" in expanded.splitlines()
    assert "note" not in expanded


def test_every_transition_is_drawn_or_collapsed():
    for name in ("sync", "eval_only"):
        d = load_machine(name)
        edges, wild = graph(d)
        drawn = {(e.src, e.dst) for e in edges} | {(s, w.dst) for w in wild for s in w.sources}
        assert drawn == {(t.source, t.dest) for t in d.transitions}


def test_layers_put_the_loop_in_order_and_shutdown_last():
    d = load_machine("sync")
    layer = layers(d, graph(d)[0])
    assert [s for s in sorted(layer, key=layer.get)] == [
        "init", "weight_sync", "eval", "rollout", "train", "save", "draining", "shutdown"]


def test_machine_show_cli(tmp_path, capsys):
    assert machine_main(["show", "eval_only"]) == 0
    assert "eval --> draining : next" in capsys.readouterr().out
    out = tmp_path / "m.png"
    assert machine_main(["show", "sync", "--format", "png", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert machine_main(["show", "no_such_machine"]) == 2
    assert "no machine named 'no_such_machine'" in capsys.readouterr().err
    assert machine_main(["paths", "eval_only"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 14
