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
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
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


@contextmanager
def weight_shadows(model: nn.Module, dtype: torch.dtype, *, grads: bool = True) -> Iterator[int]:
    """Within the context the decoder's Linear modules use `dtype` copies of their weights made on
    entry (one multi-tensor copy); with `grads`, the copies' gradients fold into the float32 masters'
    `.grad` as they come (the masters must take gradients; frozen ones get no shadow), without,
    the copies take none (no-grad passes). The masters are back in place on every exit, error or not.
    Yields the number of shadowed weights (0: nothing to shadow, or `dtype` is float32)."""
    modules = [] if dtype == torch.float32 else shadowable(model)
    if grads:
        modules = [m for m in modules if m.weight.requires_grad]
    masters = [m.weight for m in modules]
    try:
        copies = [torch.empty_like(w, dtype=dtype) for w in masters]
        if copies:
            torch._foreach_copy_(copies, [w.detach() for w in masters])
        for module, master, copy in zip(modules, masters, copies):
            shadow = nn.Parameter(copy, requires_grad=grads)
            if grads:
                shadow.register_post_accumulate_grad_hook(_fold_into(master))
            module._parameters["weight"] = shadow
        yield len(modules)
    finally:
        for module, master in zip(modules, masters):
            module._parameters["weight"] = master
