"""The runtime core: lifecycle machines, the runner, the disposer and the trace.

Nothing here imports the rest of miles or any ML library: it can drive stub phases in unit tests.
"""

from .disposer import (
    Disposer, DisposerClosedError, TeardownOutcome, TeardownTimeout, teardown_errors, with_disposer,
)
from .machine import MachineDef, MachineDefinitionError, MissingPackageError, builtin_machines, load_machine, parse_machine
from .runner import IllegalTransition, PhaseContext, PhaseTimeout, Runner, StopRequest
from .trace import Trace, TraceEvent, Tracer, read_trace

__all__ = [
    "Disposer", "DisposerClosedError", "IllegalTransition", "MachineDef", "MachineDefinitionError",
    "MissingPackageError", "PhaseContext", "PhaseTimeout", "Runner", "StopRequest", "TeardownOutcome", "TeardownTimeout",
    "Trace", "TraceEvent", "Tracer",
    "builtin_machines", "load_machine", "parse_machine", "read_trace", "teardown_errors", "with_disposer",
]
