"""A restarted engine holds the weights it is labelled with (miles.rollout.supervision.load_trainer_weights).

The trainer may have trained since the last push (the async machine trains rollout r while r+1 generates;
--update-weights-interval > 1): the restarted engine gets the trainer's weights as they are when the trainer
serves the call, and must be stamped with *their* version, and, with --check-weight-update-equal, compared
before the next push with the trainer's checksum of them, not the last push's.

Fakes of one layer: the trainer runs its calls one at a time in the order they were sent (Ray's order for
one caller's calls to an actor), and its weights are named by the version they are, so a label can be
checked against the weights under it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles.config import DataConfig, ModelConfig, RolloutConfig, RunConfig
from miles.phases import train as train_phase
from miles.phases.context import TrainingContext
from miles.phases.weights import WeightSyncMismatch, given_problems, sync_weights
from miles.rollout.supervision import load_trainer_weights
from miles.runtime import Disposer, Tracer


class _Method:
    def __init__(self, fn):
        self.remote = fn


def checksum(weights: str) -> str:
    return f"sum({weights})"


class FakeTrainer:
    """Holds weights "w<version>"; serves its calls in the order they were sent. A train step moves the
    weights on by one version, and waits for `step_done` (set it to let the step finish)."""

    def __init__(self, version: int):
        self.version, self.served = version, []
        self.step_done = asyncio.Event()
        self._last: asyncio.Future | None = None
        self.train = _Method(lambda batch, rid: self._send("train", self._step))
        self.weights = _Method(lambda *dtype: self._send("weights", lambda: f"w{self.version}"))
        self.weights_checksum = _Method(lambda *args: self._send("weights_checksum",
                                                                 lambda: checksum(f"w{self.version}")))

    def _send(self, name, serve) -> asyncio.Future:
        before, done = self._last, asyncio.get_running_loop().create_future()

        async def run():
            if before is not None:
                await before                 # after every call sent before it
            result = serve()
            done.set_result(await result if asyncio.iscoroutine(result) else result)
            self.served.append((name, self.version))

        asyncio.ensure_future(run())
        self._last = done
        return done

    async def _step(self) -> dict:
        await self.step_done.wait()
        self.version += 1
        return {"loss": 0.0}


class FakeEngine:
    """Holds (version, weights); `on_dtype` runs while its dtype is asked (the driver is awaiting then)."""

    def __init__(self, name: str, version: int = 0, weights: str = "w0", on_dtype=None):
        self.resource_name, self.handle = name, self
        self.held = (version, weights)
        self._on_dtype = on_dtype

        async def update_weights(ref, version):
            self.held = (version, await ref)

        async def weights_dtype():
            if self._on_dtype is not None:
                self._on_dtype()
            return "bf16"

        async def weight_version():
            return self.held[0]

        async def weights_checksum():
            return checksum(self.held[1])

        self.update_weights, self.weights_dtype = _Method(update_weights), _Method(weights_dtype)
        self.weight_version, self.weights_checksum = _Method(weight_version), _Method(weights_checksum)


def context(tmp_path: Path, *, check: bool = True) -> TrainingContext:
    cfg = RunConfig(model=ModelConfig(hf_checkpoint=str(tmp_path / "model")), data=DataConfig(prompt_data="p"),
                    rollout=RolloutConfig(batch_size=1), num_rollout=8, check_weight_update_equal=check)
    return TrainingContext(cfg, run_id="t", run_dir=tmp_path, disposer=Disposer(),
                           tracer=Tracer(tmp_path / "trace.jsonl", run_id="t", machine="async", console="off"))


@pytest.mark.parametrize("train_sent", ["before the restart", "while the restart asks the engine's dtype", "never"])
def test_a_restarted_engine_is_labelled_with_the_version_of_the_weights_it_got(tmp_path, train_sent):
    """v2 was pushed, rollout 2 was taken and trains (or not): the trainer's weights are v2 until its step
    returns, v3 after; the restart's weights call is served after a step sent before it, so its label is
    v3 then, and v2 when no step was sent. The label and the recorded checksum are the weights'."""
    ctx = context(tmp_path)
    ctx.next_rollout = ctx.weight_version = 2
    ctx.rollout_id = 2

    async def main():
        trainer = FakeTrainer(version=2)
        ctx.c.trainer = type("Resource", (), {"handle": trainer})()
        send = lambda: train_phase._train_policy(ctx, trainer, "batch", 2)   # noqa: E731
        stepping = send() if train_sent == "before the restart" else None
        engine = FakeEngine("engine-0-r1", on_dtype=send if train_sent.startswith("while") else None)
        restart = asyncio.ensure_future(load_trainer_weights(ctx, engine))
        await asyncio.sleep(0.01)
        assert not restart.done() or train_sent == "never"    # the weights wait for the step in flight
        trainer.step_done.set()
        version = await restart
        if stepping is not None:
            await stepping
        return version, engine.held, trainer.served

    version, held, served = asyncio.run(main())
    want = 2 if train_sent == "never" else 3
    assert held == (want, f"w{want}") and version == want
    assert ctx.engine_weights == {"engine-0-r1": (want, checksum(f"w{want}"))}
    if train_sent != "never":
        assert [name for name, _ in served] == ["train", "weights", "weights_checksum"]
    ctx.tracer.close()


def test_without_the_weight_check_nothing_is_recorded_and_no_checksum_asked(tmp_path):
    ctx = context(tmp_path, check=False)
    ctx.next_rollout = ctx.weight_version = 5          # a resumed trainer: the checkpoint of rollout 4

    async def main():
        trainer = FakeTrainer(version=5)
        ctx.c.trainer = type("Resource", (), {"handle": trainer})()
        engine = FakeEngine("engine-1-r1")
        return await load_trainer_weights(ctx, engine), engine.held, trainer.served

    version, held, served = asyncio.run(main())
    assert (version, held) == (5, (5, "w5"))
    assert ctx.engine_weights == {} and [name for name, _ in served] == ["weights"]
    ctx.tracer.close()


def test_the_train_phase_says_which_version_the_trainer_serves_from_the_moment_the_step_is_sent(tmp_path):
    ctx = context(tmp_path)
    ctx.next_rollout = ctx.rollout_id = 3
    ctx.batch_ref = "batch"

    class Metrics:
        def log(self, step, row):
            pass

    async def main():
        trainer = FakeTrainer(version=3)
        ctx.c.trainer, ctx.c.metrics = type("Resource", (), {"handle": trainer})(), Metrics()
        assert ctx.trainer_version == 3
        phase = asyncio.ensure_future(train_phase.train(ctx))
        await asyncio.sleep(0.01)
        in_flight = ctx.trainer_version          # the step is sent, not done
        trainer.step_done.set()
        await phase
        return in_flight

    assert asyncio.run(main()) == 4
    assert (ctx.next_rollout, ctx.train_submitted, ctx.trainer_version) == (4, None, 4)
    ctx.tracer.close()


def engines_after_a_restart(bad: str | None = None) -> list[FakeEngine]:
    """engine-0 holds the v2 push; engine-1 was restarted since, after the trainer trained rollout 2: v3."""
    return [FakeEngine("engine-0", 2, "w2"), FakeEngine("engine-1-r1", 3, bad or "w3")]


def test_the_check_before_the_next_push_compares_a_restarted_engine_with_what_it_got(tmp_path):
    ctx = context(tmp_path)
    ctx.weight_version, ctx.next_rollout = 2, 4
    ctx.c.engines = engines_after_a_restart()
    ctx.engine_weights = {"engine-0": (2, checksum("w2")), "engine-1-r1": (3, checksum("w3"))}

    async def main():
        ctx.c.trainer = type("Resource", (), {"handle": FakeTrainer(version=4)})()
        await sync_weights(ctx)

    asyncio.run(main())
    assert [e.held for e in ctx.c.engines] == [(4, "w4"), (4, "w4")]
    assert ctx.engine_weights == {"engine-0": (4, checksum("w4")), "engine-1-r1": (4, checksum("w4"))}
    ctx.tracer.close()


def test_a_restarted_engine_whose_weights_changed_since_still_fails_the_check_named(tmp_path):
    ctx = context(tmp_path)
    ctx.weight_version, ctx.next_rollout = 2, 4
    ctx.c.engines = engines_after_a_restart(bad="corrupted")
    ctx.engine_weights = {"engine-0": (2, checksum("w2")), "engine-1-r1": (3, checksum("w3"))}

    async def main():
        ctx.c.trainer = type("Resource", (), {"handle": FakeTrainer(version=4)})()
        await sync_weights(ctx)

    with pytest.raises(WeightSyncMismatch) as exc:
        asyncio.run(main())
    assert str(exc.value) == ("before the next update to v2: engine-1-r1 holds weights with checksum sum(corrupte, "
                              "the trainer's v3 is sum(w3)")
    assert ctx.c.engines[0].held == (2, "w2")          # nothing was pushed
    ctx.tracer.close()


def test_given_problems_compares_each_engine_with_its_own_version_and_checksum():
    assert given_problems([("engine-0", (2, "a"), (2, "a")), ("engine-1-r1", (3, "b"), (3, "b"))]) == []
    assert given_problems([("engine-0", (2, None), (2, "anything"))]) == []          # the version alone
    assert given_problems([("engine-0", (2, "a"), (3, "b")), ("engine-1-r1", (3, "b"), (3, "c"))]) == [
        "engine-0 holds weight version 3, not 2",
        "engine-1-r1 holds weights with checksum c, the trainer's v3 is b"]


@pytest.mark.parametrize("pushed", [False, True])
def test_a_restart_reloads_the_trainers_weights_once_any_push_happened_v0_included(tmp_path, monkeypatch, pushed):
    """After a --finetune load (or --start-rollout-id 0) the first push is v0 and holds the checkpoint's
    weights: an engine restarted after it must get the trainer's weights, not --hf-checkpoint's from disk;
    before any push the others hold the disk's weights and so does the new engine (nothing is loaded)."""
    from miles.rollout import supervision

    ctx = context(tmp_path)
    ctx.next_rollout = ctx.weight_version = 0
    if pushed:
        ctx.weights_pushed = True
    new = FakeEngine("engine-0-r1", 0, "disk")
    new.wait_ready = lambda: asyncio.sleep(0, result=1234)
    monkeypatch.setattr(supervision, "make_engine", lambda ctx, index, name: new)

    class Old:
        resource_name = "engine-0"

        def force(self):
            pass

    async def set_engines(handles):
        pass

    async def main():
        trainer = FakeTrainer(version=0)
        ctx.c.trainer = type("Resource", (), {"handle": trainer})()
        ctx.c.engines = [Old()]
        ctx.c.executor = type("Resource", (), {"handle": type("H", (), {"set_engines": _Method(set_engines)})()})()
        await supervision.restart_engine(ctx, 0, cause=RuntimeError("died"))
        return trainer.served

    served = asyncio.run(main())
    assert new.held == ((0, "w0") if pushed else (0, "disk"))
    assert [name for name, _ in served] == (["weights", "weights_checksum"] if pushed else [])
    assert ctx.c.engines == [new]
    ctx.tracer.close()
