"""Blocking calls awaited from the event loop in daemon threads, so that a hung one can be abandoned.

`asyncio.to_thread` uses the loop's default executor, whose threads are joined when the loop closes
and again at interpreter exit: one call that never returns then keeps the process alive forever.
A daemon thread per call is abandoned instead (the teardown of a hung resource, a reward function
stuck past its timeout).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


def in_daemon_thread(fn: Callable[..., Any], *args: Any, name: str = "miles-call") -> asyncio.Future[Any]:
    """Start `fn(*args)` in a daemon thread; the returned future settles with its result or error."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def target() -> None:
        try:
            value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting side
            _threadsafe(loop, settle, False, exc)
        else:
            _threadsafe(loop, settle, True, value)

    threading.Thread(target=target, name=name, daemon=True).start()
    return fut


def _threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:                  # loop closed: nobody is waiting any more
        pass
