"""Weight buckets from the torch trainer's ranks (the CUDA IPC transport, `miles.weights.transport`).

The ranks hold shards; an engine needs whole tensors in its dtype. A bucket is a collective: every
rank casts its shards of the bucket's tensors to the engines' dtype and all-gathers them one tensor
at a time (`GatheredWeights`), so no rank ever holds more than one bucket of whole tensors, never the
whole model. The all-gather leaves the whole tensor on every rank, so on CUDA each rank writes it
into a bucket buffer on its own GPU and hands out an IPC handle: the trainer merges them into one
`WeightBucket` (`merge_rank_buckets`) whose `peers` let an engine map the copy on its own GPU. Off
CUDA (tests, no IPC) rank 0 alone keeps the bytes, as a payload.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from miles.training.fsdp.sharding import full_tensor
from miles.weights.transport import WeightBucket


class GatheredWeights(dict):
    """The live (sharded) weights by HF name. Iterating gives the DTensors themselves (their global
    shapes and dtypes: what a bucket plan needs); indexing gives the whole tensor, floating-point ones
    cast to `dtype` before the gather. Indexing is a collective: every rank indexes the same names in
    the same order."""

    def __init__(self, live: dict[str, Tensor], dtype: torch.dtype):
        super().__init__(live)
        self.dtype = dtype

    def __getitem__(self, name: str) -> Tensor:
        t = super().__getitem__(name).detach()
        return full_tensor(t.to(self.dtype) if t.is_floating_point() else t)

    def take_part(self, names: list[str]) -> None:
        """The gathers of `names` on a rank that keeps nothing of them."""
        for name in names:
            _ = self[name]


def merge_rank_buckets(buckets: list[WeightBucket | None]) -> WeightBucket:
    """One bucket from every rank's answer (in rank order): rank 0's, with the other ranks' IPC copies
    as its peers; ranks that kept no copy answer None."""
    first, *rest = buckets
    peers = tuple((b.device_uuid, b.ipc) for b in rest if b is not None and b.ipc is not None)
    return replace(first, peers=first.peers + peers) if peers else first
