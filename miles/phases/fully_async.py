"""The fully-async machine's handlers (machines/fully_async.yaml, --fully-async; docs/fully-async.md).

- `init` is the sync composition root, then the rollout producer (miles/rollout/producer.py),
  registered with the disposer after the executor and the engines (so it stops before they go), and
  restored from the checkpoint's position when the run resumes. It starts at the first weight push.
- `weight_sync` pushes the trainer's weights to every engine WITHOUT waiting for the requests in flight:
  each engine pauses them at a token boundary, swaps, and lets them go on (`swap_weights`); the trace
  records the push and what each engine paused (`weights_pushed`). With --check-weight-update-equal
  (or --ci-test) each engine records, at the token boundary of its swap, the checksums of the weights it
  held before and after the load; they are compared with the trainer's (`check_swapped_weights`: a
  mismatch fails the run with the sync machines' WeightSyncMismatch), never waiting for a request.
- `rollout` takes the next --rollout-batch-size groups from the buffer (the staleness bound applied,
  `group_dropped` / `group_retried` traced; a dynamic-sampling filter's rejects never entered it,
  `group_filtered`), has the executor assemble them into the step's batch, and
  records the data position right after: the iterator, the buffer, the tickets in flight.
- `train` is the common one, timed for the trainer's idle fraction; `eval` pauses the producer (its
  calls in flight finish), evaluates the version the engines hold, named in the row, and resumes it.
- `draining` stops the producer first (`ctx.in_flight`): its engine calls are aborted, none is left
  running, and the trace says whether the buffered and in-flight groups are in a checkpoint or dropped.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from miles.config import ConfigError
from miles.phases import init as sync_init
from miles.phases import train as train_phase
from miles.phases.context import TrainingContext
from miles.rollout.supervision import dead_engines, restart_engine, restart_unresponsive, with_engine_restarts
from miles.phases.eval import evaluate as sync_evaluate
from miles.phases.weights import WeightSyncMismatch, expected_checksum, engine_problems, given_problems
from miles.rollout.executor import PROMPTS_KEY
from miles.rollout.producer import Producer, Taken, capacity_groups, concurrent_groups
from miles.rollout.protocol import EngineUnresponsive, SupportsInFlightWeightSwap

PRODUCER_KEY = "fully_async"        # the producer's part of a checkpoint's data position


async def init(ctx: TrainingContext) -> str:
    ctx.overlapped = True             # rollouts generate while the trainer trains
    trigger = await sync_init.init(ctx)
    spec = ctx.backends.engine_spec
    if not spec.supports(SupportsInFlightWeightSwap):
        raise ConfigError(f"--fully-async: the engine this run picked ({ctx.backends.engine_name}, "
                          f"{ctx.backends.engine.__name__}) cannot pause its requests in flight for a weight swap "
                          "(SupportsInFlightWeightSwap); use --rollout-engine embedded or fast")
    cfg, executor = ctx.cfg, ctx.c.executor.handle
    producer = Producer(
        draw=lambda k: executor.draw_prompts.remote(k),
        generate=lambda i, rows, seed, going_on: executor.generate_groups.remote(
            i, rows, seed, going_on, cfg.async_tail_cut_share),
        abort=lambda: executor.abort_engines.remote(), num_engines=len(ctx.c.engines),
        capacity=capacity_groups(cfg), concurrent_groups=concurrent_groups(cfg), bound=cfg.max_weight_staleness,
        handler=cfg.async_unused_samples_handler, seed=cfg.rollout_seed * 1_000_003, tracer=ctx.tracer,
        version=lambda: ctx.weight_version, dynamic_filter=cfg.rollout.dynamic_sampling_filter_path,
        fill_after=cfg.rollout.dynamic_sampling_max_rounds * cfg.rollout.batch_size,
        tail_cut=cfg.async_tail_cut_share > 0)
    state = await executor.fully_async_state.remote() if ctx.resumed else None
    if state is not None:
        producer.load_state_dict(state, step=ctx.start_rollout - 1)
    ctx.c.producer = producer
    ctx.disposer.add(producer, timeout=cfg.trace.teardown_timeout_s, force=producer.force)
    ctx.in_flight.insert(0, _drain_producer)
    ctx.fa_trainer_busy_s = 0.0
    ctx.fa_step_t0 = time.monotonic()
    return trigger


async def sync_weights(ctx: TrainingContext) -> str:
    """Push the trainer's weights to every engine; requests in flight pause at a token boundary, not wait."""
    t0, version = time.monotonic(), ctx.next_rollout
    producer: Producer = ctx.c.producer
    in_flight = sorted(producer.in_flight)

    check = ctx.cfg.check_weights

    async def push() -> list[dict[str, Any]]:
        weights = ctx.c.trainer.handle.weights.remote()
        return await asyncio.gather(*(e.handle.swap_weights.remote(weights, version, check) for e in ctx.c.engines))

    swaps = await with_engine_restarts(ctx, push)
    engines, names = ctx.c.engines, [e.resource_name for e in ctx.c.engines]
    held = await asyncio.gather(*(e.handle.weight_version.remote() for e in engines))
    bad = engine_problems(names, version, None, [(v, None) for v in held])
    if bad:
        raise WeightSyncMismatch(f"after the in-flight push of v{version}: " + "; ".join(bad))
    expected = None
    if check:       # what each engine recorded at its swap's token boundary, against the trainer's checksums
        expected = await expected_checksum(ctx)
        recorded = await asyncio.gather(*(e.handle.swapped_weights_checksum.remote(version) for e in engines))
        check_swapped_weights(names, version, expected, ctx.engine_weights, recorded)
        ctx.engine_weights = {n: (version, expected) for n in names}
    ctx.weight_version, ctx.weights_pushed = version, True
    fields = {"checksum": expected} if expected is not None else {}
    ctx.tracer.emit("weights_pushed", version=version, duration_s=round(time.monotonic() - t0, 6),
                    transport="object_store", in_flight_tickets=in_flight,
                    engines={e.resource_name: s for e, s in zip(engines, swaps)}, **fields)
    for e, s in zip(ctx.c.engines, swaps):
        if s["paused_requests"]:
            ctx.tracer.emit("requests_paused", engine=e.resource_name, requests=s["paused_requests"],
                            version=version, waited_s=s["waited_s"])
            ctx.tracer.emit("requests_resumed", engine=e.resource_name, requests=s["paused_requests"],
                            version=version)
    if not producer.running and not ctx.stop_requested.is_set():
        producer.start()
        ctx.fa_trainer_busy_s, ctx.fa_step_t0 = 0.0, time.monotonic()    # the idle fractions count from here
    return "next"


def check_swapped_weights(names: list[str], version: int, expected: str, given: dict[str, tuple[int, str]],
                          recorded: list[dict[str, Any]]) -> None:
    """--check-weight-update-equal under the producer: each engine's checksums, recorded at the token
    boundary where it took v`version` (`swapped_weights_checksum`), against the trainer's. What it held
    just before the swap against what the last push gave it (`given`: engine name -> that version and the
    trainer's checksum of it; a corruption between two pushes), then what it loaded against `expected`;
    the sync machines' read-back lines (`engine_problems`), raised as their WeightSyncMismatch. An engine
    restarted since is in `given` with what its restart loaded (the trainer's weights then, under their own
    version); one restarted before any checked push is not, and is compared after the swap only; one that
    already took v`version` in an attempt of this push cut short by another engine's restart held
    v`version` before its second swap: that is compared with `expected`."""
    before = []
    for name, r in zip(names, recorded):
        held = (r["before"]["version"], r["before"]["checksum"])
        if held[0] == version:
            before.append((name, (version, expected), held))
        elif name in given:
            before.append((name, given[name], held))
    bad = given_problems(before)
    if bad:
        prev = min(v for _, (v, _), _ in before)
        raise WeightSyncMismatch(f"before the next update to v{prev}: " + "; ".join(bad))
    bad = engine_problems(names, version, expected, [(r["version"], r["checksum"]) for r in recorded])
    if bad:
        raise WeightSyncMismatch(f"after the in-flight push of v{version}: " + "; ".join(bad))


async def rollout(ctx: TrainingContext) -> str:
    """Take the next --rollout-batch-size groups from the buffer and make them step r's batch."""
    r, producer = ctx.next_rollout, ctx.c.producer
    if not producer.running and not ctx.stop_requested.is_set():
        producer.start()
    t0 = time.monotonic()
    taken = await _take(ctx, r)
    waited = time.monotonic() - t0
    samples_ref, metrics = ctx.c.executor.handle.assemble_split.options(num_returns=2).remote(
        r, [g.samples for g in taken.groups], sum(g.gen_s for g in taken.groups))
    metrics = dict(await metrics)
    prompts = metrics.pop(PROMPTS_KEY, None)
    ctx.rollout_id, ctx.batch_ref = r, samples_ref
    ctx.last_metrics = {}
    now = time.monotonic()
    wall = max(now - ctx.fa_step_t0, 1e-9)
    fa = producer.step_metrics(taken, wall)
    fa["fa/trainer_idle_fraction"] = max(0.0, 1.0 - ctx.fa_trainer_busy_s / wall)
    ctx.fa_trainer_busy_s, ctx.fa_step_t0 = 0.0, now
    tickets = [g.ticket for g in taken.groups]
    ctx.record(r, {**metrics, **fa, "rollout_wait_s": waited, "staleness_max": fa["fa/staleness_max"]})
    ctx.tracer.emit("rollout_done", rollout_id=r, reward_mean=metrics["reward_mean"],
                    samples=int(metrics["num_samples"]), staleness_max=fa["fa/staleness_max"],
                    waited_s=round(waited, 6), prompts=prompts)
    ctx.tracer.emit("groups_taken", rollout_id=r, tickets=tickets, staleness=taken.staleness,
                    attempts=[g.attempts for g in taken.groups], dropped=[g.ticket for g in taken.dropped],
                    retried=[g.ticket for g in taken.retried], buffered=len(producer.buffer),
                    in_flight=sorted(producer.in_flight))
    # the position a checkpoint of step r holds: the iterator past every prompt drawn, the groups still
    # buffered, the tickets in flight (generated again on resume); r's own groups are out of it
    ctx.note_data_position(r, {"iterator": producer.iterator_state, PRODUCER_KEY: producer.note(r)})
    return "next"


async def _take(ctx: TrainingContext, r: int) -> Taken:
    """The producer's groups; an engine that died or hung under it is restarted (within the budget), the
    prompts it held are generated again, and the producer goes on."""
    producer: Producer = ctx.c.producer
    idle_retries = 0
    while True:
        try:
            return await producer.take(ctx.cfg.rollout.batch_size, r)
        except (ray.exceptions.RayActorError, EngineUnresponsive) as exc:
            ctx.tracer.emit("producer_retry", rollout_id=r, error={"type": type(exc).__name__, "message": str(exc)[:500]})
            await producer.settle(saved_rollout=None, final=False)
            producer.failure = None
            if isinstance(exc, EngineUnresponsive):
                if not await restart_unresponsive(ctx, exc):
                    raise
            else:
                dead = await dead_engines(ctx)
                for i in dead:
                    await restart_engine(ctx, i, cause=exc)
                # none dead now: the engine under the failed call was restarted since (by a weight push or
                # an eval); a failure again with every engine alive is not an engine's death
                idle_retries = 0 if dead else idle_retries + 1
                if idle_retries > 1:
                    raise
            producer.start()


async def train(ctx: TrainingContext) -> str:
    t0 = time.monotonic()
    try:
        return await train_phase.train(ctx)
    finally:
        ctx.fa_trainer_busy_s += time.monotonic() - t0


async def evaluate(ctx: TrainingContext) -> str:
    """Evals on the engines the producer shares: it pauses (its calls in flight finish), the eval runs on
    the version the engines hold (named in the row and the trace), and it resumes."""
    producer: Producer = ctx.c.producer
    running = producer.running
    if running:
        await producer.pause()
    try:
        ctx.tracer.emit("eval_on_version", version=ctx.weight_version, rollout_id=ctx.next_rollout)
        return await sync_evaluate(ctx)
    finally:
        if running:
            producer.resume()


async def _drain_producer(ctx: TrainingContext) -> None:
    """`draining`: no engine call left running; the groups buffered and in flight are in the checkpoint
    of the last trained step when one is (or will be: a stop's save writes that step's position), else
    they are counted as dropped in the trace."""
    last = ctx.next_rollout - 1
    will_save = ctx.stop_requested.is_set() and ctx.failure is None and ctx.cfg.checkpoint.saves
    in_checkpoint = (ctx.saved_rollout == last or will_save) and last >= ctx.start_rollout
    loaded = ctx.resumed and last == ctx.start_rollout - 1        # nothing trained since the --load
    held = last if in_checkpoint or loaded else None
    await ctx.c.producer.settle(saved_rollout=held)
