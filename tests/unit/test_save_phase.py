"""Both machines save through one routine: the trainer, the data position of the rollout saved, the
HF export, and PPO's critic, inside the checkpoint or in a store of its own (--critic-save).

The bug this guards: the async machine's copy of the save forgot a critic with its own store.
The components are fakes of one layer (a unit test): each writes a file where it is asked to save.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from miles.checkpoint.store import CheckpointStore
from miles.config import CheckpointConfig, DataConfig, ModelConfig, RolloutConfig, RunConfig
from miles.phases.context import TrainingContext
from miles.runtime import Disposer, Tracer, load_machine


class _Method:
    def __init__(self, fn):
        self.remote = fn


class FakeActor:
    """An ActorResource's shape: `.handle.<method>.remote(...)` returns an awaitable."""

    def __init__(self, name: str, live_state: dict | None = None):
        self.calls: list[tuple[str, str]] = []
        self.handle = self
        self.name, self._state = name, live_state

        async def save(path: str, *, optimizer: bool = True) -> None:
            Path(path).mkdir(parents=True)
            (Path(path) / f"{self.name}.txt").write_text(self.name)
            if optimizer:
                (Path(path) / "optimizer.pt").write_text("adam")
            self.calls.append(("save", path))

        async def export_hf(path: str) -> None:
            Path(path).mkdir(parents=True)
            (Path(path) / "config.json").write_text("{}")

        async def state_dict() -> dict:
            return self._state

        self.save, self.export_hf, self.state_dict = _Method(save), _Method(export_hf), _Method(state_dict)


def context(tmp_path: Path, *, save: bool, critic_save: bool) -> TrainingContext:
    ckpt = CheckpointConfig(save=str(tmp_path / "ck") if save else None,
                            critic_save=str(tmp_path / "critic") if critic_save else None, save_interval=1)
    cfg = RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(rollout_shuffle=True, prompt_data="p"),
                    rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1), checkpoint=ckpt, num_rollout=4)
    ctx = TrainingContext(cfg, run_id="t", run_dir=tmp_path, tracer=Tracer(tmp_path / "trace.jsonl", run_id="t",
                          machine="m", console="off"), disposer=Disposer())
    ctx.c.trainer, ctx.c.critic = FakeActor("trainer"), FakeActor("critic")
    ctx.c.executor = FakeActor("executor", live_state={"iterator": {"live": True}})
    ctx.c.store = CheckpointStore(ckpt.save) if save else None
    ctx.c.critic_store = CheckpointStore(ckpt.critic_save) if critic_save else None
    ctx.next_rollout = 2                       # rollout 1 was just trained
    ctx.data_states = {1: {"iterator": {"after": 1}}}     # what the async rollout phase records
    return ctx


def save_handler(machine: str):
    return load_machine(machine).resolve_phases()["save"]


@pytest.mark.parametrize("machine", ["sync", "async"])
def test_a_critic_with_its_own_store_is_saved_there_by_every_machine(tmp_path, machine):
    ctx = context(tmp_path, save=True, critic_save=True)
    assert asyncio.run(save_handler(machine)(ctx)) == "next"
    (rid, main), = CheckpointStore(tmp_path / "ck").list()
    (crid, critic), = CheckpointStore(tmp_path / "critic").list()
    assert rid == crid == 1
    assert (critic / "critic" / "critic.txt").is_file() and not (main / "critic").exists()
    assert (main / "trainer" / "trainer.txt").is_file() and (main / "hf" / "config.json").is_file()
    ctx.tracer.close()


@pytest.mark.parametrize("machine", ["sync", "async"])
def test_only_a_critic_store(tmp_path, machine):
    ctx = context(tmp_path, save=False, critic_save=True)
    asyncio.run(save_handler(machine)(ctx))
    assert [r for r, _ in CheckpointStore(tmp_path / "critic").list()] == [1]
    assert not (tmp_path / "ck").exists() and ctx.c.trainer.calls == []
    ctx.tracer.close()


@pytest.mark.parametrize("machine", ["sync", "async"])
def test_the_critic_goes_inside_without_a_store_of_its_own(tmp_path, machine):
    ctx = context(tmp_path, save=True, critic_save=False)
    asyncio.run(save_handler(machine)(ctx))
    (_, main), = CheckpointStore(tmp_path / "ck").list()
    assert (main / "critic" / "critic.txt").is_file()
    assert json.loads((main / "manifest.json").read_text())["critic"] is True
    ctx.tracer.close()


def test_the_data_position_saved_is_the_one_recorded_for_that_rollout(tmp_path):
    # async: the executor has already drawn rollout 2's prompts; the checkpoint of rollout 1 holds
    # the position recorded right after rollout 1's prompts, not the live one
    ctx = context(tmp_path, save=True, critic_save=False)
    asyncio.run(save_handler("sync")(ctx))
    (_, main), = CheckpointStore(tmp_path / "ck").list()
    assert json.loads((main / "rollout.json").read_text()) == {"iterator": {"after": 1}}
    live = context(tmp_path / "live", save=True, critic_save=False)        # nothing recorded (sync): the live one
    live.data_states = {}
    asyncio.run(save_handler("sync")(live))
    (_, main), = CheckpointStore(tmp_path / "live" / "ck").list()
    assert json.loads((main / "rollout.json").read_text()) == {"iterator": {"live": True}}
    ctx.tracer.close()
    live.tracer.close()


@pytest.mark.parametrize("machine", ["sync", "async"])
def test_no_save_optim_and_save_hf_in_every_machine(tmp_path, machine):
    ctx = context(tmp_path, save=True, critic_save=False)
    ctx.cfg = replace(ctx.cfg, checkpoint=replace(ctx.cfg.checkpoint, save_optimizer=False,
                                                  save_hf_path=str(tmp_path / "hf" / "step_{rollout_id}")))
    asyncio.run(save_handler(machine)(ctx))
    (_, main), = CheckpointStore(tmp_path / "ck").list()
    assert (main / "trainer" / "trainer.txt").is_file() and not (main / "trainer" / "optimizer.pt").exists()
    assert json.loads((main / "manifest.json").read_text())["optimizer"] is False
    assert (tmp_path / "hf" / "step_1" / "config.json").is_file()          # --save-hf, outside the checkpoint
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["step_1"]      # no temporary folder left behind
    ctx.tracer.close()


def test_save_hf_alone_exports_without_a_checkpoint(tmp_path):
    ctx = context(tmp_path, save=False, critic_save=False)
    ctx.cfg = replace(ctx.cfg, checkpoint=replace(ctx.cfg.checkpoint, save=None, save_hf_path=str(tmp_path / "hf")))
    assert ctx.save_due()
    asyncio.run(save_handler("sync")(ctx))
    asyncio.run(save_handler("sync")(ctx))                                   # the next save replaces it
    assert (tmp_path / "hf" / "config.json").is_file() and not (tmp_path / "ck").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")) == []
    ctx.tracer.close()
