"""--async-save: a save takes a CPU snapshot and returns; the files are written while training goes on,
and the checkpoint is committed only once every part is written.

The trainer's and critic's halves run on the real classes (the files of a background save taken
before a step equal a synchronous save's taken at the same point, although the write runs after the
step); the driver's half (`miles.checkpoint.background_save`) on a real store with parts that finish,
fail or hang as a test says.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles.checkpoint.background import BackgroundWrites
from miles.checkpoint.checkpointer import DiskFull, begin_checkpoint
from miles.checkpoint.store import CheckpointStore
from miles.checkpoint.background_save import BackgroundSave, commit_when_written, start_parts
from tests.unit.test_trainer import SAMPLES, model_path, trainer  # noqa: F401  (model_path: the fixture)


def held_writer(t) -> threading.Event:
    """Queue a write that waits for the returned event: the writes queued after it run only once it is set."""
    release = threading.Event()
    t._writes.submit(release.wait)
    return release


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name.endswith(".safetensors"):
            x, y = load_file(str(a / name)), load_file(str(b / name))
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
        elif name.endswith(".pt"):
            # onto the CPU: a synchronous save writes the optimizer's tensors where they live (CUDA), a
            # background one its CPU snapshot; the values and the structure are what must be equal
            x, y = (torch.load(f / name, map_location="cpu", weights_only=True) for f in (a, b))
            assert repr(x) == repr(y), name            # every tensor printed in full below a size; equal values
            flat_x, flat_y = _tensors(x), _tensors(y)
            assert len(flat_x) == len(flat_y) and all(torch.equal(p, q) for p, q in zip(flat_x, flat_y)), name
        elif (a / name).is_file():
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


# -- the trainer's and the critic's half --------------------------------------------------------------------

def test_a_background_save_writes_the_state_of_its_snapshot_not_the_one_after_the_next_step(model_path, tmp_path):
    cfg = dict(global_batch_size=2, micro_batch_size=1, use_kl_loss=True, kl_loss_coef=0.1, ref_update_interval=1)
    t = trainer(model_path, **cfg)
    t.train(SAMPLES, 0)
    t.save(tmp_path / "sync")
    release = held_writer(t)
    t.save(tmp_path / "background", background=True)
    t.export_hf(tmp_path / "hf_background", background=True)
    assert list((tmp_path / "background").iterdir()) == []     # the folder only: the writer is held
    t.train(SAMPLES, 1)                                  # weights, moments, step count and RNG all move on
    release.set()
    assert t.wait_saved() >= 0.0
    same_files(tmp_path / "sync", tmp_path / "background")
    assert json.loads((tmp_path / "background" / "trainer_state.json").read_text())["num_steps"] == 2

    # the HF export is the snapshot's weights too: it loads as the synchronous save's model did
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_background")
    saved = load_file(str(tmp_path / "sync" / "model.safetensors"))
    for name, value in exported.state_dict().items():
        if name in saved:
            assert torch.equal(value, saved[name]), name

    # and it resumes as the synchronous checkpoint does: the same next step
    a, b = trainer(model_path, **cfg), trainer(model_path, **cfg)
    a.load(tmp_path / "sync")
    b.load(tmp_path / "background")
    a.train(SAMPLES, 1)
    b.train(SAMPLES, 1)
    assert a.weights_checksum() == b.weights_checksum() == t.weights_checksum()


def test_a_write_into_a_folder_removed_meanwhile_fails_in_wait_saved_and_makes_nothing_again(model_path, tmp_path):
    import shutil

    t = trainer(model_path)
    release = held_writer(t)
    t.save(tmp_path / "aborted" / "trainer", background=True)
    t.export_hf(tmp_path / "aborted" / "hf", background=True)
    shutil.rmtree(tmp_path / "aborted")                      # the driver aborted the save
    release.set()
    with pytest.raises(FileNotFoundError, match="its save was aborted"):
        t.wait_saved()
    assert not (tmp_path / "aborted").exists()
    t.save(tmp_path / "ok", background=True)                 # the error was that save's: the next one writes
    t.wait_saved()
    assert (tmp_path / "ok" / "model.safetensors").is_file()


def test_the_critic_saves_its_snapshot_in_the_background(model_path, tmp_path):
    from tests.unit.test_critic import SAMPLES as CRITIC_SAMPLES, critic

    c = critic(model_path)

    def step(rid):
        c.train(CRITIC_SAMPLES, c.values(CRITIC_SAMPLES), torch.ones(3, 5), rollout_id=rid)

    step(0)
    c.save(tmp_path / "sync")
    release = held_writer(c)
    c.save(tmp_path / "background", background=True)
    step(1)
    release.set()
    c.wait_saved()
    same_files(tmp_path / "sync", tmp_path / "background")


def test_background_writes_run_in_order_and_raise_the_first_error_after_all_ended():
    writes, done = BackgroundWrites(), []

    def fail(name):
        done.append(name)
        raise ValueError(name)

    writes.submit(fail, "a")
    writes.submit(done.append, "b")
    writes.submit(fail, "c")
    with pytest.raises(ValueError, match="a"):
        writes.wait()
    assert done == ["a", "b", "c"]
    assert writes.wait() == pytest.approx(0.0, abs=0.5)      # nothing queued any more
    writes.close()
    writes.close()


# -- the driver's half ------------------------------------------------------------------------------------

def part(folder: Path, *, gate: asyncio.Event | None = None, error: BaseException | None = None):
    """A part's start: writes nothing yet; its finisher waits for `gate`, then writes a file (or raises)."""
    async def start():
        async def finish():
            if gate is not None:
                await gate.wait()
            if error is not None:
                raise error
            folder.mkdir(parents=True)
            (folder / "w.bin").write_bytes(b"x" * 10)
        return finish
    return start


def pending_save(store, tmp, rid, finishers, manifest, committed) -> BackgroundSave:
    pending = BackgroundSave()
    pending.start(rid, commit_when_written(store, tmp, rid, finishers, manifest, committed), lambda: store.abort(tmp))
    return pending


def test_a_pending_save_commits_only_when_every_part_is_written(tmp_path):
    async def scenario():
        store, gate, committed = CheckpointStore(tmp_path / "ck"), asyncio.Event(), []
        tmp = begin_checkpoint(store, 3)
        finishers = await start_parts(store, tmp, 3, [part(tmp / "trainer"), part(tmp / "critic", gate=gate)])
        pending = pending_save(store, tmp, 3, finishers, {"weight_version": 4}, committed.append)
        await asyncio.sleep(0.05)
        assert store.list() == [] and committed == [] and pending.pending       # the critic's part is not written
        gate.set()
        path = await pending.settle()
        assert [rid for rid, _ in store.list()] == [3] and committed == [path] and not pending.pending
        assert sorted(json.loads((path / "manifest.json").read_text())["files"]) == ["critic/w.bin", "trainer/w.bin"]
    asyncio.run(scenario())


def test_a_failed_part_leaves_no_checkpoint_and_its_error_is_raised_where_settled(tmp_path):
    async def scenario():
        store = CheckpointStore(tmp_path / "ck")
        tmp = begin_checkpoint(store, 0)
        finishers = await start_parts(store, tmp, 0, [part(tmp / "trainer", error=RuntimeError("the actor died")),
                                                     part(tmp / "critic")])
        pending = pending_save(store, tmp, 0, finishers, {}, lambda p: None)
        with pytest.raises(RuntimeError, match="the actor died"):
            await pending.settle()
        assert store.list() == [] and not tmp.exists()
    asyncio.run(scenario())


def test_a_full_disk_in_a_part_is_raised_as_disk_full(tmp_path):
    async def scenario():
        store = CheckpointStore(tmp_path / "ck")
        tmp = begin_checkpoint(store, 5)
        full = OSError(28, "No space left on device")
        finishers = await start_parts(store, tmp, 5, [part(tmp / "trainer", error=full)])
        pending = pending_save(store, tmp, 5, finishers, {}, lambda p: None)
        with pytest.raises(DiskFull) as info:
            await pending.settle()
        assert info.value.rollout_id == 5 and not tmp.exists()
    asyncio.run(scenario())


def test_a_part_that_fails_to_start_finishes_the_started_ones_then_removes_the_folder(tmp_path):
    async def scenario():
        store, finished = CheckpointStore(tmp_path / "ck"), []
        tmp = begin_checkpoint(store, 1)

        async def started():
            async def finish():
                finished.append("trainer")
            return finish

        async def refused():
            raise ConnectionError("critic gone")

        with pytest.raises(ConnectionError):
            await start_parts(store, tmp, 1, [started, refused])
        assert finished == ["trainer"] and not tmp.exists() and store.list() == []
    asyncio.run(scenario())


def test_a_pending_save_past_its_budget_or_disposed_is_aborted(tmp_path):
    async def scenario():
        store = CheckpointStore(tmp_path / "ck")
        for dispose in (False, True):
            tmp = begin_checkpoint(store, 2)
            finishers = await start_parts(store, tmp, 2, [part(tmp / "trainer", gate=asyncio.Event())])   # never set
            pending = pending_save(store, tmp, 2, finishers, {}, lambda p: None)
            if dispose:
                await pending.dispose()
            else:
                with pytest.raises(TimeoutError, match="rollout 2"):
                    await pending.settle(timeout=0.05)
            assert not tmp.exists() and store.list() == [] and not pending.pending
            await pending.dispose()                   # idempotent
    asyncio.run(scenario())


# -- the save phase and draining, on actors of one layer (fakes: each writes a file of its state) -------------

class _Method:
    def __init__(self, fn):
        self.remote = fn

    def options(self, **_):
        return self


class BackgroundActor:
    """An actor's shape (`.handle.<method>.remote`) that saves its `version` as it was at the call, and
    writes it only when `release` is set (the writer thread's work, here a coroutine)."""

    def __init__(self, name: str):
        self.handle, self.resource_name, self.version = self, name, 0
        self.release, self.fail = asyncio.Event(), None
        self._queued: list[tuple[Path, int]] = []

        async def save(path: str, *, optimizer: bool = True, background: bool = False) -> None:
            Path(path).mkdir(parents=True)               # as the trainer's `_write`: its folder now, the files later
            self._queued.append((Path(path), self.version))
            if not background:
                await wait_saved(now=True)

        async def export_hf(path: str, *, background: bool = False) -> None:
            await save(path, background=background)

        async def wait_saved(now: bool = False) -> float:
            if not now:
                await self.release.wait()
            queued, self._queued = self._queued, []
            if self.fail is not None:
                raise self.fail
            for path, version in queued:
                if path.is_dir():                             # an aborted save's folder is not made again
                    (path / "state.txt").write_text(str(version))
            return 0.0

        async def state_dict() -> dict:
            return {"position": self.version}

        self.save, self.export_hf, self.wait_saved, self.state_dict = (
            _Method(save), _Method(export_hf), _Method(wait_saved), _Method(state_dict))


def background_context(tmp_path: Path):
    from miles.config import CheckpointConfig, DataConfig, ModelConfig, RolloutConfig, RunConfig
    from miles.phases.context import TrainingContext
    from miles.runtime import Disposer, Tracer, read_trace

    ckpt = CheckpointConfig(save=str(tmp_path / "ck"), save_interval=1, async_save=True)
    cfg = RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(prompt_data="p"),
                    rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1), checkpoint=ckpt, num_rollout=4)
    ctx = TrainingContext(cfg, run_id="t", run_dir=tmp_path, tracer=Tracer(tmp_path / "trace.jsonl", run_id="t",
                          machine="m", console="off"), disposer=Disposer())
    ctx.c.trainer = BackgroundActor("trainer")
    ctx.c.executor = ctx.c.trainer
    ctx.c.store = CheckpointStore(ckpt.save)
    ctx.c.background_save = BackgroundSave()
    ctx.next_rollout = 1
    return ctx, lambda event: [e for e in read_trace(tmp_path).of(event)]


def saved_version(ctx, rid: int) -> str:
    return (ctx.c.store.path_for(rid) / "trainer" / "state.txt").read_text()


def test_the_save_phase_returns_before_the_files_and_the_next_save_commits_the_one_before_first(tmp_path):
    from miles.phases.save import save

    async def scenario():
        ctx, events = background_context(tmp_path)
        trainer = ctx.c.trainer
        assert await save(ctx) == "next"                     # rollout 0's snapshot: version 0
        assert ctx.c.store.list() == [] and ctx.c.background_save.pending
        trainer.version, ctx.next_rollout = 1, 2             # rollout 1 trained
        trainer.release.set()                                # rollout 0's files arrive
        await save(ctx)
        assert [rid for rid, _ in ctx.c.store.list()] == [0] and saved_version(ctx, 0) == "0"
        assert ctx.saved_rollout == 0
        await ctx.c.background_save.settle()
        assert saved_version(ctx, 1) == "1" and (ctx.c.store.path_for(1) / "hf" / "state.txt").is_file()
        return events

    events = asyncio.run(scenario())
    assert [e.rollout_id for e in events("checkpoint_snapshot")] == [0, 1]
    assert [e.rollout_id for e in events("checkpoint_saved")] == [0, 1]


@pytest.mark.parametrize("case", ["end", "stop_past_budget", "after_failure"])
def test_draining_settles_the_pending_save(tmp_path, case):
    from miles.phases.drain import drain
    from miles.phases.save import save

    async def scenario():
        ctx, events = background_context(tmp_path)
        ctx.c.metrics = None
        await save(ctx)                                      # rollout 0, pending
        trainer = ctx.c.trainer
        if case == "end":
            trainer.release.set()
        elif case == "stop_past_budget":                     # its files never arrive; the stop's budget is 1 s
            ctx.stop_requested.set()
            ctx.deadline = asyncio.get_running_loop().time() + 2.0
        else:
            ctx.failure = RuntimeError("an engine died")
            trainer.fail = OSError("the trainer's disk went away")
            trainer.release.set()
        assert await drain(ctx) == "finish"
        return ctx, events

    ctx, events = asyncio.run(scenario())
    stored = [rid for rid, _ in ctx.c.store.list()]
    if case == "end":
        assert stored == [0] and not events("checkpoint_failed")
    elif case == "stop_past_budget":
        # aborted, then the stop's own (synchronous) save of the same rollout
        assert [e.get("background") for e in events("checkpoint_failed")] == [True]
        assert "TimeoutError" in events("checkpoint_failed")[0].get("error")
        assert [e.get("saved") for e in events("stop_save")] == [True] and stored == [0]
    else:
        assert "the trainer's disk went away" in events("checkpoint_failed")[0].get("error") and stored == []
    assert not list((tmp_path / "ck").glob(".tmp-*"))


def test_a_float16_trainer_saves_the_loss_scale_of_its_snapshot(model_path, tmp_path):
    from tests.unit.test_fp16_training import trainer as fp16_trainer

    t = fp16_trainer(model_path, "float16", initial_loss_scale=2.0 ** 40, hysteresis=1)    # every step overflows
    t.train(SAMPLES, 0)
    t.save(tmp_path / "sync")
    release = held_writer(t)
    t.save(tmp_path / "background", background=True)
    t.train(SAMPLES, 1)                                   # the scale halves again
    release.set()
    t.wait_saved()
    same_files(tmp_path / "sync", tmp_path / "background")
    saved = json.loads((tmp_path / "background" / "trainer_state.json").read_text())["loss_scaler"]["scale"]
    assert saved > t._scaler.scale


@pytest.mark.parametrize("backend, ranks, background", [("torch", 1, True), ("torch", 2, False), ("megatron", 1, False)])
def test_a_trainer_that_cannot_save_in_the_background_saves_synchronously_and_says_so(tmp_path, backend, ranks,
                                                                                      background):
    from dataclasses import replace
    from types import SimpleNamespace

    from miles.phases.init import _async_save, _concurrency_groups
    from miles.training.protocol import TRAIN_BACKENDS

    ctx, events = background_context(tmp_path)
    ctx.c.background_save = None
    ctx.cfg = replace(ctx.cfg, train=replace(ctx.cfg.train, backend=backend),
                      cluster=replace(ctx.cfg.cluster, actor_num_gpus_per_node=ranks))
    ctx.backends = SimpleNamespace(train_spec=TRAIN_BACKENDS[backend].for_ranks(ranks))
    registered = []
    assert (_concurrency_groups(ctx) is not None) == background      # the actors' thread for wait_saved
    _async_save(ctx, registered.append)
    assert (ctx.c.background_save is not None) == background and registered == ([ctx.c.background_save] if background
                                                                               else [])
    warnings = [e for e in events("warning") if e.get("code") == "async_save_sync"]
    assert len(warnings) == (0 if background else 1)
    if warnings:
        assert f"the {backend} trainer on {ranks} rank" in warnings[0].get("message")
