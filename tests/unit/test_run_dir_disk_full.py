"""A run directory whose disk fills: every write error names the file, what it is and the space left
(never a bare `OSError: [Errno 28]`); the trace and metrics.jsonl keep whole lines only; a trace that
breaks mid-run fails the run, one that breaks during the teardown and Ray's logs that do not fit are
losses a finished run reports without failing; the Ray session folder goes whatever happened to the
logs; and the run's files and folders are not writable by other users.

ENOSPC is injected at the write layer (`os.write`, `shutil.move`): no mount needed. The one whole run
on a real small tmpfs is tests/integration/test_run_dir_disk_full_e2e.py (extended)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from miles.api.launch import _write_config
from miles.checkpoint.checkpointer import DiskFull
from miles.cli.train import lost_line
from miles.cluster import reaper
from miles.cluster.local import LocalCluster
from miles.runtime import Tracer, read_trace
from miles.runtime.files import (RUN_UMASK, LineFile, WriteFailed, free_space, is_disk_full, restrict_umask,
                                 restricted_umask)
from miles.metrics.logs import LogContext, process_logging
from miles.metrics.jsonl import MetricsWriter, read_metrics
from tests.conftest import world_writable
from tests.stub_phases import make_stub_run, stub_phase

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


class FullAfter:
    """Stands for a disk with `room` bytes left: `os.write` writes what fits, then raises ENOSPC."""

    def __init__(self, room: int):
        self.room, self._write = room, os.write

    def __call__(self, fd: int, data) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = self._write(fd, bytes(data[:self.room]))
        self.room -= n
        return n


def test_a_write_error_names_the_file_what_it_is_and_the_space_left(tmp_path):
    err = WriteFailed("the trace", tmp_path / "trace.jsonl", ENOSPC)
    text = str(err)
    assert text.startswith(f"cannot write the trace {tmp_path / 'trace.jsonl'}: No space left on device (")
    assert text.endswith(" free on its disk)") and "unknown" not in text
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC and err.disk_full and is_disk_full(err)
    assert err.filename == str(tmp_path / "trace.jsonl") and err.__cause__ is ENOSPC
    import pickle                                          # Ray pickles an actor's error to the driver
    back = pickle.loads(pickle.dumps(err))
    assert str(back).startswith(str(err).split(" (")[0]) and back.errno == errno.ENOSPC


def test_a_line_that_does_not_fit_is_cut_back_out(tmp_path, monkeypatch):
    f = LineFile(tmp_path / "x.jsonl", "the trace")
    f.write_line('{"seq": 1}')
    monkeypatch.setattr(os, "write", FullAfter(5))           # half of the next line fits
    with pytest.raises(WriteFailed) as failed:
        f.write_line('{"seq": 2, "event": "long enough"}')
    assert (tmp_path / "x.jsonl").read_text() == '{"seq": 1}\n'   # whole lines only
    assert "the trace" in str(failed.value) and str(tmp_path / "x.jsonl") in str(failed.value)
    f.close()


def test_a_trace_that_breaks_records_why_keeps_whole_lines_and_still_tells_the_listeners(tmp_path, monkeypatch):
    heard = []
    tracer = Tracer(tmp_path / "trace.jsonl", run_id="r", listeners=[heard.append])
    tracer.emit("run_start")
    monkeypatch.setattr(os, "write", FullAfter(30))
    assert tracer.emit("phase_start", state="rollout") == 2       # never raises
    assert tracer.emit("phase_end", state="rollout") == 3
    monkeypatch.undo()
    trace = read_trace(tmp_path / "trace.jsonl")
    assert [e.event for e in trace] == ["run_start"] and not trace.truncated and trace.bad_lines == []
    assert tracer.broke_at == 2 and isinstance(tracer.write_error, WriteFailed)
    assert f"cannot write the trace {tmp_path / 'trace.jsonl'}: No space left on device" in str(tracer.write_error)
    assert [e["event"] for e in heard] == ["run_start", "phase_start", "phase_end"]
    assert tracer.trace_lost() == {"what": "the trace's last events", "error": str(tracer.write_error),
                                   "from_seq": 2, "last_seq": 3, "path": str(tmp_path / "trace.jsonl")}


def run_stub(tmp_path, monkeypatch, *, fill_in: str):
    """The sync machine on stub phases, the disk full from the start of `fill_in` (a state, or the teardown)."""
    runner, ctx = make_stub_run("sync", tmp_path / "trace.jsonl", num_rollout=3)
    fill = lambda: monkeypatch.setattr(os, "write", FullAfter(0))     # noqa: E731

    async def filling(c):
        if c.state == fill_in and c.next_rollout == (3 if fill_in == "draining" else 1):
            fill()
        result = await stub_phase(c)
        if c.state == "init" and fill_in == "teardown":
            c.disposer.add(fill, name="fills_the_disk")             # the first to be torn down
        return result
    runner.handlers = {s: filling for s in runner.handlers}
    try:
        return runner, asyncio.run(runner.run()), ctx
    except Exception as exc:     # noqa: BLE001 - the test looks at it
        return runner, exc, ctx
    finally:
        monkeypatch.undo()


def test_a_trace_that_breaks_mid_run_fails_the_run_naming_it_after_a_full_teardown(tmp_path, monkeypatch):
    runner, result, ctx = run_stub(tmp_path, monkeypatch, fill_in="train")      # training rollout 1
    assert isinstance(result, WriteFailed) and f"cannot write the trace {tmp_path / 'trace.jsonl'}" in str(result)
    assert ctx.next_rollout == 2 and runner.state == "shutdown"         # the phase ended, then the fail route
    assert ctx.drained_after is result and ctx.disposed == ["res2", "res1", "res0"]   # drained, all torn down
    trace = read_trace(tmp_path / "trace.jsonl")
    assert not trace.truncated and trace.bad_lines == []
    assert (trace.events[-1].event, trace.events[-1].state) == ("phase_start", "train")   # the disk filled after it


@pytest.mark.parametrize("fill_in", ["draining", "teardown"])
def test_a_trace_that_breaks_once_the_work_is_done_is_a_loss_not_a_failure(tmp_path, monkeypatch, fill_in):
    runner, result, ctx = run_stub(tmp_path, monkeypatch, fill_in=fill_in)
    assert result == "shutdown" and runner.failure is None and ctx.disposed == ["res2", "res1", "res0"]
    lost = runner.tracer.trace_lost()
    assert lost is not None and lost["from_seq"] < lost["last_seq"]
    line = lost_line(lost)
    assert line.startswith(f"lost the trace's last events (events {lost['from_seq']}-{lost['last_seq']}): cannot "
                           f"write the trace {tmp_path / 'trace.jsonl'}: No space left on device")


def test_metrics_rows_that_do_not_fit_raise_naming_the_file_and_keep_whole_rows(tmp_path, monkeypatch):
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    w.log(0, {"loss": 1.0})
    monkeypatch.setattr(os, "write", FullAfter(4))
    with pytest.raises(WriteFailed) as failed:
        w.log(1, {"loss": 0.5})
    monkeypatch.undo()
    assert f"cannot write the metrics file {tmp_path / 'metrics.jsonl'}: No space left on device" in str(failed.value)
    assert read_metrics(tmp_path) == [{"step": 0, "loss": 1.0}]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("\n")
    w.dispose()


def test_a_log_that_does_not_fit_is_said_once_on_stderr_and_the_process_goes_on(tmp_path, monkeypatch, capsys):
    import structlog

    with process_logging(LogContext(run_id="r", log_dir=str(tmp_path / "logs"), role="driver")):
        structlog.get_logger().info("first")
        monkeypatch.setattr(os, "write", FullAfter(0))
        structlog.get_logger().info("second")                 # does not raise
        structlog.get_logger().info("third")
        monkeypatch.undo()
    err = capsys.readouterr().err
    assert err.count("log_lost") == 1
    assert f"cannot write the log {tmp_path / 'logs' / 'driver-0.jsonl'}: No space left on device (" in err
    assert [json.loads(line)["event"] for line in (tmp_path / "logs" / "driver-0.jsonl").read_text().splitlines()] \
        == ["first"]


def test_config_yaml_that_does_not_fit_names_the_file_and_leaves_no_half_file(tmp_path, monkeypatch):
    real = Path.write_text

    def full(self, text, *a, **k):
        real(self, text[:10], *a, **k)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(WriteFailed) as failed:
        _write_config(tmp_path / "run", {"machine": "sync", "lr": 1e-3})
    assert f"cannot write the run's config {tmp_path / 'run' / 'config.yaml'}: No space left" in str(failed.value)
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_the_checkpoint_store_and_the_run_dir_say_the_space_the_same_way(tmp_path):
    # DiskFull (a --save folder) and WriteFailed share miles.runtime.files' helpers: one wording of the space
    free = free_space(tmp_path)
    from miles.runtime.files import human_bytes
    assert human_bytes(free) in str(DiskFull(tmp_path, 3, free))
    assert human_bytes(free_space(tmp_path)).split()[1] in str(WriteFailed("the trace", tmp_path / "t", ENOSPC))


# -- the reaper on a full run dir ---------------------------------------------------------------------


def make_session(tmp_path: Path) -> Path:
    session = tmp_path / "private" / "ray" / "session_2026-01-01_00-00-00_1_2"
    for sub in ("logs/old", "sockets", "runtime_resources/pip"):
        (session / sub).mkdir(parents=True)
    (session / "logs" / "raylet.out").write_text("raylet log " * 100)
    (session / "logs" / "gcs_server.out").write_text("gcs log")
    for d in (session, session / "logs", session / "logs" / "old", session / "sockets", session / "runtime_resources",
              session / "runtime_resources" / "pip"):
        os.chmod(d, 0o777)                                    # what Ray does (try_make_directory_shared)
    return session


def test_logs_that_do_not_fit_are_lost_not_half_kept_and_the_session_goes_anyway(tmp_path, monkeypatch):
    session = make_session(tmp_path)
    logs_to = tmp_path / "run" / "logs" / "ray"

    def move_fills(src, dst):                  # across file systems: the first file fits, the second fills the disk
        Path(dst).mkdir()
        shutil.copy2(Path(src) / "gcs_server.out", Path(dst) / "gcs_server.out")
        raise shutil.Error([(str(Path(src) / "raylet.out"), str(Path(dst) / "raylet.out"),
                             "[Errno 28] No space left on device")])
    monkeypatch.setattr(reaper.shutil, "move", move_fills)
    lost = reaper.remove_session(session, logs_to)
    monkeypatch.undo()
    assert lost["what"] == "Ray's logs" and lost["path"] == str(logs_to)
    assert "No space left on device" in lost["error"] and isinstance(lost["free_bytes"], int)
    assert not logs_to.exists()                               # what was copied went again: the trace needs the room
    assert not session.exists()
    assert lost_line(lost).startswith(f"lost Ray's logs ({logs_to}): ") and " free there" in lost_line(lost)


def test_the_reaper_takes_shared_write_off_and_keeps_the_logs_private(tmp_path):
    session = make_session(tmp_path)
    fixed = reaper.no_shared_write(session)
    assert len(fixed) == 6 and world_writable(session) == []
    os.chmod(session / "logs" / "old", 0o777)
    logs_to = tmp_path / "run" / "logs" / "ray"
    assert reaper.remove_session(session, logs_to) is None
    assert (logs_to / "raylet.out").is_file() and world_writable(tmp_path / "run") == []


def test_the_reapers_report_comes_through_its_pipe_not_a_file_on_the_full_disk(tmp_path):
    session = make_session(tmp_path)
    private = tmp_path / "private"
    spec = {"root": os.getpid(), "session_dir": str(session), "logs_to": str(tmp_path / "run" / "logs" / "ray"),
            "private_dir": str(private)}
    proc = subprocess.Popen([sys.executable, reaper.__file__, json.dumps(spec)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    cluster = LocalCluster(session, tmp_path / "run" / "logs" / "ray", proc)
    assert cluster.close() is None                      # nothing lost
    assert not private.exists() and (tmp_path / "run" / "logs" / "ray" / "raylet.out").is_file()


def test_the_run_umask_takes_group_and_world_write_and_keeps_a_stricter_one():
    old = os.umask(0o002)
    try:
        assert restrict_umask() == 0o022 == RUN_UMASK
        os.umask(0o077)
        assert restrict_umask() == 0o077
        os.umask(0o002)
        with restricted_umask() as inside:                # a host's umask (miles.Run) comes back after the block
            assert inside == 0o022 and os.umask(inside) == 0o022
        assert os.umask(0o002) == 0o002
    finally:
        os.umask(old)


def test_a_saved_rollout_that_does_not_fit_names_the_file_and_leaves_no_partial(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from miles.rollout.debug_data import save_rollout_data

    def full(obj, f, *a, **k):
        Path(f).write_bytes(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0")
    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr("miles.rollout.debug_data.free_space", lambda p: 0)     # what that message means
    with pytest.raises(WriteFailed) as failed:
        save_rollout_data(tmp_path / "rollouts" / "rollout_3.pt", 3, [], {})
    assert str(failed.value).startswith(f"cannot write the saved rollout (--save-debug-rollout-data) "
                                        f"{tmp_path / 'rollouts' / 'rollout_3.pt'}: No space left on device")
    assert list((tmp_path / "rollouts").iterdir()) == []


def test_a_run_dir_too_full_for_its_lock_fails_with_exit_1_naming_the_file(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from miles.cli.train import EXIT_FAILED, _lock_run_folders

    cfg = SimpleNamespace(trace=SimpleNamespace(run_dir=str(tmp_path / "run")),   # the two slices it reads
                          checkpoint=SimpleNamespace(save=None, critic_save=None))
    monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    assert _lock_run_folders(cfg, "r", "miles train") == EXIT_FAILED          # not bad input (2): a retry may pass
    err = capsys.readouterr().err
    assert err.startswith(f"miles train: failed: cannot write the lock of --run-dir {tmp_path / 'run' / '.miles.lock'}: "
                          "No space left on device (")


def fake_reaper(script: str) -> subprocess.Popen:
    """A stand-in reaper: waits for the driver's pipe to close, then runs `script`."""
    return subprocess.Popen([sys.executable, "-c", f"import sys, json; sys.stdin.read(); {script}"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def test_close_returns_what_the_reaper_lost_and_fails_only_when_the_session_is_left(tmp_path):
    session = tmp_path / "session_x"
    lost = {"what": "Ray's logs", "path": "/run/logs/ray", "error": "No space left on device", "free_bytes": 0}
    report = json.dumps({"event": "reaped", "lost": lost})
    assert LocalCluster(session, None, fake_reaper(f"print({report!r})")).close() == lost
    assert LocalCluster(session, None, fake_reaper("print('{}')")).close() is None
    session.mkdir()                                          # the reaper could not delete it
    with pytest.raises(RuntimeError, match=f"the reaper of Ray session {session} exited 1 and left the folder"):
        LocalCluster(session, tmp_path / "logs" / "ray", fake_reaper("sys.exit(1)")).close()
