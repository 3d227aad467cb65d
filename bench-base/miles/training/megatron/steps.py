"""Batches through a megatron-core pipeline: micro-batches of the right shapes, the forward (and
backward) schedule, and the per-rank pieces of [B, T] results put back together on every rank.

The schedule is megatron's (`get_forward_backward_func`: no pipelining with one stage, 1F1B with
more). Every rank of a pipeline walks the same micro-batches; the first stage reads their tokens,
the last stage turns the logits into logprobs or a loss. With more than one stage the stages
exchange activations of a fixed [T, b, hidden] shape, so every micro-batch is padded to the same
rows and columns (padding has no response tokens: it weighs nothing in any loss). Sequence
parallelism needs T to be a multiple of TP, context parallelism a multiple of 2 * CP (each CP rank
feeds its two chunks of every row, `context_parallel.ContextSplit`).
"""

from __future__ import annotations

from dataclasses import fields, replace
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from miles.training.batch import TrainBatch, split
from miles.training.megatron.context_parallel import ContextSplit
from miles.training.megatron.layout import ParallelLayout

# (micro-batch, last stage's logits [b, T, V]) -> the loss megatron backpropagates (a scalar)
LossFn = Callable[[TrainBatch, Tensor], Tensor]


def _pad(mb: TrainBatch, rows: int, width: int, pad_id: int) -> TrainBatch:
    """`mb` grown to [rows, width]: pad tokens, every mask False, zeros elsewhere."""
    def grow(t: Tensor, fill) -> Tensor:
        out = t.new_full((rows, width), fill)
        out[:t.shape[0], :t.shape[1]] = t
        return out
    return replace(mb, **{f.name: grow(getattr(mb, f.name), pad_id if f.name == "tokens" else 0)
                          for f in fields(mb) if isinstance(getattr(mb, f.name), Tensor)})


def micro_batches(batch: TrainBatch, layout: ParallelLayout, size: int, pad_id: int) -> list[TrainBatch]:
    """`batch`'s rows in micro-batches of `size`. One stage: each as narrow as its longest row
    (rounded up to `layout.seq_multiple`). Several stages: all the same [size, T] shape."""
    pieces = split(batch, size)
    multiple = layout.seq_multiple
    if layout.pp == 1:
        return [_pad(mb, mb.size, -(-mb.tokens.shape[1] // multiple) * multiple, pad_id) for mb in pieces]
    width = -(-max(mb.tokens.shape[1] for mb in pieces) // multiple) * multiple
    return [_pad(mb, size, width, pad_id) for mb in pieces]


def run_schedule(module: torch.nn.Module, micro: list[TrainBatch], loss_fn: LossFn, *, forward_only: bool,
                 bf16: bool, split: ContextSplit | None = None) -> None:
    """Forward (and, unless `forward_only`, backward) every micro-batch through this rank's stage;
    on the last stage `loss_fn(mb, logits)` receives each micro-batch's logits. With context
    parallelism (`split`) the rank feeds its positions of every row (the rotary table megatron
    slices for it) and the logits are those positions' [b, T / CP, V]."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        b, t = mb.tokens.shape
        positions = torch.arange(t, device=mb.tokens.device) if split is None else split.positions(t, mb.tokens.device)
        tokens = mb.tokens if split is None else split.local(mb.tokens)
        positions = positions.expand(b, -1)
        extra = {"fp32_output": False} if bf16 else {}     # bf16 logits: miles upcasts them row chunk by chunk
        out = model(input_ids=tokens, position_ids=positions, attention_mask=None, **extra)
        return out, partial(_megatron_loss, loss_fn, mb)

    # the full width: megatron divides it by CP (and by TP under sequence parallelism) for the stages' shapes
    widths = {mb.tokens.shape for mb in micro}
    rows, width = max(s[0] for s in widths), max(s[1] for s in widths)
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro), model=[module],
                                num_microbatches=len(micro), seq_length=width, micro_batch_size=rows,
                                forward_only=forward_only)


def _megatron_loss(loss_fn: LossFn, mb: TrainBatch, logits: Tensor):
    # the three-value form: with calculate_per_token_loss megatron backpropagates the loss as it is
    # (miles' losses are shares of the global batch's already); the count is not used for scaling
    loss = loss_fn(mb, logits)
    return loss, torch.ones((), dtype=torch.int, device=loss.device), {}


def gather_rows(pieces: list[tuple[range, Tensor]], shape: tuple[int, int], owner: bool,
                device: torch.device) -> Tensor:
    """[B, T] float32 on every rank from (rows, values [rows, <= T]) pieces held by the owner ranks
    (one per data-parallel rank: the last stage's TP 0 / CP 0 rank); the others add zeros."""
    import torch.distributed as dist

    out = torch.zeros(shape, dtype=torch.float32, device=device)
    if owner:
        for rows, values in pieces:          # values may be wider than T (padding) and taller (padded rows)
            width = min(values.shape[1], shape[1])
            out[rows.start:rows.stop, :width] = values[:len(rows), :width]
    dist.all_reduce(out)
    return out


def sum_over_owners(values: dict[str, float], keys: tuple[str, ...], owner: bool, device: torch.device) -> dict[str, float]:
    """`values` summed over the owner ranks (the last stage's TP 0 / CP 0 rank of every data-parallel
    replica), the same on every rank."""
    import torch.distributed as dist

    t = torch.tensor([values.get(k, 0.0) if owner else 0.0 for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))
