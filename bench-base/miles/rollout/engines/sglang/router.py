"""The run's sglang-router: one process in front of every SGLang server, started and owned by the run.

`python -m sglang_router.launch_router` (the sglang-router package, 0.3.x) runs in its own process
group, with no workers at first; each engine's server is registered once it is healthy
(`POST /workers {"url": ...}`, answered 202 and applied in the background, so `add_worker` waits
until the worker is listed healthy) and removed when its engine goes (`DELETE /workers/{id}`). The
router health-checks its workers (`/health`, every `health_check_interval_s`) and retries a request
whose worker died on another one; engines send their `/generate` requests to it.
Teardown: SIGTERM to the group, wait, SIGKILL (miles.runtime.procs.OwnedProcess).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from miles.rollout.engines.sglang.client import SGLangClient, SGLangHTTPError, SGLangUnreachable
from miles.runtime.procs import OwnedProcess, die_with_parent, free_port, log_tail

log = structlog.get_logger().bind(role="router")


class SGLangRouterError(RuntimeError):
    pass


class SGLangRouter:
    resource_name = "sglang-router"

    def __init__(self, *, log_path: str | Path, host: str = "127.0.0.1", port: int | None = None,
                 policy: str = "cache_aware", request_timeout_s: float = 3600.0, health_check_interval_s: int = 5,
                 extra_args: Sequence[str] = (), startup_timeout_s: float = 60.0, python: str = sys.executable):
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [python, "-m", "sglang_router.launch_router", "--host", host, "--port", str(self.port),
                "--policy", policy, "--request-timeout-secs", str(int(request_timeout_s)),
                "--health-check-interval-secs", str(health_check_interval_s), "--health-failure-threshold", "1",
                "--log-level", "warn", *extra_args]
        with open(self.log_path, "ab") as logf:
            self.process = OwnedProcess(argv, name=self.resource_name, stdout=logf, stderr=logf,
                                        stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        self._client = SGLangClient(self.url, timeout_s=30.0)
        try:
            self._wait_live(startup_timeout_s)
        except BaseException:
            self.process.force()
            raise
        log.info("router_ready", url=self.url, pid=self.process.pid, policy=policy)

    def _wait_live(self, timeout_s: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.process.alive():
                raise SGLangRouterError(f"sglang-router exited with status {self.process.proc.returncode} while "
                                        f"starting; the end of its log ({self.log_path}):\n{log_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(self.url + "/liveness", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise SGLangRouterError(f"sglang-router not live after {timeout_s:.0f} s; the end of its log "
                                f"({self.log_path}):\n{log_tail(self.log_path)}")

    def alive(self) -> bool:
        return self.process.alive()

    async def workers(self) -> list[dict]:
        """The router's workers: [{"id", "url", "is_healthy", ...}]."""
        return (await self._client.request("GET", "/workers"))["workers"]

    async def add_worker(self, url: str, timeout_s: float = 60.0) -> None:
        """Register a healthy server; returns once the router lists it as healthy."""
        await self._client.request("POST", "/workers", {"url": url})
        await self._until(lambda ws: any(w["url"] == url and w.get("is_healthy") for w in ws),
                          f"worker {url} listed healthy", timeout_s)
        log.info("router_worker_added", url=url)

    async def remove_worker(self, url: str, timeout_s: float = 30.0) -> None:
        """Unregister a server (gone or going); nothing to do when it is not registered."""
        ids = [w["id"] for w in await self.workers() if w["url"] == url]
        for worker_id in ids:
            await self._client.request("DELETE", f"/workers/{worker_id}")
        await self._until(lambda ws: all(w["url"] != url for w in ws), f"worker {url} removed", timeout_s)
        log.info("router_worker_removed", url=url)

    async def _until(self, done, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if done(await self.workers()):
                    return
            except (SGLangHTTPError, SGLangUnreachable) as exc:
                if not self.alive():
                    raise SGLangRouterError(f"sglang-router died; the end of its log:\n"
                                            f"{log_tail(self.log_path)}") from exc
            if time.monotonic() > deadline:
                raise SGLangRouterError(f"sglang-router: no {what} after {timeout_s:.0f} s; the end of its log "
                                        f"({self.log_path}):\n{log_tail(self.log_path)}")
            await asyncio.sleep(0.2)

    async def dispose(self) -> None:
        """SIGTERM the router's group, wait, SIGKILL. The servers behind it are their engines'."""
        await self._client.close()
        await asyncio.to_thread(self.process.dispose)
