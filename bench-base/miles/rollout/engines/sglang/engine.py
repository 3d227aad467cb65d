"""The SGLang engine: an SGLang server subprocess behind the same interface as the embedded engine.

`SGLangEngine` starts `python -m sglang.launch_server` (token ids in and out, weight version "0" for
the weights on disk, tensor parallel size from --rollout-num-gpus-per-engine, the user's --sglang-*
flags) in its own process group, waits for `/health_generate`, and then speaks SGLang's HTTP API
(`miles.rollout.engines.sglang.api`, SGLang 0.5.23):

- generate: one `/generate` request per prompt (through the run's sglang-router when it has one),
  each with its own `sampling_seed`; cancelled calls abort their requests (`/abort_request`).
- health and abort (the engine protocol's, `miles.rollout.protocol`): the engine is an async actor, so
  both are answered beside running calls. It counts its requests in flight and when one last finished;
  `health()` asks the server (`/health_generate`, until it answers 200) only when the engine is idle
  or no request has finished for PROGRESS_FRESH_S, so a busy server is not asked at every probe. A
  hung server never answers, and the health monitor's probe times out. `abort()` aborts the running
  calls' requests where they run (`/abort_request`); they return what they generated, finish_reason
  "abort".
- weights: `update_weights` (the interface the phases call) writes the trainer's weights as HF
  safetensors next to the model's config and loads them with `/update_weights_from_disk`.
  Every update runs inside `/pause_generation` → `/flush_cache` → update → `/continue_generation`
  and names its version; the server's version is read back and must match.
- memory: `release_memory` / `resume_memory` with tags (weights, kv_cache, cuda_graph) for
  --offload-rollout (the server is started with --enable-memory-saver for it).

A dead server is found by a watchdog thread (and by any request that cannot reach it). The engine
then kills what is left of the server's group; with `exit_with_server` (set by the composition root
for engine actors) it also ends its own process, so the run sees a dead engine actor and its restart
machinery (miles.phases.engines) starts a new engine, with a new server, within the restart budget.
The server, in turn, is started with PR_SET_PDEATHSIG: it dies if the engine's process is killed.

SGLang has no checksum that a trainer can reproduce (its `/weights_checker` hashes its own fused,
sharded parameters on the GPU): `weights_checksum` is the checksum of the weights this engine handed
to the server, checked together with the version the server reports (see its docstring).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from miles.config.schema import DTYPES      # miles' --dtype names -> the long ones, which are SGLang's
from miles.rollout.engines.sglang import api
from miles.rollout.protocol import MEMORY_TAGS, TokenizerAccessors
from miles.rollout.engines.sglang.client import SGLangClient, SGLangHTTPError, SGLangUnreachable
from miles.rollout.engines.sglang.spec import SGLangEngineConfig
from miles.runtime.procs import OwnedProcess, die_with_parent, free_port, log_tail
from miles.types import Generation, SamplingParams

log = structlog.get_logger().bind(role="engine", backend="sglang")

EXIT_SERVER_DIED = 70          # the engine process's exit status when its server died (EX_SOFTWARE)
WATCH_INTERVAL_S = 0.5
# health(): a request of ours that finished this recently proves the server makes progress; past it
# the server is asked (SGLang's /health_generate answers in about a second, busy or idle)
PROGRESS_FRESH_S = 1.0
# abort(): how long an aborted request has to come back with its tokens (SGLang stops it at the
# scheduler's next step) before it is cut (its connection closed, which SGLang treats as an abort too)
ABORT_GRACE_S = 2.0
# connections to our server beyond the generate requests' (at most max_concurrency): health probes,
# aborts and pauses never wait for a generate request to free one
CONTROL_CONNECTIONS = 8
# model files the server needs besides the weights, copied next to each weight export
_MODEL_FILES = ("*.json", "*.model", "*.tiktoken", "*.txt", "*.py")


class SGLangStartError(RuntimeError):
    """The server did not become healthy: it exited, or the start-up timeout passed."""


class SGLangServerDied(RuntimeError):
    """The engine's server process is gone."""


@dataclass
class _Call:
    """A generate call running: its requests' ids, and whether abort() was asked since it started."""
    rids: list[str]
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


def server_dtype(dtype: str, device: str) -> str:
    """miles' --dtype as SGLang's --dtype: auto is bfloat16 (float32 on --device cpu), as miles' auto."""
    if dtype == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} for SGLang: use auto, bfloat16, float16 or float32")
    return DTYPES[dtype]


class SGLangEngine(TokenizerAccessors):
    def __init__(self, model_path: str, *, device: str = "auto", dtype: str = "auto", seed: int = 0,
                 sglang: SGLangEngineConfig = SGLangEngineConfig(), engine_name: str = "engine",
                 router_url: str | None = None, work_dir: str | os.PathLike | None = None,
                 exit_with_server: bool = False):
        """`device`, `dtype`, `seed` as every engine takes them (miles.rollout.protocol); the rest from
        the run's config (`sglang`: the spec's options) and its SGLang fleet (the rest: `fleet.SGLangFleet.engine_kwargs`)."""
        cfg, name = sglang, engine_name
        self.name, self.cfg, self.model_path = name, cfg, str(model_path)
        self.device, self.dtype = device, server_dtype(dtype, device)
        self.exit_with_server = exit_with_server
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix=f"miles-sglang-{name}-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.work_dir / "server.log"
        self.port = free_port(cfg.host)
        self.url = f"http://{cfg.host}:{self.port}"
        self._version = 0
        self._handed_over: str | None = None       # checksum of the last weights written for the server
        self._export: Path | None = None
        self._disposed = False
        self._death: str | None = None
        self._tokenizer = None
        self._released: set[str] = set()           # memory tags released on the server
        # what health() and abort() read; touched on the actor's event loop only
        self._calls: dict[str, _Call] = {}          # the generate calls running
        self._in_flight: set[str] = set()           # ids of the requests sent and not answered yet
        self._progress_at = time.monotonic()        # a request answered, a busy spell began, or the server proved it
        self._controls: dict[object, float] = {}    # control calls running (updates, memory) -> their start
        self.server = self._launch(seed)
        try:
            # torch now, while the server starts: later the first weight update's tensors would import it
            # on the actor's event loop, holding up every call for seconds (health probes included)
            import torch  # noqa: F401
            self._wait_healthy()
        except BaseException:
            self.server.force()             # its children too, which outlive a leader that exited
            if self._own_dir:
                shutil.rmtree(self.work_dir, ignore_errors=True)
            raise
        self._client = SGLangClient(self.url, timeout_s=cfg.request_timeout_s,
                                    connections=cfg.max_concurrency + CONTROL_CONNECTIONS)
        self._router = SGLangClient(router_url, timeout_s=cfg.request_timeout_s,
                                    connections=cfg.max_concurrency) if router_url else None
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        threading.Thread(target=self._watch, name=f"{name}-sglang-watchdog", daemon=True).start()
        log.info("engine_ready", engine=name, url=self.url, pid=self.server.pid, model=self.model_path,
                 tp_size=cfg.tp_size, router=router_url)

    # --- the server process ---------------------------------------------------------------------
    def _launch(self, seed: int) -> OwnedProcess:
        argv = api.server_argv(self.cfg.python, self.model_path, host=self.cfg.host, port=self.port,
                               tp_size=self.cfg.tp_size, dtype=self.dtype, seed=seed, device=self.device,
                               memory_saver=self.cfg.memory_saver, extra=self.cfg.server_args)
        logf = open(self.log_path, "ab")
        try:
            return OwnedProcess(argv, name=f"{self.name}-sglang-server", stdout=logf, stderr=logf,
                                stdin=subprocess.DEVNULL, env={**os.environ, **self.cfg.env},
                                preexec_fn=die_with_parent)
        finally:
            logf.close()          # the child holds its own copy of the descriptor

    def _wait_healthy(self) -> None:
        """Poll /health_generate until 200; a server that exits or outlives the timeout is an error
        that quotes the end of its log."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.server.alive():
                raise SGLangStartError(f"{self.name}: the SGLang server exited with status "
                                       f"{self.server.proc.returncode} while starting; {self._tail()}")
            if _http_ok(self.url + "/health_generate"):
                return
            time.sleep(0.25)
        raise SGLangStartError(f"{self.name}: the SGLang server was not healthy after {self.cfg.startup_timeout_s:.0f}"
                               f" s (raise --sglang-server-startup-timeout if loading is slow); {self._tail()}")

    def _tail(self) -> str:
        return f"the end of its log ({self.log_path}):\n{log_tail(self.log_path)}"

    def _watch(self) -> None:
        while not self._disposed:
            if not self.server.alive():
                self._server_died(f"exited with status {self.server.proc.returncode}")
                return
            time.sleep(WATCH_INTERVAL_S)

    def _server_died(self, how: str) -> None:
        """Kill what is left of the group; with exit_with_server, end this process too."""
        if self._disposed or self._death is not None:
            return
        self._death = f"{self.name}: the SGLang server (pid {self.server.pid}) {how}; {self._tail()}"
        self.server.force()
        log.error("sglang_server_died", engine=self.name, pid=self.server.pid, how=how)
        if self.exit_with_server:
            sys.stderr.write(self._death + "\n")
            sys.stderr.flush()
            os._exit(EXIT_SERVER_DIED)

    def _live(self) -> SGLangClient:
        if self._disposed:
            raise SGLangServerDied(f"{self.name} was disposed")
        if self._death is not None:
            raise SGLangServerDied(self._death)
        return self._client

    async def _guard(self, call):
        """Await a request; a connection error from a dead server is the server's death, not the call's."""
        try:
            return await call
        except SGLangUnreachable:
            await asyncio.sleep(WATCH_INTERVAL_S)          # let a dying process finish dying
            if not self.server.alive():
                self._server_died(f"exited with status {self.server.proc.returncode} during a request")
                raise SGLangServerDied(self._death) from None
            raise

    # --- accessors ------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The model's tokenizer, loaded in this process on first use (the server runs without one)."""
        if self._tokenizer is None:
            from miles.weights.hf import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer

    def server_url(self) -> str:
        return self.url

    def server_pid(self) -> int:
        return self.server.pid

    def weight_version(self) -> int:
        """0 for the weights on disk, then the version of the last update the server confirmed."""
        return self._version

    def weights_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    # --- generation -----------------------------------------------------------------------------
    async def generate(self, prompts: list[list[int]], params: SamplingParams,
                       max_new_tokens: Sequence[int] | None = None) -> list[Generation]:
        """One Generation per prompt, in order; with `params.seed`, request i is seeded with
        `request_seed(seed, i)` (the same call gives the same samples on the same weights).
        `max_new_tokens` (one per prompt) caps each request's response; else `params.max_new_tokens`."""
        self._live()
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:      # a semaphore belongs to one loop too
            self._slots = (loop, asyncio.Semaphore(self.cfg.max_concurrency))
        call_id = uuid.uuid4().hex[:8]
        call = _Call([f"{self.name}-{call_id}-{i}" for i in range(len(prompts))])
        seeds = [None if params.seed is None else api.request_seed(params.seed, i) for i in range(len(prompts))]
        caps = [params.max_new_tokens] * len(prompts) if max_new_tokens is None else max_new_tokens
        tasks = [asyncio.ensure_future(self._one(p, replace(params, max_new_tokens=int(c)), rid, s, call))
                 for p, c, rid, s in zip(prompts, caps, call.rids, seeds)]
        self._calls[call_id] = call
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await self._abort_quietly(call.rids)
            raise
        finally:
            del self._calls[call_id]

    async def _one(self, prompt: list[int], params: SamplingParams, rid: str, seed: int | None,
                   call: _Call) -> Generation:
        async with self._slots[1]:
            if call.aborted.is_set():           # aborted before it was sent: the server never sees it
                return Generation([], [], "abort", self._version)
            target = self._router or self._live()
            body = await self._send(target, api.generate_body(prompt, params, rid=rid, seed=seed), rid, call.aborted)
        if body is None:
            return Generation([], [], "abort", self._version)
        return api.parse_generation(body, rid=rid, abort_asked=call.aborted.is_set())

    async def _send(self, target: SGLangClient, body: dict, rid: str, aborted: asyncio.Event) -> object | None:
        """One `/generate`, counted in flight (for health). Once `aborted` is set, the server has
        ABORT_GRACE_S to answer it; then the request is cut (None)."""
        if not self._in_flight:
            self._progress_at = time.monotonic()        # a busy spell begins: progress is counted from here
        self._in_flight.add(rid)
        request = asyncio.ensure_future(self._guard(target.generate(body)))
        stop = asyncio.ensure_future(aborted.wait())
        try:
            await asyncio.wait({request, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not request.done():
                await asyncio.wait({request}, timeout=ABORT_GRACE_S)
            if not request.done():
                return None
            self._progress_at = time.monotonic()
            return request.result()
        finally:
            stop.cancel()
            request.cancel()                            # closes the connection of a request still running
            self._in_flight.discard(rid)

    async def _abort_quietly(self, rids: Sequence[str]) -> None:
        """Leftover requests of a failed or cancelled call: abort them where they run (best effort)."""
        if self._death is None and not self._disposed:
            await self._abort_where_they_run(rids)

    async def abort(self) -> None:
        """The generate calls running now return at once (the engine protocol's abort): their requests
        not sent yet are not sent; those sent are aborted where they run (`/abort_request`) and return
        what they generated until then, finish_reason "abort"; one the server does not give back
        within ABORT_GRACE_S (a hung server) is cut and returns empty. Calls started later run as usual."""
        calls = list(self._calls.values())
        for call in calls:
            call.aborted.set()
        rids = [rid for call in calls for rid in call.rids if rid in self._in_flight]
        if rids and self._death is None and not self._disposed:
            await self._abort_where_they_run(rids)

    async def _abort_where_they_run(self, rids: Sequence[str]) -> None:
        """`/abort_request` for each request, on this engine's server or, behind the router (which does not
        forward it), on every server the router lists: a server that does not hold a request ignores it.
        Best effort, and bounded by ABORT_GRACE_S: a hung server's requests are cut instead."""
        clients = [self._client]
        try:
            async with asyncio.timeout(ABORT_GRACE_S):
                if self._router is not None:
                    clients += [SGLangClient(url, timeout_s=ABORT_GRACE_S) for url in await self._router_workers()
                                if url != self.url]
                await asyncio.gather(*(c.abort(rid) for c in clients for rid in rids), return_exceptions=True)
        except TimeoutError:
            log.warning("abort_unanswered", engine=self.name, requests=len(rids))
        finally:
            for c in clients[1:]:
                await c.close()

    async def _router_workers(self) -> list[str]:
        try:
            return [w["url"] for w in (await self._router.request("GET", "/workers"))["workers"]]
        except (SGLangHTTPError, SGLangUnreachable, KeyError, TypeError):
            return []                                   # the router is going: our own server still hears it

    # --- health --------------------------------------------------------------------------------
    async def health(self) -> dict:
        """{"busy", "since_progress_s"}, the health monitor's probe (miles.rollout.protocol). Busy with
        requests of ours that finished within PROGRESS_FRESH_S on our own server: answered from that.
        Otherwise (idle, no request finished lately, or requests behind the router, which may run on
        other servers) the server must answer `/health_generate` with 200; it is asked until it does,
        so a hung server leaves the probe unanswered. A weight update or memory call running reports
        the time since it began (the server is paused or loading on purpose), as the embedded engine's
        do; with its memory released the server cannot generate and is not asked."""
        self._live()
        now = time.monotonic()
        busy = bool(self._in_flight)
        if self._controls:
            return {"busy": True, "since_progress_s": now - min(self._controls.values())}
        if self._released:
            return {"busy": busy, "since_progress_s": 0.0}
        if busy and self._router is None and now - self._progress_at < PROGRESS_FRESH_S:
            return {"busy": True, "since_progress_s": now - self._progress_at}
        while not await self._client.healthy("/health_generate"):
            self._live()                                # a dead server: the watchdog has the reason
            await asyncio.sleep(WATCH_INTERVAL_S)
        self._progress_at = time.monotonic()
        return {"busy": busy, "since_progress_s": 0.0}

    @contextmanager
    def _controlling(self) -> Iterator[None]:
        """A control call (weight update, memory release or resume) runs: health() reports it."""
        token = object()
        self._controls[token] = time.monotonic()
        try:
            yield
        finally:
            del self._controls[token]

    # --- weights --------------------------------------------------------------------------------
    async def update_weights(self, state_dict: Mapping[str, object], version: int) -> None:
        """The trainer's weights (a {name: tensor} dict, HF names), through the disk: written as
        safetensors in the engine's dtype next to the model's config, then `/update_weights_from_disk`."""
        client = self._live()
        folder = self.work_dir / f"weights-v{int(version)}"
        checksum = await asyncio.to_thread(self._export_weights, state_dict, folder)
        await self._updating(lambda: client.update_weights_from_disk(str(folder), int(version)), int(version))
        previous, self._export, self._handed_over = self._export, folder, checksum
        if previous is not None and previous != folder:
            shutil.rmtree(previous, ignore_errors=True)

    def _export_weights(self, state_dict: Mapping[str, object], folder: Path) -> str:
        from safetensors.torch import save_file

        from miles.weights.checksum import state_dict_checksum

        dtype = self.weights_dtype()
        tensors = {n: t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
                   for n, t in state_dict.items()}
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for pattern in _MODEL_FILES:
            for src in Path(self.model_path).glob(pattern):
                shutil.copy2(src, folder / src.name)
        (folder / "model.safetensors.index.json").unlink(missing_ok=True)   # one file now, not shards
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return state_dict_checksum(tensors)

    async def _updating(self, update: Callable[[], Awaitable[object]], version: int) -> None:
        """pause → flush → update → continue, then the server must report `version`."""
        client = self._live()
        with self._controlling():
            await self._guard(client.pause(self.cfg.pause_mode))
            try:
                await self._guard(client.flush_cache())
                await self._guard(update())
            finally:
                if self._death is None:
                    await self._guard(client.resume())
        reported = await self._guard(client.weight_version())
        if reported != str(version):
            raise RuntimeError(f"{self.name}: after updating to v{version} the server reports weight version "
                               f"{reported!r}")
        self._version = version
        log.info("weights_updated", engine=self.name, version=version)

    async def weights_checksum(self) -> str:
        """`state_dict_checksum` of the weights last handed to the server (in the engine's dtype), after
        checking that the server reports their version. This proves the trainer → server hand-over;
        what SGLang holds on the GPU is checked by SGLang's own strict load (names and shapes), not here."""
        reported = await self._guard(self._live().weight_version())
        if reported != str(self._version):
            raise RuntimeError(f"{self.name}: the server reports weight version {reported!r}, expected "
                               f"{self._version}")
        if self._handed_over is None:
            raise NotImplementedError(f"{self.name}: no checksum of the weights the server loaded at start-up "
                                      f"(only of those an update_weights handed it)")
        return self._handed_over

    # --- memory --------------------------------------------------------------------------------
    async def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Free GPU memory while the trainer runs (the server must be idle). Idempotent per tag:
        SGLang refuses to resume a tag that is not released, so the engine tracks them."""
        self._memory_saver_on()
        todo = [t for t in api.check_tags(tags) if t not in self._released]
        if todo:
            with self._controlling():
                await self._guard(self._live().release_memory(todo))
            self._released.update(todo)

    async def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Take back what `release_memory` freed (tags not released are skipped)."""
        self._memory_saver_on()
        todo = [t for t in api.check_tags(tags) if t in self._released]
        if todo:
            with self._controlling():
                await self._guard(self._live().resume_memory(todo))
            self._released.difference_update(todo)

    def released_memory(self) -> list[str]:
        return sorted(self._released)

    def _memory_saver_on(self) -> None:
        if not self.cfg.memory_saver:
            raise ValueError(f"{self.name}: releasing memory needs a server started with --enable-memory-saver "
                             f"(miles starts it so under --offload-rollout)")

    # --- teardown -------------------------------------------------------------------------------
    async def dispose(self) -> None:
        """SIGTERM the server's process group, wait, SIGKILL what is left; close the HTTP sessions and
        remove the weight exports (the log stays). Idempotent. The actor itself is the run's."""
        if self._disposed:
            return
        self._disposed = True
        await asyncio.to_thread(self.server.dispose)
        for client in (self._client, self._router):
            if client is not None:
                await client.close()
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        elif self._export is not None:
            shutil.rmtree(self._export, ignore_errors=True)


def _http_ok(url: str, timeout_s: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, TimeoutError):
        return False
