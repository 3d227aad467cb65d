"""`miles trace show | diff`: the timeline, failure, teardown and totals read from golden traces."""

from __future__ import annotations

import asyncio
import json
import traceback
from pathlib import Path

from miles.runtime import load_machine, read_trace
from miles.traceview import build_timeline, check_trace, diff_traces
from miles.cli.trace import main
from miles.traceview.render import fmt_s
from miles.traceview.timeline import exception_chain
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


def test_a_train_phase_that_compiled_layer_graphs_says_so(tmp_path, capsys):
    # the train phase's `metrics` event carries the trainer's layer_compiles when it compiled (a micro-batch of
    # a new kind, mid-run: seconds on a GPU); show notes it on that phase's row, and only there
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl", num_rollout=3)

    async def train(c):
        rid = c.rollout_id
        c.tracer.emit("metrics", rollout_id=rid, loss=0.0, **({"layer_compiles": 2.0} if rid == 1 else {}))
        return await stub_phase(c)

    runner.handlers["train"] = train
    asyncio.run(runner.run())
    train_spans = [s for s in build_timeline(read_trace(tmp_path)).spans if s.state == "train"]
    assert [s.note for s in train_spans] == ["", "compiled 2 graphs", ""]
    main(["show", str(tmp_path), "--format", "plain"])
    out = capsys.readouterr().out
    assert out.count("compiled 2 graphs") == 1


def test_the_train_phase_traces_its_layer_compiles_only_when_it_compiled(tmp_path):
    from miles.phases import train as train_phase
    from tests.unit.test_restarted_engine_weights import FakeTrainer, context

    class Metrics:
        def log(self, step, row):
            pass

    ctx = context(tmp_path, check=False)
    for rid, compiles in ((3, 2.0), (4, 0.0)):
        ctx.next_rollout = ctx.rollout_id = rid
        ctx.batch_ref = "batch"
        trainer = FakeTrainer(version=rid)
        trainer.step_done.set()
        step = trainer._step

        async def counted(step=step, compiles=compiles):
            return dict(await step(), layer_compiles=compiles)

        trainer._step = counted
        ctx.c.trainer, ctx.c.metrics = type("Resource", (), {"handle": trainer})(), Metrics()
        asyncio.run(train_phase.train(ctx))
    ctx.tracer.close()
    events = [e for e in read_trace(tmp_path).of("metrics")]
    assert [(e.rollout_id, e.get("layer_compiles")) for e in events] == [(3, 2.0), (4, None)]

# ---- a resumed segment: where it resumed from, what stopped it, what the stop saved -------------

def write_events(path: Path, events: list[dict]) -> Path:
    with open(path, "w") as f:
        for seq, e in enumerate(events, start=1):
            f.write(json.dumps({"seq": seq, "ts": "2026-12-06T18:00:00+00:00", "mono": float(seq), "run_id": "r",
                                "machine": "sync", "machine_hash": "h", **e}) + "\n")
    return path


def resumed_segment(*, why: str | None = "SIGTERM", cut_in_rollout: bool = False) -> list[dict]:
    """A segment that resumed from iter 2 (iter 3 passed over), trained rollout 3, then was stopped in
    rollout 4's train and saved it; or (`cut_in_rollout`) was killed in rollout 4's rollout phase,
    whose phase_start, as the runner wrote it before the fix, carries rollout 3."""
    head = [
        {"event": "run_start", "state": "init", "states": ["init", "weight_sync", "rollout", "train", "save",
                                                           "draining", "shutdown"]},
        {"event": "phase_start", "state": "init"},
        {"event": "checkpoint_skipped", "rollout_id": 3, "path": "/c/iter_0000003", "check": "sha256",
         "problems": ["/c/iter_0000003/trainer/model.safetensors does not match its sha256 in the manifest"]},
        {"event": "resumed", "rollout_id": 2, "path": "/c/iter_0000002", "next_rollout": 3, "verified": True},
        {"event": "phase_end", "state": "init", "trigger": "ready", "duration_s": 1.0},
        {"event": "phase_start", "state": "rollout", "rollout_id": 2},
        {"event": "rollout_done", "rollout_id": 3},
        {"event": "phase_end", "state": "rollout", "rollout_id": 3, "trigger": "next", "duration_s": 1.0},
        {"event": "phase_start", "state": "train", "rollout_id": 3},
        {"event": "phase_end", "state": "train", "rollout_id": 3, "trigger": "next", "duration_s": 1.0},
    ]
    if cut_in_rollout:
        return head + [{"event": "phase_start", "state": "rollout", "rollout_id": 3},
                       {"event": "phase_waiting", "state": "rollout", "rollout_id": 4, "running_s": 30.0}]
    stop = {"event": "stop_requested", "state": "train", "stop_timeout_s": 20.0}
    if why is not None:
        stop["why"] = why
    return head + [
        {"event": "phase_start", "state": "train", "rollout_id": 4}, stop,
        {"event": "phase_end", "state": "train", "rollout_id": 4, "trigger": "next", "duration_s": 1.0},
        {"event": "stop_honoured", "state": "train", "ignored_trigger": "next"},
        {"event": "phase_start", "state": "draining", "rollout_id": 4},
        {"event": "checkpoint_saved", "rollout_id": 4, "path": "/c/iter_0000004", "duration_s": 0.5},
        {"event": "stop_save", "saved": True, "rollout_id": 4, "duration_s": 0.5},
        {"event": "phase_end", "state": "draining", "rollout_id": 4, "trigger": "finish", "duration_s": 1.0},
        {"event": "run_end", "state": "shutdown", "outcome": "stopped", "duration_s": 20.0},
    ]


def test_show_says_where_a_segment_resumed_from_what_stopped_it_and_what_the_stop_saved(tmp_path, capsys):
    path = write_events(tmp_path / "trace.jsonl", resumed_segment())
    tl = build_timeline(read_trace(path))
    assert tl.story == [
        "passed over iter_0000003 (rollout 3, sha256 check): /c/iter_0000003/trainer/model.safetensors does not "
        "match its sha256 in the manifest",
        "resumed from iter_0000002 (rollout 2, its sha256 verified; /c/iter_0000002); next rollout 3",
        "stopped by SIGTERM in train, 11.0 s into the run",
        "the stop saved rollout 4 (iter_0000004) in 0.50 s"]
    assert main(["show", str(path), "--format", "plain"]) == 0
    out = capsys.readouterr().out
    assert "Resume and stop" in out and "stopped by SIGTERM in train" in out
    old = build_timeline(read_trace(write_events(tmp_path / "old.jsonl", resumed_segment(why=None))))
    assert "stopped by a stop request (this trace does not record whose) in train, 11.0 s into the run" in old.story
    nothing = resumed_segment()
    nothing[-3] = {"event": "stop_save", "saved": False, "rollout_id": 4, "reason": "rollout 4 is saved already"}
    tl = build_timeline(read_trace(write_events(tmp_path / "n.jsonl", nothing)))
    assert tl.story[-1] == "the stop saved nothing: rollout 4 is saved already"


def test_a_cut_short_segments_last_row_names_the_rollout_it_was_making(tmp_path):
    old = resumed_segment(cut_in_rollout=True)       # an older runner: rollout's phase_start says 3
    tl = build_timeline(read_trace(write_events(tmp_path / "t.jsonl", old)))
    last = tl.spans[-1]
    assert (last.state, last.outcome, last.rollout_id) == ("rollout", "open", 4)     # its heartbeat's
    assert [s.rollout_id for s in tl.spans[1:3]] == [3, 3]                  # closed rows: their phase_end's
    new = old[:-1]
    new[-1] = {**new[-1], "rollout_id": 4}            # the runner now: rollout_of("rollout") = next_rollout
    assert build_timeline(read_trace(write_events(tmp_path / "n.jsonl", new))).spans[-1].rollout_id == 4
    evaluating = old[:-2] + [{"event": "phase_start", "state": "eval", "rollout_id": 3},
                             {"event": "eval_begin", "rollout_id": 4, "why": "every --eval-interval 4 rollouts"}]
    tl = build_timeline(read_trace(write_events(tmp_path / "e.jsonl", evaluating)))
    assert (tl.spans[-1].state, tl.spans[-1].rollout_id) == ("eval", 3)   # as a closed eval row reads


def test_the_runner_names_a_rollout_phases_rollout_at_its_start(tmp_path):
    """phase_start of `rollout` carries the rollout it makes (ctx.rollout_of), not the one before."""
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl", num_rollout=2, eval_interval=None,
                                save_interval=None)
    ctx.rollout_of = lambda state: 7 if state == "rollout" else ctx.rollout_id
    asyncio.run(runner.run())
    starts = [e for e in read_trace(tmp_path / "trace.jsonl").of("phase_start") if e.state == "rollout"]
    assert starts and all(e.rollout_id == 7 for e in starts)


def test_a_fully_async_run_shows_a_lane_per_engine_and_one_for_the_trainer(capsys):
    # a real 2-engine --fully-async run (tests/fixtures/traces/real-fully_async-ok.jsonl)
    tl = timeline("real-fully_async-ok")
    calls = [b for b in tl.background if b.lane.startswith("engine-")]
    assert {b.lane for b in calls} == {"engine-0", "engine-1"} and all(b.outcome == "ok" for b in calls)
    submits = read_trace(GOLDEN / "real-fully_async-ok.jsonl").of("producer_submit")
    assert len(calls) == len(submits)
    assert main(["show", str(GOLDEN / "real-fully_async-ok.jsonl")]) == 0
    out = capsys.readouterr().out
    lanes = out[out.index("Lanes"):].splitlines()
    rows = {line.split()[0]: line for line in lanes if line.startswith(("engine-", "trainer"))}
    assert set(rows) == {"engine-0", "engine-1", "trainer"}
    assert all("#" in row and "busy" in row for row in rows.values())
    assert check_trace(read_trace(GOLDEN / "real-fully_async-ok.jsonl"), load_machine("fully_async")).ok
