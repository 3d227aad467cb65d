"""The traced background job the prefetcher and the eval dispatcher share: one start, exactly one end."""

from __future__ import annotations

import asyncio

import pytest

from miles.rollout.background import cancel_jobs, start_job
from miles.runtime import Tracer


def test_every_way_a_job_ends_writes_one_end_event_with_its_outcome():
    events: list[dict] = []
    tracer = Tracer(None, run_id="t", listeners=[events.append])

    async def main():
        loop = asyncio.get_running_loop()
        ok, bad, slow = loop.create_future(), loop.create_future(), loop.create_future()
        jobs = [start_job(tracer, "work", f, {"rollout_id": i}, on_ok=lambda r: {"got": r})
                for i, f in enumerate((ok, bad, slow))]
        never_ran = start_job(tracer, "work", loop.create_future(), {"rollout_id": 3}, on_ok=lambda r: {})
        never_ran.task.cancel()                        # before its first step: the done callback ends it
        ok.set_result(7)
        bad.set_exception(ValueError("x"))
        assert await jobs[0].task == 7
        with pytest.raises(ValueError):
            await jobs[1].task
        await cancel_jobs([jobs[2], never_ran])        # not Ray tasks: their asyncio tasks are cancelled
        assert jobs[2].task.cancelled()

    asyncio.run(main())
    starts = {e["rollout_id"]: e["seq"] for e in events if e["event"] == "work_start"}
    ends = {e["rollout_id"]: e for e in events if e["event"] == "work_end"}
    assert len([e for e in events if e["event"] == "work_end"]) == 4
    assert {i: e["outcome"] for i, e in ends.items()} == {0: "ok", 1: "error", 2: "cancelled", 3: "cancelled"}
    assert ends[0]["got"] == 7 and all(ends[i]["cause"] == starts[i] for i in ends)
