"""Weight shadows: the decoder's Linear weights cast to the compute dtype once for a step's micro-batches.

Under autocast each micro-batch casts every float32 weight it multiplies to the compute dtype (once
more in a recomputed layer), and its backward casts the weight's gradient back to float32 and adds
that into `.grad`: per micro-batch and parameter about 24 bytes of memory traffic (the cast 6, the
gradient's cast 6, the add 12) besides the matmuls. With shadows the weights are cast once, when the
micro-batch loop starts (`weight_shadows`), into leaves of their own that the Linear modules use in
place of their float32 masters until the loop ends; each shadow's gradient (in the compute dtype,
as autocast's matmul gives it) is added into the master's float32 `.grad` as soon as autograd has
accumulated it (`register_post_accumulate_grad_hook`), then dropped: 10 bytes per parameter and
micro-batch. The sums are autocast's to the bit: the same compute-dtype gradients, converted to
float32 exactly, added into `.grad` in the same order (`tests/unit/test_weight_shadows.py`).

Only `nn.Linear` weights inside the decoder are shadowed (the bulk of the parameters): not the
embeddings or the LM head (tied to the embeddings in small models; the chunked logprobs cast it once a
forward themselves), not norms or biases, not sharded (DTensor) parameters. Nothing outside the loop
sees a shadow: the context restores the masters on every exit, so weight sync, checkpoints, offload
and the optimizer only ever meet the float32 parameters.

The shadows exist while the loop runs (2 bytes per shadowed parameter), as autocast's copies did
between a micro-batch's forward and backward; the memory plan's reserve already counts them.

**Gradient-accumulation fusion** (`fuse=True`, --gradient-accumulation-fusion; Megatron-LM's idea):
the shadow takes no gradient at all; the Linear's backward adds `grad_out^T @ input` into the master's
float32 `.grad` from the weight-gradient matmul itself (`accumulate_weight_grad`: on CUDA cuBLAS with
float32 C and D, `torch.addmm(..., out_dtype=torch.float32, out=grad)`), so the product is never
rounded to the compute dtype, never written as a gradient of its own and never added by a second
kernel: 8 bytes per parameter and micro-batch instead of 12, and no hook. The sums are then *not*
autocast's to the bit: each micro-batch's product keeps float32 precision where autocast rounds it to
bf16 first (closer to the exact sum, `tests/unit/test_weight_shadows.py`). The input gradient is the
same `grad_out @ weight` as before. While the loop runs the shadowed Linear modules are of a subclass
(`FusedWgradLinear`) whose forward calls the fused function; every exit restores their class.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def shadowable(model: nn.Module) -> list[nn.Linear]:
    """The Linear modules of `model`'s decoder whose float32 weight a shadow can stand in for."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return [m for m in decoder.modules()
            if isinstance(m, nn.Linear) and type(m.weight) is nn.Parameter and m.weight.dtype == torch.float32]


def _fold_into(master: nn.Parameter):
    """The shadow's post-accumulate hook: its gradient into the master's float32 `.grad`, then gone."""
    def fold(shadow: Tensor) -> None:
        if master.grad is None:
            master.grad = shadow.grad.to(master.dtype)
        else:
            master.grad.add_(shadow.grad)
        shadow.grad = None
    return fold


@torch.library.custom_op("miles::accumulate_weight_grad", mutates_args=("main_grad",))
def accumulate_weight_grad(main_grad: Tensor, grad_out: Tensor, inp: Tensor) -> None:
    """`main_grad += grad_out^T @ inp` over every leading dimension, summed and kept in float32
    (`main_grad` [out, in] float32; `grad_out` [..., out] and `inp` [..., in] in the compute dtype).
    An op of its own (opaque to torch.compile, which records its write into `main_grad`)."""
    g, x = grad_out.reshape(-1, grad_out.shape[-1]), inp.reshape(-1, inp.shape[-1])
    if main_grad.is_cuda and x.dtype != torch.float32:
        torch.addmm(main_grad, g.t(), x, out_dtype=torch.float32, out=main_grad)
    else:        # the CPU (no mixed-dtype matmul there): the same float32 product, then the add
        main_grad.addmm_(g.t().float(), x.float())


class _FusedWgrad(torch.autograd.Function):
    """`x @ weight^T` whose backward returns the input's gradient and adds the weight's into
    `main_grad` (`accumulate_weight_grad`) instead of returning it."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, main_grad: Tensor) -> Tensor:
        x = x.to(weight.dtype)              # what autocast's linear does to its input
        ctx.save_for_backward(x, weight)
        ctx.main_grad = main_grad
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        grad_out = grad_out.to(weight.dtype)
        accumulate_weight_grad(ctx.main_grad, grad_out, x)
        return (grad_out @ weight if ctx.needs_input_grad[0] else None), None, None


class FusedWgradLinear(nn.Linear):
    """What a shadowed `nn.Linear` is while a fused loop runs: its weight is the shadow, its weight's
    gradient goes into `main_grad` (the master's float32 `.grad`), its bias (not shadowed) as usual."""

    main_grad: Tensor

    def forward(self, x: Tensor) -> Tensor:
        out = _FusedWgrad.apply(x, self.weight, self.main_grad)
        return out if self.bias is None else out + self.bias.to(out.dtype)


@contextmanager
def weight_shadows(model: nn.Module, dtype: torch.dtype, *, grads: bool = True, fuse: bool = False) -> Iterator[int]:
    """Within the context the decoder's Linear modules use `dtype` copies of their weights made on
    entry (one multi-tensor copy); with `grads`, the copies' gradients fold into the float32 masters'
    `.grad` as they come (the masters must take gradients; frozen ones get no shadow), or with `fuse`
    too, the weight-gradient matmuls of plain `nn.Linear` modules add into the masters' `.grad`
    themselves (allocated here, zeros, where there is none yet: a Linear the loop never runs then has a
    zero gradient, as in Megatron-LM's main-gradient buffers, not None; subclasses of `nn.Linear` keep
    their own forward and fold); without `grads`, the copies take none (no-grad passes). The masters and
    the modules' classes are back in place on every exit, error or not.
    Yields the number of shadowed weights (0: nothing to shadow, or `dtype` is float32)."""
    modules = [] if dtype == torch.float32 else shadowable(model)
    fuse = fuse and grads
    if grads:
        modules = [m for m in modules if m.weight.requires_grad]
    masters = [m.weight for m in modules]
    classes = [type(m) for m in modules]
    try:
        copies = [torch.empty_like(w, dtype=dtype) for w in masters]
        if copies:
            torch._foreach_copy_(copies, [w.detach() for w in masters])
        for module, master, copy in zip(modules, masters, copies):
            fused = fuse and type(module) is nn.Linear
            shadow = nn.Parameter(copy, requires_grad=grads and not fused)
            if fused:
                if master.grad is None:
                    master.grad = torch.zeros_like(master)
                module.__class__ = FusedWgradLinear
                module.main_grad = master.grad
            elif grads:
                shadow.register_post_accumulate_grad_hook(_fold_into(master))
            module._parameters["weight"] = shadow
        yield len(modules)
    finally:
        for module, master, cls in zip(modules, masters, classes):
            module._parameters["weight"] = master
            if module.__class__ is not cls:
                module.__class__ = cls
            module.__dict__.pop("main_grad", None)
