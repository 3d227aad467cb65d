"""The layout a run takes when the user named none: on a cluster of one GPU, colocate; on the CPU,
two engines.

The default layout (one trainer GPU, one engine on a GPU of its own) needs two GPUs. A run that
starts its own cluster on a machine with one GPU, with every layout flag at its default, gets
`--colocate` instead of an error (the engine shares the trainer's GPU, memory handed back and forth
as with the flag), and the trace's `placement` event and the start-up line say so. A layout the
user named (any of the flags below, or a cluster they attached to) is theirs: if it does not fit,
that stays an error before any actor starts.

On the CPU an engine decodes on one thread (`miles/training/threads.py` says why), so with one engine
every core but one idles through the rollout. A CPU run that does not give --rollout-num-engines (nor
--rollout-num-gpus) on a machine of two or more cores gets two engines, each decoding a contiguous
part of the batch with its own seed (the rollout phase of the demo-shaped run went from 0.13 s to
0.08 s on two cores, `docs/performance.md`). Two, not one per core: that is what was measured, and
every engine holds a copy of the weights. An explicit --rollout-num-engines, 1 included, is kept.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config import RunConfig

LAYOUT_FLAGS = ("--colocate", "--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus",
                "--rollout-num-gpus-per-engine", "--rollout-num-engines")
AUTO_COLOCATE_REASON = ("the cluster this run started has one GPU and no layout flag was given "
                        f"({', '.join(LAYOUT_FLAGS)}): trainer and engine share it (--colocate)")


CPU_ENGINES = 2
AUTO_ENGINES_REASON = (f"a CPU run on {{cores}} cores without --rollout-num-engines: {CPU_ENGINES} engines, each "
                       "decoding on a core of its own (--rollout-num-engines 1 for one)")


def names_no_layout(cfg: RunConfig) -> bool:
    """Every layout flag at its default (a flag given with its default value reads the same)."""
    c = cfg.cluster
    return (not c.colocate and c.actor_num_nodes == 1 and c.actor_num_gpus_per_node == 1
            and c.rollout_num_gpus is None and c.rollout_num_gpus_per_engine == 1 and cfg.rollout.num_engines in (None, 1))


def auto_num_engines(cfg: RunConfig, *, use_gpus: bool, cores: int) -> int | None:
    """The engine count the rule above picks for a run that gave none, else None (the run's own:
    --rollout-num-engines, or --rollout-num-gpus / GPUs per engine, or one)."""
    if (use_gpus or cfg.rollout.num_engines is not None or cfg.cluster.rollout_num_gpus is not None
            or cfg.rollout.engine == "sglang" or cores < CPU_ENGINES):
        return None
    return CPU_ENGINES


def auto_colocate(cfg: RunConfig, *, use_gpus: bool, cluster_gpus: float, started: bool,
                  needed_gpus: int, machine: str) -> RunConfig | None:
    """`cfg` with --colocate when the rule above applies and `machine` takes colocated runs (the async
    machine does not), else None (the layout stays as given, and so does its error)."""
    if not (use_gpus and started and cluster_gpus == 1 and needed_gpus > 1 and names_no_layout(cfg)):
        return None
    colocated = replace(cfg, cluster=replace(cfg.cluster, colocate=True))
    return colocated if _machine_takes(colocated, machine) else None


def _machine_takes(cfg: RunConfig, machine: str) -> bool:
    from miles.config import ConfigError
    from miles.config.validate import validate_for_machine
    from miles.runtime.machine import MachineDefinitionError, load_machine

    try:
        validate_for_machine(cfg, load_machine(machine))
    except (ConfigError, MachineDefinitionError):
        return False
    return True
