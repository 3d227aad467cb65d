"""FSDP2 for the torch trainer: the model sharded per decoder layer, and the data-parallel arithmetic
that makes N ranks take the same optimizer step as one.

- `shard_model`: `fully_shard` on every decoder layer, then on a `Root` holding the model (its
  embeddings, final norm and LM head form the root unit). Every forward runs inside the root's
  forward (`Root(fn)` calls `fn(model)`), so the root's parameters are gathered for whatever `fn`
  reads, the LM head's weight too when the chunked logprobs read it outside the model's own forward,
  and their gradients are reduce-scattered after the backward. Each parameter becomes a DTensor holding 1/N of its rows on
  this rank; a unit's full parameters exist only between its all-gather (forward, backward) and its
  reshard. On CUDA the units compute in bfloat16 (float16 with --fp16), the trainer's compute dtype
  (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`): the sharded float32 parameters stay
  the master weights, gradients are reduced in float32. In float32 (--dtype auto on the CPU) everything
  stays float32.
- Gradients are *summed* over the ranks (divide factor 1): every rank's micro-batch loss is already
  divided by the whole global batch's normalizer, so the sum over ranks is the global batch's
  gradient, as on one rank.
- `rank_rows`: this rank's contiguous share of a batch's rows; `padded_count`: every rank runs the
  same number of micro-batches (each forward and backward is a collective under FSDP), a rank with
  fewer rows runs empty ones that contribute nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor, nn

T = TypeVar("T")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's layer list of an HF causal LM (`model.get_decoder().layers`)."""
    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no decoder layer list (get_decoder().layers) to shard per "
                        "layer; the torch backend on more than one rank needs an HF decoder-only causal LM")
    return layers


class Root(nn.Module):
    """The root FSDP unit: holds the model (`lm`, parameters under the model's own names); calling it
    with `fn` runs `fn(lm)` between the root's pre-forward (its parameters gathered) and post-forward
    hooks. Only a callable goes in, so FSDP neither moves nor casts the micro-batch's tensors."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, fn: Callable[[nn.Module], T]) -> T:
        return fn(self.lm)


def shard_model(model: nn.Module, *, compute_dtype: torch.dtype, world_size: int,
                layers_per_unit: int = 1) -> Root:
    """`fully_shard` each decoder layer (or each run of `layers_per_unit` consecutive layers, one unit
    gathered and reduced together: fewer FSDP hooks and collectives, that many layers' full
    parameters at once), then a `Root` around the model, over the default process group (the model's
    parameters become DTensors in place); returns the root. Units compute in `compute_dtype` (the
    trainer's: bf16 on CUDA, float32 on the CPU) and reduce gradients in float32.
    On one rank a layer keeps its gathered parameters from its forward to its backward: the
    "gather" is a copy (and the cast), resharding would only repeat it."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if layers_per_unit < 1:
        raise ValueError(f"layers_per_unit must be >= 1, got {layers_per_unit}")
    kwargs: dict = {}
    if compute_dtype != torch.float32:
        # the inputs are not cast: the layers' come in the compute dtype already (the embedding's output,
        # the rotary tables made in its dtype), the root's is a callable; casting walks them every call
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                                   cast_forward_inputs=False)
    layers = list(decoder_layers(model))
    for i in range(0, len(layers), layers_per_unit):
        unit = layers[i:i + layers_per_unit]
        fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=world_size > 1, **kwargs)
    root = fully_shard(Root(model), **kwargs)    # FSDP keeps a root gathered from forward to backward
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)    # a sum: the losses are already global-batch shares
            # a custom factor is a PREMUL_SUM reduction, which gloo refuses; a plain SUM is the same here
            m.set_force_sum_reduction_for_comms(True)
    return root


def join_group(device: torch.device, address: str, port: int, *, rank: int, world_size: int) -> bool:
    """Join the ranks' default process group at rank 0's `address`:`port` (all ranks at once): NCCL on
    `device`'s GPU (Ray shows each rank its own GPU only), gloo on the CPU. True when this call made
    the group (the caller destroys it); False when the process had one already, of this `rank` and
    `world_size` (a program that made it, such as the FSDP bench's one-rank trainers sharing one
    process), which stays its maker's; one of another shape is refused."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(f"this process's torch.distributed group is rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, not rank {rank} of {world_size}: one group "
                               "per process; destroy it first or start this rank in a process of its own")
        return False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://{address}:{port}",
                            rank=rank, world_size=world_size)
    return True


def all_reduce_sum(t: Tensor) -> None:
    """`t` summed over the ranks in place (nothing to do on one rank)."""
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        dist.all_reduce(t)


def reshard_all(root: nn.Module) -> None:
    """Free every unit's gathered parameters. After a no-grad forward (no backward reshards them) the
    gathered copies would otherwise stay, holding memory and going stale when the sharded parameters
    change outside a step (a load, a reference refresh)."""
    from torch.distributed.fsdp import FSDPModule

    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor of a (possibly sharded) parameter; a collective for a DTensor: every rank calls it."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def rank_rows(num_rows: int, rank: int, world_size: int) -> list[int]:
    """Rank `rank`'s contiguous share of `num_rows` rows (the first ranks take one more when they do
    not divide evenly; a rank may get none)."""
    base, extra = divmod(num_rows, world_size)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (rank < extra)))


def padded_count(count: int, device: torch.device) -> int:
    """The largest `count` over the ranks (a collective; none on one rank, where it would only cost a
    device round trip)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return count
    t = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def sum_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Each value summed over the ranks (every rank passes the same keys; one rank: the values)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def bucket_names(weights: dict[str, Tensor], bucket_bytes: int) -> list[list[str]]:
    """Names of `weights` in order, grouped so that each group's full (unsharded) tensors take at most
    `bucket_bytes` (a larger tensor is a bucket of its own)."""
    buckets: list[list[str]] = [[]]
    size = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets if buckets[-1] else []
