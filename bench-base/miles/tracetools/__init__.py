"""Reading a run from its trace alone: the model behind `miles trace ...` and `miles machine ...` (miles/cli).

Nothing here imports torch or Ray; the commands read `trace.jsonl` and the machine YAML only.
"""

from .check import CheckReport, Violation, check_trace, first_allowed
from .diff import Divergence, diff_traces
from .paths import Step, covering_paths, guard_values, simple_paths
from .timeline import FailureView, PhaseSpan, TeardownStep, Timeline, build_timeline

__all__ = [
    "CheckReport", "Divergence", "FailureView", "PhaseSpan", "Step", "TeardownStep", "Timeline",
    "Violation", "build_timeline", "check_trace", "covering_paths", "diff_traces", "first_allowed",
    "guard_values", "simple_paths",
]
