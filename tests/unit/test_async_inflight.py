"""The async machine's in-flight work without Ray: the prefetched rollout, the eval dispatcher, and
the checks that depend on the machine (off-policy correction, --colocate, weight-update interval)."""

from __future__ import annotations

import asyncio

import pytest

from miles.config import (
    AlgorithmConfig, ClusterConfig, ConfigError, DataConfig, EvalConfig, ModelConfig, RolloutConfig, RunConfig,
)
from miles.rollout.evals import EvalDispatcher
from miles.rollout.prefetch import Prefetcher
from miles.runtime import Tracer, load_machine
from miles.config.validate import validate


class FakeExecutor:
    """`request(id)` -> (samples, metrics future): the executor's generate_split, as the prefetcher asks."""

    def __init__(self):
        self.futures: dict[int, asyncio.Future] = {}

    def request(self, rollout_id: int):
        self.futures[rollout_id] = asyncio.get_running_loop().create_future()
        return f"samples-{rollout_id}", self.futures[rollout_id]


def tracer_with(events: list[dict]) -> Tracer:
    return Tracer(None, run_id="t", listeners=[events.append])


def of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["event"] == kind]


METRICS = {"staleness_max": 1.0, "weight_version_min": 2.0, "reward_mean": 0.5}


def test_prefetch_span_names_the_weights_it_used():
    async def main():
        events: list[dict] = []
        ex = FakeExecutor()
        p = Prefetcher(ex.request, tracer_with(events))
        p.start(3, weight_version=2)
        assert p.rollout_id == 3
        ex.futures[3].set_result(METRICS)
        got = await p.take(3)
        assert got == ("samples-3", METRICS) and p.rollout_id is None
        start, end = of(events, "prefetch_start")[0], of(events, "prefetch_end")[0]
        assert (start["rollout_id"], start["weight_version"]) == (3, 2)
        assert (end["outcome"], end["cause"], end["staleness_max"]) == ("ok", start["seq"], 1.0)

    asyncio.run(main())


def test_wait_settles_without_raising_and_take_raises():
    async def main():
        ex = FakeExecutor()
        p = Prefetcher(ex.request, tracer_with(events := []))
        p.start(0, weight_version=0)
        ex.futures[0].set_exception(RuntimeError("engine gone"))
        await p.wait()                       # a weight update must not fail on a rollout it only waits for
        assert p.rollout_id == 0
        with pytest.raises(RuntimeError, match="engine gone"):
            await p.take(0)
        assert p.rollout_id is None and of(events, "prefetch_end")[0]["outcome"] == "error"

    asyncio.run(main())


def test_settle_cancels_the_rollout_in_flight_and_traces_it():
    async def main():
        ex = FakeExecutor()
        p = Prefetcher(ex.request, tracer_with(events := []))
        p.start(5, weight_version=4)
        await p.settle()
        assert p.rollout_id is None
        assert [e["outcome"] for e in of(events, "prefetch_end")] == ["cancelled"]
        await p.dispose()                    # nothing left: a no-op

    asyncio.run(main())


def test_a_cancelled_take_leaves_the_rollout_for_dispose_to_cancel():
    async def main():
        ex = FakeExecutor()
        p = Prefetcher(ex.request, tracer_with(events := []))
        p.start(1, weight_version=0)
        taker = asyncio.ensure_future(p.take(1))
        await asyncio.sleep(0)
        taker.cancel()                       # the phase is cancelled (a second Ctrl-C)
        with pytest.raises(asyncio.CancelledError):
            await taker
        assert p.rollout_id == 1 and of(events, "prefetch_end") == []   # still in flight, still owned
        await p.dispose()
        assert [e["outcome"] for e in of(events, "prefetch_end")] == ["cancelled"]

    asyncio.run(main())


def test_eval_dispatcher_records_each_result_and_returns_failures():
    async def main():
        futures: dict[int, asyncio.Future] = {}

        def evaluate(step):
            futures[step] = asyncio.get_running_loop().create_future()
            return futures[step]

        rows: list[tuple] = []
        d = EvalDispatcher(evaluate, lambda *a: rows.append(a), tracer_with(events := []))
        d.submit(0, 0)
        d.submit(2, 2)
        assert d.in_flight == [0, 2]
        futures[0].set_result({"eval/a/pass@1": 0.25})
        futures[2].set_exception(ValueError("bad reward"))
        failed = await d.wait()
        assert rows == [(0, 0, {"eval/a/pass@1": 0.25})]
        assert [(j.step, type(j.error)) for j in failed] == [(2, ValueError)]
        ends = {e["rollout_id"]: e for e in of(events, "eval_end")}
        assert ends[0]["outcome"] == "ok" and ends[0]["eval/a/pass@1"] == 0.25 and ends[2]["outcome"] == "error"
        assert d.in_flight == [] and await d.wait() == []

    asyncio.run(main())


def test_dispose_awaits_the_eval_in_flight_and_raises_its_failure():
    async def main():
        loop = asyncio.get_running_loop()
        rows: list[tuple] = []
        fut = loop.create_future()
        d = EvalDispatcher(lambda step: fut, lambda *a: rows.append(a), tracer_with([]))
        d.submit(4, 4)
        loop.call_later(0.05, fut.set_result, {"x": 1.0})
        await d.dispose()                    # returns only once the eval finished and was recorded
        assert rows == [(4, 4, {"x": 1.0})]

        bad = loop.create_future()
        d2 = EvalDispatcher(lambda step: bad, lambda *a: None, tracer_with([]))
        d2.submit(1, 1)
        bad.set_exception(OSError("disk"))
        with pytest.raises(OSError, match="disk"):
            await d2.dispose()

    asyncio.run(main())


def test_cancel_and_force_end_evals_in_flight():
    async def main():
        loop = asyncio.get_running_loop()
        d = EvalDispatcher(lambda step: loop.create_future(), lambda *a: None, tracer_with(events := []))
        d.submit(0, 0)
        await d.cancel()
        d.submit(1, 1)
        await d.force()                      # the disposer's escalation
        assert [type(j.error) for j in await d.wait()] == [asyncio.CancelledError]
        assert [e["outcome"] for e in of(events, "eval_end")] == ["cancelled", "cancelled"]

    asyncio.run(main())


# -- checks that depend on the machine ---------------------------------------------------------------


def cfg(**run) -> RunConfig:
    algorithm = run.pop("algorithm", AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"))
    return RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(rollout_shuffle=True, prompt_data="p.jsonl"),
                     rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=2), algorithm=algorithm,
                     cluster=run.pop("cluster", ClusterConfig()), eval=run.pop("eval", EvalConfig(temperature=0.0)), **run)


def problems(config: RunConfig, machine: str) -> list[str]:
    try:
        validate(config, machine=load_machine(machine))
    except ConfigError as exc:
        return exc.problems
    return []


def test_async_policy_loss_needs_an_off_policy_correction():
    [msg] = problems(cfg(), "async")
    assert "--use-tis" in msg and "--use-rollout-logprobs" in msg
    assert problems(cfg(algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", use_tis=True)), "async") == []
    assert problems(cfg(algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", use_rollout_logprobs=True)), "async") == []
    assert problems(cfg(algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", loss_type="sft_loss")), "async") == []
    assert problems(cfg(), "sync") == []


def test_offload_is_for_the_sync_machine_only_and_async_colocation_is_the_resident_one():
    tis = AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", use_tis=True)
    [msg] = problems(cfg(algorithm=tis, cluster=ClusterConfig(colocate=True)), "async")
    assert msg.startswith("--colocate cannot be used with the async machine") and "--no-offload-rollout" in msg
    # --colocate --no-offload-rollout: the GPU shared, both resident, nothing handed back and forth
    resident = ClusterConfig(colocate=True, offload_rollout=False)
    assert resident.shares_gpu_resident and not ClusterConfig(colocate=True).shares_gpu_resident
    assert problems(cfg(algorithm=tis, cluster=resident), "async") == []
    both = ClusterConfig(colocate=True, offload_rollout=False, offload_train=True)
    [msg] = problems(cfg(algorithm=tis, cluster=both), "async")
    assert msg.startswith("--offload-train cannot be used with the async machine")
    [msg] = problems(cfg(algorithm=tis, cluster=ClusterConfig(offload_train=True)), "async")
    assert msg.startswith("--offload-train cannot be used with the async machine")
    assert problems(cfg(cluster=ClusterConfig(colocate=True, offload=True)), "sync") == []


def test_update_weights_interval_belongs_to_async_and_bounds_the_eval_interval():
    tis = AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", use_tis=True)
    assert problems(cfg(algorithm=tis, update_weights_interval=2, eval=EvalConfig(temperature=0.0, interval=4)), "async") == []
    [msg] = problems(cfg(algorithm=tis, update_weights_interval=2, eval=EvalConfig(temperature=0.0, interval=3)), "async")
    assert "--eval-interval 3 is not a multiple of --update-weights-interval 2" in msg
    [msg] = problems(cfg(update_weights_interval=2), "sync")
    assert "--update-weights-interval 2: only the async machine reads it" in msg


# -- the trace tools' lanes for work in flight ---------------------------------------------------------


def test_work_in_flight_gets_its_own_lanes_with_versions_and_outcomes(tmp_path):
    from miles.runtime import read_trace
    from miles.traceview.gantt import lanes_of, plot_timeline
    from miles.traceview.timeline import build_timeline

    t = Tracer(tmp_path / "trace.jsonl", run_id="r", machine="async")
    t.emit("run_start", state="init", states=["init", "rollout", "train", "draining", "shutdown"])
    t.emit("phase_start", state="rollout")
    a = t.emit("prefetch_start", rollout_id=1, weight_version=0)
    b = t.emit("eval_start", rollout_id=0, weight_version=0)
    t.emit("phase_end", state="rollout", trigger="next", duration_s=0.01)
    t.emit("prefetch_end", rollout_id=1, weight_version=0, outcome="ok", cause=a)
    t.emit("prefetch_start", rollout_id=2, weight_version=1)          # no end: the trace was cut short
    t.emit("eval_end", rollout_id=0, weight_version=0, outcome="cancelled", cause=b)
    t.close()
    tl = build_timeline(read_trace(tmp_path))
    assert [(s.lane, s.rollout_id, s.weight_version, s.outcome) for s in tl.background] == [
        ("prefetch", 1, 0, "ok"), ("eval (bg)", 0, 0, "cancelled"), ("prefetch", 2, 1, "open")]
    assert all(s.duration_s >= 0 for s in tl.background)
    assert lanes_of(tl) == ["rollout", "prefetch", "eval (bg)", "teardown"]
    assert plot_timeline(tl, tmp_path / "g.png").stat().st_size > 0
