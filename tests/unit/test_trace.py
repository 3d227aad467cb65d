"""The trace file: schema, gapless seq, causes, truncation, per-run isolation."""

from __future__ import annotations

import json

from miles.runtime import Tracer, read_trace


def test_events_carry_the_schema_fields_and_gapless_seq(tmp_path):
    t = Tracer(tmp_path / "trace.jsonl", run_id="r42", machine="sync", machine_hash="abc")
    first = t.emit("phase_start", state="rollout", rollout_id=3)
    t.emit("phase_end", state="rollout", rollout_id=3, duration_s=0.5, trigger="next", cause=first)
    try:
        raise ValueError("bad sample")
    except ValueError as exc:
        t.emit("error", state="train", error=exc)
    t.close()
    lines = [json.loads(x) for x in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [x["seq"] for x in lines] == [1, 2, 3]
    for x in lines:
        assert x["run_id"] == "r42" and x["machine"] == "sync" and x["machine_hash"] == "abc"
        assert x["ts"].endswith("+00:00") and x["mono"] >= 0
    assert lines[1]["cause"] == 1 and lines[1]["trigger"] == "next"
    assert lines[2]["error"]["type"] == "ValueError" and "bad sample" in lines[2]["error"]["traceback"]
    events = read_trace(tmp_path).events
    assert events[1].duration_s == 0.5 and events[0].rollout_id == 3


def test_a_cut_off_last_line_is_reported_as_truncated(tmp_path):
    t = Tracer(tmp_path / "trace.jsonl", run_id="r")
    t.emit("a")
    t.emit("b")
    t.close()
    path = tmp_path / "trace.jsonl"
    path.write_text(path.read_text() + '{"seq": 3, "event": "transi')
    trace = read_trace(path)
    assert trace.truncated and [e.event for e in trace] == ["a", "b"] and trace.bad_lines == []


def test_two_tracers_in_one_process_do_not_share_events(tmp_path):
    a = Tracer(tmp_path / "a.jsonl", run_id="a")
    b = Tracer(tmp_path / "b.jsonl", run_id="b")
    seen_a = []
    a.add_listener(seen_a.append)
    a.emit("x")
    b.emit("y")
    b.emit("z")
    assert [e.event for e in read_trace(tmp_path / "a.jsonl")] == ["x"]
    assert [e.seq for e in read_trace(tmp_path / "b.jsonl")] == [1, 2]
    assert [e["event"] for e in seen_a] == ["x"]
