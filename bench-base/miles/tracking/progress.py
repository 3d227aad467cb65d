"""Live progress of a run on the terminal: a trace listener, attached by the CLI (never by the library).

    progress = Progress.for_terminal("auto", run_dir=run_dir, expected=Expected.of(cfg))
    await train(cfg, disposer=d, listeners=[progress])     # the tracer calls progress(event)

What it shows: the state the run is in, rollout r of N, a bar for the rollout in progress (samples)
and the training step (micro-batches), the last reward, KL, step time, tokens/s and eval accuracy,
and an ETA. On a terminal it is a rich live display; elsewhere (CI, a log file) one plain line per
trained rollout, per eval and per lifecycle milestone. A phase that runs long gets a line every 30 s
(the runner's `phase_waiting` heartbeat, on a terminal too): how long it has run, when its deadline
cuts it, what it waits on, and how many samples the running rollout or eval has made and scored, with
the engine and reward calls still running.

Where the numbers come from: the trace events (states, rollout ids, reward, KL, samples) and the
row the run just appended to metrics.jsonl (tokens/s, entropy, response length). The actors report
no progress while a phase runs (that would cost Ray round trips on the hot path), so the bars inside
a phase are estimates from how long the same phase took last time, marked `~`, and jump to the
real count when the phase ends. The first rollout of a run has no estimate: its bar pulses.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from miles.tracking.metrics import console_line

MILESTONES = ("init", "draining", "shutdown")       # states a plain log line announces
STEP_WINDOW = 5                                      # step times the ETA averages over


@dataclass(frozen=True)
class Expected:
    """Sizes the run's config fixes: the totals of the bars."""

    samples_per_rollout: int | None = None
    micro_batches_per_rollout: int | None = None
    num_rollout: int | None = None
    sft: bool = False                        # SFT shows its loss and tokens trained, not RL numbers

    @classmethod
    def of(cls, cfg: Any) -> "Expected":
        """From a RunConfig (duck-typed: this module imports nothing from the run)."""
        n = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
        return cls(samples_per_rollout=n, micro_batches_per_rollout=-(-n // cfg.train.micro_batch_size),
                   num_rollout=cfg.num_rollout, sft=cfg.algorithm.loss_type == "sft_loss")


@dataclass
class ProgressModel:
    """What the display shows, kept up to date from trace events. Pure: no terminal, no clock
    (times are the events' `mono`, and `now` is passed in)."""

    expected: Expected = field(default_factory=Expected)
    run_id: str = ""
    state: str = ""
    rollout_id: int | None = None
    num_rollout: int | None = None
    start_rollout: int = 0
    trained: int = 0                          # rollouts trained by this invocation
    last_trained: int | None = None
    phase_start: float | None = None          # mono of the current phase's start
    last_duration: dict[str, float] = field(default_factory=dict)   # state -> its last duration
    stats: dict[str, float] = field(default_factory=dict)           # reward, kl, step_s, tok_s, samples_s
    evals: dict[str, float] = field(default_factory=dict)           # eval set -> pass@1
    step_times: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    last_step_mono: float | None = None
    stopping: bool = False
    no_signal: int = 0                        # rollouts in a row with equal rewards in every group (from the trace)
    tokens_trained: float = 0.0               # SFT: response tokens trained on by this invocation
    error: str | None = None
    outcome: str | None = None
    mono: float = 0.0                          # the latest event's mono

    def __post_init__(self) -> None:
        self.num_rollout = self.num_rollout or self.expected.num_rollout

    # -- events ---------------------------------------------------------------------------------
    def update(self, ev: dict[str, Any]) -> list[str]:
        """Apply one trace event; return the plain lines it produces (none for most events)."""
        self.mono = float(ev.get("mono", self.mono))
        handler = getattr(self, f"_on_{ev['event']}", None)
        return (handler(ev) or []) if handler is not None else []

    def _on_run_start(self, ev: dict[str, Any]) -> list[str]:
        self.run_id = ev.get("run_id", "")
        return [f"run {self.run_id} started"]

    def _on_plan(self, ev: dict[str, Any]) -> None:
        self.num_rollout = ev.get("num_rollout", self.num_rollout)

    def _on_eval_begin(self, ev: dict[str, Any]) -> list[str]:
        return [f"evaluating after {ev.get('rollout_id')} rollouts: {ev.get('why')}"]

    def _on_phase_waiting(self, ev: dict[str, Any]) -> list[str]:
        return [waiting_line(ev)]

    def _on_resumed(self, ev: dict[str, Any]) -> list[str]:
        self.start_rollout = int(ev.get("next_rollout", 0))
        line = f"resumed after rollout {ev.get('rollout_id')} from {ev.get('path')}"
        return [f"{line} ({ev['note']})" if ev.get("note") else line]

    def _on_resume_skipped(self, ev: dict[str, Any]) -> list[str]:
        return [f"starting fresh: {ev.get('reason')} under --load {ev.get('root')}"]

    def _on_checkpoint_skipped(self, ev: dict[str, Any]) -> list[str]:
        return [ev.get("message") or f"checkpoint {ev.get('path')} skipped: {(ev.get('problems') or ['?'])[0]}"]

    def _on_lock_taken_over(self, ev: dict[str, Any]) -> list[str]:
        return [str(ev.get("message"))]

    def _on_engine_picked(self, ev: dict[str, Any]) -> list[str]:
        what = ev.get("architecture") or ev.get("family") or "the model"
        line = f"engine: {ev.get('cls')} for {what}: {ev.get('why')}"
        return [("warning: " + line) if ev.get("fast_path_refused") else line]

    def _on_placement(self, ev: dict[str, Any]) -> list[str]:
        return ([f"colocating: {ev['auto_colocate']}"] if ev.get("auto_colocate") else []) + \
            ([f"engines: {ev['auto_engines']}"] if ev.get("auto_engines") else [])

    def _on_start_rollout_set(self, ev: dict[str, Any]) -> list[str]:
        self.start_rollout = int(ev.get("next_rollout", 0))
        return [f"starting at rollout {self.start_rollout} (--start-rollout-id)"]

    def _on_phase_start(self, ev: dict[str, Any]) -> list[str]:
        self.state, self.phase_start = ev.get("state", ""), self.mono
        if ev.get("rollout_id") is not None:
            self.rollout_id = ev["rollout_id"]
        if self.state == "draining":
            return ["draining after the error" if self.error else "draining"]
        return [self.state] if self.state in MILESTONES and self.state != "draining" else []

    def _on_phase_end(self, ev: dict[str, Any]) -> None:
        if ev.get("duration_s") is not None:
            self.last_duration[ev.get("state", "")] = float(ev["duration_s"])

    def _on_rollout_done(self, ev: dict[str, Any]) -> None:
        self.stats["reward"] = float(ev.get("reward_mean", float("nan")))
        since = self.mono - self.phase_start if self.phase_start is not None and self.state == "rollout" else None
        if since and ev.get("samples"):
            self.stats["samples_s"] = ev["samples"] / since

    def _on_metrics(self, ev: dict[str, Any]) -> None:
        rid = ev.get("rollout_id")
        self.last_trained, self.trained = rid, self.trained + 1
        for key, name in (("reward_mean", "reward"), ("kl", "kl"), ("loss", "loss")):
            if isinstance(ev.get(key), (int, float)):
                self.stats[name] = float(ev[key])
        self.no_signal = int(ev.get("zero_variance_rollouts") or 0)
        if isinstance(ev.get("train_tokens"), (int, float)):
            self.tokens_trained += ev["train_tokens"]
        if self.last_step_mono is not None:
            self.step_times.append(self.mono - self.last_step_mono)
            self.stats["step_s"] = self.step_times[-1]
        self.last_step_mono = self.mono

    def add_row(self, row: dict[str, Any]) -> list[str]:
        """A metrics.jsonl row (train or eval): the numbers the trace events do not carry."""
        if row.get("kind") == "eval":
            self.evals.update({k.split("/")[1]: v for k, v in row.items()
                               if k.startswith("eval/") and k.endswith("/pass@1") and isinstance(v, (int, float))})
            return [console_line(int(row.get("step", 0)), row)]
        for key, name in (("gen_tokens_per_s", "tok_s"), ("entropy", "entropy"), ("response_len_mean", "len")):
            if isinstance(row.get(key), (int, float)):
                self.stats[name] = float(row[key])
        if self.expected.sft and row.get("train_time_s") and isinstance(row.get("train_tokens"), (int, float)):
            self.stats["tok_s"] = row["train_tokens"] / row["train_time_s"]      # trained, not generated
        return [self.rollout_line()]

    def _on_eval_done(self, ev: dict[str, Any]) -> None:
        self._pass_at_1(ev)

    def _on_eval_end(self, ev: dict[str, Any]) -> None:
        if ev.get("outcome") == "ok":
            self._pass_at_1(ev)

    def _pass_at_1(self, ev: dict[str, Any]) -> None:
        self.evals.update({k.split("/")[1]: v for k, v in ev.items() if k.startswith("eval/") and k.endswith("/pass@1")})

    def _on_stop_honoured(self, ev: dict[str, Any]) -> list[str]:
        self.stopping = True
        return [f"stop requested: finishing after {ev.get('state')}"]

    def _on_engine_restart(self, ev: dict[str, Any]) -> list[str]:
        return [f"engine {ev.get('engine')} died; restarting it"]

    def _on_warning(self, ev: dict[str, Any]) -> list[str]:
        return [f"warning: {ev.get('message', ev.get('code', ''))}"]

    def _on_error(self, ev: dict[str, Any]) -> list[str]:
        err = ev.get("error") or {}
        first = self.error is None
        self.error = err.get("summary") or f"{err.get('type', 'error')}: {err.get('message', '')}".strip()
        return [f"error in {ev.get('state')}: {self.error}"] if first else []   # the cause once: the first

    def _on_run_end(self, ev: dict[str, Any]) -> list[str]:
        self.outcome, self.state = ev.get("outcome", ""), "shutdown"
        return [f"run {self.run_id} ended: {self.outcome} after {_clock(ev.get('duration_s'))}"]

    # -- what the display derives -----------------------------------------------------------------
    @property
    def done(self) -> int:
        return self.start_rollout + self.trained

    def eta_s(self) -> float | None:
        """Rollouts left times the mean of the recent step times."""
        if not self.step_times or self.num_rollout is None:
            return None
        return max(self.num_rollout - self.done, 0) * sum(self.step_times) / len(self.step_times)

    def phase_progress(self, now: float) -> tuple[float | None, float | None, bool]:
        """(completed, total, estimated) of the bar inside the current phase: samples in rollout,
        micro-batches in train; completed is None while nothing is known (pulse)."""
        total = {"rollout": self.expected.samples_per_rollout,
                 "train": self.expected.micro_batches_per_rollout}.get(self.state)
        last = self.last_duration.get(self.state)
        if total is None or self.phase_start is None or not last:
            return None, total, True
        fraction = min((now - self.phase_start) / last, 0.99)     # an estimate never claims done
        return fraction * total, total, True

    def rollout_line(self) -> str:
        s = self.stats
        parts = [f"rollout {self.last_trained} ({self.done}/{self.num_rollout or '?'})"]
        for key, label, fmt in _line_keys(self.expected.sft):
            if key in s:
                parts.append(f"{label}={s[key]:{fmt}}" + ("s" if key == "step_s" else ""))
        if self.expected.sft:
            parts.insert(2, f"tokens={int(self.tokens_trained)}")
        eta = self.eta_s()
        if eta is not None:
            parts.append(f"eta={_clock(eta)}")
        if self.no_signal:
            parts.append(f"WARNING: equal rewards in every group for {self.no_signal} rollouts, nothing to learn")
        return "  ".join(parts)


def waiting_line(ev: dict[str, Any]) -> str:
    """The progress line of a phase that runs long (a `phase_waiting` event)."""
    state, rid = ev.get("state", "?"), ev.get("rollout_id")
    head = f"{state}{'' if rid is None else f' (rollout {rid})'} still running after {_clock(ev.get('running_s'))}"
    if ev.get("cut_in_s") is not None:
        head += f", cut by its deadline in {_clock(ev['cut_in_s'])}"
    if ev.get("unanswered"):
        return (f"{head}; the rollout executor did not answer ({ev['unanswered']}): busy, or its event loop "
                "blocked by a reward or generate function running in it")
    parts = [f"{head}; waiting for {ev.get('waiting_for', 'the phase')}"]
    parts += [_activity_text(a) for a in ev.get("activities") or []]
    return "; ".join(parts)


def _activity_text(a: dict[str, Any]) -> str:
    n = a.get("samples") or "?"
    text = f"{a.get('activity')}: {a.get('generated', 0)}/{n} samples generated, {a.get('scored', 0)}/{n} scored"
    if a.get("engine_pending"):
        text += f", {a['engine_pending']} in engine calls (oldest call {a.get('engine_oldest_s', 0):.0f} s)"
    if a.get("reward_pending"):
        bound = (f"--reward-timeout {a['reward_timeout_s']:g} s" if a.get("reward_timeout_s")
                 else "no --reward-timeout")
        text += (f", {a['reward_pending']} awaiting their reward (oldest call {a.get('reward_oldest_s', 0):.0f} s; "
                 f"{bound})")
    return text


def _line_keys(sft: bool) -> tuple[tuple[str, str, str], ...]:
    """What a trained rollout's line shows: RL's reward and KL, or SFT's loss and training speed."""
    if sft:
        return (("loss", "loss", ".4g"), ("step_s", "step", ".1f"), ("tok_s", "train tok/s", ".0f"))
    return (("reward", "reward", ".4g"), ("kl", "kl", ".3g"), ("entropy", "ent", ".3g"),
            ("step_s", "step", ".1f"), ("tok_s", "tok/s", ".0f"))


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """The trace listener: feeds the model, follows metrics.jsonl, and renders (rich or plain).
    Call `close()` when the run is over (the CLI does, in a finally)."""

    def __init__(self, mode: str, *, run_dir: str | Path | None = None, expected: Expected | None = None,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        if mode not in ("rich", "plain", "off"):
            raise ValueError(f"progress mode {mode!r}: use rich, plain or off")
        self.mode = mode
        self.model = ProgressModel(expected=expected or Expected())
        self._stream = stream if stream is not None else sys.stderr
        self._metrics = _Follower(Path(run_dir) / "metrics.jsonl") if run_dir is not None else None
        self._lock = threading.Lock()
        self._clock, self._mono0 = clock, None         # event mono ↔ our clock, for the live estimate
        self._live: Any = None

    @classmethod
    def for_terminal(cls, mode: str = "auto", **kwargs: Any) -> "Progress":
        """auto: rich on a terminal, plain lines elsewhere."""
        stream = kwargs.get("stream") or sys.stderr
        if mode == "auto":
            mode = "rich" if stream.isatty() and not _dumb_terminal() else "plain"
        return cls(mode, **kwargs)

    def __call__(self, ev: dict[str, Any]) -> None:
        if self.mode == "off":
            return
        try:
            self._show(ev)
        except Exception as exc:  # noqa: BLE001 - the tracer calls us inside the run: a display bug must not fail it
            self.close()
            self.mode = "off"
            print(f"miles: progress display off after {type(exc).__name__}: {exc}", file=self._stream, flush=True)

    def _show(self, ev: dict[str, Any]) -> None:
        with self._lock:
            if self._mono0 is None and "mono" in ev:
                self._mono0 = self._clock() - float(ev["mono"])
            lines = self.model.update(ev)
            lines += self._rows(ev)
        if self.mode == "rich" and ev["event"] == "run_start":
            self._start_live()
        if self.mode == "rich" and ev["event"] == "run_end":
            self.close()
        for line in lines:                  # above the live display, if there is one
            if self._live is not None:
                self._live.console.print(f"miles: {line}", highlight=False, markup=False)
            else:
                print(f"miles: {line}", file=self._stream, flush=True)

    def _rows(self, ev: dict[str, Any]) -> list[str]:
        """Lines for a trained rollout or an eval, with the metrics.jsonl row when there is one."""
        kind = ev["event"]
        if kind not in ("metrics", "eval_done") and not (kind == "eval_end" and ev.get("outcome") == "ok"):
            return []
        if self._metrics is not None:
            return [line for row in self._metrics.new_rows() for line in self.model.add_row(row)]
        if kind == "metrics":
            return [self.model.rollout_line()]
        return [f"eval after {ev.get('rollout_id')} rollouts  " +
                "  ".join(f"{k}={v:.3f}" for k, v in self.model.evals.items())]

    def _now(self) -> float:
        return self._clock() - (self._mono0 or 0.0)

    # -- rich ---------------------------------------------------------------------------------------
    def _start_live(self) -> None:
        from rich.console import Console
        from rich.live import Live

        console = Console(file=self._stream, force_terminal=True if self._stream.isatty() else None)
        self._live = Live(get_renderable=self.render, console=console, refresh_per_second=4, transient=False,
                          redirect_stdout=True, redirect_stderr=True)
        self._live.start()

    def render(self) -> Any:
        """The live display: state and times, the rollouts bar, the phase bar, the last numbers."""
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        with self._lock:
            m, now = self.model, self._now()
            head = Text.assemble(("miles ", "bold"), (m.state or "starting", "bold cyan"),
                                 (" (stopping)" if m.stopping else "", "yellow"),
                                 f"   run {m.run_id}   elapsed {_clock(now)}   eta {_clock(m.eta_s())}")
            bars = Table.grid(padding=(0, 1))
            bars.add_column(justify="right", style="bold", min_width=10)
            bars.add_column(width=40)
            bars.add_column()
            total = m.num_rollout or None
            bars.add_row("rollouts", ProgressBar(total=total, completed=m.done, width=40), f"{m.done}/{total or '?'}")
            completed, phase_total, estimated = m.phase_progress(now)
            unit = {"rollout": "samples", "train": "micro-batches"}.get(m.state)
            if unit is not None:
                mark = "~" if estimated and completed is not None else ""
                bars.add_row(f"{m.state} {m.rollout_id}",
                             ProgressBar(total=phase_total if completed is not None else None,
                                         completed=completed or 0, width=40),
                             f"{mark}{int(completed or 0)}/{phase_total} {unit}")
            parts = [head, bars, Text(_stats_text(m), style="dim" if not m.stats else "")]
            if m.error:
                parts.append(Text(f"error: {m.error}", style="red"))
            return Group(*parts)

    def close(self) -> None:
        """Stop the live display (idempotent); the last frame stays on the terminal."""
        live, self._live = self._live, None
        if live is not None:
            live.refresh()
            live.stop()


def _stats_text(m: ProgressModel) -> str:
    s, parts = m.stats, []
    keys = (("loss", "loss", ".4g"), ("step_s", "step s", ".1f"), ("tok_s", "train tok/s", ".0f")) if m.expected.sft \
        else (("reward", "reward", ".4g"), ("kl", "kl", ".3g"), ("entropy", "entropy", ".3g"), ("step_s", "step s", ".1f"),
              ("tok_s", "tok/s", ".0f"), ("samples_s", "samples/s", ".1f"))
    if m.expected.sft:
        parts.append(f"tokens {int(m.tokens_trained)}")
    for key, label, fmt in keys:
        if key in s:
            parts.append(f"{label} {s[key]:{fmt}}")
    if m.no_signal:
        parts.append(f"WARNING: equal rewards in every group for {m.no_signal} rollouts")
    parts += [f"{name} pass@1 {v:.3f}" for name, v in m.evals.items()]
    return "   ".join(parts) or "-"


def _dumb_terminal() -> bool:
    import os
    return os.environ.get("TERM") == "dumb"


class _Follower:
    """Reads the rows appended to a JSONL file since the last call (the run writes and flushes each)."""

    def __init__(self, path: Path):
        # rows already there belong to an earlier invocation in the same run dir
        self.path, self._offset = path, path.stat().st_size if path.exists() else 0

    def new_rows(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1          # a line still being written waits for the next call
        self._offset += end
        rows = []
        for line in data[:end].splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return rows
