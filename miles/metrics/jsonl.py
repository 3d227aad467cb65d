"""The metrics file: one JSONL line per trained rollout and per eval, `<run_dir>/metrics.jsonl`.

It is the run's record of its numbers (`miles plot`, `read_metrics`, the demo's summary read it); the
other sinks (TensorBoard, W&B, in `miles.metrics.sinks`) are views of the same rows. Library code
prints nothing: `console_line` is what the CLI's plain progress lines show.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TextIO

from miles.runtime.files import LineFile, WriteFailed

CONSOLE_KEYS = (("reward_mean", "reward"), ("eval_pass@1", "eval"), ("kl", "kl"), ("entropy", "ent"),
                ("clip_frac", "clip"), ("response_len_mean", "len"), ("gen_tokens_per_s", "tok/s"),
                ("step_time_s", "step_s"))


class MetricsWriter:
    """Appends `{"step": rollout_id, ...}` lines to `<run_dir>/metrics.jsonl`, each on disk when `log`
    returns. The run owns the file. A row that cannot be written (a full disk) is cut back out and
    raises WriteFailed naming the file and the space left: the run fails, its record would have a gap."""

    resource_name = "metrics_writer"

    def __init__(self, path: str | Path, *, console: TextIO | None = None):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise WriteFailed("the metrics file's folder", self.path.parent, exc)
        self._file = LineFile(self.path, "the metrics file")
        self._console = console

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write_line(json.dumps(row))
        if self._console is not None:
            self._console.write(console_line(step, row) + "\n")
            self._console.flush()

    def flush(self) -> None:
        """Each row is written through when logged: nothing is buffered."""

    def dispose(self) -> None:
        """Close metrics.jsonl."""
        self._file.close()


def console_line(step: int, row: dict[str, Any]) -> str:
    parts = [f"eval after {step} rollouts" if row.get("kind") == "eval" else f"rollout {step}"]
    for key, label in CONSOLE_KEYS:
        v = row.get(key)
        if isinstance(v, (int, float)):
            parts.append(f"{label}={v:.4g}")
    evals = [f"{k.split('/')[1]}={v:.3f}" for k, v in row.items() if k.startswith("eval/") and k.endswith("/pass@1")]
    return "  ".join(parts + evals)


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


# the metrics the wall clock gives, the numbers two runs of the same seed may differ in: durations and
# rates (their names end in "_s": step_time_s, gen_tokens_per_s) and the trainer's achieved throughput; and
# what the process's own history decides (graphs compiled: a resumed run's new process compiles again)
TIMED_NAMES = ("tflops", "mfu", "layer_compiles")


def is_timed(key: str) -> bool:
    """Whether metric `key` is measured by the clock, not computed from the data and the weights."""
    return key.endswith("_s") or key.rsplit("/", 1)[-1] in TIMED_NAMES


def untimed(row: dict[str, Any]) -> dict[str, Any]:
    """`row` without its timed metrics: what reruns of one seed (or a resumed run) must reproduce."""
    return {k: v for k, v in row.items() if not is_timed(k)}


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a run dir's (or a file's) metrics.jsonl; a line cut off by a killed driver is skipped."""
    p = Path(path)
    p = p / "metrics.jsonl" if p.is_dir() else p
    rows = []
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
