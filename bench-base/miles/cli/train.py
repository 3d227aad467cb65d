"""`miles train` and `scripts/train.py`: parse flags, run, map the outcome to an exit code.

Signals are the CLI's business (library code installs none): the first SIGINT, SIGTERM or SIGHUP (the
terminal or SSH connection that started it went away) asks the run to stop (the current phase gets a share of --stop-timeout to finish, then `draining` saves the
last trained rollout when --save is set, then the teardown), and arms a hard deadline: the process
exits --stop-timeout seconds after that first signal whatever it is doing (a phase blocking the
event loop included). A second signal cancels the run, which cuts draining short. A phase cut by its
deadline (--phase-timeout) arms the same hard deadline: from the cut to the process's exit is bounded
as after a signal. Exit codes: 0 done, 1 failed, 2 bad config or input (a run dir or --save folder
another run holds included), 130 SIGINT, 143 SIGTERM, 129 SIGHUP. After SIGHUP a terminal on stdout or
stderr is gone (writes to it fail): those descriptors go to /dev/null, and the trace and the run's logs
say the rest.

The run dir's and --save's locks (miles.runtime.runlock) are taken here, before torch and Ray load,
so a second run into a busy folder is refused within a second. The process's umask gains
`miles.runtime.files.RUN_UMASK` first: nothing the run or the processes it starts create is writable
by other users.

A run that did its work but could not keep something (Ray's logs on a full disk, the trace's last
events) exits 0 and says what was lost, one warning line each; a write error while it runs (the trace,
metrics.jsonl, config.yaml, a checkpoint) fails it (exit 1), naming the file and the space left.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from miles.config.flags import parse_flags
from miles.config import ConfigError
from miles.runtime import MachineDefinitionError, MissingPackageError, with_disposer
from miles.runtime.files import human_bytes, restrict_umask, write_failed
from miles.runtime.runlock import FolderLocked, lock_folders, run_folders
from miles.runtime.runner import AFTER_DEADLINE_S, StopRequest
from miles.runtime.trace import new_run_id

EXIT_OK, EXIT_FAILED, EXIT_INPUT = 0, 1, 2
SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
EXIT_MARGIN_S = 1.5     # past the runner's bound after a phase deadline, for the process's own exit


def main(argv: Sequence[str] | None = None, *, default_machine: str = "sync", prog: str = "miles train") -> int:
    try:
        cfg, machine = parse_flags(argv, prog=prog)
    except ConfigError as exc:
        print(f"{prog}: bad configuration:\n{_indent(exc)}", file=sys.stderr)
        return EXIT_INPUT
    run_id = new_run_id()
    restrict_umask()           # before the first file: nothing the run (or Ray, started later) writes is others' to write
    locks = _lock_run_folders(cfg, run_id, prog)      # before torch and Ray load: a busy folder is refused at once
    if isinstance(locks, int):
        return locks
    from miles.phases.debug import debug_machine      # --load-debug-rollout-data / --debug-rollout-only pick theirs

    # the hard deadline stays armed until the process is gone: exiting (joining threads) is part of the bound
    return run_with_signals(cfg, machine or debug_machine(cfg) or default_machine, prog=prog, until_exit=True,
                            run_id=run_id, locks=locks)


def exit_bounded(code: int) -> None:
    """The process's end once a signal or a phase deadline bounded it: everything the run owned is torn
    down (or abandoned to the owner-bound actors' fate and the cluster's reaper) by now, and the
    interpreter's own finalization may not be: a Ray shutdown the teardown abandoned can hold it for
    many seconds, in C, where no timer thread runs. So flush and leave."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class SignalStop:
    """The first SIGINT/SIGTERM/SIGHUP sets the run's stop event and arms the hard deadline; a second cancels
    the run. The handlers are Python's (`signal.signal`), not the loop's, so they run even while a
    phase blocks the event loop (time.sleep, a blocking call), and the deadline is a thread."""

    def __init__(self, prog: str, stop_timeout_s: float, hard_exit_s: float | None = None):
        self.prog, self.stop_timeout_s = prog, stop_timeout_s
        self.hard_exit_s = stop_timeout_s if hard_exit_s is None else hard_exit_s
        # after a phase deadline the runner ends the run within AFTER_DEADLINE_S; this is the backstop
        self.deadline_exit_s = min(stop_timeout_s, AFTER_DEADLINE_S + EXIT_MARGIN_S) if hard_exit_s is None \
            else hard_exit_s
        self.received: list[int] = []
        self.event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._deadline: threading.Timer | None = None
        # known now: after a hangup isatty() on the lost terminal fails (EIO) and says False
        self._terminal_fds = [fd for fd in (1, 2) if os.isatty(fd)]

    def attach(self) -> asyncio.Event:
        """Called in the run's task: the event the run watches (set now if a signal came first)."""
        self._loop, self._task, self.event = asyncio.get_running_loop(), asyncio.current_task(), StopRequest()
        if self.received:
            self.event.request(signal.Signals(self.received[0]).name)
        return self.event

    def _on_signal(self, sig: int, _frame: Any) -> None:
        self.received.append(sig)
        if sig == signal.SIGHUP:
            detach_terminal(self._terminal_fds)
        if len(self.received) == 1:
            print(f"\n{self.prog}: {signal.Signals(sig).name}: stopping: the phase, draining (a save with --save) "
                  f"and the teardown get {self.stop_timeout_s:g} s in all (--stop-timeout); send it again to cut "
                  "draining short", file=sys.stderr, flush=True)
            self._deadline = threading.Timer(self.hard_exit_s, self._hard_exit, args=(sig,))
            self._deadline.daemon = True
            self._deadline.start()
            self._soon(lambda: self.event is not None and self.event.request(signal.Signals(sig).name))
        else:
            self._soon(lambda: self._task is not None and self._task.cancel())

    @property
    def bounded(self) -> bool:
        """A signal or a phase deadline armed the hard deadline: the process's exit is bounded."""
        return self._deadline is not None

    def _soon(self, fn: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn)

    def _hard_exit(self, sig: int) -> None:
        print(f"{self.prog}: still running {self.hard_exit_s:g} s after {signal.Signals(sig).name} "
              "(--stop-timeout): exiting now; the run's actors are owner-bound and go with this process, and a "
              "cluster it started is ended by its reaper (the trace is cut short)", file=sys.stderr, flush=True)
        os._exit(SIGNAL_EXIT[sig])

    def on_event(self, ev: dict[str, Any]) -> None:
        """A trace listener: a phase cut by its own deadline arms the hard deadline, as a signal does
        (what the phase left hung, a thread or an actor call, must not hold the exit)."""
        if ev.get("event") == "phase_timeout" and ev.get("reason") == "deadline" and self._deadline is None:
            self._deadline = threading.Timer(self.deadline_exit_s, self._deadline_exit, args=(ev.get("state"),))
            self._deadline.daemon = True
            self._deadline.start()

    def _deadline_exit(self, state: str) -> None:
        print(f"{self.prog}: still running {self.deadline_exit_s:g} s after phase {state!r} ran past its deadline: "
              "exiting now; the run's actors are owner-bound and go with this process (the trace is cut short)",
              file=sys.stderr, flush=True)
        os._exit(EXIT_FAILED)

    @contextmanager
    def installed(self, *, until_exit: bool) -> Iterator["SignalStop"]:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNAL_EXIT}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self._deadline is not None and not until_exit:
                self._deadline.cancel()


def detach_terminal(fds: Sequence[int]) -> None:
    """`fds` (stdout and stderr where they were a terminal at the start) to /dev/null: after a hangup a
    write to the terminal fails (EIO), and the stop's own messages, the progress line and Ray's
    forwarded logs must not fail the teardown they report on. A redirected stdout or stderr (a file,
    `nohup`) is not among them and stays."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in fds:
            os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def run_with_signals(cfg, machine: str, *, prog: str, until_exit: bool = False, hard_exit_s: float | None = None,
                     run_id: str | None = None, locks: list | None = None) -> int:
    """Run under the CLI's signal handling. `until_exit`: the hard deadline a signal arms stays armed
    after this returns (the CLI's own process); in-process callers (tests) leave it off, and may move
    the hard deadline (`hard_exit_s`, default --stop-timeout) past what they check in-loop. `locks`:
    the run's folders, locked by the caller under `run_id` (else locked here)."""
    run_id = run_id or new_run_id()
    locks = _lock_run_folders(cfg, run_id, prog) if locks is None else locks
    if isinstance(locks, int):
        return locks
    from miles.api.launch import train      # torch and Ray load only once the flags are known good
    from miles.tracking.logs import LogContext, process_logging

    cfg, progress = _with_progress(cfg, run_id)
    stops = SignalStop(prog, cfg.reliability.stop_timeout_s, hard_exit_s)

    async def main_task() -> None:
        stop = stops.attach()
        result = await with_disposer(train, cfg, machine=machine, stop=stop, run_id=run_id,
                                     listeners=[progress, stops.on_event], locks=locks)
        word = f"stopped ({signal.Signals(stops.received[0]).name})" if stops.received else "done"
        print(f"{prog}: {word}: {result.run_dir}", file=sys.stderr)
        for lost in result.lost:         # the run did its work: what it could not keep is a warning, not a failure
            print(f"  warning: {lost_line(lost)}", file=sys.stderr)

    received = stops.received
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")   # Ray's "(Actor pid=...)" prefixes: no colour codes in a log
    log_context = LogContext(run_id=run_id, log_dir=f"{cfg.trace.run_dir}/logs", role="driver",
                             level=cfg.tracking.worker_log_level)
    with process_logging(log_context), stops.installed(until_exit=until_exit):
        code = _run_and_report(main_task, progress, locks, received, prog=prog, log=log_context.path)
    if until_exit and stops.bounded:
        exit_bounded(code)
    return code


def _run_and_report(main_task: Callable[[], Any], progress: Any, locks: list, received: list[int], *, prog: str,
                    log: Path) -> int:
    try:
        try:
            asyncio.run(main_task())
        finally:
            progress.close()
            for lock in locks:          # the disposer released them, unless the run never got that far
                lock.release()
    except (asyncio.CancelledError, KeyboardInterrupt):
        return SIGNAL_EXIT.get(received[0] if received else signal.SIGINT, 130)
    except BaseException as exc:  # noqa: BLE001 - the process's last word on any failure
        return report_failure(exc, prog=prog, shown=progress.model.error is not None, log=log)
    return SIGNAL_EXIT[received[0]] if received else EXIT_OK


def lost_line(lost: dict[str, Any]) -> str:
    """One line for something a run lost without failing (a `lost` record: what, error, path, ...)."""
    where = f" ({lost['path']})" if lost.get("path") and str(lost["path"]) not in lost["error"] else ""
    free = f"; {human_bytes(lost['free_bytes'])} free there" if "free_bytes" in lost else ""
    seqs = f" (events {lost['from_seq']}-{lost['last_seq']})" if "from_seq" in lost else ""
    return f"lost {lost['what']}{seqs}{where}: {lost['error']}{free}"


def _lock_run_folders(cfg, run_id: str, prog: str) -> list | int:
    """The run dir's and --save's locks, or the exit code after saying why not: 2 when another run holds
    one or the folder cannot be used, 1 when its disk is full (not the input's fault: a retry may pass)."""
    c = cfg.checkpoint
    try:
        return lock_folders(run_folders(cfg.trace.run_dir, run_id, save=c.save, critic_save=c.critic_save),
                            run_id=run_id)
    except FolderLocked as exc:
        print(f"{prog}: bad input: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except OSError as exc:              # a --run-dir that is a file, a folder that cannot be created
        if exc.errno == errno.ENOSPC:   # not the input's fault: a later retry may pass
            print(f"{prog}: failed: {write_failed('a lock', exc.filename or '.', exc)}", file=sys.stderr)
            return EXIT_FAILED
        print(f"{prog}: bad input: cannot use {exc.filename or 'the run dir'} for the run: {exc.strerror or exc}",
              file=sys.stderr)
        return EXIT_INPUT


def report_failure(exc: BaseException, *, prog: str, shown: bool, log: Path) -> int:
    """The cause once, plainly: the progress display printed it first (`shown`), else it goes here;
    the full traceback (Ray's remote one included) goes to the driver's log file, not the terminal,
    once the run has its directory (a configuration refused before the run starts creates none).
    Bad input (a ConfigError, a reward that fails) exits 2, anything else 1."""
    import structlog

    from miles.runtime.trace import error_summary, strip_ansi

    root = _root(exc)
    started = log.parent.parent.exists()   # the run dir: bad input found before the run starts leaves none
    if started:
        structlog.get_logger().error("run_failed", stderr=False, summary=error_summary(exc),
                                     traceback=_traceback_text(exc, strip_ansi))
    code = EXIT_INPUT if _is_input_error(exc) else EXIT_FAILED
    word = "bad input" if code == EXIT_INPUT else "failed"
    if isinstance(root, MissingPackageError) and not shown:
        print(f"{prog}: missing package:\n{_indent(root)}", file=sys.stderr)
    elif isinstance(root, (ConfigError, MachineDefinitionError)) and not shown:
        print(f"{prog}: bad input:\n{_indent(root)}", file=sys.stderr)
    elif not shown:
        print(f"{prog}: {word}: {error_summary(exc)}", file=sys.stderr)
    else:
        print(f"{prog}: {word}: the error above", file=sys.stderr)
    for note in getattr(exc, "__notes__", []):
        print(f"  {strip_ansi(note)}", file=sys.stderr)
    if started:
        print(f"  full traceback: {log} (event run_failed)", file=sys.stderr)
    return code


def _traceback_text(exc: BaseException, strip: Callable[[str], str]) -> str:
    import traceback

    return strip("".join(traceback.format_exception(exc)))


def _with_progress(cfg, run_id: str):
    """The run dir made explicit (the progress display follows its metrics.jsonl) and the progress
    listener; with progress on, the trace's `auto` console is off (the display shows the states)."""
    from dataclasses import replace

    from miles.tracking.progress import Expected, Progress

    progress = Progress.for_terminal(cfg.tracking.progress, run_dir=cfg.trace.run_dir or f"runs/{run_id}",
                                     expected=Expected.of(cfg))
    console = "off" if progress.mode != "off" and cfg.trace.console == "auto" else cfg.trace.console
    trace = replace(cfg.trace, run_dir=cfg.trace.run_dir or f"runs/{run_id}", console=console)
    return replace(cfg, trace=trace), progress


def _is_input_error(exc: BaseException) -> bool:
    """The input's fault: a ConfigError or a bad machine file, or an error that says so (a user's reward
    that fails: `input_fault`), also when Ray delivers it wrapped."""
    root = _root(exc)
    return isinstance(root, (ConfigError, MachineDefinitionError)) or getattr(root, "input_fault", False) is True


def _root(exc: BaseException) -> BaseException:
    from miles.runtime.trace import root_cause   # ray.exceptions.RayTaskError keeps the original as `cause`

    return root_cause(exc)


def _indent(exc: BaseException) -> str:
    return "\n".join(f"  {line}" if not line.startswith("  ") else line for line in str(exc).splitlines())

