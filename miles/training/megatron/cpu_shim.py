"""Run megatron-core on the CPU (gloo), for tests and CI machines without a GPU.

megatron-core is written for CUDA: it allocates with `device="cuda"` or `torch.cuda.current_device()`,
asks `tensor.type()` for "torch.cuda.*Tensor" names, waits on CUDA streams, and forks CUDA RNG
states around dropout. `apply()` points each of those at the CPU in the calling process only. A
megatron rank calls it before building anything when its device is the CPU; the process is that
rank's alone (a Ray actor or a test subprocess), so nothing else sees the patches. Dropout is 0 in
miles' megatron models, so the RNG fork has nothing to fork. Never applied on a GPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_FACTORIES = ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like", "ones_like")
_applied = False


def _is_cuda(device) -> bool:
    if isinstance(device, int):
        return True                         # a CUDA device index
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _on_cpu(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)
    return make


class _NoStream:
    def wait_event(self, *_): pass
    def wait_stream(self, *_): pass
    def synchronize(self): pass


def _cuda_type_names(original):
    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu" or name.startswith("torch.cuda."):
            return name
        return "torch.cuda." + name[len("torch."):]     # megatron's dtype checks read CUDA type names
    return type_


def apply() -> None:
    """Patch this process for megatron-core on the CPU. Idempotent."""
    global _applied
    if _applied:
        return
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    torch.Tensor.type = _cuda_type_names(torch.Tensor.type)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.default_stream = lambda *args, **kwargs: _NoStream()
    from megatron.core.tensor_parallel import random as tp_random

    @contextlib.contextmanager
    def fork(self, name=None):
        yield
    tp_random.CudaRNGStatesTracker.fork = fork
    _applied = True
