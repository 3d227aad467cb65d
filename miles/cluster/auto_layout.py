"""The layout a run takes when the user named none: on a cluster of one GPU, colocate.

The default layout (one trainer GPU, one engine on a GPU of its own) needs two GPUs. A run that
starts its own cluster on a machine with one GPU, with every layout flag at its default, gets
`--colocate` instead of an error (the engine shares the trainer's GPU, memory handed back and forth
as with the flag), and the trace's `placement` event and the start-up line say so. A layout the
user named (any of the flags below, or a cluster they attached to) is theirs: if it does not fit,
that stays an error before any actor starts.
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


def names_no_layout(cfg: RunConfig) -> bool:
    """Every layout flag at its default (a flag given with its default value reads the same)."""
    c = cfg.cluster
    return (not c.colocate and c.actor_num_nodes == 1 and c.actor_num_gpus_per_node == 1
            and c.rollout_num_gpus is None and c.rollout_num_gpus_per_engine == 1 and cfg.rollout.num_engines == 1)


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
