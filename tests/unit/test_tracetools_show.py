"""`miles trace show | diff`: the timeline, failure, teardown and totals read from golden traces."""

from __future__ import annotations

import asyncio
import json
import traceback
from pathlib import Path

from miles.runtime import load_machine, read_trace
from miles.tracetools import build_timeline, check_trace, diff_traces
from miles.cli.trace import main
from miles.tracetools.render import fmt_s
from miles.tracetools.timeline import exception_chain
from tests.stub_phases import make_stub_run, stub_phase

GOLDEN = Path(__file__).parents[1] / "fixtures" / "traces"


def timeline(name: str):
    return build_timeline(read_trace(GOLDEN / f"{name}.jsonl"))


def test_timeline_of_a_normal_run():
    tl = timeline("sync-ok")
    assert tl.outcome == "ok" and tl.failure is None and not tl.truncated
    assert [s.state for s in tl.spans[:5]] == ["init", "weight_sync", "eval", "rollout", "train"]
    assert tl.rollouts == [0, 1, 2]
    # phases do not overlap and each starts after the previous one ended
    assert all(a.end_s <= b.start_s + 1e-6 for a, b in zip(tl.spans, tl.spans[1:]))
    assert [s.resource for s in tl.teardown] == [
        "rollout_executor", "train_group", "engine_group", "ray_cluster", "tracker"]
    totals = {t.state: t for t in tl.totals()}
    assert totals["rollout"].visits == 3 and totals["weight_sync"].visits == 4
    assert 0.0 < sum(t.share for t in totals.values()) <= 1.0


def test_failure_names_state_rollout_time_and_error():
    tl = timeline("sync-failed-train")
    f = tl.failure
    assert f is not None and f.state == "train" and f.rollout_id == 1 and not f.cancelled
    assert f.error["type"] == "InjectedFault" and "injected in train" in f.error["traceback"]
    train = [s for s in tl.spans if s.state == "train"]
    assert train[-1].outcome == "error" and train[-1].trigger == "fail"
    assert abs(f.at_s - train[-1].end_s) < 1e-3
    assert [(e.event, e.src, e.dst) for e in f.consequences][0] == ("transition", "train", "draining")
    assert tl.outcome == "failed" and len(tl.teardown) == 5


def test_show_prints_every_section(capsys):
    assert main(["show", str(GOLDEN / "sync-failed-train.jsonl")]) == 0
    out = capsys.readouterr().out
    for heading in ("Timeline", "Failure", "Teardown: 5 of 5 registered resources", "Time per state"):
        assert heading in out
    assert "failed in train (rollout 1)" in out and "InjectedFault: injected in train" in out
    assert "→ seq" in out and "transition train -fail-> draining" in out
    assert "Traceback (most recent call last)" in out


def test_show_cancelled_and_teardown_escalations(capsys):
    main(["show", str(GOLDEN / "sync-cancelled.jsonl")])
    assert "cancelled in rollout" in capsys.readouterr().out
    main(["show", str(GOLDEN / "sync-teardown-errors.jsonl")])
    rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()
            if line[:6].strip().isdigit() and len(line.split()) > 4}
    assert "forced" in rows["sglang_server"] and "timed out → forced" in rows["sglang_server"]
    assert "ConnectionError: engine_group: actor died" in rows["engine_group"]


def test_show_cut_short(capsys):
    tl = timeline("sync-cut-short")
    assert tl.outcome == "incomplete" and tl.truncated and tl.spans[-1].outcome == "open"
    main(["show", str(GOLDEN / "sync-cut-short.jsonl")])
    out = capsys.readouterr().out
    assert "Cut short" in out and "(cut short)" in out
    assert "never started (5 resources registered)" in out and out.count("not disposed") == 5


def test_long_runs_elide_the_middle_of_the_table(tmp_path, capsys):
    lines = (GOLDEN / "sync-ok.jsonl").read_text().splitlines()
    events = [json.loads(x) for x in lines]
    loop = [e for e in events if e["event"] in ("phase_start", "phase_end") and e["state"] == "rollout"]
    # 300 extra rollout phases (not a legal run, but show does not check)
    extra = [{**loop[k % 2], "seq": 1000 + k} for k in range(600)]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in events[:5] + extra + events[5:]) + "\n")
    main(["show", str(path)])
    out = capsys.readouterr().out
    assert "phases omitted (--all shows them)" in out
    main(["show", str(path), "--all"])
    assert "omitted" not in capsys.readouterr().out


def test_show_missing_file_exits_2(tmp_path, capsys):
    assert main(["show", str(tmp_path)]) == 2
    assert "no trace at" in capsys.readouterr().err


def test_diff_finds_the_first_divergence(capsys):
    ok, failed = read_trace(GOLDEN / "sync-ok.jsonl"), read_trace(GOLDEN / "sync-failed-train.jsonl")
    d = diff_traces(ok, failed)
    # both: init, ws, eval, rollout, train, ws, rollout -> train; then A trains, B fails in train
    assert d is not None and d.index == 7
    assert (d.a.src, d.a.trigger, d.a.dst) == ("train", "next", "save")
    assert (d.b.src, d.b.trigger, d.b.dst) == ("train", "fail", "draining")
    assert d.b_cause is not None and d.b_cause.event == "error"
    assert diff_traces(ok, ok) is None
    assert main(["diff", str(GOLDEN / "sync-ok.jsonl"), str(GOLDEN / "sync-failed-train.jsonl")]) == 1
    out = capsys.readouterr().out
    assert "diverge at transition #8" in out and "InjectedFault" in out
    assert main(["diff", str(GOLDEN / "sync-ok.jsonl"), str(GOLDEN / "sync-ok.jsonl")]) == 0


def test_diff_when_one_run_is_a_prefix():
    ok, cut = read_trace(GOLDEN / "sync-ok.jsonl"), read_trace(GOLDEN / "sync-cut-short.jsonl")
    d = diff_traces(ok, cut)
    assert d is not None and d.b is None and d.a is not None
    assert d.index == len(cut.of("transition"))


def test_exception_chain_reads_causes_and_notes():
    try:
        try:
            raise KeyError("shard-3")
        except KeyError as inner:
            raise RuntimeError("load failed") from inner
    except RuntimeError as exc:
        exc.add_note("while unwinding after this error, a teardown failed: OSError: port busy")
        text = "".join(traceback.format_exception(exc))
    links = exception_chain(text)
    assert [link.exception for link in links] == ["KeyError: 'shard-3'", "RuntimeError: load failed"]
    assert links[0].via == "direct cause of" and links[1].via == ""
    assert links[1].notes == ("while unwinding after this error, a teardown failed: OSError: port busy",)


def test_fmt_s_units():
    assert [fmt_s(x) for x in (12e-6, 0.0034, 1.254, 245, 7380)] == ["12 µs", "3.4 ms", "1.25 s", "4m 05s", "2h 03m"]


def test_a_honoured_stop_request_shows_and_conforms(tmp_path, capsys):
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl", num_rollout=3)

    async def train_then_stop(c):
        c.stop_requested.set()             # a host asks to stop while rollout 0 trains
        return await stub_phase(c)

    runner.handlers["train"] = train_then_stop
    asyncio.run(runner.run())
    trace = read_trace(tmp_path)
    assert check_trace(trace, load_machine("sync")).ok
    tl = build_timeline(trace)
    assert tl.outcome == "stopped"
    train = [s for s in tl.spans if s.state == "train"]
    assert len(train) == 1 and train[0].trigger == "stop" and train[0].note == "returned next; stop requested"
    main(["show", str(tmp_path)])
    assert "stop  (returned next; stop requested)" in capsys.readouterr().out
