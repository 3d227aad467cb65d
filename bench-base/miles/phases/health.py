"""Engine health: probe every engine on a schedule, and kill the ones that are hung.

`init` starts the monitor once the engines are ready and registers it with the disposer (so it is
stopped before the engines are torn down). After `--rollout-health-check-first-wait` seconds, and
then every `--rollout-health-check-interval` seconds, each engine is asked `health()`
(`miles.rollout.protocol.Engine`). An engine is hung when the probe gets no answer within
`--rollout-health-check-timeout` (the process is stuck), or when it reports a call that has made no
progress for that long (a decode loop that stopped). A hung engine is killed: the call in flight
on it then fails as for a dead actor, and the phase running it restarts the engine within the
restart budget and retries (`miles.phases.engines.with_engine_restarts`); an engine killed between
phases is restarted by the next phase that calls it. A probe that raises (the engine cannot vouch
for itself) counts as hung too. Once the run's teardown has begun, nothing is reported or killed:
engines go on purpose then. Trace events: `engine_unhealthy` (engine, reason) then
`engine_killed`; a dead engine is reported once as `engine_unhealthy` with reason "dead".

Only engines whose spec declares `SupportsHealth` are probed: they answer beside a running call (the
embedded engine's actor runs two threads; the SGLang engine is an async actor, whose calls Ray runs
concurrently on its event loop).
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from miles.phases.context import TrainingContext
from miles.rollout.protocol import SupportsHealth

DEAD = "dead"


class HealthMonitor:
    """The periodic probe of the run's engines (a background task of the driver's loop)."""

    resource_name = "engine_health_monitor"

    def __init__(self, ctx: TrainingContext):
        r = ctx.cfg.rollout
        self._ctx = ctx
        self.interval_s, self.timeout_s, self.first_wait_s = (r.health_check_interval_s, r.health_check_timeout_s,
                                                              r.health_check_first_wait_s)
        self._reported: set[int] = set()      # id() of the engine resources already reported
        self._task: asyncio.Task | None = None
        self.probes = 0

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        await asyncio.sleep(self.first_wait_s)
        while not self._ctx.disposer.closed:
            await self.probe_all()
            await asyncio.sleep(self.interval_s)

    async def probe_all(self) -> None:
        engines = list(self._ctx.c.engines or [])
        self.probes += 1
        await asyncio.gather(*(self._probe(i, e) for i, e in enumerate(engines) if id(e) not in self._reported))

    async def _probe(self, index: int, engine: Any) -> None:
        reason = await self._diagnose(engine)
        # once the run's teardown has begun, engines go on purpose (one restarted mid-run, registered
        # after this monitor, goes before it): nothing to report
        if reason is None or self._ctx.disposer.closed:
            return
        if reason == DEAD:
            self._reported.add(id(engine))    # dead already: the next phase that calls it restarts it
            self._ctx.tracer.emit("engine_unhealthy", engine=index, reason=DEAD)
            return
        self._kill(index, engine, reason)

    async def _diagnose(self, engine: Any) -> str | None:
        """None for a healthy engine, DEAD for a dead one, else why it is hung."""
        try:
            state = await asyncio.wait_for(engine.handle.health.remote(), self.timeout_s)
        except ray.exceptions.RayActorError:
            return DEAD
        except asyncio.TimeoutError:
            return f"no answer to a health probe within --rollout-health-check-timeout {self.timeout_s:g}s"
        except Exception as exc:          # noqa: BLE001 - a probe that fails must not end the monitor
            cause = getattr(exc, "cause", None) or exc          # Ray's wrapper holds the engine's error
            return f"the health probe failed: {type(cause).__name__}: {str(cause)[:300]}"
        stalled = float(state.get("since_progress_s", 0.0))
        if state.get("busy") and stalled > self.timeout_s:
            return f"a call made no progress for {stalled:.1f}s (--rollout-health-check-timeout {self.timeout_s:g}s)"
        return None

    def _kill(self, index: int, engine: Any, reason: str) -> None:
        self._reported.add(id(engine))
        seq = self._ctx.tracer.emit("engine_unhealthy", engine=index, reason=reason)
        engine.force()
        self._ctx.tracer.emit("engine_killed", engine=index, cause=seq, pid=engine.pid)

    async def dispose(self) -> None:
        """Stop probing. The engines are the run's."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


def start_health_monitor(ctx: TrainingContext) -> HealthMonitor | None:
    """Start the probe (unless --rollout-health-check-interval 0, or the engine cannot answer it
    beside a running call) and register it with the disposer."""
    if ctx.cfg.rollout.health_check_interval_s <= 0:
        return None
    if not ctx.backends.engine_spec.supports(SupportsHealth):
        ctx.tracer.emit("engine_health_monitor_skipped", engine=ctx.backends.engine.__name__,
                        reason="the engine does not answer health probes while it generates; hung calls are "
                               "still found by --engine-generate-timeout")
        return None
    monitor = HealthMonitor(ctx)
    ctx.disposer.add(monitor, timeout=ctx.cfg.trace.teardown_timeout_s)
    monitor.start()
    ctx.tracer.emit("engine_health_monitor_started", interval_s=monitor.interval_s, timeout_s=monitor.timeout_s,
                    first_wait_s=monitor.first_wait_s)
    return monitor

