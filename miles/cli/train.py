"""`miles train` and `scripts/train.py`: parse flags, run, map the outcome to an exit code.

Signals are the CLI's business (library code installs none): the first SIGINT or SIGTERM asks the
run to stop (the current phase finishes, then `draining`); a second cancels it, which cuts draining
short. Exit codes: 0 done, 1 failed, 2 bad config or input, 130 SIGINT, 143 SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Sequence

from miles.config.flags import parse_flags
from miles.config import ConfigError
from miles.runtime import MachineDefinitionError, with_disposer

EXIT_OK, EXIT_FAILED, EXIT_INPUT = 0, 1, 2
SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


def main(argv: Sequence[str] | None = None, *, default_machine: str = "sync", prog: str = "miles train") -> int:
    try:
        cfg, machine = parse_flags(argv, prog=prog)
    except ConfigError as exc:
        print(f"{prog}: bad configuration:\n{_indent(exc)}", file=sys.stderr)
        return EXIT_INPUT
    from miles.phases.debug import debug_machine      # --load-debug-rollout-data / --debug-rollout-only pick theirs

    return run_with_signals(cfg, machine or debug_machine(cfg) or default_machine, prog=prog)


def run_with_signals(cfg, machine: str, *, prog: str) -> int:
    from miles.api.launch import new_run_id, train      # torch and Ray load only once the flags are known good
    from miles.tracking.logs import LogContext, process_logging

    received: list[int] = []
    run_id = new_run_id()
    cfg, progress = _with_progress(cfg, run_id)

    async def main_task() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        task = asyncio.current_task()

        def on_signal(sig: int) -> None:
            received.append(sig)
            if len(received) == 1:
                print(f"\n{prog}: {signal.Signals(sig).name}: finishing the current phase, then draining "
                      "(send it again to cut draining short)", file=sys.stderr)
                stop.set()
            else:
                task.cancel()

        for sig in SIGNAL_EXIT:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            result = await with_disposer(train, cfg, machine=machine, stop=stop, run_id=run_id, listeners=[progress])
            print(f"{prog}: done: {result.run_dir}", file=sys.stderr)
        finally:
            for sig in SIGNAL_EXIT:
                loop.remove_signal_handler(sig)

    try:
        with process_logging(LogContext(run_id=run_id, log_dir=f"{cfg.trace.run_dir}/logs", role="driver",
                                         level=cfg.tracking.worker_log_level)):
            try:
                asyncio.run(main_task())
            finally:
                progress.close()
    except (ConfigError, MachineDefinitionError) as exc:
        print(f"{prog}: bad input:\n{_indent(exc)}", file=sys.stderr)
        return EXIT_INPUT
    except (asyncio.CancelledError, KeyboardInterrupt):
        return SIGNAL_EXIT.get(received[0] if received else signal.SIGINT, 130)
    except BaseException as exc:  # noqa: BLE001 - the process's last word on any failure
        if _is_input_error(exc):
            print(f"{prog}: bad input: {_root(exc)}", file=sys.stderr)
            return EXIT_INPUT
        print(f"{prog}: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        for note in getattr(exc, "__notes__", []):
            print(f"  {note}", file=sys.stderr)
        return EXIT_FAILED
    return SIGNAL_EXIT[received[0]] if received else EXIT_OK


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
    """A ConfigError raised inside an actor arrives wrapped by Ray; unwrap it."""
    return isinstance(_root(exc), ConfigError)


def _root(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)       # ray.exceptions.RayTaskError keeps the original here
    return cause if isinstance(cause, BaseException) else exc


def _indent(exc: BaseException) -> str:
    return "\n".join(f"  {line}" if not line.startswith("  ") else line for line in str(exc).splitlines())

