"""How many threads a CPU trainer computes with.

Ray starts an actor declared with `num_cpus=0` (every miles actor: CPUs are not what places them)
with OMP_NUM_THREADS=1, so torch in the trainer actor would use one core of a machine it has to
itself while it trains (the rollout waits for it in the synchronous loop). On the CPU, inside a Ray
actor, the trainer takes the cores its process may run on instead (measured on a 2-core machine:
the demo's train phase went from 27 s with one thread to 19 s with two). Outside an actor (a test,
a script, an in-process run) torch's setting is the caller's and is left alone.

A CPU engine keeps Ray's one thread: its decode steps are many small parallel regions, and with two
threads every stray wake-up of the run's other processes stalls one of them at each region's barrier
(measured in the demo-shaped run on 2 cores: a 256-sample generate took 136-147 ms with two threads,
121-136 ms with one, though two were faster in a process of its own).
"""

from __future__ import annotations

import sys

import torch

from miles.runtime.procs import usable_cores


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


def pick_cpu_threads(*, on_cpu: bool, in_actor: bool, cores: int, current: int) -> int | None:
    """The thread count to set (None: leave torch's): the process's cores for a CPU trainer in a Ray
    actor, when that is more than torch has now."""
    if not (on_cpu and in_actor) or cores <= current:
        return None
    return cores


def cpu_threads(device: torch.device, share: int = 1) -> int:
    """Apply `pick_cpu_threads` for a trainer on `device`, one of `share` trainer processes on this
    machine's cores (CPU ranks: each takes its part, not all); returns the threads torch uses now."""
    cores = max(1, usable_cores() // max(1, share))
    n = pick_cpu_threads(on_cpu=device.type == "cpu", in_actor=in_ray_actor(), cores=cores,
                         current=torch.get_num_threads())
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()
