"""Content checksums of weight dicts, to prove that an engine holds exactly the trainer's weights.

`state_dict_checksum` hashes names, dtypes, shapes and raw bytes in name order, so the digest is
the same in every process and on every device for the same values in the same dtype. Engines may
hold a lower precision than the trainer (bf16 vs fp32 master weights): compare
`state_dict_checksum(trainer_weights, dtype=torch.bfloat16)` with the engine's checksum then.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import Tensor


def state_dict_checksum(state_dict: Mapping[str, Tensor], *, dtype: torch.dtype | None = None) -> str:
    """sha256 hex digest over (name, dtype, shape, bytes) of every tensor, names sorted.

    With `dtype`, floating-point tensors are cast to it first (what an engine of that dtype loads).
    """
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.to("cpu").contiguous()
        # the header is NUL-separated, so no (name, shape) pair can run into the next one
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        # viewed as bytes: numpy has no bfloat16, and this avoids a copy
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def state_dict_to_cpu(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Detached, contiguous CPU copies (never views of the live tensors), in the same order."""
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in state_dict.items()}
