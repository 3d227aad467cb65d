"""The guards the machines name (miles/phases/context.py), each on its own: counters in, decision out."""

from __future__ import annotations


import pytest

from miles.config import CheckpointConfig, DataConfig, EvalConfig, ModelConfig, RolloutConfig, RunConfig
from miles.phases.context import TrainingContext
from miles.runtime import Disposer, Tracer


@pytest.fixture
def make(tmp_path):
    tracers = []

    def make(**run) -> TrainingContext:
        sections = {k: run.pop(k) for k in ("checkpoint", "eval") if k in run}
        cfg = RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(rollout_shuffle=True, prompt_data="p"),
                        rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1), **{"num_rollout": 4, **run}, **sections)
        tracer = Tracer(tmp_path / f"trace{len(tracers)}.jsonl", run_id="g", machine="sync", console="off")
        tracers.append(tracer)
        return TrainingContext(cfg, run_id="g", run_dir=tmp_path, tracer=tracer, disposer=Disposer())

    yield make
    for t in tracers:
        t.close()


def test_rollouts_left_counts_to_num_rollout_and_debug_exit_counts_from_the_resume_point(make):
    ctx = make()
    assert [ctx.will_run(r) for r in range(5)] == [True, True, True, True, False]
    ctx.next_rollout = 4
    assert not ctx.rollouts_left()
    resumed = make(debug_exit_after_rollout=1)
    resumed.start_rollout = resumed.next_rollout = 2       # this invocation makes rollout 2 only
    assert resumed.rollouts_left() and not resumed.will_run(3)


def test_weights_due_every_interval_and_after_the_last(make):
    ctx = make(update_weights_interval=3)
    due = []
    for done in range(1, 5):
        ctx.next_rollout = done
        due.append(ctx.weights_due())
    assert due == [False, False, True, True]       # 3 is the interval, 4 the last rollout


def test_eval_due(make):
    data = (("arith", "e.jsonl"),)
    assert not make().eval_due()                                           # no eval data
    ctx = make(eval=EvalConfig(temperature=0.0, prompt_data=data, interval=2))
    assert ctx.eval_due()                                                  # before training
    ctx.evaluated_version = ctx.eval_key()
    assert not ctx.eval_due()                                              # never twice on the same weights
    for done, expected in ((1, False), (2, True), (3, False), (4, True)):  # 4: every 2, and the last
        ctx.next_rollout, ctx.weight_version = done, done
        assert ctx.eval_due() is expected, done
    assert not make(eval=EvalConfig(temperature=0.0, prompt_data=data, skip_before_train=True)).eval_due()
    resumed = make(eval=EvalConfig(temperature=0.0, prompt_data=data, interval=3))
    resumed.start_rollout = resumed.next_rollout = resumed.weight_version = 2
    assert not resumed.eval_due()        # resumed at 2, not a multiple of 3: the first eval waits for 3


def test_eval_keeps_its_schedule_when_the_weights_never_move(make):
    # --debug-skip-weight-update: the engines hold version 0 throughout; the evals still run every
    # --eval-interval (miles' schedule), once per rollout position
    data = (("arith", "e.jsonl"),)
    ctx = make(eval=EvalConfig(temperature=0.0, prompt_data=data, interval=2), debug_skip_weight_update=True)
    due = []
    for done in range(5):
        ctx.next_rollout = done
        due.append(ctx.eval_due())
        if due[-1]:
            ctx.evaluated_version = ctx.eval_key()
            assert not ctx.eval_due()                                      # not twice at one position
    assert due == [True, False, True, False, True]
    assert ctx.weight_version == 0


def test_save_due(make, tmp_path):
    assert not make().save_due()                                           # nowhere to save
    ctx = make(checkpoint=CheckpointConfig(save=str(tmp_path / "ck"), save_interval=3))
    due = []
    for done in range(1, 5):
        ctx.next_rollout = done
        due.append(ctx.save_due())
    assert due == [False, False, True, True]
    ctx.next_rollout = 1
    ctx.save_requested = True                                              # a host asked
    assert ctx.save_due()
    sentinel = tmp_path / "save-now"
    by_file = make(checkpoint=CheckpointConfig(critic_save=str(tmp_path / "c"), save_trigger_sentinel=str(sentinel)))
    by_file.next_rollout = 1
    assert not by_file.save_due()
    sentinel.touch()
    assert by_file.save_due()                                              # --critic-save alone is somewhere


def test_only_the_machines_guards_are_public_predicates(make):
    # the machines name these and nothing else: a new guard gets a test here
    from miles.runtime import builtin_machines, load_machine

    named = set().union(*(load_machine(m).guards for m in builtin_machines()))
    assert named == {"eval_due", "rollouts_left", "save_due", "weights_due"}
    assert all(callable(getattr(make(), g)) for g in named)


def test_a_rollout_phase_is_named_by_the_rollout_it_makes(make):
    """The runner writes `rollout_of(state)` into phase_start: a cut-short trace's last row is right."""
    ctx = make()
    ctx.rollout_id, ctx.next_rollout = 3, 4
    assert [ctx.rollout_of(s) for s in ("rollout", "train", "save", "weight_sync", "eval")] == [4, 3, 3, 3, 3]
