"""Test-only stand-ins for programs miles drives but that cannot run here.

`FAKES_DIR` holds a fake `sglang` package (`sglang/launch_server.py`): with it on PYTHONPATH,
`python -m sglang.launch_server ...` (the command line the SGLang engine really runs) starts
`sglang_server.py`, an aiohttp server that speaks SGLang's HTTP contract.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

FAKES_DIR = Path(__file__).resolve().parent


def with_fake_sglang(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default os.environ) whose PYTHONPATH starts with the fakes, so the fake
    `sglang` package shadows any other."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAKES_DIR), out.get("PYTHONPATH", "")) if p)
    return out


def real_sglang_installed() -> bool:
    spec = importlib.util.find_spec("sglang")
    return spec is not None and not str(spec.origin or "").startswith(str(FAKES_DIR))


def fake_calls(url: str, endpoint: str | None = None) -> list[dict]:
    """The calls a fake server recorded (GET /fake/calls), optionally of one endpoint."""
    import json
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/fake/calls", timeout=10) as resp:
        calls = json.loads(resp.read())
    return [c for c in calls if endpoint is None or c["endpoint"] == endpoint]


def fake_state(url: str, knobs: dict | None = None) -> dict:
    """A fake server's state (GET /fake/state), after setting `knobs` (POST /fake/hang) when given."""
    import json
    import urllib.request

    data = None if knobs is None else json.dumps(knobs).encode()
    req = urllib.request.Request(url.rstrip("/") + ("/fake/state" if knobs is None else "/fake/hang"), data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def sglang_processes(marker: str = "") -> list[int]:
    """Pids of live fake servers, their children and sglang-routers (cmdline contains `marker` too)."""
    import psutil

    pids = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["status"] == psutil.STATUS_ZOMBIE or marker not in cmd:
            continue
        if "sglang.launch_server" in cmd or "fake-sglang-child" in cmd or "sglang_router.launch_router" in cmd:
            pids.append(p.info["pid"])
    return pids
