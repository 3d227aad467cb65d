"""Run megatron-core on the CPU (gloo), for tests and CI machines without a GPU.

megatron-core is written for CUDA: it allocates with `device="cuda"` or `torch.cuda.current_device()`
and in pinned host memory (the rotary table's context-parallel slice), asks `tensor.type()` for
"torch.cuda.*Tensor" names, waits on CUDA streams, and forks CUDA RNG states around dropout and
around recomputed layers. `apply()` points those at the CPU, in the calling process only: a megatron
rank calls it before building anything when its device is the CPU, in a process that is that
rank's alone (a Ray actor or a test subprocess). Dropout is 0 in miles' megatron models, so the RNG
fork has nothing to fork and a recomputed layer no CUDA RNG state to restore. Never applied on a GPU.

What megatron's modules call `torch` is replaced, in those modules only, by a stand-in that moves
CUDA allocations to the CPU: patching torch's own factories would reach every library in the
process (transformers then builds models with uninitialised rotary buffers). Two tensor methods
are patched for everyone, harmlessly for a CPU-only process: `.cuda()` returns the tensor, and a
bare `.type()` names CPU tensors "torch.cuda.*" (megatron's optimizer checks those names).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import pkgutil
import sys
import types

import torch

# megatron modules whose `torch` is replaced (imported first so that they exist); with every module of
# the dist_checkpointing package, which imports its savers' pieces lazily
MEGATRON_MODULES = ("megatron.core", "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs",
                    "megatron.core.distributed", "megatron.core.optimizer", "megatron.core.pipeline_parallel",
                    "megatron.core.transformer.module")
MEGATRON_PACKAGES = ("megatron.core.dist_checkpointing",)
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
        kwargs.pop("pin_memory", None)     # a CPU-only process has no pinned-memory allocator
        return factory(*args, **kwargs)
    return make


class _NoStream:
    def wait_event(self, *_): pass
    def wait_stream(self, *_): pass
    def synchronize(self): pass


class _StandIn(types.ModuleType):
    """Looks up everything on `target`, except the names in `overrides`."""

    def __init__(self, target: types.ModuleType, overrides: dict):
        super().__init__(target.__name__)
        self._target = target
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._target, name)


def _cpu_torch() -> types.ModuleType:
    cuda = _StandIn(torch.cuda, {"current_device": lambda: "cpu", "synchronize": lambda *a, **k: None,
                                  "current_stream": lambda *a, **k: _NoStream(),
                                  "default_stream": lambda *a, **k: _NoStream()})
    return _StandIn(torch, {"cuda": cuda, **{name: _on_cpu(getattr(torch, name)) for name in _FACTORIES}})


def _cuda_type_names(original):
    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu" or name.startswith("torch.cuda."):
            return name
        return "torch.cuda." + name[len("torch."):]
    return type_


def apply() -> None:
    """Patch this process for megatron-core on the CPU. Idempotent."""
    global _applied
    if _applied:
        return
    for name in MEGATRON_MODULES:
        importlib.import_module(name)
    for package in MEGATRON_PACKAGES:
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
            importlib.import_module(info.name)
    stand_in = _cpu_torch()
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = stand_in
    torch.Tensor.type = _cuda_type_names(torch.Tensor.type)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    from megatron.core.tensor_parallel import random as tp_random

    @contextlib.contextmanager
    def fork(self, name=None):
        yield
    tp_random.CudaRNGStatesTracker.fork = fork
    # activation recomputation saves and restores the CUDA RNG state around each layer: nothing to keep
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    _applied = True
