"""A resumed run dir is a sequence of runs: each run writes a trace segment of its own, and
`miles trace show/check/diff` take the segments in order, checking each."""

from __future__ import annotations

import asyncio
import shutil

from miles.cli.trace import main as trace_main
from miles.runtime.trace import next_segment_path, read_trace, resolve_trace_path, segment_paths
from tests.stub_phases import make_stub_run


def run_stub(run_dir, num_rollout: int = 2) -> None:
    path = next_segment_path(run_dir)
    runner, ctx = make_stub_run("sync", path, num_rollout=num_rollout)
    asyncio.run(runner.run())
    ctx.tracer.close()


def test_each_run_in_a_run_dir_writes_its_own_segment_and_check_passes_on_each(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert next_segment_path(run_dir) == run_dir / "trace.jsonl"
    for _ in range(3):
        run_stub(run_dir)
    assert segment_paths(run_dir) == [run_dir / "trace.jsonl", run_dir / "trace.2.jsonl", run_dir / "trace.3.jsonl"]
    assert resolve_trace_path(run_dir) == run_dir / "trace.3.jsonl"       # a run dir reads as its newest run
    for seg in segment_paths(run_dir):
        assert [e.event for e in read_trace(seg).of("run_start")] == ["run_start"]
    assert trace_main(["check", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.count("conforms to machine sync") == 3
    assert "== segment 3/3:" in out and "trace.3.jsonl" in out
    assert trace_main(["show", str(run_dir), "--format", "plain"]) == 0
    assert capsys.readouterr().out.count("== segment") == 3


def test_check_fails_when_one_segment_does_not_conform(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_stub(run_dir)
    run_stub(run_dir)
    lines = (run_dir / "trace.2.jsonl").read_text().splitlines()
    (run_dir / "trace.2.jsonl").write_text("\n".join(lines[:-3]) + "\n")      # the second run cut short
    assert trace_main(["check", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert "trace.jsonl: conforms" in out and "trace.2.jsonl: conforms" not in out


def test_diff_compares_segment_with_segment(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    run_stub(a)
    run_stub(a)
    shutil.copytree(a, b)
    assert trace_main(["diff", str(a), str(b)]) == 0
    capsys.readouterr()
    run_stub(b, num_rollout=1)                         # b ran a third time
    assert trace_main(["diff", str(a), str(b)]) == 1
    assert "has 2 trace segments" in capsys.readouterr().out
    (b / "trace.3.jsonl").unlink()
    (b / "trace.2.jsonl").unlink()
    run_stub(b, num_rollout=1)                         # b's second run took fewer rollouts
    assert trace_main(["diff", str(a), str(b)]) == 1
    assert "segment 2:" in capsys.readouterr().out
