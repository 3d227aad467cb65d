"""Hand the trainer's GPU memory to a colocated engine and take it back (--offload-train).

`HostOffload.offload()` copies the optimizer state (AdamW's exp_avg and exp_avg_sq: twice the
float32 parameters) and, optionally, the parameters themselves into host buffers, drops the
gradients, and returns the freed blocks to CUDA (`empty_cache`), so that another process (the
engine) can allocate them. `onload()` copies everything back. Values are bit-for-bit the same after
a round trip: the next optimizer step is the one that would have been taken without it.

Host buffers are allocated once (pinned when CUDA is there, which makes the copies asynchronous
and fast) and reused by every later offload; `dispose` drops them. Parameters stay the same
`nn.Parameter` objects (only `.data` moves), so the optimizer's references stay valid.

On a machine without CUDA the same code runs with host "device" tensors: the copies still happen,
which is what the CPU tests check.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn


class HostOffload:
    """Owned by the trainer that creates it; `dispose` frees the host buffers (it does not onload)."""

    resource_name = "trainer_offload"

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None, *, weights: bool = False):
        if weights and model is None:
            raise ValueError("offloading the weights needs the model")
        self._optimizer, self._model, self._weights = optimizer, model, weights
        self._host: dict[tuple[int, str], Tensor] = {}     # (id of the owning param, key) -> host buffer
        self._device: dict[tuple[int, str], torch.device] = {}
        self.offloaded = False

    def _tensors(self) -> Iterator[tuple[tuple[int, str], object, str]]:
        """(key, container, attribute-or-item name) of every tensor this offloads."""
        for param, state in self._optimizer.state.items():
            for name, value in state.items():
                if isinstance(value, Tensor) and value.numel() > 1:   # AdamW's scalar step stays put
                    yield (id(param), name), state, name
        if self._weights:
            for param in self._model.parameters():
                yield (id(param), ".data"), param, ".data"

    @staticmethod
    def _get(container, name: str) -> Tensor:
        return container.data if name == ".data" else container[name]

    @staticmethod
    def _set(container, name: str, value: Tensor) -> None:
        if name == ".data":
            container.data = value
        else:
            container[name] = value

    def offload(self) -> int:
        """Move the tensors to host memory; returns the bytes moved. Idempotent."""
        if self.offloaded:
            return 0
        moved = 0
        if self._model is not None:
            for p in self._model.parameters():
                p.grad = None             # recomputed by the next backward; zero_grad(set_to_none) drops them anyway
        for key, container, name in self._tensors():
            value = self._get(container, name)
            host = self._host.get(key)
            if host is None or host.shape != value.shape or host.dtype != value.dtype:
                host = self._host[key] = torch.empty(value.shape, dtype=value.dtype, device="cpu",
                                                     pin_memory=value.is_cuda)
            host.copy_(value, non_blocking=value.is_cuda)
            self._device[key] = value.device
            self._set(container, name, host)
            moved += value.numel() * value.element_size()
        self._settle()
        self.offloaded = True
        return moved

    def onload(self) -> int:
        """Copy the tensors back to where they were; returns the bytes moved. Idempotent."""
        if not self.offloaded:
            return 0
        moved = 0
        for key, container, name in self._tensors():
            host = self._get(container, name)
            device = self._device[key]
            value = host.to(device, non_blocking=device.type == "cuda", copy=True)
            self._set(container, name, value)
            moved += host.numel() * host.element_size()
        self._settle()
        self.offloaded = False
        return moved

    def _settle(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()      # the copies are done before anyone reads or reuses the memory
            torch.cuda.empty_cache()      # freed blocks go back to CUDA, where a colocated engine can take them

    def dispose(self) -> None:
        """Drop the host buffers (not the tensors the optimizer holds now). The optimizer is the trainer's."""
        if not self.offloaded:
            self._host.clear()
