"""The data position a stop's save writes is the one right after the last TRAINED rollout's prompts.

The bug this guards (issue 59): a stop (SIGTERM) while rollout r generates lets that rollout finish,
then drains and saves rollout r-1, the last trained one. The rollout phase had replaced the recorded
positions with rollout r's alone, so the save found none for r-1 and wrote the executor's live
position, after rollout r's prompts: the resumed run trained rollout r on rollout r+1's prompts and
never saw rollout r's. Both machines' rollout phases run here over an executor whose prompt iterator
is the real one (miles.data.iterator); the trainer is a fake that writes a file where it is asked to
save (a unit test of the phases' layer). Also: the positions the context keeps, the prompts the trace
names, and the position after a dynamic-sampling rollout (the executor with a scripted engine).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from miles.checkpoint.store import CheckpointStore
from miles.config import CheckpointConfig, DataConfig, ModelConfig, RolloutConfig, RunConfig
from miles.data.iterator import PromptIterator
from miles.phases import async_loop
from miles.phases.context import TrainingContext
from miles.phases.drain import save_on_stop
from miles.phases.rollout import rollout as sync_rollout
from miles.rollout.executor import PROMPTS_KEY
from miles.rollout.prefetch import Prefetcher
from miles.runtime import Disposer, Tracer
from miles.types import Prompt
from tests.unit.test_save_phase import FakeActor, _Method

BATCH = 2
PROMPTS = [Prompt(index=i, text=f"p{i}", prompt_ids=(i,)) for i in range(10)]


class FakeExecutor:
    """The executor's calls the rollout phases make, over a real PromptIterator: each rollout draws
    BATCH prompts when it is asked for (as the executor does), its metrics come later."""

    def __init__(self):
        self.iterator = PromptIterator(PROMPTS, BATCH, shuffle=False, seed=1)
        self.handle = self
        self.drawn: dict[int, list[int]] = {}

        async def state_dict() -> dict:
            return {"iterator": self.iterator.state_dict()}

        self.state_dict = _Method(state_dict)
        self.generate_split = self

    def options(self, **_):
        return self

    def remote(self, rollout_id: int):
        prompts = self.iterator.next_batch(BATCH)
        self.drawn[rollout_id] = [p.index for p in prompts]

        async def metrics() -> dict:
            return {"reward_mean": 0.5, "num_samples": float(BATCH), "staleness_max": 0.0,
                    "weight_version_min": 0.0}

        return f"samples of rollout {rollout_id}", metrics()


def context(tmp_path: Path, machine: str) -> TrainingContext:
    ckpt = CheckpointConfig(save=str(tmp_path / "ck"), save_interval=100, save_hf=False)
    cfg = RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(prompt_data="p"),
                    rollout=RolloutConfig(n_samples_per_prompt=1, batch_size=BATCH), checkpoint=ckpt, num_rollout=4)
    tracer = Tracer(tmp_path / "trace.jsonl", run_id="t", machine=machine, console="off")
    ctx = TrainingContext(cfg, run_id="t", run_dir=tmp_path, tracer=tracer, disposer=Disposer())
    ctx.c.trainer, ctx.c.executor = FakeActor("trainer"), FakeExecutor()
    ctx.c.store = CheckpointStore(ckpt.save)
    if machine == "async":
        executor = ctx.c.executor
        ctx.c.prefetch = Prefetcher(lambda r: executor.generate_split.options(num_returns=2).remote(r), tracer)
    return ctx


def trained(ctx: TrainingContext) -> None:
    """What `train` leaves behind for the save: the rollout it stepped on is the last trained."""
    ctx.next_rollout, ctx.batch_ref = ctx.rollout_id + 1, None


def saved_position(tmp_path: Path) -> tuple[int, dict]:
    (rid, folder), = CheckpointStore(tmp_path / "ck").list()
    return rid, json.loads((folder / "rollout.json").read_text())["iterator"]


@pytest.mark.parametrize("machine", ["sync", "async"])
def test_a_stop_while_the_next_rollout_generates_saves_the_position_after_the_last_trained_rollout(tmp_path, machine):
    ctx = context(tmp_path, machine)
    phase = sync_rollout if machine == "sync" else async_loop.rollout

    async def run() -> None:
        await phase(ctx)                 # rollout 0 ...
        trained(ctx)                     # ... trained, not saved (no periodic save due)
        ctx.stop_requested.set()         # SIGTERM while rollout 1 generates: the phase finishes it
        await phase(ctx)
        assert ctx.rollout_id == 1 and ctx.next_rollout == 1
        await save_on_stop(ctx)          # draining: the stop's save of rollout 0

    asyncio.run(run())
    ctx.tracer.close()
    drawn = ctx.c.executor.drawn
    # rollout 1's prompts were drawn (async: ahead, while rollout 0 trained); rollout 2's were not: the
    # async phase asks for no rollout ahead once a stop is requested
    assert drawn == {0: [0, 1], 1: [2, 3]}
    rid, position = saved_position(tmp_path)
    assert rid == 0
    assert position["offset"] == BATCH, position              # right after rollout 0's prompts, not 2 * BATCH
    # the resumed run draws rollout 1's prompts first
    resumed = PromptIterator(PROMPTS, BATCH, shuffle=False, seed=1)
    resumed.load_state_dict(position)
    assert [p.index for p in resumed.next_batch(BATCH)] == drawn[1]


def test_the_positions_kept_are_the_last_trained_rollouts_and_those_rolled_out_since(tmp_path):
    ctx = context(tmp_path, "sync")
    for r in range(4):
        ctx.next_rollout = r             # rollout r-1 is the last trained
        ctx.note_data_position(r, {"after": r})
        assert sorted(ctx.data_states) == ([r - 1, r] if r else [0])
    ctx.tracer.close()


def test_the_trace_names_each_groups_prompt_in_batch_order():
    from miles.rollout.executor import trained_prompts
    from miles.types import Sample

    def sample(row: int, group: int) -> Sample:
        return Sample(prompt=Prompt(index=row, text="", prompt_ids=(row,)), group=group, response_ids=[1],
                      rollout_logprobs=[0.0], finish_reason="stop", weight_version=0)

    # two samples a group; the last group is the first one's prompt again (a batch across an epoch's end)
    samples = [sample(7, 0), sample(7, 0), sample(3, 1), sample(3, 1), sample(7, 2), sample(7, 2)]
    assert trained_prompts(samples) == [7, 3, 7]


def odd_rows(group) -> bool:
    """A dynamic-sampling filter: keeps the groups of odd dataset rows."""
    return group[0].prompt.index % 2 == 1


def test_the_position_after_a_rollout_covers_the_prompts_its_filter_dropped():
    # dynamic sampling draws rounds of 2 prompts until 2 groups pass: rollout 0 draws rows 0-3 and trains
    # 1 and 3; the position saved with it is after row 3, so a resumed executor's rollout 1 trains the
    # uninterrupted one's (5 and 7), neither rows 2-3 again nor skipping any
    from tests.unit.test_partial_rollout import Engine, executor

    def run(ex, rollout_id):
        return asyncio.run(ex.generate_split(rollout_id))[1][PROMPTS_KEY]

    flags = {"partial_rollout": False, "batch_size": 2, "dynamic_sampling_filter_path": f"{__name__}:odd_rows"}
    uninterrupted = executor([Engine()], **flags)
    assert run(uninterrupted, 0) == [1, 3]
    position = json.loads(json.dumps(uninterrupted.state_dict()))      # rollout.json is JSON
    assert position["iterator"]["offset"] == 4
    assert run(uninterrupted, 1) == [5, 7]
    resumed = executor([Engine()], **flags)
    resumed.load_state_dict(position)
    assert run(resumed, 1) == [5, 7]
