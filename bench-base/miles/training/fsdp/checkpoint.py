"""The torch backend's sharded checkpoint: model and optimizer state through torch.distributed.checkpoint
(DCP), keyed by parameter names (not by rank), so a folder saved on N ranks loads on M ranks, and on
the one-process trainer (DCP runs without a process group there).

    dcp/                   DCP's shards (one file per saving rank) and its metadata: {"model", "optim"}
    rng/rank_<r>.pt        each rank's RNG states (a rank beyond the saved ones takes rank 0's)
    trainer_state.json     optimizer steps taken, whether the optimizer state was saved, the world size
    reference.safetensors  the refreshed KL reference (--ref-update-interval), written by rank 0

Atomicity is the caller's: the run's checkpoint store hands in a temporary folder and renames it once
every rank has written its part.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

DCP_DIR, RNG_DIR = "dcp", "rng"


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / DCP_DIR / ".metadata").is_file()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | Path) -> None:
    """This rank's shards of the model (and optimizer state) into `path`/dcp; every rank calls it."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, optimizer), checkpoint_id=str(Path(path) / DCP_DIR))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | Path) -> None:
    """What `save_sharded` wrote, resharded onto this model (any number of ranks, or none); the
    optimizer state when `optimizer` is given. Every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    import torch.distributed as dist

    state = _state(model, optimizer)
    with warnings.catch_warnings():
        if not dist.is_initialized():       # the one-process trainer: loading in one process is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(Path(path) / DCP_DIR))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])


def load_full(model: nn.Module, weights: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer | None = None,
              optimizer_state: dict | None = None) -> None:
    """Whole weights (and the one-process trainer's optimizer state, keyed by parameter index as
    `Optimizer.state_dict()` writes it) into a sharded model: each rank keeps its shards. Every rank
    calls it with the same whole tensors."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True)
    # the tied LM head is the embedding: the one-process trainer's file names it once
    weights = {**{alias: weights[name] for alias, name in _aliases(model, weights).items()}, **weights}
    set_model_state_dict(model, weights, options=full)
    if optimizer is not None and optimizer_state is not None:
        names = [n for n, _ in model.named_parameters()]      # the optimizer's parameter order, tied ones once
        by_name = {"state": {names[i]: st for i, st in optimizer_state["state"].items()},
                   "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                    for g in optimizer_state["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, by_name, options=full)


def whole_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The sharded `optimizer`'s state gathered whole onto rank 0's CPU, keyed by parameter index as the
    one-process `Optimizer.state_dict()` writes it (what `load_full` reads); {} on the other ranks.
    Every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
    if not by_name:
        return {}
    index = {n: i for i, (n, _) in enumerate(model.named_parameters())}   # the optimizer's order, tied ones once
    return {"state": {index[n]: st for n, st in by_name["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]}


def _aliases(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """{name missing from `weights`: the name of the same parameter that is there} (tied parameters)."""
    out, seen = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen and name not in weights:
            out[name] = seen[id(t)]
        seen.setdefault(id(t), name)
    return out


def rng_file(path: str | Path, rank: int) -> Path:
    return Path(path) / RNG_DIR / f"rank_{rank}.pt"
