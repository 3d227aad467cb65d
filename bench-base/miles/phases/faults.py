"""Fault injection (`--inject-fault STATE:KIND[:VISIT]`): the fault matrix's lever, and a user's
way to rehearse a failure before it happens on a real cluster (miles: --ci-ft-test-actions).

A fault fires when STATE's phase starts on its VISIT-th visit (default 1); in `init`, and for
`corrupt_weights`, it fires when the phase ends (nothing exists to break before; weights pushed
by the phase would overwrite the corruption). Kinds:

    raise           the phase raises InjectedFault
    kill_engine     SIGKILL engine-0's worker process (the run restarts it, within its budget)
    kill_trainer    SIGKILL the trainer's worker process (unrecoverable: the run fails)
    kill_trainer_rank  SIGKILL the last rank's process of a trainer on several ranks (the others may
                    wait for it in a collective: the run fails, and the ranks are killed at teardown)
    kill_critic_rank  the same for PPO's critic on several ranks (its ranks: `critic-rank-<r>`)
    sigint/sigterm  the driver sends itself the signal (the CLI drains, then exits 130/143)
    teardown_raise  register a teardown that raises
    teardown_hang   register a teardown that hangs past a 0.2 s timeout, with no force
    hang            the phase hangs (a stuck collective, say) until cancelled or killed
    hang_thread     the phase waits on a thread that never returns (cancelling the wait leaves the thread)
    hang_ray        the phase waits on a Ray call that never returns: the executor actor blocks in it
                    (its event loop too, so its teardown must be forced)
    hang_trainer    the phase waits on a trainer call that never returns (a stuck training step: the
                    trainer's thread blocks in it, so its teardown must be forced)
    hang_blocking   the phase blocks the driver's event loop (time.sleep): only the CLI's hard deadline
                    (--stop-timeout after a signal) ends it
    corrupt_weights engine-0 gets the trainer's weights with one value changed, stamped with the
                    version it holds (a corruption after a sync; --check-weight-update-equal finds it)
    hang_engine     SIGSTOP engine-0's worker process: alive but answering nothing (a hung engine);
                    the health probe or the generate timeout finds it, and the run restarts it
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from miles.config import ConfigError, RunConfig
from miles.config.checks import check
from miles.runtime.machine import STATES
from miles.runtime.procs import pid_running
from miles.runtime.threads import in_daemon_thread

FAULT_KINDS = ("raise", "kill_engine", "kill_trainer", "kill_trainer_rank", "kill_critic_rank", "sigint", "sigterm", "teardown_raise", "teardown_hang",
               "hang", "hang_thread", "hang_ray", "hang_trainer", "hang_blocking", "corrupt_weights", "hang_engine")
AFTER_PHASE = ("corrupt_weights",)     # kinds that fire when the phase ends (in init, every kind does)
TEARDOWN_HANG_TIMEOUT_S = 0.2          # the hang is the point, not its length: each one costs a run this much


class InjectedFault(RuntimeError):
    """The failure --inject-fault asked for."""


@dataclass(frozen=True)
class FaultSpec:
    state: str
    kind: str
    visit: int = 1


def parse_fault(text: str) -> FaultSpec:
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[0] not in STATES or parts[1] not in FAULT_KINDS \
            or (len(parts) == 3 and not parts[2].isdigit()):
        raise ConfigError(f"--inject-fault {text}: expected STATE:KIND[:VISIT] with STATE one of "
                          f"{', '.join(STATES)} and KIND one of {', '.join(FAULT_KINDS)}")
    return FaultSpec(parts[0], parts[1], int(parts[2]) if len(parts) == 3 else 1)


def with_faults(handlers: dict[str, Callable[..., Any]], faults: list[FaultSpec]) -> dict[str, Callable[..., Any]]:
    """Wrap the handlers of the states that have faults; the others are left as they are."""
    out = dict(handlers)
    for state in {f.state for f in faults}:
        if state in out:
            out[state] = _wrap(out[state], [f for f in faults if f.state == state])
    return out


def _wrap(handler: Callable[..., Any], faults: list[FaultSpec]) -> Callable[..., Any]:
    visits = 0

    async def phase(ctx: Any) -> str:
        nonlocal visits
        visits += 1
        due = [f for f in faults if f.visit == visits]
        after = [f for f in due if ctx.state == "init" or f.kind in AFTER_PHASE]
        for f in due:
            if f not in after:
                await _fire(ctx, f)
        trigger = await handler(ctx)
        for f in after:
            await _fire(ctx, f)
        return trigger

    return phase


async def _fire(ctx: Any, f: FaultSpec) -> None:
    ctx.tracer.emit("fault_injected", state=f.state, kind=f.kind, visit=f.visit)
    if f.kind == "raise":
        raise InjectedFault(f"injected fault in {f.state} (visit {f.visit})")
    if f.kind in ("kill_engine", "kill_trainer"):
        actor = ctx.c.engines[0] if f.kind == "kill_engine" else ctx.c.trainer
        if actor.pid is None or not pid_running(actor.pid):
            ctx.tracer.emit("fault_skipped", state=f.state, kind=f.kind, reason="the actor is dead already")
            return
        os.kill(actor.pid, signal.SIGKILL)
        await asyncio.sleep(0.5)       # let Ray notice before the phase uses the actor
    elif f.kind in ("kill_trainer_rank", "kill_critic_rank"):
        await _kill_last_rank(ctx, f, "trainer" if f.kind == "kill_trainer_rank" else "critic")
    elif f.kind == "hang_engine":
        engine = ctx.c.engines[0]
        if engine.pid is None or not pid_running(engine.pid):
            ctx.tracer.emit("fault_skipped", state=f.state, kind=f.kind, reason="the engine is dead already")
            return
        os.kill(engine.pid, signal.SIGSTOP)
    elif f.kind in ("sigint", "sigterm"):
        os.kill(os.getpid(), signal.SIGINT if f.kind == "sigint" else signal.SIGTERM)
        await asyncio.sleep(0.05)      # the loop runs the handler before the phase goes on
    elif f.kind == "teardown_raise":
        ctx.disposer.add(_raise_on_teardown, name="injected_teardown_raise")
    elif f.kind == "teardown_hang":
        ctx.disposer.add(_hang_on_teardown, name="injected_teardown_hang", timeout=TEARDOWN_HANG_TIMEOUT_S)
    elif f.kind == "hang":
        await asyncio.sleep(1e9)
    elif f.kind == "hang_thread":
        await in_daemon_thread(threading.Event().wait, name="miles-injected-hang")
    elif f.kind == "hang_ray":
        await ctx.c.executor.handle.__ray_call__.remote(_block_forever)
    elif f.kind == "hang_trainer":
        await ctx.c.trainer.handle.__ray_call__.remote(_block_forever)
    elif f.kind == "hang_blocking":
        time.sleep(1e9)                # noqa: ASYNC251 - the point: nothing else on the loop runs
    elif f.kind == "corrupt_weights":
        engine = ctx.c.engines[0]
        corrupted = ctx.c.trainer.handle.__ray_call__.remote(_perturbed_weights)   # stays in the object store
        await engine.handle.update_weights.remote(corrupted, await engine.handle.weight_version.remote())


async def _kill_last_rank(ctx: Any, f: FaultSpec, role: str) -> None:
    """SIGKILL the highest rank's process of the `role` ("trainer" or "critic"); the trace names every
    rank's pid (`trainer_rank_pids` / `critic_rank_pids`)."""
    import ray

    from miles.training.ranks import CRITIC_RANK_ACTOR_PREFIX, RANK_ACTOR_PREFIX

    prefix = RANK_ACTOR_PREFIX if role == "trainer" else CRITIC_RANK_ACTOR_PREFIX
    namespace = ctx.c.cluster.namespace
    names = sorted((a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a.get("namespace") == namespace and a["name"].startswith(prefix)),
                   key=lambda n: int(n.removeprefix(prefix)))
    if len(names) < 2:
        ctx.tracer.emit("fault_skipped", state=f.state, kind=f.kind, reason=f"the {role} does not run on several ranks")
        return
    pids = {n: await ray.get_actor(n, namespace=namespace).__ray_call__.remote(_pid) for n in names}
    ctx.tracer.emit(f"{role}_rank_pids", pids=pids)
    os.kill(pids[names[-1]], signal.SIGKILL)
    await asyncio.sleep(0.5)       # let Ray notice before the phase uses the ranks


def _pid(_actor: Any) -> int:
    return os.getpid()


def _block_forever(_actor: Any) -> None:
    """In an actor: never returns, and holds the actor's thread (its event loop, for an async actor)."""
    time.sleep(1e9)


def _perturbed_weights(trainer: Any) -> dict[str, Any]:
    """In the trainer actor: its weights with the first value of the first tensor moved by 1."""
    weights = trainer.weights()
    name = sorted(weights)[0]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] += 1.0
    return weights


def _raise_on_teardown() -> None:
    raise InjectedFault("injected teardown failure")


async def _hang_on_teardown() -> None:
    await asyncio.sleep(3600)


@check
def _faults(cfg: RunConfig, problems: list[str]) -> None:
    """Each --inject-fault parses."""
    for text in cfg.inject_faults:
        try:
            parse_fault(text)
        except ConfigError as exc:
            problems.append(str(exc))
