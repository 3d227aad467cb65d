"""What SGLang engines need around them in a run: their options, their GPUs, and the router in front.

`SGLangEngine.make_fleet` makes one per run (the `EngineFleet` of miles.rollout.protocol). It turns the
run's config slices into each engine's constructor keywords (`SGLangEngineConfig`, a work folder under
`<run-dir>/sglang/<engine>`, the router's address, `exit_with_server` so that a dead server ends its
engine actor and the run's restart machinery replaces both) and, with more than one engine, owns the
run's sglang-router: an engine's server joins it once the engine holds the run's weights and leaves it
when the engine goes. The GPUs are the run's placement's (miles.cluster.placement): each engine actor
gets `--rollout-num-gpus-per-engine` GPUs in a bundle of its own, and its server inherits the actor's
CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from miles.config import ClusterConfig, SGLangConfig
from miles.rollout.engines.sglang.engine import SGLangEngineConfig
from miles.rollout.engines.sglang.router import SGLangRouter

log = structlog.get_logger().bind(role="sglang_fleet")


class SGLangFleet:
    resource_name = "sglang-fleet"

    def __init__(self, cluster: ClusterConfig, sglang: SGLangConfig, *, run_dir: str | Path, num_engines: int,
                 server_concurrency: int = 512):
        """`num_engines`: the run's placement's (--rollout-num-engines, or --rollout-num-gpus / GPUs per engine);
        `server_concurrency`: --sglang-server-concurrency (GenerateConfig's, read by custom generation too)."""
        self.run_dir = Path(run_dir) / "sglang"
        self.engine_cfg = SGLangEngineConfig(
            tp_size=cluster.rollout_num_gpus_per_engine, server_args=tuple(sglang.server_args),
            memory_saver=cluster.offloads_rollout,     # release/resume_memory_occupation need it (miles.phases.memory)
            startup_timeout_s=sglang.startup_timeout_s, request_timeout_s=sglang.router_request_timeout_s,
            max_concurrency=server_concurrency)
        self.router = SGLangRouter(log_path=self.run_dir / "router.log", policy=sglang.router_policy,
                                   request_timeout_s=sglang.router_request_timeout_s) if num_engines > 1 else None
        self._urls: dict[int, str] = {}

    def engine_kwargs(self, index: int, name: str) -> dict[str, Any]:
        return {"sglang": self.engine_cfg, "engine_name": name, "work_dir": str(self.run_dir / name),
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
                "tp_size": self.engine_cfg.tp_size, "server_args": list(self.engine_cfg.server_args)}

    async def dispose(self) -> None:
        """The router (after the engines, which are disposed first: registered later)."""
        if self.router is not None:
            await self.router.dispose()


def make_fleet(cfg: Any, *, run_dir: str | Path, num_engines: int) -> SGLangFleet:
    """`SGLangEngine.make_fleet`: the run's slices for SGLang."""
    return SGLangFleet(cfg.cluster, cfg.sglang, run_dir=run_dir, num_engines=num_engines,
                       server_concurrency=cfg.generate.server_concurrency)
