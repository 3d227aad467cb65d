"""The local cluster's guards without starting one: the authentication check, the loopback address,
and the reaper's cleanup of a session folder."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from miles.cluster import reaper
from miles.cluster.local import AUTH_ENV, auth_problem, is_loopback, node_address


def test_a_cluster_without_token_authentication_is_refused_unless_allowed(monkeypatch):
    monkeypatch.delenv(AUTH_ENV, raising=False)
    assert auth_problem(allow_no_auth=False) is None              # Ray turns it on by default
    monkeypatch.setenv(AUTH_ENV, "token")
    assert auth_problem(allow_no_auth=False) is None
    monkeypatch.setenv(AUTH_ENV, "disabled")
    problem = auth_problem(allow_no_auth=False)
    assert "RAY_AUTH_MODE=disabled" in problem and "run code as you" in problem and "--ray-allow-no-auth" in problem
    assert auth_problem(allow_no_auth=True) is None


def test_the_node_address():
    assert is_loopback("127.0.0.1") and not is_loopback("10.1.2.3") and not is_loopback("auto")
    assert node_address("auto") is None and node_address("10.1.2.3") == "10.1.2.3"


def test_the_reaper_keeps_the_logs_and_removes_the_session_and_its_link(tmp_path):
    session = tmp_path / "ray" / "session_2026-01-01_00-00-00_1_2"
    (session / "logs").mkdir(parents=True)
    (session / "logs" / "raylet.out").write_text("raylet log")
    (session / "sockets").mkdir()
    (tmp_path / "ray" / "session_latest").symlink_to(session)
    reaper.remove_session(session, tmp_path / "run" / "logs" / "ray")
    assert (tmp_path / "run" / "logs" / "ray" / "raylet.out").read_text() == "raylet log"
    assert not session.exists() and not (tmp_path / "ray" / "session_latest").is_symlink()


def test_the_reaper_ends_what_it_recorded_when_the_pipe_closes(tmp_path):
    # a stand-in "Ray process": a child of this test whose command line names the session
    session = tmp_path / "session_x"
    (session / "logs").mkdir(parents=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", str(session)])
    spec = f'{{"root": {os.getpid()}, "session_dir": "{session}", "logs_to": "{tmp_path / "kept"}"}}'
    proc = subprocess.Popen([sys.executable, reaper.__file__, spec], stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(2 * reaper.POLL_S + 1.0)                         # it has recorded the child
    t0 = time.monotonic()
    proc.stdin.close()                                          # what the driver's death does too
    assert proc.wait(timeout=10) == 0, proc.stderr.read()
    assert child.wait(timeout=5) == -9 and time.monotonic() - t0 < 5
    assert not session.exists() and (tmp_path / "kept").is_dir()
