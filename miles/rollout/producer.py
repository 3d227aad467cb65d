"""--fully-async: a rollout producer that never stops, its bounded buffer of finished groups, and the
staleness bound (machines/fully_async.yaml; docs/fully-async.md).

The producer is a plain object on the driver, a disposer resource. It runs one loop per engine: each
loop draws prompts (the executor's iterator; the oldest prompts waiting to be generated again first),
asks the executor for one engine call of their groups (`--n-samples-per-prompt` samples each, scored),
and puts the finished groups into the buffer. It keeps at most `--async-max-concurrent-samples` samples
in flight (default: one rollout batch) and at most `--async-data-buffer-capacity-factor` x
`--rollout-batch-size` groups finished or in flight. The trainer's `rollout` phase takes the next
`--rollout-batch-size` groups, oldest first (`take`).

Every prompt drawn gets a ticket (a run-wide counter, kept in checkpoints): the identity by which the
trace shows that no group is trained twice and none is lost. A group's weight versions are every
version that produced a token of it (`metadata["weight_versions"]`; per token `metadata["token_versions"]`
when a swap happened mid-call); its staleness at step r is r minus the oldest. A group past
`--max-weight-staleness` when the trainer would take it is dropped or its prompt retried
(`--async-unused-samples-handler`), and counted.

Dynamic sampling (`--dynamic-sampling-filter-path`): the executor applies the user's filter to each group
as it scores it, as in the sync machine, and a group it rejects never enters the buffer: its prompt is
consumed (not generated again, as a rejected group's prompt in a sync rollout), its ticket is counted and
traced (`group_filtered`), and the producer goes on generating. So that a filter that rejects every group
cannot keep a step waiting for ever, once `--dynamic-sampling-max-rounds` x `--rollout-batch-size` groups
were rejected since the last step took its groups, the rejected ones fill the buffer instead (`group_filled`),
as the sync machine fills its batch with filtered-out groups after its last round.

Exactly once: `state_dict` is the position a checkpoint of step r holds, read right after r's groups
were taken: the iterator past every prompt drawn, the groups in the buffer, and the tickets still in
flight (their prompts are generated again on resume). So what a resumed run trains is what the saved
run had not trained, once.

This module stays light (no torch, no Ray): it also holds the config check that refuses an engine
without in-flight weight swaps.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Awaitable, Callable

from miles.config import RunConfig
from miles.config.checks import check
from miles.rollout.engines.registry import ENGINES
from miles.rollout.protocol import SupportsInFlightWeightSwap
from miles.types import Prompt, Sample, routing_as_lists

HANDLERS = ("drop", "retry")


@check
def _engine_swaps_in_flight(cfg: RunConfig, problems: list[str]) -> None:
    spec = ENGINES.get(cfg.rollout.engine)
    if cfg.fully_async and spec is not None and not spec.supports(SupportsInFlightWeightSwap):
        able = ", ".join(n for n, s in ENGINES.items() if s.supports(SupportsInFlightWeightSwap))
        problems.append(f"--fully-async with --rollout-engine {cfg.rollout.engine}: that engine cannot pause its "
                        "requests in flight at a token boundary for a weight swap (SupportsInFlightWeightSwap), "
                        f"which a fully-async push needs; use --rollout-engine {able}")


def capacity_groups(cfg: RunConfig) -> int:
    return max(cfg.rollout.batch_size, int(cfg.async_data_buffer_capacity_factor * cfg.rollout.batch_size))


def concurrent_groups(cfg: RunConfig) -> int:
    cap = cfg.async_max_concurrent_samples
    samples = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt if cap is None else cap
    return max(1, samples // cfg.rollout.n_samples_per_prompt)


@dataclass
class Group:
    """One prompt's samples, finished and scored, as the buffer holds them."""

    ticket: int
    samples: list[Sample]
    attempts: int = 1                     # 2+: generated again after a staleness retry or a resume
    filled: bool = False                  # rejected by the dynamic-sampling filter, let through to fill (see above)
    gen_s: float = 0.0                    # its share of its engine call's time (the call's / its groups)
    done_at: float = field(default_factory=time.monotonic)

    @property
    def versions(self) -> list[int]:
        return sorted({v for s in self.samples for v in s.metadata.get("weight_versions", [s.weight_version])})

    @property
    def oldest(self) -> int:
        return min(s.weight_version for s in self.samples)

    @property
    def mixed_tokens(self) -> int:
        """Tokens of its samples whose response was generated under more than one weight version."""
        return sum(s.response_length for s in self.samples if len(s.metadata.get("weight_versions", ())) > 1)

    @property
    def tokens(self) -> int:
        return sum(s.response_length for s in self.samples)


@dataclass
class Taken:
    """What `GroupBuffer.take` hands the trainer, and what it handled on the way."""

    groups: list[Group]
    staleness: list[int]
    dropped: list[Group]
    retried: list[Group]
    filtered: int = 0                     # groups the dynamic-sampling filter rejected since the previous take
    judged: int = 0                       # groups it judged since then (rejected, passed or filled)
    passed: int = 0                       # ... and passed
    filtered_total: int = 0               # rejected in all, when the take closed the window


class GroupBuffer:
    """The finished groups, oldest first, with the staleness bound applied when they are taken."""

    def __init__(self, capacity: int, bound: int | None, handler: str):
        assert handler in HANDLERS, handler
        self.capacity, self.bound, self.handler = capacity, bound, handler
        self.groups: deque[Group] = deque()

    def __len__(self) -> int:
        return len(self.groups)

    def put(self, group: Group) -> None:
        self.groups.append(group)

    def stale(self, group: Group, step: int) -> bool:
        return self.bound is not None and step - group.oldest > self.bound

    def take(self, want: int, step: int) -> Taken:
        """Up to `want` groups fit to train at step `step`, oldest first; the stale ones met on the way
        leave the buffer, dropped or to be retried (`handler`)."""
        out = Taken([], [], [], [])
        while self.groups and len(out.groups) < want:
            g = self.groups.popleft()
            if self.stale(g, step):
                (out.dropped if self.handler == "drop" else out.retried).append(g)
                continue
            out.groups.append(g)
            out.staleness.append(step - g.oldest)
        return out

    def give_back(self, groups: list[Group]) -> None:
        """Groups taken but not trained (the take was cut short): first in line again."""
        self.groups.extendleft(reversed(groups))


# the executor's side, as the producer calls it: (prompts to draw) -> (prompts, iterator state after);
# (engine index, prompt rows, seed, groups a tail cut left unfinished) -> (one group of samples per continued
# group, then per row, scored when finished; whether each passed the dynamic-sampling filter, all True
# without one)
Draw = Callable[[int], Awaitable[tuple[list[Prompt], dict[str, Any]]]]
Generate = Callable[[int, list[int], int, list[list[Sample]]], Awaitable[tuple[list[list[Sample]], list[bool]]]]


@dataclass
class Stats:
    """Counters since the run started and since the last step."""

    dropped: int = 0
    retried: int = 0
    filtered: int = 0                     # rejected by the dynamic-sampling filter (their prompts consumed)
    produced: int = 0
    busy_s: list[float] = field(default_factory=list)     # per engine loop, since the last `step_metrics`


class Producer:
    resource_name = "rollout_producer"

    def __init__(self, *, draw: Draw, generate: Generate, abort: Callable[[], Awaitable[None]], num_engines: int,
                 capacity: int, concurrent_groups: int, bound: int | None, handler: str, seed: int,
                 tracer: Any, version: Callable[[], int], dynamic_filter: str | None = None,
                 fill_after: int | None = None, tail_cut: bool = False):
        self._draw, self._generate, self._abort = draw, generate, abort
        # --dynamic-sampling-filter-path (for the reasons traced), and after how many groups rejected since
        # the last take the rejected ones fill instead (--dynamic-sampling-max-rounds x --rollout-batch-size)
        self._filter, self._fill_after = dynamic_filter, fill_after
        self._window_filtered = self._window_judged = self._window_passed = 0
        self.buffer = GroupBuffer(capacity, bound, handler)
        self._num_engines, self._per_call = num_engines, max(1, concurrent_groups // num_engines)
        self._seed, self._tracer, self._version = seed, tracer, version
        self.next_ticket = 0
        self.iterator_state: dict[str, Any] | None = None
        self.retry: deque[tuple[int, int, int]] = deque()     # (ticket, prompt row, attempts so far) to generate again
        self.in_flight: dict[int, tuple[int, int, int]] = {}  # ticket -> (prompt row, attempts, engine)
        # --async-tail-cut-share: groups an engine call returned unfinished (its tail cut), to continue in a
        # next call: ticket -> (prompt row, attempts, samples so far, engine seconds so far); in flight too
        self._tail_cut = tail_cut
        self.partial: dict[int, tuple[int, int, list[Sample], float]] = {}
        self.stats = Stats(busy_s=[0.0] * num_engines)
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._paused = False
        self._since = time.monotonic()
        self.failure: BaseException | None = None
        self._snapshots: dict[int, dict[str, Any]] = {}     # step -> the position `note` gave for it

    # -- the loops ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._stopping = False
        self._since = time.monotonic()
        self.stats.busy_s = [0.0] * self._num_engines
        self._tasks = [asyncio.ensure_future(self._loop(i)) for i in range(self._num_engines)]
        self._tracer.emit("producer_start", engines=self._num_engines, capacity=self.buffer.capacity,
                          per_call_groups=self._per_call, bound=self.buffer.bound, handler=self.buffer.handler,
                          dynamic_filter=self._filter, fill_after=self._fill_after,
                          next_ticket=self.next_ticket, buffered=len(self.buffer), retry=len(self.retry))

    @property
    def running(self) -> bool:
        return any(not t.done() for t in self._tasks)

    def _room(self) -> int:
        return self.buffer.capacity - len(self.buffer) - len(self.in_flight)

    async def _loop(self, engine: int) -> None:
        try:
            while not self._stopping:
                # a cut tail takes no new room (its group is in flight already): it goes on even when full
                if self._paused or (self._room() <= 0 and not self.partial):
                    self._changed.clear()
                    await self._changed.wait()
                    continue
                await self._one_call(engine, min(self._per_call, max(self._room(), 0) + len(self.partial)))
                self._changed.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:          # noqa: BLE001 - the rollout phase raises it
            self.failure = exc
            self._tracer.emit("producer_failed", engine=engine, error=exc)
            self._changed.set()

    async def _one_call(self, engine: int, k: int) -> None:
        work: list[tuple[int, int, int]] = []
        held = {t: self.partial.pop(t) for t in list(self.partial)[:k]}   # cut tails first, oldest first
        going_on = {t: (samples, gen_s) for t, (_, _, samples, gen_s) in held.items()}  # ticket -> samples, seconds
        work += [(t, row, attempts) for t, (row, attempts, _, _) in held.items()]
        while self.retry and len(work) < k:
            ticket, row, attempts = self.retry.popleft()
            work.append((ticket, row, attempts + 1))
        if len(work) < k:
            try:
                prompts, state = await self._draw(k - len(work))
            except BaseException:
                self.partial.update(held)       # not submitted: they wait for the next call
                raise
            for p in prompts:
                work.append((self.next_ticket, p.index, 1))
                self.next_ticket += 1
            self.iterator_state = state
        for ticket, row, attempts in work:
            self.in_flight[ticket] = (row, attempts, engine)
        tickets = [t for t, _, _ in work]
        version = self._version()
        seq = self._tracer.emit("producer_submit", engine=engine, tickets=tickets, weight_version=version,
                                **({"continued": list(going_on)} if going_on else {}))
        t0 = time.monotonic()
        try:
            # the continued groups first (the executor answers them first), then the fresh and retried rows
            groups, kept = await self._generate(engine, [row for t, row, _ in work if t not in going_on],
                                                self._seed + tickets[0], [going_on[t][0] for t in going_on])
            order = [w for w in work if w[0] in going_on] + [w for w in work if w[0] not in going_on]
        except BaseException:
            # what did not finish goes back to be generated again (an engine restart, a drain)
            self.retry.extendleft(reversed([(t, row, a - 1) for t, row, a in work if self.in_flight.pop(t, None)]))
            raise
        finally:
            self.stats.busy_s[engine] += time.monotonic() - t0
        cut: list[tuple[int, int, int]] = []
        tails: list[int] = []
        filtered: list[int] = []
        share = (time.monotonic() - t0) / len(work)
        for (ticket, row, attempts), samples, ok in zip(order, groups, kept, strict=True):
            gen_s = share + going_on.get(ticket, ((), 0.0))[1]
            if any(s.finish_reason == "abort" for s in samples):
                if self._tail_cut and not self._stopping:    # its tail cut: continued by a next call
                    self.partial[ticket] = (row, attempts, samples, gen_s)
                    tails.append(ticket)
                    continue
                self.in_flight.pop(ticket, None)          # an abort cut it (a drain): generated again later
                cut.append((ticket, row, attempts - 1))
                continue
            self.in_flight.pop(ticket, None)
            group = Group(ticket, samples, attempts, gen_s=gen_s)
            if self._filter is not None and not self._judge(group, ok, engine, seq):
                filtered.append(ticket)
                continue
            self.buffer.put(group)
            self.stats.produced += 1
        if cut:
            self.retry.extendleft(reversed(cut))
            self._tracer.emit("producer_cut", engine=engine, tickets=[t for t, _, _ in cut], cause=seq, reason="aborted mid-generation: its prompt "
                              "is generated again (a checkpoint lists it to regenerate)")
        if tails:
            self._tracer.emit("producer_tail_cut", engine=engine, tickets=tails, cause=seq, reason="the call "
                              "returned once few of its samples were left running (--async-tail-cut-share): "
                              "their groups go on in a next call, from prompt + response so far")
        self._tracer.emit("producer_groups", engine=engine, tickets=tickets, cause=seq, filtered=filtered,
                          duration_s=round(time.monotonic() - t0, 6),
                          versions=sorted({v for s in (s for g in groups for s in g)
                                           for v in s.metadata.get("weight_versions", [s.weight_version])}),
                          buffered=len(self.buffer))

    def _judge(self, group: Group, passed: bool, engine: int, cause: int) -> bool:
        """The dynamic-sampling filter's verdict on a finished group: True, it goes into the buffer (passed,
        or filling: see the module docstring); False, rejected: counted, traced, its prompt consumed."""
        self._window_judged += 1
        if passed:
            self._window_passed += 1
            return True
        rewards = [s.reward for s in group.samples]
        if self._fill_after is not None and self._window_filtered >= self._fill_after:
            group.filled = True
            self._tracer.emit("group_filled", ticket=group.ticket, engine=engine, cause=cause, rewards=rewards,
                              reason=f"--dynamic-sampling-filter-path {self._filter} rejected it, but "
                              f"{self._window_filtered} groups were rejected since the last step took its groups "
                              f"(--dynamic-sampling-max-rounds x --rollout-batch-size = {self._fill_after}): "
                              "it fills the buffer, as filtered-out groups fill a sync rollout after its last round")
            return True
        self._window_filtered += 1
        self.stats.filtered += 1
        self._tracer.emit("group_filtered", ticket=group.ticket, engine=engine, cause=cause, rewards=rewards,
                          oldest_version=group.oldest,
                          reason=f"--dynamic-sampling-filter-path {self._filter} rejected it: its prompt is "
                          "consumed (not generated again), as in a sync rollout's dynamic sampling")
        return False

    # -- the trainer's side -------------------------------------------------------------------------
    async def take(self, want: int, step: int) -> Taken:
        """The next `want` groups fit for step `step` (waits for the producer); stale ones are handled on
        the way and traced (`group_dropped` / `group_retried`, with the reason)."""
        got = Taken([], [], [], [])
        try:
            await self._take_into(got, want, step)
        except BaseException:
            self.buffer.give_back(got.groups)       # cut short (a stop, a failure): nothing taken is lost
            raise
        # the dynamic-sampling filter's window closes with the take: rejected groups are dropped again
        got.filtered, got.judged, got.passed = self._window_filtered, self._window_judged, self._window_passed
        got.filtered_total = self.stats.filtered
        self._window_filtered = self._window_judged = self._window_passed = 0
        return got

    async def _take_into(self, got: Taken, want: int, step: int) -> None:
        while len(got.groups) < want:
            if self.failure is not None:
                raise self.failure
            part = self.buffer.take(want - len(got.groups), step)
            got.groups += part.groups
            got.staleness += part.staleness
            for g in part.dropped:
                self.stats.dropped += 1
                got.dropped.append(g)
                self._tracer.emit("group_dropped", ticket=g.ticket, step=step, oldest_version=g.oldest,
                                  reason=f"staleness {step - g.oldest} > --max-weight-staleness {self.buffer.bound}")
            for g in part.retried:
                self.stats.retried += 1
                got.retried.append(g)
                self.retry.append((g.ticket, g.samples[0].prompt.index, g.attempts))
                self._tracer.emit("group_retried", ticket=g.ticket, step=step, oldest_version=g.oldest,
                                  reason=f"staleness {step - g.oldest} > --max-weight-staleness {self.buffer.bound}")
            if part.dropped or part.retried or part.groups:
                self._changed.set()              # room for the producer
            if len(got.groups) < want:
                if not self.running and self.failure is None:
                    raise RuntimeError("the rollout producer is not running")
                self._changed.clear()
                await self._changed.wait()

    def step_metrics(self, taken: Taken, step_wall_s: float) -> dict[str, float]:
        """The step's fully-async metrics (fa/...); resets the per-step engine busy time."""
        now = time.monotonic()
        wall = max(now - self._since, 1e-9)
        self._since = now
        idle = [max(0.0, 1.0 - b / wall) for b in self.stats.busy_s]
        self.stats.busy_s = [0.0] * self._num_engines
        st = taken.staleness or [0]
        return {"fa/staleness_min": float(min(st)), "fa/staleness_mean": sum(st) / len(st),
                "fa/staleness_max": float(max(st)), "fa/buffer_fill": len(self.buffer) / self.buffer.capacity,
                "fa/buffer_groups": float(len(self.buffer)), "fa/in_flight_groups": float(len(self.in_flight)),
                "fa/engine_idle_fraction": sum(idle) / len(idle),
                "fa/groups_dropped": float(len(taken.dropped)), "fa/groups_retried": float(len(taken.retried)),
                "fa/groups_dropped_total": float(self.stats.dropped),
                "fa/groups_retried_total": float(self.stats.retried),
                "fa/mixed_version_tokens": float(sum(g.mixed_tokens for g in taken.groups)),
                "fa/trained_tokens": float(sum(g.tokens for g in taken.groups)), **self._filter_metrics(taken)}

    def _filter_metrics(self, taken: Taken) -> dict[str, float]:
        """--dynamic-sampling-filter-path: the groups it rejected since the previous step (their prompts
        consumed) and in all, the share it passed, and the step's groups that filled in for rejected ones."""
        if self._filter is None:
            return {}
        out = {"fa/groups_filtered": float(taken.filtered), "fa/groups_filtered_total": float(taken.filtered_total),
               "fa/dynamic_sampling_filled_groups": float(sum(g.filled for g in taken.groups))}
        if taken.judged:
            out["fa/dynamic_sampling_pass_ratio"] = taken.passed / taken.judged
        return out

    # -- pause (evals on the shared engines), stop ----------------------------------------------------
    async def pause(self) -> None:
        """No new engine calls; the running ones finish. `resume` lets the loops go on."""
        self._paused = True
        while len(self.in_flight) > len(self.partial) and self.running:     # calls running (a cut tail waits)
            self._changed.clear()
            await self._changed.wait()
        self._tracer.emit("producer_paused", buffered=len(self.buffer))

    def resume(self) -> None:
        self._paused = False
        self._changed.set()
        self._tracer.emit("producer_resumed", buffered=len(self.buffer))

    async def settle(self, *, saved_rollout: int | None, final: bool = True) -> None:
        """`draining`: stop the loops, abort the engine calls running (none is left running), and say what
        becomes of the groups buffered and in flight: held by the checkpoint of `saved_rollout` (its
        position lists them), or dropped. Not `final` (an engine restart): the loops stop the same way,
        their groups stay (buffered, or to generate again), and `start` goes on."""
        if self._stopping and not self._tasks:
            return
        self._stopping = True
        self._changed.set()
        in_flight = sorted(self.in_flight)
        if self.running:
            try:
                await self._abort()
            except Exception as exc:          # noqa: BLE001 - a dead engine: its call fails on its own
                self._tracer.emit("producer_abort_failed", error=exc)
            done, pending = await asyncio.wait(self._tasks, timeout=30)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending)
        for t in self._tasks:
            if t.done() and not t.cancelled():
                t.exception()                  # retrieved: the loop traced its own failure
        self._tasks = []
        buffered = [g.ticket for g in self.buffer.groups]
        if not final:
            self._tracer.emit("producer_stopped", buffered_tickets=buffered, in_flight_tickets=in_flight,
                              retry_tickets=[t for t, _, _ in self.retry], reason="an engine restart")
            return
        unused = sorted({*buffered, *in_flight, *(t for t, _, _ in self.retry)})
        snap = self._snapshots.get(saved_rollout) if saved_rollout is not None else None
        if snap is None:
            fate = {"dropped_tickets": unused, "why": "no checkpoint holds them"}
        else:
            held = sorted({g["ticket"] for g in snap["buffer"]} | {t for t, _, _ in snap["regenerate"]})
            fate = {"checkpoint": saved_rollout, "held_tickets": held,       # buffered or to regenerate in it
                    "redrawn_from": snap["next_ticket"],     # tickets from here are drawn again from its data position
                    "dropped_tickets": []}
        self._tracer.emit("producer_drained", buffered_tickets=buffered, in_flight_tickets=in_flight,
                          retry_tickets=[t for t, _, _ in self.retry], next_ticket=self.next_ticket,
                          dropped_total=self.stats.dropped, retried_total=self.stats.retried,
                          filtered_total=self.stats.filtered, **fate)

    async def dispose(self) -> None:
        await self.settle(saved_rollout=None)

    async def force(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()

    # -- checkpoint ---------------------------------------------------------------------------------
    def note(self, step: int) -> dict[str, Any]:
        """`state_dict` as the position of step `step` (just taken); kept to account for the groups at a drain."""
        state = self.state_dict()
        self._snapshots[step] = state
        for old in [k for k in self._snapshots if k < step - 1]:
            del self._snapshots[old]
        return state

    def state_dict(self) -> dict[str, Any]:
        """JSON-able: what a checkpoint of the step just taken holds (see the module docstring)."""
        return {"next_ticket": self.next_ticket,
                "buffer": [{"ticket": g.ticket, "attempts": g.attempts, "filled": g.filled,
                            "samples": [_sample_state(s) for s in g.samples]} for g in self.buffer.groups],
                "regenerate": [[t, row, a] for t, row, a in self.retry]
                + [[t, row, a] for t, (row, a, _) in sorted(self.in_flight.items())],
                "dropped_total": self.stats.dropped, "retried_total": self.stats.retried,
                "filtered_total": self.stats.filtered}

    def load_state_dict(self, state: dict[str, Any], step: int | None = None) -> None:
        """Restore the position of a checkpoint (of step `step`: a drain before any new step says its
        groups are still held by that checkpoint)."""
        if step is not None:
            self._snapshots[step] = state
        self.next_ticket = int(state["next_ticket"])
        self.buffer.groups = deque(Group(int(g["ticket"]), [_sample_from(s) for s in g["samples"]], int(g["attempts"]),
                                         filled=bool(g.get("filled", False))) for g in state["buffer"])
        self.retry = deque((int(t), int(row), int(a)) for t, row, a in state["regenerate"])
        self.stats.dropped, self.stats.retried = int(state["dropped_total"]), int(state["retried_total"])
        self.stats.filtered = int(state.get("filtered_total", 0))      # checkpoints before dynamic sampling here
        self._tracer.emit("producer_restored", next_ticket=self.next_ticket,
                          buffered_tickets=[g.ticket for g in self.buffer.groups],
                          regenerate_tickets=[t for t, _, _ in self.retry])


def _sample_state(s: Sample) -> dict[str, Any]:
    # the fast engine's routing arrays as JSON lists
    out = asdict(replace(s, rollout_routed_experts=routing_as_lists(s.rollout_routed_experts)))
    out["prompt"]["prompt_ids"] = list(s.prompt.prompt_ids)
    return out


def _sample_from(d: dict[str, Any]) -> Sample:
    p = dict(d["prompt"])
    p["prompt_ids"] = tuple(p["prompt_ids"])
    return Sample(**{**d, "prompt": Prompt(**p)})
