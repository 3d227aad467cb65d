"""`miles plot`: series read from a run dir, the PNG, and the errors for a dir that is not a run."""

from __future__ import annotations

import json

from miles.cli import main as miles_main
from miles.metrics.plot import eval_series, panels, step_times, train_series


def write_run(run_dir, rows, trace=()):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "trace.jsonl").write_text("".join(json.dumps({"seq": i + 1, **e}) + "\n" for i, e in enumerate(trace)))


ROWS = [
    {"step": 0, "kind": "eval", "eval/arith/pass@1": 0.25, "eval/other/pass@1": 0.5},
    {"step": 0, "kind": "train", "reward_mean": 0.1, "response_len_mean": 5.0, "kl": 0.0, "entropy": 2.0,
     "gen_time_s": 1.5, "train_time_s": 0.5},
    {"step": 1, "kind": "train", "reward_mean": 0.3, "response_len_mean": 4.0, "kl": 0.01, "entropy": 1.8,
     "gen_time_s": 1.4, "train_time_s": 0.6},
    {"step": 2, "kind": "eval", "eval/arith/pass@1": 0.75},
]
TRACE = [{"event": "metrics", "rollout_id": 0, "mono": 3.0}, {"event": "metrics", "rollout_id": 1, "mono": 5.5}]


def test_series_come_from_the_right_rows(tmp_path):
    write_run(tmp_path, ROWS, TRACE)
    assert train_series(ROWS, "reward_mean") == ([0, 1], [0.1, 0.3])
    assert eval_series(ROWS) == {"arith": ([0, 2], [0.25, 0.75]), "other": ([0], [0.5])}
    assert step_times(tmp_path) == ([1], [2.5])          # 5.5 - 3.0 between the two trained rollouts
    got = panels(tmp_path)
    assert list(got) == ["reward (mean)", "eval accuracy (pass@1)", "response length (tokens)", "KL to reference",
                         "entropy", "step time (s)"]
    assert got["step time (s)"]["generate"] == ([0, 1], [1.5, 1.4])


def test_plot_writes_a_png_for_one_run_and_for_several(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, ROWS, TRACE)
    write_run(b, ROWS[1:3])                              # no evals, empty trace: panels say "not logged"
    assert miles_main(["plot", str(a)]) == 0
    png = a / "plots" / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and capsys.readouterr().out.strip() == str(png)
    out = tmp_path / "cmp.png"
    assert miles_main(["plot", str(a), str(b), "-o", str(out), "--title", "a vs b"]) == 0
    assert out.stat().st_size > 10_000


def test_not_a_run_dir_or_nothing_trained_is_exit_2_with_the_reason(tmp_path, capsys):
    assert miles_main(["plot", str(tmp_path / "nope")]) == 2
    assert "no metrics.jsonl here" in capsys.readouterr().err
    write_run(tmp_path / "empty", [])
    assert miles_main(["plot", str(tmp_path / "empty")]) == 2
    assert "no rollout was trained yet" in capsys.readouterr().err
