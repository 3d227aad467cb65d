"""`--rm-type remote_rm`: score a response by POSTing it to a reward service (`--rm-url`).

The request body is miles' `{"prompt": ..., "response": ..., "label": ...}` as JSON; the service
answers with a JSON number, or a JSON object of named scores that `--reward-key` picks from.

Each request gets `--rm-timeout` seconds. A transient failure (no connection, a timeout, HTTP 429 or
5xx) is retried up to `--rm-max-retries` times, waiting `--rm-retry-backoff` seconds before the first
retry and twice as long before each next one; any other HTTP error, or a body that is not JSON, fails
at once. When the retries run out the reward raises `RemoteRewardError`, which names the URL, the
attempts and the last failure (the rollout then fails as on any reward error).

`check_reachable` is the start-up check: on the driver, before any actor starts, the service must
answer an HTTP request (any status: a GET on a POST-only route answers 405, which is fine).

One aiohttp session per event loop, opened at the first request, closed by `close()` (the rollout
executor's dispose).
"""

from __future__ import annotations

import asyncio
from typing import Any

from miles.config import ConfigError
from miles.types import Prompt

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_BODY_PREVIEW_CHARS = 200


class RemoteRewardError(RuntimeError):
    """The reward service failed a request for good (retries used up, or a permanent error)."""


class _Transient(Exception):
    """One attempt failed in a way worth retrying."""


class RemoteReward:
    """A reward function `await reward(prompt, response, label)` backed by the service at `url`."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, max_retries: int = 3, backoff_s: float = 0.5):
        self.url, self.timeout_s, self.max_retries, self.backoff_s = url, timeout_s, max_retries, backoff_s
        self.__qualname__ = f"remote_rm[{url}]"      # how reward errors name this function
        self._session: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, prompt: Prompt, response: str, label: str | None) -> Any:
        return await self.post({"prompt": prompt.text, "response": response, "label": label})

    async def post(self, payload: dict[str, Any]) -> Any:
        """The service's JSON answer to `payload`, retrying transient failures with backoff."""
        wait, last = self.backoff_s, ""
        for attempt in range(1, self.max_retries + 2):
            try:
                return await self._attempt(payload)
            except _Transient as exc:
                last = str(exc)
            if attempt <= self.max_retries:
                await asyncio.sleep(wait)
                wait *= 2
        raise RemoteRewardError(f"--rm-url {self.url}: {self.max_retries + 1} attempts failed "
                                f"(--rm-max-retries {self.max_retries}); last: {last}")

    async def _attempt(self, payload: dict[str, Any]) -> Any:
        import aiohttp

        session = self._open()
        try:
            async with session.post(self.url, json=payload,
                                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                body = await resp.text()
                if resp.status in RETRY_STATUSES:
                    raise _Transient(f"HTTP {resp.status}: {body[:_BODY_PREVIEW_CHARS]}")
                if resp.status >= 400:
                    raise RemoteRewardError(f"--rm-url {self.url}: HTTP {resp.status} (not retried): "
                                            f"{body[:_BODY_PREVIEW_CHARS]}")
        except asyncio.TimeoutError as exc:
            raise _Transient(f"no answer within --rm-timeout {self.timeout_s:g}s") from exc
        except aiohttp.ClientConnectionError as exc:
            raise _Transient(f"{type(exc).__name__}: {exc}") from exc
        return _json(body, self.url)

    def _open(self) -> Any:
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session, self._loop = aiohttp.ClientSession(), loop
        return self._session

    async def close(self) -> None:
        """Close the session (its connections). Idempotent."""
        if self._session is not None and not self._session.closed and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None


def _json(body: str, url: str) -> Any:
    import json

    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise RemoteRewardError(f"--rm-url {url}: the answer is not JSON ({exc.msg}): "
                                f"{body[:_BODY_PREVIEW_CHARS]!r}; answer a number or an object of scores") from exc


async def check_reachable(url: str, *, timeout_s: float, attempts: int = 3, backoff_s: float = 0.5,
                          flag: str = "--rm-url", what: str = "the reward service",
                          why_needed: str = "--rm-type remote_rm posts every response there") -> None:
    """ConfigError unless the service at `url` answers an HTTP request (any status) within
    `attempts` tries: what the run checks before it starts anything. `flag`, `what` and `why_needed`
    word the error (the reward service's by default)."""
    import aiohttp

    last: BaseException | None = None
    async with aiohttp.ClientSession() as session:
        for attempt in range(attempts):
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)):
                    return
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                last = exc
            if attempt + 1 < attempts:
                await asyncio.sleep(backoff_s * 2 ** attempt)
    why = f"{type(last).__name__}: {last}" if str(last) else type(last).__name__
    raise ConfigError(f"{flag} {url}: {what} does not answer ({why}); start it, or fix the address ({why_needed})")
