"""Every phase the user's code runs in is bounded by default, and says what it waits on (issue 59, item 3):
a default --reward-timeout, eval's deadline following rollout's --phase-timeout, the initial eval by
miles' rule, and the progress line of a long phase from the executor's own counts."""

from __future__ import annotations

import asyncio
import threading

import pytest

from miles.config import AlgorithmConfig, ConfigError, EvalConfig, RolloutConfig
from miles.config.schema import ReliabilityConfig
from miles.config.flags import FLAGS, parse_flags
from miles.rollout.executor import RolloutExecutor
from miles.runtime import load_machine
from miles.metrics.progress import ProgressModel, waiting_line
from tests.unit.test_executor_algorithms import PROMPTS, Digits
from tests.unit.test_executor_eval_config import Recording



# ---- --reward-timeout: on by default, 0 turns it off -------------------------------------------

def test_a_reward_call_is_bounded_by_default_and_the_help_says_why_the_value(tiny_task, tmp_path):
    base = ["--hf-checkpoint", tiny_task["model"], "--prompt-data", tiny_task["train"], "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--num-rollout", "1", "--run-dir", str(tmp_path / "run")]
    cfg, _ = parse_flags(base)
    assert cfg.reliability.reward_timeout_s == 300.0 and cfg.reliability.reward_limit_s == 300.0
    off, _ = parse_flags([*base, "--reward-timeout", "0"])
    assert off.reliability.reward_limit_s is None                        # 0: no limit
    help_text = next(f.help for f in FLAGS if f.name == "reward-timeout")
    assert "300" in help_text and "remote_rm" in help_text and "0: no limit" in help_text
    with pytest.raises(ConfigError) as refused:
        parse_flags([*base, "--reward-timeout", "-5"])
    assert "--reward-timeout -5: must be >= 0 seconds (0: no limit)" in str(refused.value)


# ---- eval's deadline: rollout's --phase-timeout covers it unless eval is named --------------------

def test_eval_takes_rollouts_deadline_unless_it_is_named():
    sync = load_machine("sync")
    r = ReliabilityConfig(phase_timeouts=("rollout=15",))
    assert sync.deadlines(r.deadline_overrides(sync.states))["eval"] == 15.0
    named = ReliabilityConfig(phase_timeouts=("rollout=15", "eval=900"))
    assert sync.deadlines(named.deadline_overrides(sync.states))["eval"] == 900.0
    assert sync.deadlines(ReliabilityConfig().deadline_overrides(sync.states))["eval"] == 3600.0   # the YAML's
    rollout_only = load_machine("rollout_only")
    assert "eval" not in r.deadline_overrides(rollout_only.states)       # a machine without eval gets none
    help_text = next(f.help for f in FLAGS if f.name == "phase-timeout")
    assert "eval takes rollout's unless named" in help_text


# ---- the initial eval: miles' rule ---------------------------------------------------------------

def test_the_initial_eval_runs_even_when_the_interval_is_past_the_last_rollout(tmp_path):
    """miles evaluates before the first rollout unless --skip-eval-before-train, whatever
    --eval-interval is: the baseline the eval after the last rollout is compared with."""
    from miles.config import CheckpointConfig, DataConfig, ModelConfig, RunConfig
    from miles.phases.context import TrainingContext
    from miles.runtime import Disposer, Tracer

    def ctx(**eval_kw):
        cfg = RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(prompt_data="p"),
                        rollout=RolloutConfig(batch_size=1), num_rollout=3, checkpoint=CheckpointConfig(),
                        eval=EvalConfig(prompt_data=(("arith", "e.jsonl"),), **eval_kw))
        return TrainingContext(cfg, run_id="g", run_dir=tmp_path,
                               tracer=Tracer(tmp_path / "t.jsonl", run_id="g", machine="sync", console="off"),
                               disposer=Disposer())

    c = ctx(interval=100)
    due = []
    for done in range(4):
        c.next_rollout = c.weight_version = done
        due.append(c.eval_due())
        if due[-1]:
            c.evaluated_version = c.eval_key()
    assert due == [True, False, False, True]                 # before training, and after the last rollout
    skipped = ctx(interval=100, skip_before_train=True)
    assert not skipped.eval_due()
    c.tracer.close()
    skipped.tracer.close()


# ---- the progress of a long eval: a hung reward is seen, then cut -------------------------------

HUNG = threading.Event()


def hung_reward(prompt, response, label):
    HUNG.wait()                                  # never returns while the test holds it
    return 1.0


def test_a_hung_reward_in_an_eval_is_reported_while_it_runs_and_cut_by_the_reward_timeout(tmp_path):
    (tmp_path / "hung_rm.py").write_text("from tests.unit.test_bounded_phases import hung_reward\n")
    cfg = RolloutConfig(batch_size=2, n_samples_per_prompt=2, max_response_len=4,
                        custom_rm_path=f"{tmp_path / 'hung_rm.py'}:hung_reward")
    ex = RolloutExecutor(prompts=PROMPTS, eval_sets={"arith": PROMPTS[:3]}, rollout=cfg,
                         algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"),
                         eval=EvalConfig(temperature=0.0, prompt_data=(("arith", "x"),), n_samples_per_prompt=2),
                         shuffle=False, tokenizer=Digits(), engines=[Recording([[1]])], seed=0, reward_timeout_s=1.0)
    HUNG.clear()

    async def main():
        assert ex.progress() == []                                   # nothing runs
        task = asyncio.ensure_future(ex.evaluate(0))
        await asyncio.sleep(0.4)
        seen = ex.progress()
        metrics = await task
        return seen, metrics

    try:
        seen, metrics = asyncio.run(main())
    finally:
        HUNG.set()
    [eval_] = seen
    assert eval_["activity"] == "eval after 0 rollouts" and eval_["samples"] == 6 and eval_["generated"] == 6
    assert eval_["scored"] == 0 and eval_["reward_pending"] == 6 and 0.3 <= eval_["reward_oldest_s"] < 1.0
    assert eval_["reward_timeout_s"] == 1.0 and "engine_pending" not in eval_
    assert metrics["eval/arith/reward_mean"] == 0.0                  # every call cut: each sample scored 0
    assert ex.progress() == []                                       # the eval's meter is closed

    line = waiting_line({"event": "phase_waiting", "state": "eval", "rollout_id": 0, "running_s": 61.0,
                         "cut_in_s": 3539.0, "waiting_for": "the engines' samples and their rewards",
                         "activities": seen})
    assert line == ("eval (rollout 0) still running after 0:01:01, cut by its deadline in 0:58:59; waiting for "
                    "the engines' samples and their rewards; eval after 0 rollouts: 6/6 samples generated, "
                    f"0/6 scored, 6 awaiting their reward (oldest call {eval_['reward_oldest_s']:.0f} s; "
                    "--reward-timeout 1 s)")
    assert ProgressModel().update({"event": "phase_waiting", "mono": 1.0, **{"state": "eval", "running_s": 30.0,
                                   "unanswered": "no answer within 5 s"}}) == [
        "eval still running after 0:00:30; the rollout executor did not answer (no answer within 5 s): busy, or "
        "its event loop blocked by a reward or generate function running in it"]


def test_an_eval_says_why_it_runs(tmp_path):
    from miles.config import CheckpointConfig, DataConfig, ModelConfig, RunConfig
    from miles.phases.context import TrainingContext
    from miles.phases.eval import why_due
    from miles.runtime import Disposer, Tracer

    cfg = RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(prompt_data="p"),
                    rollout=RolloutConfig(batch_size=1), num_rollout=7, checkpoint=CheckpointConfig(),
                    eval=EvalConfig(prompt_data=(("arith", "e.jsonl"),), interval=3))
    tracer = Tracer(tmp_path / "t.jsonl", run_id="g", machine="sync", console="off")
    ctx = TrainingContext(cfg, run_id="g", run_dir=tmp_path, tracer=tracer, disposer=Disposer())
    assert why_due(ctx).startswith("before the first rollout") and "--skip-eval-before-train" in why_due(ctx)
    ctx.next_rollout = 3
    assert why_due(ctx) == "every --eval-interval 3 rollouts"
    ctx.next_rollout = 7
    assert why_due(ctx) == "after the last rollout"
    tracer.close()
    assert ProgressModel().update({"event": "eval_begin", "mono": 0.0, "rollout_id": 7, "why": why_due(ctx)}) == [
        "evaluating after 7 rollouts: after the last rollout"]


def test_the_heartbeat_asks_the_executor_except_while_init_creates_it(tmp_path):
    from miles.config import CheckpointConfig, DataConfig, ModelConfig, RunConfig
    from miles.phases.context import TrainingContext
    from miles.runtime import Disposer, Tracer

    class Remote:
        def __init__(self):
            self.asked = 0

        def remote(self):
            self.asked += 1
            fut = asyncio.get_running_loop().create_future()
            fut.set_result([{"activity": "rollout 2", "samples": 8, "generated": 8, "scored": 4}])
            return fut

    class Handle:
        progress = Remote()

    class Resource:
        handle = Handle()

    cfg = RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(prompt_data="p"),
                    rollout=RolloutConfig(batch_size=1), num_rollout=3, checkpoint=CheckpointConfig())
    tracer = Tracer(tmp_path / "t.jsonl", run_id="g", machine="sync", console="off")
    ctx = TrainingContext(cfg, run_id="g", run_dir=tmp_path, tracer=tracer, disposer=Disposer())
    ctx.c.executor = Resource()
    ctx.state = "init"
    assert asyncio.run(ctx.waiting_for()) == {"waiting_for": "the run's actors to start"}
    ctx.state = "train"                      # an async run's background eval shows in any later state
    assert asyncio.run(ctx.waiting_for()) == {"waiting_for": "the trainer's step", "activities": [
        {"activity": "rollout 2", "samples": 8, "generated": 8, "scored": 4}]}
    assert Handle.progress.asked == 1
    tracer.close()
