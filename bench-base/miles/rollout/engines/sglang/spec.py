"""The SGLang engine's spec: its options from the config, its fleet (the router), its checks."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles.config.packages import missing_package
from miles.config.schema import ROUTER_POLICIES
from miles.rollout.engines.sglang import api
from miles.rollout.protocol import EngineSpec, SupportsAbort, SupportsHealth, SupportsMemoryRelease

if TYPE_CHECKING:
    from miles.config import RunConfig


@dataclass(frozen=True, kw_only=True)
class SGLangEngineConfig:
    tp_size: int = 1                         # --rollout-num-gpus-per-engine
    server_args: tuple[str, ...] = ()        # SGLang's own flags, from --sglang-* (api.passthrough_flags)
    memory_saver: bool = False               # --enable-memory-saver, needed by release/resume (--offload-rollout)
    host: str = "127.0.0.1"
    startup_timeout_s: float = 600.0         # --sglang-server-startup-timeout (model load + CUDA graphs)
    request_timeout_s: float = 3600.0
    max_concurrency: int = 256               # requests in flight per engine (--sglang-server-concurrency)
    pause_mode: str = "retract"              # requests in flight survive an update and finish on new weights
    python: str = sys.executable
    env: Mapping[str, str] = field(default_factory=dict)   # extra environment for the server

    def __post_init__(self):
        if self.tp_size < 1:
            raise ValueError(f"--rollout-num-gpus-per-engine must be >= 1, got {self.tp_size}")
        if self.pause_mode not in api.PAUSE_MODES:
            raise ValueError(f"pause mode {self.pause_mode!r}: use one of {', '.join(api.PAUSE_MODES)}")



def options(cfg: RunConfig) -> dict[str, Any]:
    """The server's options: tensor parallel size, the --sglang-* pass-through, timeouts, concurrency."""
    c, g = cfg.cluster, cfg.sglang
    return {"sglang": SGLangEngineConfig(
        tp_size=c.rollout_num_gpus_per_engine, server_args=tuple(g.server_args),
        memory_saver=c.offloads_rollout,     # release/resume_memory_occupation need it (miles.phases.memory)
        startup_timeout_s=g.startup_timeout_s, request_timeout_s=g.router_request_timeout_s,
        max_concurrency=cfg.generate.server_concurrency)}


def check(cfg: RunConfig, problems: list[str]) -> None:
    """SGLang's flags need --rollout-engine sglang; flags miles sets itself cannot be passed through."""
    g, r = cfg.sglang, cfg.rollout
    if r.engine == "sglang":       # the client and the router (SGLang itself: docs/sglang.md)
        problems += filter(None, (missing_package("--rollout-engine sglang", module, package, "sglang")
                                  for module, package in (("aiohttp", "aiohttp"), ("sglang_router", "sglang-router"))))
    if r.engine != "sglang" and g.server_args:
        problems.append(f"--sglang-<flag> pass-through ({' '.join(g.server_args)}): only the SGLang engine reads "
                        "it; add --rollout-engine sglang or drop it")
    if r.engine == "sglang" and r.max_batch_size is not None:
        problems.append(f"--rollout-max-batch-size {r.max_batch_size} is the embedded and fast engines' limit; an "
                        "SGLang server's is --sglang-max-running-requests N")
    if r.engine == "sglang" and r.chunked_prefill_size is not None:
        problems.append(f"--rollout-chunked-prefill-size {r.chunked_prefill_size} is the fast engine's; an SGLang "
                        "server's is --sglang-chunked-prefill-size N")
    if r.engine == "sglang" and r.health_check_interval_s > 0 and \
            0 < r.health_check_timeout_s < api.MIN_HEALTH_CHECK_TIMEOUT_S:
        problems.append(f"--rollout-health-check-timeout {r.health_check_timeout_s:g}: an SGLang server answers "
                        f"/health_generate a second after it is asked at the earliest; give the probe at least "
                        f"{api.MIN_HEALTH_CHECK_TIMEOUT_S:g} s (default 30), or --rollout-health-check-interval 0")
    given = [a[2:] for a in g.server_args if a.startswith("--")]
    problems += [api.reserved_flag_problem(f) for f in given if f in api.RESERVED_FLAGS]
    if g.router_policy not in ROUTER_POLICIES:
        problems.append(f"--sglang-router-policy {g.router_policy}: use one of {', '.join(ROUTER_POLICIES)}")
    for flag, value in (("--sglang-server-startup-timeout", g.startup_timeout_s),
                        ("--sglang-router-request-timeout-secs", g.router_request_timeout_s)):
        if value <= 0:
            problems.append(f"{flag} {value}: must be > 0 (seconds)")


# an async actor: health and abort run beside generate calls on its event loop (the engine limits its
# own requests); the fleet owns the router in front of several servers
SPEC = EngineSpec(engine="miles.rollout.engines.sglang.engine:SGLangEngine", options=options, check=check,
                  fleet="miles.rollout.engines.sglang.fleet:make_fleet", tensor_parallel=True,
                  capabilities=(SupportsMemoryRelease, SupportsHealth, SupportsAbort))
