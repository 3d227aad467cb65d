"""The progress listener: its model of the run from trace events, plain lines, the rich frame."""

from __future__ import annotations

import io
import json

import pytest

from miles.metrics.progress import Expected, Progress, ProgressModel


def ev(event, mono, **fields):
    return {"event": event, "mono": mono, "run_id": "run-1", **fields}


def two_rollouts():
    """init, then rollouts 0 and 1 of 4 (rollout 4 s, train 2 s each), an eval after rollout 1."""
    return [
        ev("run_start", 0.0), ev("phase_start", 0.1, state="init"), ev("plan", 5.0, num_rollout=4),
        ev("phase_end", 5.0, state="init", duration_s=4.9),
        ev("phase_start", 10.0, state="rollout", rollout_id=0),
        ev("rollout_done", 14.0, rollout_id=0, reward_mean=0.25, samples=16),
        ev("phase_end", 14.0, state="rollout", rollout_id=0, duration_s=4.0),
        ev("phase_start", 14.0, state="train", rollout_id=0),
        ev("metrics", 16.0, rollout_id=0, reward_mean=0.25, loss=0.1, kl=0.01),
        ev("phase_end", 16.0, state="train", rollout_id=0, duration_s=2.0),
        ev("phase_start", 20.0, state="rollout", rollout_id=1),
        ev("rollout_done", 24.0, rollout_id=1, reward_mean=0.5, samples=16),
        ev("phase_end", 24.0, state="rollout", rollout_id=1, duration_s=4.0),
        ev("phase_start", 24.0, state="train", rollout_id=1),
        ev("metrics", 26.0, rollout_id=1, reward_mean=0.5, loss=0.05, kl=0.02),
    ]


def test_model_counts_rollouts_and_estimates_eta_from_step_times():
    m = ProgressModel(expected=Expected(samples_per_rollout=16, micro_batches_per_rollout=4))
    for e in two_rollouts():
        m.update(e)
    assert (m.num_rollout, m.done, m.last_trained) == (4, 2, 1)
    # one step time measured: 26 - 16 = 10 s between the two trained rollouts; 2 rollouts left → 20 s
    assert m.stats["step_s"] == 10.0 and m.eta_s() == 20.0
    assert m.stats["reward"] == 0.5 and m.stats["kl"] == 0.02
    # rollout 1 took 4 s for 16 samples
    assert m.stats["samples_s"] == 4.0


def test_phase_bar_estimates_from_the_last_duration_and_never_claims_done():
    m = ProgressModel(expected=Expected(samples_per_rollout=16, micro_batches_per_rollout=4))
    for e in two_rollouts()[:5]:               # in rollout 0: no earlier rollout to estimate from
        m.update(e)
    assert m.phase_progress(now=11.0) == (None, 16, True)
    for e in two_rollouts()[5:11]:             # rollout 1 started at mono 20; rollout 0 took 4 s
        m.update(e)
    assert m.phase_progress(now=21.0) == (4.0, 16, True)       # 1 s of ~4 s: a quarter of 16 samples
    assert m.phase_progress(now=30.0) == (16 * 0.99, 16, True)  # late: capped below the total


def test_resume_counts_from_the_checkpoint():
    m = ProgressModel(expected=Expected(num_rollout=10))
    m.update(ev("resumed", 1.0, rollout_id=5, next_rollout=6, path="ckpt/5"))
    m.update(ev("metrics", 9.0, rollout_id=6, reward_mean=1.0))
    assert m.done == 7


def test_a_resume_that_starts_something_fresh_says_what():
    from miles.checkpoint.megatron_resume import FRESH_NOTE

    line, = ProgressModel().update(ev("resumed", 1.0, rollout_id=7, next_rollout=8, path="ckpt/iter_0000007",
                                      format="megatron_torch_dist", note=FRESH_NOTE))
    assert line == f"resumed after rollout 7 from ckpt/iter_0000007 ({FRESH_NOTE})"
    assert "optimizer state is not read" in line


def test_plain_lines_tell_the_story_with_metrics_from_the_file(tmp_path):
    out = io.StringIO()
    p = Progress("plain", run_dir=tmp_path, expected=Expected(samples_per_rollout=16), stream=out)
    rows = tmp_path / "metrics.jsonl"
    for e in two_rollouts():
        if e["event"] == "metrics":            # the run appends the row, then emits the event
            with open(rows, "a") as f:
                f.write(json.dumps({"step": e["rollout_id"], "kind": "train", "reward_mean": e["reward_mean"],
                                    "gen_tokens_per_s": 123.4, "entropy": 1.5}) + "\n")
        p(e)
    with open(rows, "a") as f:
        f.write(json.dumps({"step": 2, "kind": "eval", "eval/arith/pass@1": 0.375}) + "\n")
    p(ev("eval_done", 30.0, rollout_id=2, **{"eval/arith/pass@1": 0.375}))
    p(ev("error", 31.0, state="rollout", error={"type": "RuntimeError", "message": "boom"}))
    p(ev("phase_start", 31.5, state="draining"))
    p(ev("run_end", 32.0, outcome="failed", duration_s=32.0))
    got = out.getvalue().splitlines()
    assert got[0] == "miles: run run-1 started"
    assert got[1] == "miles: init"
    assert got[2] == "miles: rollout 0 (1/4)  reward=0.25  kl=0.01  ent=1.5  tok/s=123"
    assert got[3] == "miles: rollout 1 (2/4)  reward=0.5  kl=0.02  ent=1.5  step=10.0s  tok/s=123  eta=0:00:20"
    assert got[4].startswith("miles: eval after 2 rollouts") and "arith=0.375" in got[4]
    assert got[5:] == ["miles: error in rollout: RuntimeError: boom", "miles: draining after the error",
                       "miles: run run-1 ended: failed after 0:00:32"]


def test_rows_of_an_earlier_invocation_in_the_same_run_dir_are_not_repeated(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "kind": "train", "reward_mean": 9.0}) + "\n")
    out = io.StringIO()
    p = Progress("plain", run_dir=tmp_path, stream=out)
    p(ev("metrics", 1.0, rollout_id=1, reward_mean=0.5))
    assert out.getvalue() == ""               # the new row is not written yet; the old one is not news


def test_off_shows_nothing_and_auto_is_plain_off_a_terminal():
    out = io.StringIO()
    p = Progress("off", stream=out)
    for e in two_rollouts():
        p(e)
    assert out.getvalue() == ""
    assert Progress.for_terminal("auto", stream=io.StringIO()).mode == "plain"
    with pytest.raises(ValueError, match="'fancy'"):
        Progress("fancy")


def test_rich_frame_shows_state_bars_and_numbers():
    from rich.console import Console

    p = Progress("rich", expected=Expected(samples_per_rollout=16, micro_batches_per_rollout=4),
                 stream=io.StringIO(), clock=lambda: 100.0)
    for e in two_rollouts()[:11]:             # in rollout 1
        p.model.update(e)
    p._mono0 = 100.0 - 21.0                   # "now" is mono 21: 1 s into rollout 1, which should take ~4 s
    console = Console(file=io.StringIO(), width=120, record=True, color_system=None)
    console.print(p.render())
    text = console.export_text()
    assert "rollout" in text and "1/4" in text          # state, and one rollout done of 4
    assert "~4/16 samples" in text
    assert "reward 0.25" in text and "kl 0.01" in text


def test_rich_live_starts_and_stops_with_the_run():
    out = io.StringIO()
    p = Progress("rich", stream=out)
    p(ev("run_start", 0.0))
    assert p._live is not None
    p(ev("run_end", 1.0, outcome="ok", duration_s=1.0))
    assert p._live is None and "run run-1 ended: ok" in out.getvalue()
    p.close()                                  # idempotent: the CLI closes it again in a finally


def test_a_display_bug_turns_the_display_off_instead_of_failing_the_run():
    out = io.StringIO()
    p = Progress("plain", stream=out)

    def broken(ev):
        raise KeyError("oops")

    p.model.update = broken
    p(ev("run_start", 0.0))                   # the tracer would have raised into the runner
    p(ev("run_end", 1.0, outcome="ok"))
    assert p.mode == "off" and out.getvalue() == "miles: progress display off after KeyError: 'oops'\n"


def test_sft_lines_show_the_loss_and_the_tokens_trained_not_rl_numbers():
    m = ProgressModel(expected=Expected(num_rollout=2, sft=True))
    m.update(ev("metrics", 1.0, rollout_id=0, reward_mean=0.0, loss=2.5, kl=0.0, train_tokens=300))
    m.add_row({"kind": "train", "step": 0, "train_tokens": 300, "train_time_s": 0.5, "gen_tokens_per_s": 2_000_681})
    m.update(ev("metrics", 3.0, rollout_id=1, reward_mean=0.0, loss=2.0, kl=0.0, train_tokens=200))
    line = m.add_row({"kind": "train", "step": 1, "train_tokens": 200, "train_time_s": 0.5})[0]
    assert line == "rollout 1 (2/2)  loss=2  tokens=500  step=2.0s  train tok/s=400  eta=0:00:00"
    assert "reward" not in line and "kl" not in line


def test_a_warning_is_a_line_and_equal_rewards_mark_the_rollout_line():
    m = ProgressModel(expected=Expected(num_rollout=5))
    assert m.update(ev("warning", 1.0, code="label_key", message="set --label-key label")) == [
        "warning: set --label-key label"]
    m.update(ev("metrics", 2.0, rollout_id=2, reward_mean=0.0, zero_variance_rollouts=3))
    assert m.rollout_line().endswith("WARNING: equal rewards in every group for 3 rollouts, nothing to learn")
    m.update(ev("metrics", 3.0, rollout_id=3, reward_mean=0.5))
    assert "WARNING" not in m.rollout_line()


def test_the_error_line_is_the_root_cause_once():
    m = ProgressModel()
    err = {"type": "RayTaskError(RewardError)", "message": "\x1b[36mray::X\x1b[39m long traceback",
           "summary": "RewardError: reward function reward.py:reward returned nan"}
    assert m.update(ev("error", 1.0, state="rollout", error=err)) == [
        "error in rollout: RewardError: reward function reward.py:reward returned nan"]
    assert m.update(ev("error", 2.0, state="draining", error={"type": "X", "summary": "X: again"})) == []
    assert m.update(ev("phase_start", 3.0, state="draining")) == ["draining after the error"]
