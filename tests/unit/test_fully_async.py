"""--fully-async without Ray: the group buffer and its staleness bound, the producer's bookkeeping
(tickets, capacity, retries, pause, drain, checkpoint state) on fake executor calls, and the config
rules (miles/rollout/producer.py, miles/config/validate.py)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import numpy as np
import pytest

from miles.config import ConfigError
from miles.config.flags import parse_flags
from miles.config.validate import validate
from miles.rollout.producer import Group, GroupBuffer, Producer, capacity_groups, concurrent_groups
from miles.runtime import load_machine
from miles.types import Generation, Prompt, Sample


class Events:
    def __init__(self):
        self.events: list[tuple[str, dict]] = []

    def emit(self, event: str, **fields) -> int:
        self.events.append((event, fields))
        return len(self.events)

    def of(self, event: str) -> list[dict]:
        return [f for e, f in self.events if e == event]


def sample(row: int, versions: list[int], length: int = 3) -> Sample:
    s = Sample(prompt=Prompt(row, f"p{row}", (5, 6)), group=0, response_ids=[7] * length,
               rollout_logprobs=[-0.5] * length, finish_reason="stop", weight_version=min(versions))
    s.metadata["weight_versions"] = sorted(set(versions))
    return s


def group(ticket: int, versions: list[int]) -> Group:
    return Group(ticket, [sample(ticket, versions), sample(ticket, versions[:1])])


# -- the buffer ------------------------------------------------------------------------------------

def test_take_is_oldest_first_and_reports_each_groups_staleness():
    b = GroupBuffer(capacity=8, bound=None, handler="drop")
    for t, v in enumerate([0, 1, 1, 2]):
        b.put(group(t, [v]))
    taken = b.take(3, step=3)
    assert [g.ticket for g in taken.groups] == [0, 1, 2] and taken.staleness == [3, 2, 2]
    assert [g.ticket for g in b.groups] == [3]


def test_a_group_past_the_bound_is_dropped_or_retried_never_taken():
    for handler in ("drop", "retry"):
        b = GroupBuffer(capacity=8, bound=1, handler=handler)
        for t, v in enumerate([0, 1, 2, 2]):
            b.put(group(t, [v]))
        taken = b.take(2, step=2)           # ticket 0: staleness 2 > 1
        assert [g.ticket for g in taken.groups] == [1, 2] and max(taken.staleness) <= 1
        handled = taken.dropped if handler == "drop" else taken.retried
        assert [g.ticket for g in handled] == [0]
        assert (taken.retried if handler == "drop" else taken.dropped) == []


def test_the_oldest_token_decides_staleness_and_mixed_tokens_are_counted():
    g = Group(0, [sample(0, [1, 3], length=4), sample(0, [3], length=2)])
    assert g.oldest == 1 and g.versions == [1, 3] and g.mixed_tokens == 4 and g.tokens == 6
    b = GroupBuffer(capacity=4, bound=2, handler="drop")
    b.put(g)
    assert b.take(1, step=4).dropped == [g]         # 4 - 1 = 3 > 2, though most of it is version 3


def test_groups_given_back_are_first_in_line():
    b = GroupBuffer(capacity=8, bound=None, handler="drop")
    for t in range(4):
        b.put(group(t, [0]))
    taken = b.take(2, step=0)
    b.give_back(taken.groups)
    assert [g.ticket for g in b.groups] == [0, 1, 2, 3]


# -- the producer on fake executor calls -----------------------------------------------------------

class FakeExecutor:
    """draw: the next rows; generate: one group per row, made by `version`, judged by `keep` (the
    dynamic-sampling filter the executor applies; None: every group passes); a call can be held."""

    def __init__(self, version: list[int], hold: asyncio.Event | None = None, hold_after: int | None = None,
                 keep=None):
        self.offset, self.version, self.hold, self.hold_after, self.keep = 0, version, hold, hold_after, keep
        self.calls: list[tuple[int, list[int]]] = []
        self.aborted = 0

    async def draw(self, k: int):
        rows = list(range(self.offset, self.offset + k))
        self.offset += k
        return [Prompt(r, f"p{r}", (5,)) for r in rows], {"offset": self.offset}

    async def generate(self, engine: int, rows: list[int], seed: int, continuing=()):
        assert not continuing, "this fake cuts no tail"
        self.calls.append((engine, rows))
        if self.hold_after is not None and len(self.calls) > self.hold_after:
            self.hold = self.hold or asyncio.Event()
        if self.hold is not None:
            await self.hold.wait()
        await asyncio.sleep(0)
        out = [[sample(r, [self.version[0]]), sample(r, [self.version[0]])] for r in rows]
        for s in (s for g in out for s in g):
            s.finish_reason = "abort" if self.aborted else s.finish_reason     # what an aborted engine returns
        return out, [self.keep is None or bool(self.keep(g)) for g in out]

    async def abort(self):
        self.aborted += 1
        if self.hold is not None:
            self.hold.set()


def producer(ex: FakeExecutor, tracer: Events, *, capacity=6, concurrent=4, engines=2, bound=None, handler="drop",
             fill_after=None, tail_cut=False):
    return Producer(draw=ex.draw, generate=ex.generate, abort=ex.abort, num_engines=engines, capacity=capacity,
                    concurrent_groups=concurrent, bound=bound, handler=handler, seed=0, tracer=tracer,
                    version=lambda: ex.version[0], dynamic_filter="tests:odd_rows" if ex.keep else None,
                    fill_after=fill_after, tail_cut=tail_cut)


class TailCuttingExecutor(FakeExecutor):
    """Each call's tail is cut (--async-tail-cut-share): a fresh group's second sample comes back "abort"
    after 1 token; continued in a later call (the groups given first), it gets 2 more and finishes."""

    def __init__(self, version: list[int]):
        super().__init__(version)
        self.continued: list[list[int]] = []

    async def generate(self, engine: int, rows: list[int], seed: int, continuing=()):
        self.calls.append((engine, rows))
        self.continued.append([g[0].prompt.index for g in continuing])
        await asyncio.sleep(0)
        out = []
        for g in continuing:
            assert [s.finish_reason for s in g] == ["stop", "abort"], "only the cut sample goes on"
            done = sample(g[1].prompt.index, [*g[1].metadata["weight_versions"], self.version[0]], length=3)
            out.append([g[0], done])
        for r in rows:
            cut = sample(r, [self.version[0]], length=1)
            cut.finish_reason = "abort"
            out.append([sample(r, [self.version[0]]), cut])
        return out, [True] * len(out)


def test_the_producer_fills_the_buffer_to_capacity_and_the_trainer_takes_batches():
    async def go():
        ex, tr = FakeExecutor([0]), Events()
        p = producer(ex, tr, capacity=6, concurrent=4)
        p.start()
        taken = await p.take(4, step=0)
        assert [g.ticket for g in taken.groups] == [0, 1, 2, 3]
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(p.buffer) + len(p.in_flight) <= 6       # capacity: finished and in flight together
        assert len(p.buffer) == 6
        assert all(len(rows) <= 2 for _, rows in ex.calls)   # 4 concurrent groups over 2 engines
        await p.settle(saved_rollout=None)
        assert not p.running
        drained = tr.of("producer_drained")[-1]
        assert drained["buffered_tickets"] == [4, 5, 6, 7, 8, 9] and drained["dropped_tickets"] == [4, 5, 6, 7, 8, 9]
        # every ticket drawn is trained, buffered, or in flight: none lost
        assert p.next_ticket == 10

    asyncio.run(go())


def test_a_cut_tail_goes_on_in_a_later_call_and_every_ticket_is_trained_once():
    async def go():
        version = [0]
        ex, tr = TailCuttingExecutor(version), Events()
        p = producer(ex, tr, capacity=4, concurrent=4, engines=1, tail_cut=True)
        p.start()
        trained = []
        for step in range(3):
            taken = await asyncio.wait_for(p.take(2, step=step), 5)
            assert all(s.finish_reason != "abort" for g in taken.groups for s in g.samples)    # whole groups only
            assert all(g.samples[1].response_length == 3 for g in taken.groups)               # 1 + 2 continued
            trained += [g.ticket for g in taken.groups]
            version[0] += 1
        assert trained == list(range(6))                 # in ticket order, none twice, none skipped
        assert any(ex.continued), ex.continued           # the cut groups were handed back to the executor
        assert all(not set(c) & set(rows) for c, (_, rows) in zip(ex.continued, ex.calls))   # not drawn again
        cuts = tr.of("producer_tail_cut")
        assert cuts and all("--async-tail-cut-share" in e["reason"] for e in cuts)
        # cut groups go on even when the buffer is full (they are in flight already: no new room), so none waits
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(p.buffer) == 4 and not p.in_flight and not p.partial
        await p.settle(saved_rollout=None)
        drained = tr.of("producer_drained")[-1]
        assert sorted({*trained, *drained["dropped_tickets"]}) == list(range(p.next_ticket))

    asyncio.run(go())


def test_a_cut_tail_waiting_for_its_next_call_is_in_flight_for_pauses_checkpoints_and_drains():
    async def go():
        ex, tr = FakeExecutor([0], hold=asyncio.Event()), Events()
        p = producer(ex, tr, capacity=6, concurrent=2, engines=1, tail_cut=True)
        p.start()
        for _ in range(5):
            await asyncio.sleep(0)
        assert sorted(p.in_flight) == [0, 1]                     # a call holds tickets 0 and 1
        cut = [sample(9, [0]), sample(9, [0], length=1)]
        cut[1].finish_reason = "abort"
        p.partial[9], p.in_flight[9] = (9, 1, cut, 0.0), (9, 1, 0)    # a group an earlier call cut
        pausing = asyncio.ensure_future(p.pause())
        await asyncio.sleep(0)
        assert not pausing.done()                                 # the running call is waited for ...
        ex.hold.set()
        await asyncio.wait_for(pausing, 5)                        # ... the cut group, with no call, is not
        assert sorted(p.partial) == [9] and 9 in p.in_flight
        assert [9, 9, 1] in p.state_dict()["regenerate"]          # a checkpoint generates it again
        await p.settle(saved_rollout=None)
        drained = tr.of("producer_drained")[-1]
        assert 9 in drained["in_flight_tickets"] and 9 in drained["dropped_tickets"]   # accounted for

    asyncio.run(go())


def test_a_retried_group_keeps_its_ticket_and_prompt_and_counts():
    async def go():
        version = [0]
        ex, tr = FakeExecutor(version), Events()
        p = producer(ex, tr, capacity=4, concurrent=4, engines=1, bound=1, handler="retry")
        p.start()
        first = await p.take(2, step=0)
        assert [g.ticket for g in first.groups] == [0, 1]
        for _ in range(10):
            await asyncio.sleep(0)
        version[0] = 3                         # new groups come from version 3; 2 and 3 are stale at step 3
        taken = await p.take(2, step=3)
        assert [g.ticket for g in taken.retried][:2] == [2, 3]
        assert all(s <= 1 for s in taken.staleness)
        again = [g for g in taken.groups if g.attempts == 2]
        assert {g.ticket for g in again} <= {2, 3}
        assert all(g.samples[0].prompt.index == g.ticket for g in taken.groups)   # the same prompt again
        assert {e["ticket"] for e in tr.of("group_retried")} >= {2, 3}
        assert all("--max-weight-staleness 1" in e["reason"] for e in tr.of("group_retried"))
        m = p.step_metrics(taken, 1.0)
        assert m["fa/groups_retried"] >= 2 and m["fa/staleness_max"] <= 1
        await p.settle(saved_rollout=None)

    asyncio.run(go())


def test_settle_aborts_the_calls_in_flight_and_none_is_left_running():
    async def go():
        hold = asyncio.Event()
        ex, tr = FakeExecutor([0], hold), Events()
        p = producer(ex, tr)
        p.start()
        for _ in range(5):
            await asyncio.sleep(0)
        assert p.in_flight
        p.note(7)                             # the position a checkpoint of step 7 holds
        await p.settle(saved_rollout=7)
        assert ex.aborted == 1 and not p.running
        drained = tr.of("producer_drained")[-1]
        assert drained["checkpoint"] == 7 and drained["held_tickets"] == [0, 1, 2, 3] and drained["dropped_tickets"] == []

    asyncio.run(go())


def test_a_take_cut_short_gives_its_groups_back():
    async def go():
        ex, tr = FakeExecutor([0], hold_after=1), Events()
        p = producer(ex, tr, capacity=4, concurrent=2, engines=1)
        p.start()
        task = asyncio.ensure_future(p.take(4, step=0))    # 2 made, the next call hangs: it waits for more
        for _ in range(10):
            await asyncio.sleep(0)
        await p.settle(saved_rollout=None)
        task.cancel()
        with pytest.raises((asyncio.CancelledError, RuntimeError)):
            await task
        assert [g.ticket for g in p.buffer.groups] == [0, 1]
        assert [t for t, _, _ in p.retry] == [2, 3]          # the aborted call's prompts: to generate again
        assert tr.of("producer_cut")[0]["tickets"] == [2, 3]

    asyncio.run(go())


def test_state_dict_round_trips_the_buffer_and_regenerates_what_was_in_flight():
    async def go():
        hold = asyncio.Event()
        ex, tr = FakeExecutor([0]), Events()
        p = producer(ex, tr, capacity=4, concurrent=2, engines=1)
        p.start()
        await p.take(1, step=0)
        for _ in range(10):
            await asyncio.sleep(0)
        ex.hold = hold                        # the next call stays in flight
        await p.take(1, step=0)
        for _ in range(10):
            await asyncio.sleep(0)
        state = json.loads(json.dumps(p.state_dict()))      # it goes to rollout.json
        buffered, in_flight = [g.ticket for g in p.buffer.groups], sorted(p.in_flight)
        assert in_flight and state["regenerate"] and state["next_ticket"] == p.next_ticket
        await p.settle(saved_rollout=0)

        ex2, tr2 = FakeExecutor([5]), Events()
        ex2.offset = ex.offset
        q = producer(ex2, tr2, capacity=4, concurrent=2, engines=1)
        q.load_state_dict(state, step=0)
        assert [g.ticket for g in q.buffer.groups] == buffered
        assert q.buffer.groups[0].samples[0].prompt == p.buffer.groups[0].samples[0].prompt
        q.start()
        taken = await q.take(len(buffered) + len(in_flight), step=5)
        tickets = [g.ticket for g in taken.groups]
        assert tickets == buffered + in_flight           # the buffer first, then the regenerated ones
        assert ex2.calls[0][1][:len(in_flight)] == in_flight    # the same prompt rows, generated again first
        await q.settle(saved_rollout=None)

    asyncio.run(go())


def test_the_state_dict_carries_the_fast_engines_routing_arrays_as_json_lists():
    # a buffered MoE sample: two tokens routed by the fast engine (uint8 arrays [MoE layers 2, k 2]), a tool
    # token; another sample, the fast engine's whole response: one array [tokens 2, MoE layers 2, k 2]
    routed = np.arange(8, dtype=np.uint8).reshape(2, 2, 2)
    s = sample(0, [0])
    s.rollout_routed_experts = [*routed, []]
    whole = sample(0, [0])
    whole.rollout_routed_experts = routed
    p = producer(FakeExecutor([0]), Events())
    p.buffer.groups.append(Group(0, [s, sample(0, [0])]))
    p.buffer.groups.append(Group(1, [whole]))
    state = json.loads(json.dumps(p.state_dict()))          # rollout.json
    q = producer(FakeExecutor([0]), Events())
    q.load_state_dict(state, step=0)
    back = q.buffer.groups[0].samples
    assert back[0].rollout_routed_experts == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], []]
    assert back == [replace(s, rollout_routed_experts=[[[0, 1], [2, 3]], [[4, 5], [6, 7]], []]), sample(0, [0])]
    assert isinstance(s.rollout_routed_experts[0], np.ndarray)      # the buffer's own sample is not changed
    assert q.buffer.groups[1].samples[0].rollout_routed_experts == routed.tolist()


def test_pause_lets_the_calls_in_flight_finish_and_starts_no_new_one():
    async def go():
        ex, tr = FakeExecutor([0]), Events()
        p = producer(ex, tr, capacity=8, concurrent=2, engines=2)
        p.start()
        await asyncio.sleep(0)
        await p.pause()
        assert not p.in_flight
        n = len(ex.calls)
        await p.take(min(2, len(p.buffer)), step=0)
        for _ in range(10):
            await asyncio.sleep(0)
        assert len(ex.calls) == n
        p.resume()
        for _ in range(10):
            await asyncio.sleep(0)
        assert len(ex.calls) > n
        await p.settle(saved_rollout=None)

    asyncio.run(go())


# -- dynamic sampling under the producer (--dynamic-sampling-filter-path) -------------------------------

def odd_rows(group) -> bool:
    """A dynamic-sampling filter: keeps the groups of odd dataset rows (the fake executor: ticket == row)."""
    return group[0].prompt.index % 2 == 1


async def spin(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_groups_the_filter_rejects_never_reach_take_and_are_counted_and_traced():
    async def go():
        ex, tr = FakeExecutor([0], keep=odd_rows), Events()
        p = producer(ex, tr, capacity=6, concurrent=4)
        p.start()
        taken = await asyncio.wait_for(p.take(4, step=0), timeout=10)
        assert [g.ticket for g in taken.groups] == [1, 3, 5, 7]
        filtered = [e["ticket"] for e in tr.of("group_filtered")]
        assert filtered[:4] == [0, 2, 4, 6] and all(t % 2 == 0 for t in filtered)
        assert all("--dynamic-sampling-filter-path tests:odd_rows rejected it" in e["reason"]
                   for e in tr.of("group_filtered"))
        m = p.step_metrics(taken, 1.0)
        assert m["fa/groups_filtered"] == taken.filtered >= 4           # rejected while step 0 waited
        assert m["fa/groups_filtered_total"] == taken.filtered_total == taken.filtered   # none before step 0's
        assert m["fa/dynamic_sampling_pass_ratio"] == taken.passed / taken.judged
        assert m["fa/dynamic_sampling_filled_groups"] == 0 and m["fa/groups_dropped"] == 0
        await spin()
        # rejected groups hold no room: the buffer fills to capacity with groups that passed
        assert len(p.buffer) + len(p.in_flight) <= 6 and len(p.buffer) == 6
        assert all(g.ticket % 2 == 1 for g in p.buffer.groups)
        second = await p.take(4, step=1)
        assert all(g.ticket % 2 == 1 for g in second.groups)
        assert second.filtered == second.filtered_total - taken.filtered_total > 0    # the window since step 0
        await p.settle(saved_rollout=None)
        # every ticket drawn is trained, buffered, in flight (to generate again) or filtered, once
        drained = tr.of("producer_drained")[-1]
        trained = [g.ticket for g in taken.groups + second.groups]
        held = drained["buffered_tickets"] + drained["in_flight_tickets"] + drained["retry_tickets"]
        filtered = [e["ticket"] for e in tr.of("group_filtered")]
        assert sorted(trained + held + filtered) == list(range(p.next_ticket))
        assert drained["filtered_total"] == len(filtered)
        # the trace says which tickets of each engine call the filter took out
        assert sorted(t for e in tr.of("producer_groups") for t in e["filtered"]) == sorted(filtered)

    asyncio.run(go())


def test_a_filter_that_rejects_every_group_cannot_keep_a_step_waiting():
    """After --dynamic-sampling-max-rounds x --rollout-batch-size rejects since the last take, the rejected
    groups fill the buffer (as filtered-out groups fill a sync rollout); the next take closes the window."""
    async def go():
        ex, tr = FakeExecutor([0], keep=lambda g: False), Events()
        p = producer(ex, tr, capacity=4, concurrent=2, engines=1, fill_after=6)
        p.start()
        taken = await asyncio.wait_for(p.take(2, step=0), timeout=10)
        assert [e["ticket"] for e in tr.of("group_filtered")][:6] == [0, 1, 2, 3, 4, 5] and taken.filtered == 6
        assert [g.ticket for g in taken.groups] == [6, 7] and all(g.filled for g in taken.groups)
        assert all("--dynamic-sampling-max-rounds" in e["reason"] for e in tr.of("group_filled"))
        m = p.step_metrics(taken, 1.0)
        assert m["fa/dynamic_sampling_filled_groups"] == 2 and m["fa/groups_filtered"] == 6
        assert m["fa/dynamic_sampling_pass_ratio"] == 0.0
        filled_before = {e["ticket"] for e in tr.of("group_filled")}
        await spin()
        # the window closed with the take: the groups after it are rejected again
        later = [e["ticket"] for e in tr.of("group_filtered")][6:]
        assert later and min(later) > max(filled_before) and not set(later) & {g.ticket for g in p.buffer.groups}
        await p.settle(saved_rollout=None)

    asyncio.run(go())


def test_filtered_tickets_are_neither_retrained_nor_lost_across_a_checkpoint():
    async def go():
        hold = asyncio.Event()
        ex, tr = FakeExecutor([0], keep=odd_rows), Events()
        p = producer(ex, tr, capacity=4, concurrent=2, engines=1)
        p.start()
        first = await p.take(2, step=0)
        await spin()
        ex.hold = hold                                    # the next call stays in flight
        second = await p.take(1, step=1)
        await spin()
        state = json.loads(json.dumps(p.note(1)))       # the position a checkpoint of step 1 holds
        filtered = {e["ticket"] for e in tr.of("group_filtered")}
        trained = {g.ticket for g in first.groups + second.groups}
        held = {g["ticket"] for g in state["buffer"]} | {t for t, _, _ in state["regenerate"]}
        assert filtered and state["filtered_total"] == len(filtered)
        assert not filtered & held and not filtered & trained and not trained & held
        assert filtered | trained | held == set(range(state["next_ticket"]))
        await p.settle(saved_rollout=1)

        ex2, tr2 = FakeExecutor([5], keep=odd_rows), Events()
        ex2.offset = ex.offset
        q = producer(ex2, tr2, capacity=4, concurrent=2, engines=1)
        q.load_state_dict(state, step=1)
        assert q.stats.filtered == len(filtered)
        q.start()
        again = await asyncio.wait_for(q.take(len(held), step=5), timeout=10)
        refiltered = {e["ticket"] for e in tr2.of("group_filtered")}
        resumed = {g.ticket for g in again.groups}
        assert not resumed & (trained | filtered)                   # none trained twice, none filtered one trained
        assert held <= resumed | refiltered                         # the held ones: trained, or filtered (counted)
        # the total goes on from the checkpoint's: the resumed run's rejects are added to it
        assert q.step_metrics(again, 1.0)["fa/groups_filtered_total"] == len(filtered) + again.filtered
        assert again.filtered <= len(refiltered) == q.stats.filtered - len(filtered)
        await q.settle(saved_rollout=None)

    asyncio.run(go())


def test_the_executor_judges_each_group_with_the_dynamic_sampling_filter():
    """generate_groups scores the groups and calls the filter on each, as a sync rollout does."""
    from tests.unit.test_partial_rollout import Engine, executor

    ex = executor([Engine()], partial_rollout=False, over_sampling_batch_size=None,
                  dynamic_sampling_filter_path=f"{__name__}:odd_rows")
    groups, kept = asyncio.run(ex.generate_groups(0, [2, 3, 5], seed=1))
    assert [g[0].prompt.index for g in groups] == [2, 3, 5] and kept == [False, True, True]
    assert all(len(g) == 2 for g in groups)
    plain = executor([Engine()], partial_rollout=False, over_sampling_batch_size=None,
                     dynamic_sampling_filter_path=None)
    assert asyncio.run(plain.generate_groups(0, [2, 3], seed=1))[1] == [True, True]


class TailEngine:
    """Honours SamplingParams.tail_cut_share: the call's last share of requests end "abort" after one token
    ([5]); the others answer [1] (a fresh prompt) or [9] (a continued one), weights `version`."""

    def __init__(self):
        self.version, self.calls = 0, []

    async def generate(self, prompts, params, caps=None):
        self.calls.append(([list(p) for p in prompts], caps, params.tail_cut_share))
        cut = len(prompts) - int(params.tail_cut_share * len(prompts))
        return [Generation([5], [-0.7], "abort", self.version) if i >= cut else
                Generation([9] if p[-1] == 5 else [1], [-0.3], "stop", self.version) for i, p in enumerate(prompts)]


def test_the_executor_cuts_a_calls_tail_and_continues_it_with_each_tokens_version():
    from tests.unit.test_partial_rollout import executor

    engine = TailEngine()
    ex = executor([engine], partial_rollout=False, over_sampling_batch_size=None, dynamic_sampling_filter_path=None,
                  max_response_len=4)
    groups, kept = asyncio.run(ex.generate_groups(0, [2, 3], seed=1, tail_cut_share=0.25))
    assert engine.calls[-1][2] == 0.25                              # the share, passed on: the engine knows its batch
    assert [[s.finish_reason for s in g] for g in groups] == [["stop", "stop"], ["stop", "abort"]]
    assert kept == [True, True]                                     # a cut group is not judged
    engine.version = 1
    again, kept = asyncio.run(ex.generate_groups(0, [4], seed=2, continuing=[groups[1]], tail_cut_share=0.0))
    prompts, caps, tail_cut = engine.calls[-1]
    cont = [s for s in groups[1] if s.finish_reason == "abort"][0]
    # only the cut sample goes on (from prompt + its response so far, with what is left of its cap), then
    # the fresh row's two samples; the continued group comes back first
    assert prompts[0] == [*cont.prompt.prompt_ids, 5] and caps == [3, 4, 4] and tail_cut == 0
    assert [g[0].prompt.index for g in again] == [3, 4] and kept == [True, True]
    done = again[0][1]
    assert done.response_ids == [5, 9] and done.rollout_logprobs == [-0.7, -0.3] and done.finish_reason == "stop"
    assert done.metadata["token_versions"] == [0, 1] and done.metadata["weight_versions"] == [0, 1]
    assert done.weight_version == 0 and cont.response_ids == [5]     # the cut group's own sample is kept as it was
    assert again[0][0] is groups[1][0]                                # its finished sample is not generated again


# -- config ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def BASE(tiny_task):
    return ["--hf-checkpoint", tiny_task["model"], "--prompt-data", tiny_task["train"], "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--use-tis", "--num-rollout", "2"]


def problems(argv: list[str], machine: str = "fully_async") -> str:
    try:
        cfg, _ = parse_flags(argv)
        validate(cfg, machine=load_machine(machine))
    except ConfigError as exc:
        return str(exc)
    return ""


def test_fully_async_flags_parse_and_size_the_producer(BASE):
    cfg, _ = parse_flags([*BASE, "--fully-async", "--max-weight-staleness", "2", "--async-max-concurrent-samples",
                          "8", "--async-data-buffer-capacity-factor", "1.5", "--async-unused-samples-handler", "retry"])
    assert (cfg.fully_async, cfg.max_weight_staleness, cfg.async_unused_samples_handler) == (True, 2, "retry")
    assert capacity_groups(cfg) == 6 and concurrent_groups(cfg) == 2
    assert problems([*BASE, "--fully-async", "--max-weight-staleness", "2"]) == ""
    assert problems([*BASE, "--fully-async", "--async-tail-cut-share", "0.25"]) == ""


@pytest.mark.parametrize("extra,machine,expected", [
    (["--max-weight-staleness", "2"], "async", "--max-weight-staleness 2: only --fully-async reads it"),
    (["--fully-async"], "async", "--fully-async needs the fully_async machine"),
    ([], "fully_async", "add --fully-async"),
    (["--fully-async", "--update-weights-interval", "2", "--max-weight-staleness", "1"], "fully_async",
     "--max-weight-staleness 1 is below --update-weights-interval 2"),
    (["--fully-async", "--async-max-concurrent-samples", "2"], "fully_async",
     "--async-max-concurrent-samples 2 is below --n-samples-per-prompt 4"),
    (["--fully-async", "--async-data-buffer-capacity-factor", "0.5"], "fully_async",
     "--async-data-buffer-capacity-factor 0.5"),
    (["--fully-async", "--partial-rollout", "--dynamic-sampling-filter-path", "a:b"], "fully_async",
     "--partial-rollout cannot be used with --fully-async"),
    (["--fully-async", "--async-tail-cut-share", "1"], "fully_async", "--async-tail-cut-share 1.0: the share"),
    (["--async-tail-cut-share", "0.25"], "async", "--async-tail-cut-share 0.25: only --fully-async reads it"),
    (["--fully-async", "--debug-skip-weight-update"], "fully_async",
     "--debug-skip-weight-update cannot be used with --fully-async"),
    (["--fully-async", "--colocate"], "fully_async", "--colocate cannot be used with the async machine"),
])
def test_what_fully_async_cannot_take_is_refused_by_flag(BASE, extra, machine, expected):
    assert expected in problems([*BASE, *extra], machine)


def test_dynamic_sampling_is_taken_with_fully_async_and_over_sampling_is_refused_by_name(BASE):
    filt = ["--dynamic-sampling-filter-path", "miles.rollout.filters:check_reward_nonzero_std"]
    assert problems([*BASE, "--fully-async", *filt]) == ""
    assert problems([*BASE, "--fully-async", *filt, "--dynamic-sampling-max-rounds", "3"]) == ""
    msg = problems([*BASE, "--fully-async", *filt, "--over-sampling-batch-size", "8"])
    assert "--over-sampling-batch-size cannot be used with --fully-async" in msg and "drop it" in msg
    assert problems([*BASE, *filt, "--over-sampling-batch-size", "8"], "async") == ""     # the sync sampler's


def test_the_weight_check_and_ci_test_are_taken_with_fully_async(BASE):
    """Each engine records its checksums at its swap's token boundary (tests/unit/test_inflight_swap.py);
    only their own rules still apply (--debug-skip-weight-update keeps the engines on other weights)."""
    assert problems([*BASE, "--fully-async", "--check-weight-update-equal"]) == ""
    assert "cannot be used with --fully-async" not in problems([*BASE, "--fully-async", "--ci-test"])
    msg = problems([*BASE, "--fully-async", "--check-weight-update-equal", "--debug-skip-weight-update"])
    assert "--debug-skip-weight-update keeps the engines on the initial weights" in msg


def test_the_push_checks_each_engines_swap_checksums_against_the_trainers():
    """`check_swapped_weights` on what engines recorded at their swaps (the engines' side: test_inflight_swap)."""
    from miles.phases.fully_async import check_swapped_weights
    from miles.phases.weights import WeightSyncMismatch

    a, b, c = "a" * 64, "b" * 64, "c" * 64

    def rec(before_version, before, after, version=4):
        return {"version": version, "checksum": after, "before": {"version": before_version, "checksum": before}}

    names = ["engine-0", "engine-1"]
    given = {n: (3, a) for n in names}                 # what the last push (v3) gave each
    check_swapped_weights(names, 4, b, given, [rec(3, a, b), rec(3, a, b)])
    check_swapped_weights(names, 4, b, {}, [rec(0, c, b), rec(0, c, b)])         # the first push: nothing before
    # engine-0 took v4 in an attempt cut short by engine-1's restart: before its second swap it held v4
    check_swapped_weights(names, 4, b, given, [rec(4, b, b), rec(3, a, b)])
    # engine-1 was restarted since v3 (a new name): the restart reloaded its weights, checked after the swap only
    check_swapped_weights(["engine-0", "engine-1-r1"], 4, b, given, [rec(3, a, b), rec(3, c, b)])
    with pytest.raises(WeightSyncMismatch, match="^before the next update to v3: engine-1 holds weights with "
                                                 "checksum cccccccccccc, the trainer's v3 is aaaaaaaaaaaa$"):
        check_swapped_weights(names, 4, b, given, [rec(3, a, b), rec(3, c, b)])
    with pytest.raises(WeightSyncMismatch, match="^before the next update to v3: engine-0 holds weight version 2, "
                                                 "not 3$"):
        check_swapped_weights(names, 4, b, given, [rec(2, a, b), rec(3, a, b)])
    with pytest.raises(WeightSyncMismatch, match="^after the in-flight push of v4: engine-0 holds weights with "
                                                 "checksum cccccccccccc, the trainer's v4 is bbbbbbbbbbbb$"):
        check_swapped_weights(names, 4, b, given, [rec(3, a, c), rec(3, a, b)])


def test_engines_without_in_flight_swaps_are_refused_by_name(BASE):
    msg = problems([*BASE, "--fully-async", "--rollout-engine", "sglang"])
    assert "--fully-async with --rollout-engine sglang" in msg and "--rollout-engine embedded, fast" in msg
    assert "--fully-async with --rollout-engine fast" not in problems([*BASE, "--fully-async", "--rollout-engine",
                                                                       "fast"])


def test_miles_train_picks_the_fully_async_machine(BASE, monkeypatch):
    import miles.cli.train as cli

    seen = {}
    monkeypatch.setattr(cli, "run_with_signals", lambda cfg, machine, **kw: seen.setdefault("machine", machine) and 0)
    monkeypatch.setattr(cli, "_lock_run_folders", lambda *a: [])
    cli.main([*BASE, "--fully-async"], default_machine="async", prog="scripts/train_async.py")
    assert seen["machine"] == "fully_async"


def test_on_gpus_fully_async_runs_the_fast_engine(BASE):
    """The fast engine swaps in flight too, so a GPU run's `embedded` becomes it under --fully-async as
    without (the tiny Qwen2 is one the fast engine implements)."""
    from miles.rollout.engines.registry import engine_to_run

    cfg, _ = parse_flags([*BASE, "--fully-async"])
    assert engine_to_run(cfg, on_gpus=True) == ("fast", None)
    plain, _ = parse_flags(BASE)
    assert engine_to_run(plain, on_gpus=True) == ("fast", None)


def test_a_producer_drained_right_after_a_resume_says_the_loaded_checkpoint_still_holds_its_groups():
    async def go():
        ex, tr = FakeExecutor([0]), Events()
        p = producer(ex, tr, capacity=4, concurrent=2, engines=1)
        p.start()
        await p.take(1, step=3)
        for _ in range(10):
            await asyncio.sleep(0)
        state = json.loads(json.dumps(p.note(3)))
        await p.settle(saved_rollout=3)
        q = producer(FakeExecutor([4]), Events(), capacity=4, concurrent=2, engines=1)
        q.load_state_dict(state, step=3)
        await q.settle(saved_rollout=3)            # init failed after the load: nothing trained since
        drained = q._tracer.of("producer_drained")[-1]
        held = sorted({g["ticket"] for g in state["buffer"]} | {t for t, _, _ in state["regenerate"]})
        assert held and drained["checkpoint"] == 3 and drained["held_tickets"] == held
        assert drained["dropped_tickets"] == []

    asyncio.run(go())
