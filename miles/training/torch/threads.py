"""How many threads a CPU trainer computes with.

Ray starts an actor declared with `num_cpus=0` (every miles actor: CPUs are not what places them)
with OMP_NUM_THREADS=1, so torch in the trainer actor would use one core of a machine it has to
itself while it trains (the rollout waits for it in the synchronous loop). On the CPU, inside a Ray
actor, the trainer takes the cores its process may run on instead (measured on a 2-core machine:
the demo's train phase went from 27 s with one thread to 19 s with two). Outside an actor (a test,
a script, an in-process run) torch's setting is the caller's and is left alone.

How many: the budget the run's placement gave it (`miles.cluster.placement.cpu_thread_budget`, in the
actor's environment: all the cores when the trainer trains alone, what the engines leave when they
generate beside it), else (an actor started without one) the cores its process may run on, split
between the trainer's ranks.

A CPU engine keeps Ray's one thread: its decode steps are many small parallel regions, and with two
threads every stray wake-up of the run's other processes stalls one of them at each region's barrier
(measured in the demo-shaped run on 2 cores: a 256-sample generate took 136-147 ms with two threads,
121-136 ms with one, though two were faster in a process of its own).
"""

from __future__ import annotations

import os
import sys

import torch

from miles.runtime.procs import CPU_THREADS_ENV, usable_cores


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor's worker (without importing Ray when nothing did)."""
    if "ray" not in sys.modules:
        return False
    import ray

    if not ray.is_initialized():
        return False
    try:
        return ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 (a driver without a worker context)
        return False


def pick_cpu_threads(*, on_cpu: bool, in_actor: bool, cores: int, current: int,
                     budget: int | None = None) -> int | None:
    """The thread count to set (None: leave torch's) for a CPU trainer in a Ray actor: its `budget`
    when the placement gave one (fewer threads than torch has, too), else the process's `cores` when
    that is more than torch has now."""
    if not (on_cpu and in_actor):
        return None
    want = budget if budget is not None else max(cores, current)
    return None if want == current else max(1, want)


def placement_budget() -> int | None:
    """The threads this process's placement gave it (`CPU_THREADS_ENV`), None when none did."""
    value = os.environ.get(CPU_THREADS_ENV, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def cpu_threads(device: torch.device, share: int = 1) -> int:
    """Apply `pick_cpu_threads` for a trainer on `device`, one of `share` trainer processes on this
    machine's cores (CPU ranks: each takes its part, not all; a placement's budget is per rank
    already); returns the threads torch uses now."""
    cores = max(1, usable_cores() // max(1, share))
    n = pick_cpu_threads(on_cpu=device.type == "cpu", in_actor=in_ray_actor(), cores=cores,
                         current=torch.get_num_threads(), budget=placement_budget())
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()
