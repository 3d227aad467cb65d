"""The fully-async machine on real parts: local Ray, two embedded engines, the torch trainer, a tiny model.

What it must show, from the trace and the metrics alone: the staleness of every trained group stays
within --max-weight-staleness; a SIGTERM drains the producer (no engine call left running, every group
accounted for: trained, held by the checkpoint, redrawn from its data position, or counted as dropped);
a run resumed with --load trains no group twice and loses none; a dynamic-sampling filter's rejected
groups never reach the trainer and are counted and traced; --check-weight-update-equal compares every
engine's checksums, recorded at its in-flight swap, with the trainer's at every push. Whole runs: out of the default test run
(CI's budget), `-m extended`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.checkpoint.store import CheckpointStore
from miles.cli.train import run_with_signals
from miles.config.flags import parse_flags
from miles.checkpoint.checkpointer import read_data_position
from miles.runtime import load_machine, read_trace
from miles.traceview.check import check_trace
from tests.conftest import assert_cpu_threads, base_flags

pytestmark = [pytest.mark.ray, pytest.mark.extended]

BOUND = 2


def fa_flags(task, run_dir: Path, **extra):
    return base_flags(task, run_dir, **{**dict(use_tis=True, fully_async=True, rollout_num_engines=2, num_rollout=6,
                                               max_weight_staleness=BOUND, rollout_max_response_len=8), **extra})


ODD_ROWS = "def odd_rows(group):\n    return group[0].prompt.index % 2 == 1\n"


def assert_only_odd_rows_trained(run_dir: Path, trace, restored_total: int = 0) -> set[int]:
    """--dynamic-sampling-filter-path odd_rows: every trained prompt is an odd row, the rejected groups are
    traced with their reason and counted (each step's count adds up to the run's total, which a resume
    continues from `restored_total`); returns the tickets it rejected."""
    rows = [r for e in trace.of("rollout_done") for r in e.get("prompts")]
    assert rows and all(r % 2 == 1 for r in rows), rows
    filtered = {e.get("ticket") for e in trace.of("group_filtered")}
    assert all("--dynamic-sampling-filter-path" in e.get("reason") for e in trace.of("group_filtered"))
    assert not filtered & {t for ts in taken(trace).values() for t in ts}, "a rejected group was trained"
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in metrics if r.get("kind") == "train"]
    assert all(r["fa/dynamic_sampling_filled_groups"] == 0 for r in train_rows)
    totals = [restored_total] + [r["fa/groups_filtered_total"] for r in train_rows]
    assert [b - a for a, b in zip(totals, totals[1:])] == [r["fa/groups_filtered"] for r in train_rows]
    return filtered


def taken(trace) -> dict[int, list[int]]:
    return {e.rollout_id: e.get("tickets") for e in trace.of("groups_taken")}


def assert_no_request_left_running(trace) -> None:
    """Every engine call the producer made came back (groups, or cut by the drain's abort) before the
    executor and the engines were torn down; none started after the drain."""
    submitted = {t for e in trace.of("producer_submit") for t in e.get("tickets")}
    returned = {t for e in trace.of("producer_groups", "producer_cut") for t in e.get("tickets")}
    drained = trace.of("producer_drained")
    assert drained, "the producer was never drained"
    assert submitted <= returned | set(drained[0].get("in_flight_tickets")), submitted - returned
    gone = min(e.seq for e in trace.of("disposed") if e.get("resource") in ("rollout-executor", "engine-0", "engine-1"))
    assert drained[0].seq < gone
    assert not [e for e in trace.of("producer_submit") if e.seq > drained[0].seq]


def assert_staleness_bounded(run_dir: Path, trace) -> None:
    for e in trace.of("groups_taken"):
        assert max(e.get("staleness")) <= BOUND, e
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r.get("kind") == "train"]
    assert train_rows and all(r["fa/staleness_max"] <= BOUND for r in train_rows)
    for key in ("fa/staleness_min", "fa/staleness_mean", "fa/buffer_fill", "fa/engine_idle_fraction",
                "fa/trainer_idle_fraction", "fa/groups_dropped", "fa/groups_retried", "fa/mixed_version_tokens"):
        assert all(key in r for r in train_rows), key


def assert_weights_checked(trace) -> None:
    """--check-weight-update-equal: every push compared both engines' swap checksums with the trainer's (a
    mismatch would have failed the run): each push names the trainer's checksum it compared."""
    pushes = trace.of("weights_pushed")
    assert pushes and all(len(e.get("engines")) == 2 for e in pushes)
    sums = [e.get("checksum") for e in pushes]
    assert all(isinstance(c, str) and len(c) == 64 for c in sums), sums
    assert not trace.of("error")


# both engines swap weights in flight; the fast engine also with its calls' tails cut and continued
@pytest.mark.parametrize("engine,tail_cut", [("embedded", 0.0), ("fast", 0.0), ("fast", 0.5)])
def test_sigterm_then_load_trains_every_group_once_within_the_staleness_bound(ray_cluster, tiny_task, tmp_path,
                                                                             engine, tail_cut):
    ck, odd = tmp_path / "ck", tmp_path / "odd.py"
    odd.write_text(ODD_ROWS)             # DAPO dynamic sampling under the producer: odd dataset rows only
    cfg, _ = parse_flags(fa_flags(tiny_task, tmp_path / "first", save=ck, save_interval=10,
                                  inject_fault=["train:sigterm:3"], rollout_engine=engine,
                                  # answers long enough for the engine to see most of a call's end first
                                  async_tail_cut_share=tail_cut, rollout_max_response_len=32 if tail_cut else 8,
                                  dynamic_sampling_filter_path=f"{odd}:odd_rows", check_weight_update_equal=True))
    assert run_with_signals(cfg, "fully_async", prog="scripts/train_async.py") == 143
    first = read_trace(tmp_path / "first")
    assert check_trace(first, load_machine("fully_async")).ok
    assert first.events[-1].get("outcome") == "stopped"
    assert_no_request_left_running(first)
    assert_staleness_bounded(tmp_path / "first", first)
    assert_weights_checked(first)
    if tail_cut:                         # calls returned with their tails cut, continued in later calls
        cut = {t for e in first.of("producer_tail_cut") for t in e.get("tickets")}
        assert cut and cut & {t for e in first.of("producer_submit") for t in e.get("continued", [])}
    filtered = assert_only_odd_rows_trained(tmp_path / "first", first)
    assert filtered, "the filter rejected no group (half the rows are even)"
    [(rid, path)] = CheckpointStore(ck).list()
    trained_first = taken(first)
    assert rid == max(trained_first) == 2                      # the stop's save: the last trained step
    # the checkpoint's position accounts for every ticket drawn until then: trained, buffered, to regenerate,
    # dropped, or rejected by the filter (its prompt consumed; one in flight at the checkpoint and rejected
    # after it is to regenerate there)
    state = read_data_position(path)["fully_async"]
    held = {g["ticket"] for g in state["buffer"]} | {t for t, _, _ in state["regenerate"]}
    trained = [t for r in sorted(trained_first) for t in trained_first[r]]
    dropped = {e.get("ticket") for e in first.of("group_dropped")}
    assert len(trained) == len(set(trained))
    assert set(trained) | held | dropped | (filtered & set(range(state["next_ticket"]))) == set(range(state["next_ticket"]))
    noted = next(e.seq for e in first.of("groups_taken") if e.rollout_id == rid)     # the position is read here
    filtered_before = {e.get("ticket") for e in first.of("group_filtered") if e.seq < noted}
    assert state["filtered_total"] == len(filtered_before) and not filtered_before & held
    assert not (set(trained) & held) and not (held & dropped)
    drained = first.of("producer_drained")[0]
    assert drained.get("checkpoint") == rid and drained.get("dropped_tickets") == []
    assert set(drained.get("held_tickets")) == held

    cfg, _ = parse_flags(fa_flags(tiny_task, tmp_path / "second", save=ck, load=ck, rollout_engine=engine,
                                  async_tail_cut_share=tail_cut, rollout_max_response_len=32 if tail_cut else 8,
                                  dynamic_sampling_filter_path=f"{odd}:odd_rows", check_weight_update_equal=True))
    assert run_with_signals(cfg, "fully_async", prog="scripts/train_async.py") == 0
    second = read_trace(tmp_path / "second")
    assert check_trace(second, load_machine("fully_async")).ok
    restored = second.of("producer_restored")[0]
    assert set(restored.get("buffered_tickets")) | set(restored.get("regenerate_tickets")) == held
    trained_second = taken(second)
    assert sorted(trained_second) == [3, 4, 5]
    again = [t for r in sorted(trained_second) for t in trained_second[r]]
    assert not set(again) & set(trained), "a group trained twice across the stop"
    assert len(again) == len(set(again))
    # nothing the checkpoint held is lost: each held ticket is trained after the resume, or dropped (counted)
    dropped_second = {e.get("ticket") for e in second.of("group_dropped")}
    filtered_second = assert_only_odd_rows_trained(tmp_path / "second", second, state["filtered_total"])
    # (tickets from the checkpoint's next_ticket on are numbered again on resume: other prompts then)
    rejected_before = (filtered & set(range(state["next_ticket"]))) - held
    assert not set(again) & rejected_before, "a group rejected before the checkpoint was trained after it"
    assert held <= set(again) | dropped_second | filtered_second | set(
        second.of("producer_drained")[0].get("buffered_tickets"))
    assert_no_request_left_running(second)
    assert_staleness_bounded(tmp_path / "second", second)
    assert_weights_checked(second)
    # the prompts: a ticket keeps its prompt row across the resume (held groups are restored, regenerated
    # ones generated again from the same row)
    weights = second.of("weights_pushed")
    assert [e.get("version") for e in weights][:1] == [rid + 1]



NONE = "def none(group):\n    return False\n"


def test_a_filter_that_rejects_every_group_fills_each_step_after_max_rounds(ray_cluster, tiny_task, tmp_path):
    """A filter that rejects everything cannot keep a step waiting: after --dynamic-sampling-max-rounds x
    --rollout-batch-size rejects since the last take, the rejected groups fill the buffer (traced
    `group_filled`), every step trains a full batch of them, and the metrics count them."""
    none = tmp_path / "none.py"
    none.write_text(NONE)
    run = tmp_path / "run"
    cfg, _ = parse_flags(fa_flags(tiny_task, run, num_rollout=3, dynamic_sampling_filter_path=f"{none}:none",
                                  dynamic_sampling_max_rounds=1))
    assert run_with_signals(cfg, "fully_async", prog="scripts/train_async.py") == 0
    trace = read_trace(run)
    assert check_trace(trace, load_machine("fully_async")).ok
    filled = {e.get("ticket") for e in trace.of("group_filled")}
    assert all("--dynamic-sampling-max-rounds" in e.get("reason") for e in trace.of("group_filled"))
    steps = taken(trace)
    assert sorted(steps) == [0, 1, 2] and all(len(ts) == 4 for ts in steps.values())   # --rollout-batch-size 4
    trained = [t for ts in steps.values() for t in ts]
    assert len(trained) == len(set(trained)) and set(trained) <= filled    # nothing passed the filter
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r.get("kind") == "train"]
    assert [r["fa/dynamic_sampling_filled_groups"] for r in train_rows] == [4, 4, 4]
    assert all(r["fa/dynamic_sampling_pass_ratio"] == 0.0 and r["fa/groups_filtered"] >= 4 for r in train_rows)
    assert_staleness_bounded(run, trace)
    assert_no_request_left_running(trace)


ROOT = Path(__file__).resolve().parents[2]


def test_demo_recipe_learns_fully_async(ray_cluster, tmp_path):
    """The demo's recipe with --fully-async on two engines learns as the sync demo does (>= +15 points of
    greedy accuracy over its 40 steps), every trained group within the staleness bound."""
    from miles.api.launch import train
    from miles.runtime import with_disposer
    import asyncio

    cfg, _ = parse_flags(["--config", str(ROOT / "examples/arithmetic/grpo.yaml"), "--run-dir", str(tmp_path / "run"),
                          "--trace-console", "off", "--fully-async", "--use-tis", "--rollout-num-engines", "2",
                          "--max-weight-staleness", str(BOUND)])
    result = asyncio.run(with_disposer(train, cfg, machine="fully_async"))
    evals = [r for r in result.metrics if r.get("kind") == "eval"]
    before, after = evals[0]["eval/arith/pass@1"], evals[-1]["eval/arith/pass@1"]
    print(f"fully_async demo: greedy accuracy {before:.3f} -> {after:.3f}")
    assert [r["step"] for r in evals] == [0, 10, 20, 30, 40]
    assert after - before >= 0.15, (before, after)
    trace = read_trace(result.run_dir)
    assert check_trace(trace, load_machine("fully_async")).ok
    assert_staleness_bounded(result.run_dir, trace)
    assert_cpu_threads(result.run_dir, trace, overlapped=True)
