"""How the trainer gets per-token logprobs and entropies out of its model; one way is picked at start-up.

- `logits_forward` (CPU, and models the other path cannot read): the model's [B, T, V] logits, then
  `logprobs_from_logits` / `entropy_from_logits`. What the trainer always did.
- `hidden_forward` (CUDA): the decoder's last hidden states and the LM head's weight go to
  `masked_logprobs_entropy`, which computes only the positions of the loss mask, chunk by chunk of
  rows, and keeps no [rows, V] logits for the backward. The rows are right-padded, so under causal
  attention no real token sees padding: the forward runs without an attention mask (exact on the real
  tokens, and SDPA keeps its flash kernel). Outside the loss mask its logprobs and entropies are 0.

Both return (logprobs [B, T] float32, entropy [B, T] float32 or None), aligned to tokens as in
`miles.algorithms.entropy`; every consumer reads them under the loss mask only. `packed` (picked at
start-up with --use-dynamic-batch-size, `miles.training.packing`): the micro-batch's real tokens run
as one [1, L] row with per-sample attention, and the results come back in its [B, T] layout; a
micro-batch whose padding is negligible carries no pack (`packing.worth_packing`) and runs its rows.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn

from miles.algorithms import entropy_from_logits, logprobs_from_logits, masked_logprobs_entropy
from miles.algorithms.fused_logprobs import DEFAULT_CHUNK_ROWS
from miles.training.batch import TrainBatch

# (model, micro-batch, want entropy, entropy gets gradients) -> (logprobs, entropy or None)
Forward = Callable[[nn.Module, TrainBatch, bool, bool], tuple[Tensor, Tensor | None]]


def logits_forward(temperature: float, autocast: Callable[[], AbstractContextManager], model: nn.Module,
                   mb: TrainBatch, entropy: bool, entropy_grad: bool, packed: bool = False) -> tuple[Tensor, Tensor | None]:
    pack = mb.pack() if packed else None
    if pack is not None:
        tokens = pack.pack(mb.tokens)
        with autocast():
            logits = model(input_ids=tokens, use_cache=False, **pack.model_kwargs()).logits
        # a sample's first position would read the previous sample's last logits: 0, as in a row of its own
        first = pack.position_ids == 0
        logprobs = pack.unpack(logprobs_from_logits(logits, tokens, temperature).masked_fill(first, 0.0))
        if not entropy:
            return logprobs, None
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            return logprobs, pack.unpack(entropy_from_logits(logits, temperature).masked_fill(first, 0.0))
    with autocast():
        logits = model(input_ids=mb.tokens, attention_mask=mb.attention_mask, use_cache=False).logits
    logprobs = logprobs_from_logits(logits, mb.tokens, temperature)
    if not entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logprobs, entropy_from_logits(logits, temperature)


def hidden_forward(temperature: float, autocast: Callable[[], AbstractContextManager], matmul_dtype: torch.dtype,
                   chunk_rows: int, model: nn.Module, mb: TrainBatch, entropy: bool,
                   entropy_grad: bool, packed: bool = False) -> tuple[Tensor, Tensor | None]:
    weight = model.get_output_embeddings().weight
    # the trained tokens' positions in the forward's layout: known on the host when the micro-batch
    # carries its layout, so nothing after the decoder's launch waits for it to finish
    trained = None if mb.layout is None else mb.layout.trained
    pack = mb.pack() if packed else None
    if pack is not None:      # the loss mask is False on every sample's first (prompt) token: no cross-sample reads
        tokens = pack.pack(mb.tokens)
        with autocast():
            hidden = model.get_decoder()(input_ids=tokens, use_cache=False, **pack.model_kwargs()).last_hidden_state
        logprobs, ent = (pack.unpack(x) for x in masked_logprobs_entropy(
            hidden, weight, tokens, pack.pack(mb.loss_mask), temperature, trained=trained, matmul_dtype=matmul_dtype,
            chunk_rows=chunk_rows))
    else:
        with autocast():
            # right padding + causal attention: the mask would change only the padding's own outputs
            hidden = model.get_decoder()(input_ids=mb.tokens, use_cache=False).last_hidden_state
        logprobs, ent = masked_logprobs_entropy(hidden, weight, mb.tokens, mb.loss_mask, temperature, trained=trained,
                                                matmul_dtype=matmul_dtype, chunk_rows=chunk_rows)
    if not entropy:
        return logprobs, None
    return logprobs, ent if entropy_grad else ent.detach()   # detached: no backward work for a metric


def hidden_path_problem(model: nn.Module) -> str | None:
    """None when `hidden_forward` computes exactly what the model's logits would; else why not."""
    get_decoder, head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", lambda: None)()
    if get_decoder is None or not isinstance(head, nn.Linear):
        return "no decoder / linear LM head to read"
    if head.bias is not None:
        return "the LM head has a bias"
    cfg = model.config
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(cfg, name, None) not in (None, 1.0):
            return f"the model transforms its logits ({name})"
    return None


def pick_forward(model: nn.Module, *, temperature: float, autocast: Callable[[], AbstractContextManager],
                 compute_dtype: torch.dtype, hidden: bool, chunk_rows: int | None = None,
                 packed: bool = False) -> tuple[Forward, str]:
    """The forward to use and its name; `hidden` asks for the chunked path where the model allows it,
    `chunk_rows` rows per chunk there (--log-probs-chunk-size; None: DEFAULT_CHUNK_ROWS); `packed`
    runs each micro-batch as one packed row (the model's attention switched by `enable_packing`)."""
    from functools import partial

    if hidden and hidden_path_problem(model) is None:
        return partial(hidden_forward, temperature, autocast, compute_dtype, chunk_rows or DEFAULT_CHUNK_ROWS,
                       packed=packed), "hidden" + ("+packed" if packed else "")
    return partial(logits_forward, temperature, autocast, packed=packed), "logits" + ("+packed" if packed else "")


def compile_decoder_layers(model: nn.Module, backend: str = "inductor") -> int:
    """torch.compile each decoder layer in place (CUDA trainer): the layers' elementwise work (norms
    in float32, rotary, SiLU x up, residual adds, their backward) fuses into a few kernels instead of
    one pass over the activations each. One layer class compiles once (the others reuse its code),
    with dynamic shapes from the start (`dynamic=True`): a micro-batch's rows and length, a pack's
    sample count and longest sample vary from one micro-batch to the next, and under dynamo's default
    (static first, dynamic on a change) each new kind of change recompiled every variant (grad and
    no-grad, padded and packed): 12-22 s in the second rollout of a 1.7B run on the GPU, and the CPU's
    packed path reached dynamo's recompile limit (8), past which the layers run eager. The model's own
    sizes stay constants (its parameters' shapes fix them). Returns the layers compiled (0: the model
    has no `.layers` list to compile, and runs as it is). `backend`: torch.compile's (tests on the CPU
    pass one that needs no C++ compiler)."""
    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    if not isinstance(layers, nn.ModuleList):
        return 0
    for layer in layers:
        layer.compile(backend=backend, dynamic=True)
    return len(layers)


def compiled_graphs() -> int:
    """Graphs torch.compile (dynamo) has compiled in this process so far: the difference over a train call is
    its `layer_compiles` metric. With compiled layers each new kind of micro-batch (a layout, or a batch of one
    row, which dynamo specialises) compiles a variant the first time one needs it, mid-run when no earlier
    micro-batch did: seconds on a GPU, and this says which step paid them. (Not imported, dynamo compiled
    nothing: 0, without importing it.)"""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Every decoder layer recomputes its activations in the backward (--recompute-activations)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):          # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    disable_dropout(model)


def disable_dropout(model: nn.Module) -> None:
    """Train mode is needed for activation checkpointing (transformers checkpoints only in training);
    the logprobs must still be those of the distribution the engine samples from: no dropout."""
    model.train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
