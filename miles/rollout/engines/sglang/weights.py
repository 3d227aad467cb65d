"""Colocated weight updates into SGLang: flattened buckets as the payloads `/update_weights_from_tensor` reads.

A thin adapter between a bucketed transport (the trainer's weights packed into flat byte buffers; see
miles.weights) and SGLang 0.5.23's `load_format="flattened_bucket"`: SGLang unpickles, on each TP rank,
`{"flattened_tensor": <1-D uint8 tensor>, "metadata": [<name, shape, dtype, start_idx, end_idx,
numel>]}` (sglang/srt/weight_sync/tensor_bucket.py; numel and the indices count bytes) and rebuilds
each tensor as `flat[start:end].view(dtype).reshape(shape)`.

The payload is pickled with `multiprocessing.reduction.ForkingPickler`, so a CUDA tensor travels as a
CUDA IPC handle (no copy through host memory) and SGLang copies from it into its own parameters.
SGLang unpickles with an allow-list (`SafeUnpickler`): the metadata entries are `types.SimpleNamespace`
(allowed, and read by attribute as SGLang's own class is), and the device is written as the GPU's UUID
instead of its index, which SGLang's patched `rebuild_cuda_tensor` resolves, because the trainer and
the server number their visible GPUs differently. One payload per TP rank: each rank unpickles only its
own (`serialized_named_tensors[tp_rank]`), which keeps the IPC reference counts per rank.
"""

from __future__ import annotations

import base64
import io
import types
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler

import torch
from torch import Tensor
from torch.multiprocessing import reductions

# (name, shape, dtype, start byte, end byte) of one tensor inside a flat uint8 bucket
BucketEntry = tuple[str, Sequence[int], torch.dtype, int, int]
_DEVICE_ARG = 6        # position of the device index in rebuild_cuda_tensor's arguments (torch 2.x)


def flatten_bucket(named: Sequence[tuple[str, Tensor]]) -> tuple[Tensor, list[BucketEntry]]:
    """Pack tensors (any dtypes, one device) into one 1-D uint8 tensor and their entries. Each tensor
    starts at a multiple of its element size, as SGLang's `.view(dtype)` of the byte slice requires."""
    if not named:
        raise ValueError("an empty bucket: give at least one tensor")
    parts, entries, start = [], [], 0
    for name, t in named:
        pad = -start % t.element_size()
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=t.device))
            start += pad
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        entries.append((name, tuple(t.shape), t.dtype, start, start + raw.numel()))
        start += raw.numel()
    return torch.cat(parts), entries


def bucket_payloads(flat: Tensor, entries: Sequence[BucketEntry], tp_size: int) -> list[str]:
    """One base64 payload per TP rank for `SGLangEngine.update_weights_from_tensor`.

    `flat` must stay alive (and unchanged) until the server has answered: for a CUDA tensor the
    payload is a handle to its memory, not a copy."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"a bucket is a 1-D uint8 tensor, got {flat.dtype} of shape {tuple(flat.shape)}")
    metadata = [types.SimpleNamespace(name=name, shape=torch.Size(shape), dtype=dtype, start_idx=start,
                                      end_idx=end, numel=end - start) for name, shape, dtype, start, end in entries]
    bad = [m.name for m in metadata if not 0 <= m.start_idx <= m.end_idx <= flat.numel()]
    if bad:
        raise ValueError(f"bucket entries outside the {flat.numel()}-byte bucket: {bad[:3]}")
    unaligned = [m.name for m in metadata if m.start_idx % m.dtype.itemsize]
    if unaligned:
        raise ValueError(f"bucket entries not aligned to their element size (SGLang views each byte slice as its "
                         f"dtype): {unaligned[:3]}; pack with flatten_bucket")
    obj = {"flattened_tensor": flat, "metadata": metadata}
    return [base64.b64encode(_dumps(obj)).decode("ascii") for _ in range(tp_size)]


def _dumps(obj: object) -> bytes:
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[Tensor] = _reduce_tensor    # this pickler only: no global monkey-patching
    pickler.dump(obj)
    return buf.getvalue()


def _reduce_tensor(t: Tensor):
    rebuild, args = reductions.reduce_tensor(t)
    if t.is_cuda:
        args = (*args[:_DEVICE_ARG], str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid),
                *args[_DEVICE_ARG + 1:])
    return rebuild, args
