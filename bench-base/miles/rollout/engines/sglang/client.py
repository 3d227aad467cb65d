"""An async HTTP client for one SGLang server (or a router in front of several): one method per endpoint.

Bodies come from `miles.rollout.engines.sglang.api`; this module only sends them and reads the answers. A
non-2xx answer, or a 200 whose body says `"success": false`, raises SGLangHTTPError with the endpoint,
the status and SGLang's message (whatever the error body's shape: `{"error": "..."}`,
`{"error": {"message": ...}}`, `{"message": ...}` or plain text). A server that cannot be reached
raises SGLangUnreachable, so a caller can tell a dead server from a refused request.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from miles.rollout.engines.sglang import api


class SGLangHTTPError(RuntimeError):
    def __init__(self, endpoint: str, status: int, message: str):
        super().__init__(f"SGLang {endpoint} answered {status}: {message}")
        self.endpoint, self.status, self.message = endpoint, status, message


class SGLangUnreachable(ConnectionError):
    """The connection failed or broke (refused, reset, server gone mid-request)."""


class SGLangClient:
    def __init__(self, url: str, *, timeout_s: float = 3600.0, connections: int = 256):
        self.url = url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> aiohttp.ClientSession:
        # made on first use in the caller's event loop; an aiohttp session belongs to one loop, so a
        # caller that runs several loops one after another (asyncio.run per call) gets one per loop
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(timeout=self._timeout,
                                                  connector=aiohttp.TCPConnector(limit=self._connections))
            self._loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None

    async def request(self, method: str, endpoint: str, body: Any = None, *, check_success: bool = True,
                      params: dict[str, str] | None = None) -> Any:
        """Send one request; the parsed JSON answer (or text, or None for an empty body)."""
        try:
            async with self._http().request(method, self.url + endpoint, json=body, params=params) as resp:
                text = await resp.text()
                status = resp.status
        except (aiohttp.ClientConnectionError, aiohttp.ServerDisconnectedError, ConnectionError) as exc:
            raise SGLangUnreachable(f"{self.url}{endpoint}: {type(exc).__name__}: {exc}") from exc
        data = _parse(text)
        if status >= 300:
            raise SGLangHTTPError(endpoint, status, _message(data))
        if check_success and isinstance(data, dict) and data.get("success") is False:
            raise SGLangHTTPError(endpoint, status, _message(data))
        return data

    # --- health and info ------------------------------------------------------------------------
    async def healthy(self, endpoint: str = "/health_generate") -> bool:
        """True on 200; False on any other answer or none (starting, overloaded, gone)."""
        try:
            await self.request("GET", endpoint)
            return True
        except (SGLangHTTPError, SGLangUnreachable, TimeoutError):
            return False

    async def model_info(self) -> dict[str, Any]:
        return await self.request("GET", "/model_info")

    async def weight_version(self) -> str:
        return str((await self.model_info())["weight_version"])

    # --- generation -----------------------------------------------------------------------------
    async def generate(self, body: dict[str, Any]) -> Any:
        return await self.request("POST", "/generate", body, check_success=False)

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request by rid, or all (rid None)."""
        await self.request("POST", "/abort_request", {"rid": rid} if rid else {"abort_all": True})

    # --- around weight updates ------------------------------------------------------------------
    async def pause(self, mode: str = "retract") -> None:
        if mode not in api.PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: use one of {', '.join(api.PAUSE_MODES)}")
        await self.request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self.request("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self.request("POST", "/flush_cache")

    async def update_weights_from_disk(self, model_path: str, version: int) -> dict[str, Any]:
        return await self.request("POST", "/update_weights_from_disk", api.disk_update_body(model_path, version))

    # --- memory ---------------------------------------------------------------------------------
    async def release_memory(self, tags: list[str]) -> None:
        await self.request("POST", "/release_memory_occupation", {"tags": api.check_tags(tags)})

    async def resume_memory(self, tags: list[str]) -> None:
        await self.request("POST", "/resume_memory_occupation", {"tags": api.check_tags(tags)})


def _parse(text: str) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _message(data: Any) -> str:
    """SGLang's error text out of any of its error-body shapes."""
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
        if "message" in data:
            return str(data["message"])
    return str(data).strip()[:2000]
