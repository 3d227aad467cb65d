"""`miles trace check`: golden traces conform; each kind of corruption is caught with its message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from miles.runtime import load_machine, read_trace
from miles.traceview import check_trace
from miles.cli.trace import main

GOLDEN = Path(__file__).parents[1] / "fixtures" / "traces"
COMPLETE = ["sync-ok", "sync-failed-train", "sync-cancelled", "sync-teardown-errors", "eval_only-ok"]


def events_of(name: str) -> list[dict]:
    return [json.loads(line) for line in (GOLDEN / f"{name}.jsonl").read_text().splitlines()]


def write(tmp_path: Path, events: list[dict], *, renumber: bool = True) -> Path:
    """Write events as a trace; with `renumber`, seq (and causes) are made gapless again."""
    if renumber:
        new = {e["seq"]: i for i, e in enumerate(events, start=1)}
        events = [{**e, "seq": new[e["seq"]], **({"cause": new.get(e["cause"])} if "cause" in e else {})}
                  for e in events]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def check(path: Path, machine: str = "sync"):
    return check_trace(read_trace(path), load_machine(machine))


def index(events: list[dict], **match) -> int:
    return next(i for i, e in enumerate(events) if all(e.get(k) == v for k, v in match.items()))


@pytest.mark.parametrize("name", COMPLETE)
def test_golden_traces_conform(name):
    machine = name.split("-")[0]
    report = check(GOLDEN / f"{name}.jsonl", machine)
    assert report.ok, report.violations
    assert main(["check", str(GOLDEN / f"{name}.jsonl")]) == 0


def test_teardown_errors_are_warnings_not_violations():
    report = check(GOLDEN / "sync-teardown-errors.jsonl")
    assert report.ok
    assert sorted(w.message.split(" ended ")[1][:8] for w in report.warnings if w.code == "teardown_failed") == [
        "'error':", "'forced'"]


def test_illegal_transition_is_named_with_its_event(tmp_path):
    events = events_of("sync-ok")
    i = index(events, event="transition", src="rollout", dst="train")
    events[i]["dst"] = "save"              # sync has rollout -next-> train only
    report = check(write(tmp_path, events))
    bad = [v for v in report.violations if v.code == "illegal_transition"]
    assert bad[0].seq == events[i]["seq"]
    assert "rollout -next-> save" in bad[0].message and "never 'save'" in bad[0].message


def test_a_trigger_the_state_does_not_have_is_illegal(tmp_path):
    events = events_of("sync-ok")
    i = index(events, event="transition", src="init")
    events[i]["trigger"] = "next"
    j = index(events, event="phase_end", state="init")
    events[j]["trigger"] = "next"
    report = check(write(tmp_path, events))
    assert report.codes() == ["illegal_transition"]
    assert "has no 'next' from 'init'" in report.violations[0].message


def test_missing_teardown_is_reported_with_the_resource(tmp_path):
    events = events_of("sync-ok")
    del events[index(events, event="disposed", resource="engine_group")]
    report = check(write(tmp_path, events))
    assert report.codes() == ["not_disposed"]
    assert report.violations[0].message.startswith("engine_group (position 2")


def test_reordered_teardown_is_reported(tmp_path):
    events = events_of("sync-ok")
    a = index(events, event="disposed", resource="train_group")
    b = index(events, event="disposed", resource="engine_group")
    keep = ("seq", "ts", "mono")
    events[a], events[b] = ({**events[b], **{k: events[a][k] for k in keep}},
                            {**events[a], **{k: events[b][k] for k in keep}})
    report = check(write(tmp_path, events, renumber=False))
    assert report.codes() == ["teardown_order"]
    assert "train_group (position 3) was torn down after engine_group (position 2)" in report.violations[0].message


def test_truncated_file_is_reported_as_cut_short_not_a_crash(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    shutil.copy(GOLDEN / "sync-cut-short.jsonl", path)
    report = check(path)
    assert report.cut_short and report.codes() == ["cut_short"]
    assert "cut off mid-write" in report.violations[0].message
    assert "inside phase 'rollout'" in report.violations[0].message
    assert main(["check", str(path)]) == 1
    assert "the trace is cut short" in capsys.readouterr().out


def test_killed_between_lines_is_cut_short_too(tmp_path):
    events = events_of("sync-ok")
    cut = index(events, event="phase_start", state="train")
    report = check(write(tmp_path, events[:cut + 1]))
    assert report.codes() == ["cut_short"]
    assert "mid-write" not in report.violations[0].message and "'train'" in report.violations[0].message


def test_seq_gap_is_reported(tmp_path):
    events = events_of("sync-ok")
    i = index(events, event="phase_start", state="eval")
    del events[i:i + 3]                    # the eval phase and the transition out of it vanish
    report = check(write(tmp_path, events, renumber=False))
    gap = [v for v in report.violations if v.code == "seq_gap"]
    assert len(gap) == 1 and "events missing" in gap[0].message


def test_recorded_guards_must_pick_the_destination(tmp_path):
    events = events_of("sync-ok")
    i = index(events, event="transition", src="weight_sync", dst="rollout")
    assert events[i]["guards"] == {"eval_due": False, "rollouts_left": True}
    events[i]["guards"]["eval_due"] = True   # then the machine would have gone to eval
    report = check(write(tmp_path, events))
    assert report.codes() == ["guard_mismatch"]
    assert "goes to 'eval'" in report.violations[0].message


def test_run_must_end_in_shutdown(tmp_path):
    events = events_of("sync-ok")
    last = index(events, event="transition", dst="shutdown")
    teardown = [e for e in events[last + 1:] if e["event"] != "run_end"]
    events = events[:last] + teardown + [events[-1]]
    report = check(write(tmp_path, events))
    assert "no_shutdown" in report.codes()
    assert "ended in 'draining'" in next(v.message for v in report.violations if v.code == "no_shutdown")


def test_changed_definition_is_a_warning_and_still_checked(tmp_path):
    events = [{**e, "machine_hash": "0000000000000000"} for e in events_of("sync-ok")]
    report = check(write(tmp_path, events))
    assert report.ok and [w.code for w in report.warnings] == ["definition_changed"]


def test_unknown_event_kinds_are_ignored(tmp_path):
    events = events_of("sync-ok")
    i = index(events, event="phase_end", state="train")
    extra = [{**events[i], "event": "metrics", "loss": 0.5}, {**events[i], "event": "weights_synced"}]
    events[i:i] = [{**e, "seq": events[i]["seq"] - 0.5 + k * 0.1} for k, e in enumerate(extra)]
    assert check(write(tmp_path, events)).ok


def test_explicit_machine_is_used(tmp_path, capsys):
    # a sync trace checked against eval_only: sync's rollout loop is not in eval_only
    assert main(["check", str(GOLDEN / "sync-ok.jsonl"), "--machine", "eval_only"]) == 1
    out = capsys.readouterr().out
    assert "does not conform" in out and "machine eval_only" in out


def test_copy_of_the_definition_in_the_run_dir_wins_when_its_hash_matches(tmp_path, capsys):
    # the run used a sync.yaml that differs from the built-in one (here: by a comment)
    run = tmp_path / "run"
    run.mkdir()
    text = load_machine("sync").text + "# tuned for this run\n"
    copy = run / "machine.yaml"
    copy.write_text(text)
    events = [{**e, "machine_hash": load_machine(copy).hash} for e in events_of("sync-ok")]
    write(run, events)
    assert main(["check", str(run)]) == 0
    assert "definition changed" not in capsys.readouterr().out
    copy.unlink()                          # without the copy: the built-in, with a warning
    assert main(["check", str(run)]) == 0
    assert "the definition changed since the run" in capsys.readouterr().out


def test_bad_input_exits_2(tmp_path, capsys):
    assert main(["check", str(tmp_path / "nope")]) == 2
    assert "no trace at" in capsys.readouterr().err
    events = [{**e, "machine": "mine"} for e in events_of("sync-ok")]
    assert main(["check", str(write(tmp_path, events))]) == 2
    assert "--machine path/to/mine.yaml" in capsys.readouterr().err


def test_empty_or_one_broken_line_is_cut_short(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    for text in ("", '{"seq": 1, "eve'):
        path.write_text(text)
        assert main(["check", str(path)]) == 1
        assert "cut short" in capsys.readouterr().out
        assert check_trace(read_trace(path), load_machine("sync")).codes() == ["cut_short"]


@pytest.mark.parametrize("name, outcome", [("real-demo-ok", "ok"), ("real-failed-train", "failed")])
def test_golden_traces_from_real_runs_conform(name, outcome):
    # real-demo-ok: the arithmetic demo (40 rollouts, local Ray, CPU); real-failed-train: a tiny-model
    # run with --inject-fault train:raise:2. Both written by the real runner, disposer and phases.
    trace = read_trace(GOLDEN / f"{name}.jsonl")
    assert trace.events[-1].get("outcome") == outcome
    report = check(GOLDEN / f"{name}.jsonl", "sync")
    assert report.ok, report.violations
    assert main(["check", str(GOLDEN / f"{name}.jsonl")]) == 0
