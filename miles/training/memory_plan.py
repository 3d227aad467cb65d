"""The token budget of a CUDA micro-batch when `--max-tokens-per-gpu` is not given: planned from the
free memory, so a micro-batch that TRL trains at the same size does not run out of memory here.

The rule (pure functions, unit-tested; the inputs come from `torch.cuda.mem_get_info` and the model's
config at the start of each train call, after a colocated engine has released its KV cache):

    budget_tokens = floor(HEADROOM * (free - reserve) / bytes_per_token)

- free: the device's free memory plus what this process's allocator holds cached but unused.
- reserve: what the step will still allocate whatever the micro-batch: the float32 gradients
  (4 B/param) and AdamW's two moments (8 B/param) when they do not exist yet on the device (the
  first step; never with --offload-train, whose step streams them a chunk at a time once the
  activations are gone), autocast's half-precision weight copies (2 B/param under a
  bf16/fp16 compute dtype), and the chunked logprob pass's temporaries (chunk rows x vocab x 16 B:
  the chunk's logits and three float32 passes over them).
- bytes_per_token (`activation_bytes_per_token`): what autograd keeps per token for the backward.
  Per decoder layer 32 h + 4 e I + 5 e (q_dim + kv_dim) + 512 bytes (h hidden size, I the MLP's
  intermediate size, q_dim = heads x head_dim, kv_dim = KV heads x head_dim, e the compute dtype's
  bytes; the residual stream and the norms stay float32 under autocast); plus 8 h for the final norm
  and the chunked LM head, or 12 V more when the logits are materialised (the CPU path). With
  --recompute-activations a layer keeps only its float32 input (8 h, rounded up), and one layer's
  activations exist at a time during its recompute. The coefficients are an upper bound of the
  bytes autograd saved in eager Qwen3 layers (measured on the CPU by `saved_tensors_hooks`;
  tests/unit/test_memory_plan.py checks the bound); compiled layers keep less.
- HEADROOM = 0.8: a margin for the allocator's fragmentation, kernel workspaces and the backward's
  transient gradient buffers, which the saved-tensor count does not see. A policy, not a measurement:
  the trainer reports `gpu_mem_peak_gib` per train call to check it against.

The budget caps micro-batches by their padded size (rows x longest; `plan_micro_batches`'
`memory_tokens`); it never merges rows, so the gradient is the same as without it. A budget below
one row's length cannot be split further: where even the longest row does not fit,
`plan_token_budget` says so, naming the flags that make room, and the trainer logs that as a
`memory_plan_tight` warning and trains one row per micro-batch (the coefficients are not yet
checked against GPU peaks, so the plan warns rather than refuses).
"""

from __future__ import annotations

import math

HEADROOM = 0.8
LOGPROB_CHUNK_BYTES_PER_VOCAB = 16


def _dims(cfg) -> tuple[int, int, int, int, int, int]:
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    inter = getattr(cfg, "intermediate_size", None) or 4 * h
    return h, inter, heads * head_dim, kv_heads * head_dim, cfg.num_hidden_layers, cfg.vocab_size


def activation_bytes_per_token(cfg, *, compute_bytes: int, recompute: bool, logits: bool) -> int:
    """Bytes autograd keeps per token of a micro-batch (see the module docstring)."""
    h, inter, q_dim, kv_dim, layers, vocab = _dims(cfg)
    layer = 32 * h + 4 * compute_bytes * inter + 5 * compute_bytes * (q_dim + kv_dim) + 512
    head = 8 * h + (12 * vocab if logits else 0)
    return (layers * 8 * h + layer if recompute else layers * layer) + head


def reserve_bytes(*, params: int, grads_allocated: bool, optimizer_allocated: bool, compute_bytes: int,
                  chunk_rows: int, vocab: int) -> int:
    """Bytes the step allocates besides the activations (see the module docstring)."""
    return ((0 if grads_allocated else 4 * params) + (0 if optimizer_allocated else 8 * params)
            + (2 * params if compute_bytes < 4 else 0) + chunk_rows * vocab * LOGPROB_CHUNK_BYTES_PER_VOCAB)


def plan_token_budget(free_bytes: int, reserve: int, bytes_per_token: int, *, min_tokens: int = 1) -> int:
    """floor(HEADROOM * (free - reserve) / bytes_per_token); a ValueError when fewer than `min_tokens` fit."""
    budget = math.floor(HEADROOM * (free_bytes - reserve) / bytes_per_token) if free_bytes > reserve else 0
    if budget < min_tokens:
        gib = 2 ** 30
        raise ValueError(
            f"training needs {min_tokens} tokens per micro-batch but only {max(budget, 0)} fit: "
            f"{free_bytes / gib:.1f} GiB free, {reserve / gib:.1f} GiB reserved for gradients, optimizer state and "
            f"logprob chunks, {bytes_per_token} B of activations per token; make room with --recompute-activations, "
            f"--offload-train, a smaller --rollout-mem-fraction or shorter --rollout-max-response-len")
    return budget


def cuda_token_budget(model, optimizer, *, device, compute_bytes: int, recompute: bool, logits: bool,
                      chunk_rows: int, min_tokens: int, streamed: bool = False) -> int:
    """`plan_token_budget` for `model` on the CUDA `device` now (see the module docstring). `streamed`:
    the optimizer state lives on the host and each step streams it (--offload-train), so the step
    never allocates it here beside the activations."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    reserve = reserve_bytes(params=sum(p.numel() for p in params),
                            grads_allocated=any(p.grad is not None for p in params),
                            optimizer_allocated=streamed or (bool(state) and all(v.is_cuda for v in state)),
                            compute_bytes=compute_bytes, chunk_rows=chunk_rows, vocab=model.config.vocab_size)
    per_token = activation_bytes_per_token(model.config, compute_bytes=compute_bytes, recompute=recompute,
                                           logits=logits)
    try:
        return plan_token_budget(free, reserve, per_token, min_tokens=min_tokens)
    except ValueError as exc:
        # the coefficients are an eager-layer bound, not yet checked against GPU peaks: say it, and
        # train one row per micro-batch rather than refuse a step that may still fit
        import structlog

        structlog.get_logger().warning("memory_plan_tight", problem=str(exc), budget=min_tokens)
        return min_tokens
