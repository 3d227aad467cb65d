"""Logprobs and entropies straight from the last hidden states, without the full-vocabulary logits.

A causal LM's head turns hidden states h [N, H] into logits h @ W.T [N, V]. With V = 151,936 and
N = a micro-batch's tokens (tens of thousands), the float32 logits alone are gigabytes, and autograd
would keep them (and their softmax) for the backward. `linear_logprobs_entropy` computes, for each
row, the logprob of its target token and the entropy of softmax(logits / temperature), chunk by
chunk of rows: only one chunk's [rows, V] logits exist at a time, in the forward and in the
backward, which recomputes them (one extra matmul per chunk, the price of the memory).

Gradients, with z = logits / T, p = softmax(z), lse = logsumexp(z):
    logprob  = z[y] - lse              d/dz = onehot(y) - p
    entropy  = lse - sum(p * z)        d/dz = -p * (log p + entropy)
and d/dlogits = d/dz / T, d/dh = d/dlogits @ W, d/dW = d/dlogits.T @ h.

The matmul runs in `matmul_dtype` (the trainer's compute dtype: bf16 on GPU), the softmax and
everything after it in float32 (float64 for float64 inputs), as the plain `logits.float()` path does. The caller picks the rows:
the trainer passes only the positions that predict response tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK_ROWS = 2048  # 2048 rows x 152k vocab x 4 bytes ≈ 1.2 GB per float32 temporary


def _chunk_logits(h: Tensor, weight: Tensor, matmul_dtype: torch.dtype) -> Tensor:
    """[rows, V] logits of one chunk in `matmul_dtype`, with autocast off (the dtype is ours)."""
    with torch.autocast(device_type=h.device.type, enabled=False):
        return h.to(matmul_dtype) @ weight.to(matmul_dtype).T


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs (the tests' exact reference)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_values(logits: Tensor, target: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """(logprob of target [rows], entropy [rows], lse [rows]) of one chunk's logits [rows, V]."""
    z = logits.to(_softmax_dtype(logits.dtype)) / temperature
    lse = torch.logsumexp(z, dim=-1)
    logprob = z.gather(-1, target[:, None]).squeeze(-1) - lse
    p = torch.exp(z - lse[:, None])
    entropy = lse - (p * z).sum(-1)
    return logprob, entropy, lse


def _chunk_grad(logits: Tensor, lse: Tensor, entropy: Tensor, target: Tensor, g_lp: Tensor, g_ent: Tensor,
                temperature: float) -> Tensor:
    """d(loss)/d(logits) [rows, V] in the logits' dtype, from the upstream grads of logprob and entropy:
    d/dz = -p * (g_ent * (log p + H) + g_lp) + onehot(y) * g_lp, and d/dlogits = d/dz / T."""
    logp = logits.to(lse.dtype) / temperature - lse[:, None]
    p = torch.exp(logp)
    grad = -p * (g_ent[:, None] * (logp + entropy[:, None]) + g_lp[:, None])
    onehot = torch.arange(logits.shape[-1], device=logits.device)[None, :] == target[:, None]
    grad = torch.where(onehot, grad + g_lp[:, None], grad)
    return (grad / temperature).to(logits.dtype)


# On CUDA the chunk math runs compiled: eager, each of its ~15 float32 passes over [rows, 152k] reads
# and writes the whole chunk (measured on an H200: ~0.5 s of a 1.15 s GRPO step at 65k response
# tokens); fused, each function reads the bf16 logits about twice and writes once. Compiled once per
# process; a compile failure falls back to the eager functions (same numbers), once, with a warning.
_COMPILED: dict[str, object] = {}


def _math(name: str, fn, device: torch.device):
    if device.type != "cuda":
        return fn
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn)      # lazy: a compiler failure shows at the first call, below
    compiled = _COMPILED[name]

    def call(*args):
        try:
            return compiled(*args)
        except Exception as e:  # noqa: BLE001 (Inductor/triton failures; the eager path is the reference)
            if compiled is fn or isinstance(e, torch.cuda.OutOfMemoryError):
                raise
            import warnings
            warnings.warn(f"fused_logprobs: compiled {name} failed ({e!r}); running eager from now on", stacklevel=2)
            _COMPILED[name] = fn
            return fn(*args)
    return call


_MM_OUT_DTYPE: list[bool] = []   # [whether torch.mm(..., out_dtype=) works here], learned at the first call


def _add_matmul(out: Tensor, a: Tensor, b: Tensor) -> None:
    """out += a @ b, with a float32 (or float64) product: the weight gradient sums one product per
    chunk, and rounding each to bf16 first would add one bf16 error per chunk."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif not a.is_cuda:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))  # CPU: the same numbers, exactly
    else:
        if not _MM_OUT_DTYPE:
            try:        # bf16 inputs, float32 accumulate and output (CUDA, torch >= 2.8)
                out += torch.mm(a, b, out_dtype=out.dtype)
                _MM_OUT_DTYPE.append(True)
                return
            except torch.cuda.OutOfMemoryError:
                raise
            except (TypeError, RuntimeError, NotImplementedError):   # this torch has no out_dtype for mm
                _MM_OUT_DTYPE.append(False)
        if _MM_OUT_DTYPE[0]:
            out += torch.mm(a, b, out_dtype=out.dtype)
        else:
            out += (a @ b).to(out.dtype)     # rounded to bf16 per chunk, as autocast's own gradient is


class _LinearLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, temperature, chunk_rows, matmul_dtype):
        n, dtype = hidden.shape[0], _softmax_dtype(matmul_dtype)
        logprobs = hidden.new_empty(n, dtype=dtype)
        entropy = hidden.new_empty(n, dtype=dtype)
        lse = hidden.new_empty(n, dtype=dtype)
        values = _math("values", _chunk_values, hidden.device)
        w = weight.to(matmul_dtype)     # cast once, not once a chunk (the head is 0.4-0.6 B parameters at 4B-8B)
        for s in range(0, n, chunk_rows):
            logits = _chunk_logits(hidden[s:s + chunk_rows], w, matmul_dtype)
            logprobs[s:s + chunk_rows], entropy[s:s + chunk_rows], lse[s:s + chunk_rows] = \
                values(logits, target[s:s + chunk_rows], temperature)
        ctx.save_for_backward(hidden, weight, target, entropy, lse)
        ctx.options = (temperature, chunk_rows, matmul_dtype)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return logprobs, entropy, lse

    @staticmethod
    def backward(ctx, g_logprobs, g_entropy, _g_lse):
        hidden, weight, target, entropy, lse = ctx.saved_tensors
        temperature, chunk_rows, matmul_dtype = ctx.options
        if g_logprobs is None and g_entropy is None:
            return None, None, None, None, None, None
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=_softmax_dtype(weight.dtype)) if ctx.needs_input_grad[1] else None
        w = weight.to(matmul_dtype)
        g_logprobs = torch.zeros_like(lse) if g_logprobs is None else g_logprobs.to(lse.dtype)
        g_entropy = torch.zeros_like(lse) if g_entropy is None else g_entropy.to(lse.dtype)
        grad = _math("grad", _chunk_grad, hidden.device)
        for s in range(0, hidden.shape[0], chunk_rows):
            rows = slice(s, s + chunk_rows)
            h = hidden[rows].to(matmul_dtype)
            grad_logits = grad(_chunk_logits(h, w, matmul_dtype), lse[rows], entropy[rows], target[rows],
                               g_logprobs[rows], g_entropy[rows], temperature)
            with torch.autocast(device_type=h.device.type, enabled=False):
                if grad_h is not None:
                    grad_h[rows] = grad_logits @ w
                if grad_w is not None:
                    _add_matmul(grad_w, grad_logits.T, h)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def linear_logprobs_entropy(hidden: Tensor, weight: Tensor, target: Tensor, temperature: float = 1.0, *,
                            chunk_rows: int = DEFAULT_CHUNK_ROWS,
                            matmul_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Logprob of `target` and entropy under softmax((hidden @ weight.T) / temperature), row by row.

    hidden [N, H] (rows that each predict one token), weight [V, H] (the LM head), target [N] int64
    → (logprobs [N], entropy [N]) in float32 (float64 when matmul_dtype is). Differentiable in `hidden` and `weight`; the
    backward recomputes each chunk's logits instead of keeping them. `matmul_dtype` defaults to
    hidden's dtype.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the rollout's sampling temperature), got {temperature}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be [N, H] and [V, H]")
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"target {tuple(target.shape)} must hold one token id per row of hidden {tuple(hidden.shape)}")
    logprobs, entropy, _ = _LinearLogprobsEntropy.apply(hidden, weight, target, float(temperature), chunk_rows,
                                                        matmul_dtype or hidden.dtype)
    return logprobs, entropy


def masked_logprobs_entropy(hidden: Tensor, weight: Tensor, tokens: Tensor, loss_mask: Tensor,
                            temperature: float = 1.0, *, trained: Tensor | None = None,
                            **options) -> tuple[Tensor, Tensor]:
    """[B, T] logprobs and entropies in the project's token alignment (see `miles.algorithms.entropy`),
    computed only where `loss_mask` is True (0.0 elsewhere).

    hidden [B, T, H] are the model's last hidden states (position t - 1 predicts tokens[:, t]);
    tokens [B, T] int64; loss_mask [B, T] bool, False at position 0. `trained` [n] int64, when the
    caller knows it: the flat positions (in [B * T], row-major) where `loss_mask` is True. Without it
    they are read from `loss_mask`, which makes the host wait for the device.
    """
    if hidden.shape[:2] != tokens.shape or tokens.shape != loss_mask.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)}, tokens {tuple(tokens.shape)} and loss_mask "
                         f"{tuple(loss_mask.shape)} must share [B, T]")
    if trained is None:
        if loss_mask[:, :1].any():
            raise ValueError("loss_mask is True at position 0, which no hidden state predicts")
        trained = loss_mask.reshape(-1).nonzero().squeeze(1)
    predicts = trained - 1           # position t - 1 of the same row: no trained token sits at t = 0
    lp, ent = linear_logprobs_entropy(hidden.reshape(-1, hidden.shape[-1]).index_select(0, predicts), weight,
                                      tokens.reshape(-1).index_select(0, trained), temperature, **options)
    size = tokens.numel()
    return (lp.new_zeros(size).index_copy(0, trained, lp).view(tokens.shape),
            ent.new_zeros(size).index_copy(0, trained, ent).view(tokens.shape))
