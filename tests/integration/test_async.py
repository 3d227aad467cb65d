"""The async machine on real parts: local Ray, the embedded engine, the torch trainer, a tiny model.

What it must show: rollout r+1 is requested before training on r; every sample records the weight
version that produced it, and no rollout straddles two versions; weights go out every
--update-weights-interval rollouts; a checkpoint holds the data position of the rollout it saved
(not the one generating ahead); an eval in flight when the run fails completes before the executor
and the engines are torn down, whether `draining` or the disposer settles it.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from miles.checkpoint.store import CheckpointStore
from miles.config.flags import parse_flags
from miles.api.launch import prepare_run
from miles.api.faults import InjectedFault
from miles.runtime import load_machine, read_trace, with_disposer
from miles.traceview.check import check_trace
from miles.cli.train import main as train_main
from tests.conftest import assert_cpu_threads, base_flags, miles_actors

pytestmark = pytest.mark.ray


def run_async(argv: list[str]) -> tuple[object, dict[int, list[tuple[int, int]]], BaseException | None]:
    """Run the async machine; record (prompt index, weight version) of every sample the trainer gets."""
    cfg, _ = parse_flags(argv)
    seen: dict[int, list[tuple[int, int]]] = {}
    holder: dict[str, object] = {}

    async def main(*, disposer):
        runner, ctx = prepare_run(cfg, machine="async", disposer=disposer)
        holder["ctx"] = ctx
        train = runner.handlers["train"]

        async def train_and_record(ctx):
            samples = await ctx.batch_ref
            seen[ctx.rollout_id] = [(s.prompt.index, s.weight_version) for s in samples]
            return await train(ctx)

        runner.handlers["train"] = train_and_record
        try:
            await runner.run()
        finally:
            ctx.tracer.close()

    error = None
    try:
        asyncio.run(with_disposer(main))
    except BaseException as exc:  # noqa: BLE001 - the failure tests look at it
        error = exc
    return holder["ctx"], seen, error


def seq_of(trace, event: str, **match) -> int:
    return next(e.seq for e in trace.events if e.event == event and all(e.get(k) == v for k, v in match.items()))


def test_rollout_ahead_is_requested_before_training_and_one_version_old(ray_cluster, tiny_task, tmp_path):
    ctx, seen, error = run_async(base_flags(tiny_task, tmp_path / "run", use_tis=True, save=tmp_path / "ck",
                                            save_interval=2, eval_prompt_data=["arith", tiny_task["eval"]],
                                            eval_interval=2, check_weight_update_equal=True))
    assert error is None
    trace = read_trace(ctx.run_dir)
    assert trace.events[-1].get("outcome") == "ok"
    assert check_trace(trace, load_machine("async")).ok
    # the engines generate beside the trainer: it takes the cores they leave it
    assert_cpu_threads(ctx.run_dir, trace, overlapped=True)
    # r+1 is asked for before training on r starts, with the weights the engines held
    for r in (0, 1):
        assert seq_of(trace, "prefetch_start", rollout_id=r + 1) < seq_of(trace, "phase_start", state="train",
                                                                          rollout_id=r)
    starts = {e.rollout_id: e for e in trace.of("prefetch_start")}
    # each sample's version is the one its request saw: r was made by the weights after r-1 updates
    # minus the one still training (one step off-policy), rollout 0 by the initial weights
    assert {r: {v for _, v in s} for r, s in seen.items()} == {0: {0}, 1: {0}, 2: {1}}
    assert {r: starts[r].get("weight_version") for r in starts} == {0: 0, 1: 0, 2: 1}
    train_rows = [m for m in ctx.metrics_history if m.get("kind") == "train"]
    assert [m["staleness_max"] for m in train_rows] == [0, 1, 1]
    # --use-tis, one optimizer step a rollout: no old-logprob pass, the step's own logprobs make the TIS
    # weights, and the metrics the pass made are still reported (tests/unit/test_trainer_gpu_paths.py: equal)
    assert [m["logprob_passes"] for m in train_rows] == [0.0, 0.0, 0.0]
    assert all(k in m for m in train_rows for k in ("tis_weight_mean", "tis_clip_frac", "logprob_diff_rollout"))
    assert [e.get("version") for e in trace.of("weights_synced")] == [0, 1, 2, 3]
    # the in-flight objects are registered after the executor: settled before it on the way out
    registered = [e.get("resource") for e in trace.of("registered")]
    assert registered.index("rollout-executor") < registered.index("prefetched_rollout") < \
        registered.index("eval_dispatcher")
    assert [e.get("resource") for e in trace.of("disposed")] == registered[::-1]
    assert [m["step"] for m in ctx.metrics_history if m.get("kind") == "eval"] == [0, 2, 3]
    assert miles_actors(ctx.c.cluster.namespace) == []


def test_update_weights_interval_2_via_miles_train_machine_async_saving_a_critic(ray_cluster, tiny_task, tmp_path):
    # PPO, saving the policy and, in a store of its own, the critic (the bug: the async machine's own copy
    # of the save never wrote --critic-save's store); the weights' schedule does not depend on the algorithm.
    # engine-0 is killed as rollout 2 trains (rollout 3 generating ahead on v2): it is restarted in rollout 3's
    # phase with the trainer's weights after rollout 2, which are v3, not the v2 the last push gave out
    code = train_main([*base_flags(tiny_task, tmp_path / "run", num_rollout=4, use_tis=True,
                                   update_weights_interval=2, advantage_estimator="ppo", save=tmp_path / "ck",
                                   critic_save=tmp_path / "critic", save_interval=2, check_weight_update_equal=True,
                                   inject_fault=["train:kill_engine:3"]), "--machine", "async"])
    assert code == 0
    critic, main = CheckpointStore(tmp_path / "critic"), CheckpointStore(tmp_path / "ck")
    assert [r for r, _ in critic.list()] == [r for r, _ in main.list()] == [1, 3]
    assert (critic.latest()[1] / "critic" / "value_head.safetensors").is_file()
    assert not (main.latest()[1] / "critic").exists()
    trace = read_trace(tmp_path / "run")
    assert check_trace(trace, load_machine("async")).ok
    # weights go out after rollouts 1 and 3 (versions 2, 4) besides the initial push; PPO's critic moves the
    # policy at every step, so each push's checksum is new (the weight check below compares real changes)
    synced = trace.of("weights_synced")
    assert [e.get("version") for e in synced] == [0, 2, 4]
    assert len({e.get("checksum") for e in synced}) == 3
    # the restarted engine is labelled with the version it got: v3, the trainer's weights after rollout 2
    [killed] = trace.of("fault_injected")
    [restarted] = trace.of("engine_restarted")
    assert killed.seq < seq_of(trace, "phase_start", state="rollout", rollout_id=3) < restarted.seq
    assert restarted.get("version") == 3
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # r0: v0 (asked for at the start); r1: v0 (asked for before training r0); r2: v0 (before training
    # r1; the update to v2 waited for it); r3: asked for on v2 before training r2, then made again on the
    # restarted engine, which holds v3: its samples say so (staleness 0, not 1). Staleness = rollout id -
    # version, at most N = 2
    assert [r["weight_version_min"] for r in rows] == [0, 0, 0, 3]
    assert [r["staleness_max"] for r in rows] == [0, 1, 2, 0]
    # the update awaited the rollout in flight: r2's generation ended before v2 was pushed
    assert seq_of(trace, "prefetch_end", rollout_id=2) < seq_of(trace, "weights_synced", version=2)
    # --check-weight-update-equal: before the push of v4 the restarted engine was compared with the trainer's
    # checksum of v3 (what it got), the others with v2's; the run passed, so no engine was called corrupted


@pytest.mark.extended   # out of the default test run (CI budget); bash scripts/test.sh -m extended
def test_checkpoint_holds_the_data_position_of_the_rollout_it_saved(ray_cluster, tiny_task, tmp_path):
    flags = dict(num_rollout=4, use_tis=True, save_interval=2)
    _, full, _ = run_async(base_flags(tiny_task, tmp_path / "full", save=tmp_path / "ck_full", **flags))
    # the same run, crashed in the weight sync after saving rollout 1 (visit 3: start, after r0, after
    # r1); rollout 2 was already generating when rollout 1 was saved
    _, _, crash = run_async(base_flags(tiny_task, tmp_path / "first", save=tmp_path / "ck",
                                       inject_fault=["weight_sync:raise:3"], **flags))
    assert isinstance(crash, InjectedFault)
    [(rid, path)] = CheckpointStore(tmp_path / "ck").list()
    # 2 rollouts of --rollout-batch-size 4 served: offset 8, not 12 (rollout 2's prompts were drawn)
    assert rid == 1 and json.loads((path / "rollout.json").read_text())["iterator"]["offset"] == 8
    ctx, resumed, error = run_async(base_flags(tiny_task, tmp_path / "second", save=tmp_path / "ck",
                                               load=tmp_path / "ck", **flags))
    assert error is None and sorted(resumed) == [2, 3]
    for r in (2, 3):                    # the resumed run trains on the prompts the full run did
        assert [p for p, _ in resumed[r]] == [p for p, _ in full[r]], r
    # resumed, rollout 2 is made by the weights synced at the start: on-policy for one step
    assert {v for _, v in resumed[2]} == {2}


def slow_eval_flags(task, tmp_path, **extra):
    """Evals that finish only once the run has failed (their reward waits for the trace's first
    `error`, up to a minute); training rollouts are scored at once."""
    trace = tmp_path / "run" / "trace.jsonl"
    rm = tmp_path / "slow_eval_reward.py"
    rm.write_text("import asyncio, pathlib, time\n"
                  f"TRACE = pathlib.Path({str(trace)!r})\n"
                  "async def reward(prompt, response, label):\n"
                  "    if label == 'slow':\n"
                  "        deadline = time.monotonic() + 60\n"
                  "        while time.monotonic() < deadline and '\"event\": \"error\"' not in TRACE.read_text():\n"
                  "            await asyncio.sleep(0.05)\n"
                  "        return 0.0\n"
                  "    return float(response.strip() == label)\n")
    slow = tmp_path / "slow_eval.jsonl"
    slow.write_text("".join(json.dumps({"input": f"{i}+1=", "label": "slow"}) + "\n" for i in range(4)))
    return base_flags(task, tmp_path / "run", use_tis=True, custom_rm_path=f"{rm}:reward",
                      eval_prompt_data=["slow", str(slow)], eval_interval=1, **extra)


def assert_eval_finished_before_teardown(trace):
    end = trace.of("eval_end")[-1]
    assert end.get("outcome") == "ok", end
    for resource in ("rollout-executor", "engine-0", "trainer"):
        assert end.seq < seq_of(trace, "disposed", resource=resource), resource
    return end


def test_a_failure_while_an_eval_is_in_flight_lets_it_finish_first(ray_cluster, tiny_task, tmp_path):
    ctx, _, error = run_async(slow_eval_flags(tiny_task, tmp_path, num_rollout=2, inject_fault=["train:raise"]))
    assert isinstance(error, InjectedFault)
    trace = read_trace(ctx.run_dir)
    assert check_trace(trace, load_machine("async")).ok
    failed_at = trace.of("error")[0]
    assert failed_at.state == "train"
    end = assert_eval_finished_before_teardown(trace)
    assert seq_of(trace, "eval_start", rollout_id=0) < failed_at.seq < end.seq    # it was in flight
    assert end.seq < seq_of(trace, "drained")                                     # `draining` settled it
    rows = [json.loads(x) for x in (ctx.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0]
    assert miles_actors(ctx.c.cluster.namespace) == []


def test_draining_cut_short_still_settles_the_eval_before_the_executor(ray_cluster, tiny_task, tmp_path):
    # the final eval is dispatched, then `draining` fails before settling anything: the disposer's
    # eval_dispatcher entry (registered after the executor and models) awaits it first
    ctx, _, error = run_async(slow_eval_flags(tiny_task, tmp_path, num_rollout=1, skip_eval_before_train=True,
                                              inject_fault=["draining:raise"]))
    assert isinstance(error, InjectedFault)
    trace = read_trace(ctx.run_dir)
    assert check_trace(trace, load_machine("async")).ok
    assert trace.of("drained") == []
    end = assert_eval_finished_before_teardown(trace)
    assert end.get("rollout_id") == 1
    assert seq_of(trace, "error", state="draining") < end.seq < seq_of(trace, "disposed", resource="eval_dispatcher")
    assert miles_actors(ctx.c.cluster.namespace) == []


@pytest.mark.parametrize("extra,expected", [
    ({}, "add --use-tis"),
    ({"use_tis": True, "colocate": True}, "--colocate cannot be used with the async machine"),
    ({"use_tis": True, "update_weights_interval": 2, "eval_interval": 3,
      "eval_prompt_data": ["arith", "EVAL"]}, "--eval-interval 3 is not a multiple of --update-weights-interval 2"),
])
def test_async_rejects_what_it_cannot_train_before_anything_starts(tiny_task, tmp_path, capsys, extra, expected):
    extra = {k: ([v[0], tiny_task["eval"]] if v == ["arith", "EVAL"] else v) for k, v in extra.items()}
    code = train_main(base_flags(tiny_task, tmp_path / "run", **extra), default_machine="async",
                      prog="scripts/train_async.py")
    assert code == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
