"""Micro-batches of a global batch: a fixed number of samples, or a token budget (--use-dynamic-batch-size).

With a token budget (`--max-tokens-per-gpu`), rows are sorted by length, longest first (ties by row
index, so the plan is deterministic), and consecutive rows go into one micro-batch while
rows x longest row <= the budget: what a right-padded micro-batch costs in memory and compute is its
padded size, and sorting keeps the padding small. A row longer than the budget gets a micro-batch
of its own (it cannot be split). Which rows share a micro-batch does not change the loss: every
micro-batch term is divided by the global batch's normalizer (miles.training.trainer), so the
accumulated gradient is the same for any partition of the rows.

Packed (the default with a token budget; `miles.training.packing`): the budget bounds a micro-batch's
*real* tokens (`pack_groups`), since its forward runs them end to end in one row with per-sample
attention and computes no padding (rows of about one length, under 3% of padding, run as they are:
`packing.worth_packing`). `--no-pack-sequences` (or a model packing does not support)
keeps the padded plan above, whose cost is rows x longest; right-padded rows need no mask under
causal attention (a real token never looks at the padding after it), so that forward is exact too.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from miles.training.batch import HostLayout, TrainBatch
from miles.training.packing import Pack, pack_groups, to_device, worth_packing


def token_budget_groups(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices of each micro-batch: longest rows first, each micro-batch's rows x longest <= max_tokens
    (one row alone may exceed it). Every index appears exactly once."""
    if max_tokens < 1:
        raise ValueError(f"--max-tokens-per-gpu must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        # rows come longest first, so a group's first row is its longest
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def fixed_size_groups(num_rows: int, size: int) -> list[list[int]]:
    """Consecutive rows, `size` at a time (the last group may be smaller)."""
    if size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {size}")
    return [list(range(s, min(s + size, num_rows))) for s in range(0, num_rows, size)]


@dataclass(frozen=True)
class HostRows:
    """A global batch's row lengths and loss mask on the host: read from the device once, before
    the step's first forward, so the micro-batches' layouts need no read inside the loop."""

    lengths: list[int]       # real tokens of each row
    loss_mask: Tensor        # [B, T] bool, on the CPU

    @classmethod
    def of(cls, batch: TrainBatch) -> HostRows:
        return cls(batch.attention_mask.sum(dim=1).tolist(), batch.loss_mask.cpu())


def host_layout(loss_mask: Tensor, lengths: list[int], width: int, packed: bool, device: torch.device) -> HostLayout:
    """The `HostLayout` of right-padded rows of `width` with these real `lengths` and host `loss_mask`
    [b, width]; `packed` (the trainer packs): the rows get a pack unless their padding is negligible
    (`worth_packing`), and the trained positions are the pack's (row after row), else in [b * width]."""
    if bool(loss_mask[:, :1].any()):
        raise ValueError("loss_mask is True at position 0, which no hidden state predicts")
    rows, cols = loss_mask.nonzero(as_tuple=True)
    if packed and worth_packing(lengths, width):
        pack = Pack.of_lengths(lengths, width, device)
        starts = torch.tensor([0, *itertools.accumulate(lengths)][:-1], dtype=torch.long)
        trained = starts[rows] + cols
    else:
        pack, trained = None, rows * width + cols
    return HostLayout(num_tokens=len(trained), real_tokens=sum(lengths), pack=pack, trained=to_device(trained, device))


def take_rows(batch: TrainBatch, rows: Sequence[int], *, host: HostRows | None = None,
              packed: bool = False) -> TrainBatch:
    """The rows `rows` of `batch`, in that order, without the columns that are padding in all of them.
    With `host` (`HostRows.of(batch)`) nothing waits for the device: the width comes from the host's
    lengths, the row index is copied behind the queued work, and the micro-batch carries its
    `HostLayout` (with its pack when `packed` and its padding is worth removing: `worth_packing`)."""
    device, layout = batch.tokens.device, None
    if host is None:
        index = torch.as_tensor(list(rows), dtype=torch.long, device=device)
        width = int(batch.attention_mask.index_select(0, index).sum(dim=1).max())  # right padding: real tokens first
    else:
        index = to_device(torch.tensor(list(rows), dtype=torch.long), device)
        lengths = [host.lengths[r] for r in rows]
        width = max(lengths)
        layout = host_layout(host.loss_mask[list(rows), :width], lengths, width, packed, device)
    return replace(batch, layout=layout, **{f.name: getattr(batch, f.name).index_select(0, index)[:, :width]
                                            for f in fields(batch) if isinstance(getattr(batch, f.name), Tensor)})


def plan_micro_batches(lengths: Sequence[int], *, micro_batch_size: int, max_tokens_per_gpu: int | None = None,
                       packed: bool = False, memory_tokens: int | None = None) -> list[list[int]]:
    """Row groups of a right-padded batch whose rows hold `lengths` real tokens: by token budget when
    `max_tokens_per_gpu` is set (real tokens when `packed`, rows x longest otherwise), else by
    `micro_batch_size` rows, each group then split further where its padded size exceeds
    `memory_tokens` (the memory-planned cap when no budget was given; None: no cap)."""
    if max_tokens_per_gpu is not None:
        return (pack_groups if packed else token_budget_groups)(lengths, max_tokens_per_gpu)
    groups = fixed_size_groups(len(lengths), micro_batch_size)
    if memory_tokens is None:
        return groups
    return [[rows[i] for i in sub] for rows in groups
            for sub in token_budget_groups([lengths[r] for r in rows], memory_tokens)]


def padded_tokens(batch: TrainBatch) -> int:
    """What a right-padded micro-batch costs: rows x width (its real tokens plus padding)."""
    return batch.tokens.shape[0] * batch.tokens.shape[1]
