"""What SGLang engines need around them in a run: their wiring, their GPUs, and the router in front.

`make_fleet` (the spec's `fleet`) makes one per run (the `EngineFleet` of miles.rollout.protocol). It
gives each engine its wiring (a work folder under `<run-dir>/sglang/<engine>`, the router's address,
`exit_with_server` so that a dead server ends its engine actor and the run's restart machinery
replaces both; the server's options come from the spec's `options`) and, with more than one engine, owns the
run's sglang-router: an engine's server joins it once the engine holds the run's weights and leaves it
when the engine goes. The GPUs are the run's placement's (miles.cluster.placement): each engine actor
gets `--rollout-num-gpus-per-engine` GPUs in a bundle of its own, and its server inherits the actor's
CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from miles.config import SGLangConfig
from miles.rollout.engines.sglang.router import SGLangRouter

if TYPE_CHECKING:
    from miles.config import RunConfig

log = structlog.get_logger().bind(role="sglang_fleet")


class SGLangFleet:
    resource_name = "sglang-fleet"

    def __init__(self, sglang: SGLangConfig, *, run_dir: str | Path, num_engines: int, tp_size: int = 1):
        """`num_engines`: the run's placement's (--rollout-num-engines, or --rollout-num-gpus / GPUs per engine);
        `tp_size`: --rollout-num-gpus-per-engine (traced)."""
        self.run_dir = Path(run_dir) / "sglang"
        self.tp_size, self.server_args = tp_size, tuple(sglang.server_args)
        self.router = SGLangRouter(log_path=self.run_dir / "router.log", policy=sglang.router_policy,
                                   request_timeout_s=sglang.router_request_timeout_s) if num_engines > 1 else None
        self._urls: dict[int, str] = {}

    def engine_kwargs(self, index: int, name: str) -> dict[str, Any]:
        return {"engine_name": name, "work_dir": str(self.run_dir / name),
                "router_url": self.router.url if self.router else None, "exit_with_server": True}

    async def joined(self, index: int, engine: Any) -> None:
        url = await engine.server_url.remote()
        self._urls[index] = url
        if self.router is not None:
            await self.router.add_worker(url)

    async def left(self, index: int) -> None:
        url = self._urls.pop(index, None)
        if self.router is not None and url is not None and self.router.alive():
            await self.router.remove_worker(url)

    def describe(self) -> dict[str, Any]:
        return {"router_url": self.router.url if self.router else None,
                "router_pid": self.router.process.pid if self.router else None,
                "tp_size": self.tp_size, "server_args": list(self.server_args)}

    async def dispose(self) -> None:
        """The router (after the engines, which are disposed first: registered later)."""
        if self.router is not None:
            await self.router.dispose()


def make_fleet(cfg: RunConfig, *, run_dir: str | Path, num_engines: int) -> SGLangFleet:
    """The SGLang spec's `fleet`: the run's slices for it."""
    return SGLangFleet(cfg.sglang, run_dir=run_dir, num_engines=num_engines,
                       tp_size=cfg.cluster.rollout_num_gpus_per_engine)
