"""Padding-free micro-batches: the rows of a micro-batch laid end to end in one row of real tokens.

With `--use-dynamic-batch-size --max-tokens-per-gpu N` a micro-batch holds up to N *real* tokens
(`pack_groups`), and its forward runs on one [1, L] row (L = its real tokens): position ids restart
at every sample, and attention stays inside each sample (causal within it, blind to the others).
The logprobs and entropies come back in the micro-batch's right-padded [b, W] layout (`Pack.unpack`),
so every loss, reduction and metric reads exactly what the padded forward gives (float rounding
aside): packing changes the work done, not the numbers.

Attention inside a pack is `packed_attention`, registered with transformers as the implementation
"miles_packed" (`enable_packing`): a model with it builds no attention mask at all (transformers
makes none for an implementation without a mask function), and each layer gets the pack's sample
boundaries (`cu_seq_lens_q`, `max_length_q`) through the forward's keyword arguments. On CUDA, in
half precision, a pack whose samples differ in length goes to torch's variable-length flash attention
(`torch.nn.attention.varlen.varlen_attn`) when this torch has it: O(sum of l_i^2) work, no mask.
Otherwise (samples of about one length: `attention_path`; CPU, float32, an older torch) the pack's
samples are laid out as right-padded rows for one causal SDPA call and packed back
(`_padded_attention`): the attention of a padded micro-batch, exact, no [L, L] mask either, while
everything else in the layers runs on real tokens only; on CUDA that call runs cuDNN's flash kernels,
faster than the variable-length kernel while the rows add little padding. Called without boundaries (a padded
forward of the same model) it is plain causal SDPA, which is exact on right-padded rows.

Why not transformers' own packed format (restarting `position_ids`, no mask): with SDPA it builds a
[L, L] block-diagonal mask and attends over all L^2 pairs without the flash kernel, more work than
the padding it saves.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

ATTENTION_NAME = "miles_packed"
# families whose decoder hands position ids and extra keyword arguments to the attention function
# unchanged (RoPE from position_ids; tests/unit/test_packing.py, tests/gpu/test_packing_gpu.py)
PACKING_FAMILIES = ("qwen2", "qwen3", "llama")


def pack_groups(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices of each packed micro-batch: first-fit decreasing on the rows' real tokens, each
    group's sum <= max_tokens (a row longer than the budget gets a group of its own; rows are never
    split). Deterministic (ties by row index); every index appears exactly once."""
    if max_tokens < 1:
        raise ValueError(f"--max-tokens-per-gpu must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for g, free in enumerate(room):
            if lengths[i] <= free:
                groups[g].append(i)
                room[g] -= lengths[i]
                break
        else:
            groups.append([i])
            room.append(max_tokens - lengths[i])
    return groups


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device` without making the host wait: on CUDA it is copied from pinned
    memory behind the work already queued (a copy from pageable memory synchronizes the stream)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class Pack:
    """Where a right-padded micro-batch's real tokens go in its [1, L] pack (row after row). Made on
    the host from the rows' lengths (`of_lengths`): packing and unpacking are index copies, and
    nothing of it makes the host wait for the device."""

    shape: tuple[int, int]  # (b, W): the padded layout
    index: Tensor           # [L] int64, the flat position in [b * W] of each packed token
    position_ids: Tensor    # [1, L] int64, 0.. within each sample
    cu_seqlens: Tensor      # [b + 1] int32, sample boundaries in the pack
    max_len: int            # the longest sample
    num_tokens: int         # L

    @classmethod
    def of_lengths(cls, lengths: Sequence[int], width: int, device: torch.device | str = "cpu") -> Pack:
        """The pack of right-padded rows of `width` whose real tokens are `lengths` (host ints)."""
        if not lengths or min(lengths) < 1:
            raise ValueError("a packed micro-batch has a row without tokens")
        if max(lengths) > width:
            raise ValueError(f"a row of {max(lengths)} tokens does not fit the width {width}")
        device = torch.device(device)
        n = torch.tensor(lengths, dtype=torch.long)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
        cu[1:] = n.cumsum(0)
        total = int(cu[-1])
        positions = torch.arange(total) - torch.repeat_interleave(cu[:-1], n, output_size=total)
        rows = torch.repeat_interleave(torch.arange(len(lengths)), n, output_size=total)
        return cls(shape=(len(lengths), width), index=to_device(rows * width + positions, device),
                   position_ids=to_device(positions[None], device), cu_seqlens=to_device(cu.int(), device),
                   max_len=max(lengths), num_tokens=total)

    @classmethod
    def of(cls, attention_mask: Tensor) -> Pack:
        """The pack of right-padded rows read from their attention mask (one host read of the lengths)."""
        return cls.of_lengths(attention_mask.sum(dim=1).tolist(), attention_mask.shape[1], attention_mask.device)

    def pack(self, x: Tensor) -> Tensor:
        """[b, W, ...] -> [1, L, ...]: the real tokens, row after row."""
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.index)[None]

    def unpack(self, x: Tensor) -> Tensor:
        """[1, L] -> [b, W], zeros on the padding; differentiable in `x`."""
        return x.new_zeros(self.shape[0] * self.shape[1]).index_copy(0, self.index, x.reshape(-1)).view(self.shape)

    def model_kwargs(self) -> dict:
        """What a forward of the packed row passes to the model: the restarting positions and the
        boundaries `packed_attention` reads (transformers' names for them)."""
        return {"position_ids": self.position_ids, "cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_len, "max_length_k": self.max_len}


# --- attention --------------------------------------------------------------------------------------
def _varlen():
    """(varlen_attn, its keyword arguments for causal, GQA and scale) when this torch has it, else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params, "scale" in params


_VARLEN: list = []       # [_varlen()], looked up once


def _varlen_once():
    if not _VARLEN:
        _VARLEN.append(_varlen())
    return _VARLEN[0]


# torch >= 2.5: scaled_dot_product_attention(enable_gqa=...)
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def _repeat_kv(x: Tensor, n_rep: int, head_dim: int = 1) -> Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=head_dim)


def _padded_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_len: int,
                      scaling: float | None) -> Tensor:
    """[1, H, L, D] q, [1, Hkv, L, D] k/v -> [1, H, L, D]: the pack's samples laid out as right-padded
    rows for one causal SDPA call (a real token never sees the padding after it), then packed back.
    The same work as a padded micro-batch's attention, without a mask and without a host sync."""
    n, total = cu_seqlens.shape[0] - 1, query.shape[2]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    sample = torch.repeat_interleave(torch.arange(n, device=query.device), lengths, output_size=total)
    offset = torch.arange(total, device=query.device) - cu_seqlens[:-1].long()[sample]

    def rows(x: Tensor) -> Tensor:       # [1, h, L, D] -> [n, h, max_len, D]
        padded = x.new_zeros(n, max_len, x.shape[1], x.shape[3])
        return padded.index_put((sample, offset), x[0].transpose(0, 1)).transpose(1, 2)

    n_rep = query.shape[1] // key.shape[1]
    if _SDPA_GQA:        # SDPA reads the shared K/V heads itself (cuDNN's kernels on Hopper take GQA)
        k, v, options = rows(key), rows(value), {"enable_gqa": n_rep > 1}
    else:
        k, v, options = _repeat_kv(rows(key), n_rep), _repeat_kv(rows(value), n_rep), {}
    out = torch.nn.functional.scaled_dot_product_attention(rows(query), k, v, is_causal=True, scale=scaling, **options)
    return out.transpose(1, 2)[sample, offset].transpose(0, 1)[None]

# A pack laid out as padded rows computes n x max_len positions for its `total` tokens. On CUDA, SDPA on
# the rows runs cuDNN's flash kernels, which on the H200 took 1.02 s where the variable-length kernel
# (torch's FlashAttention-2) took 1.73 s for the same 24 x 4,160-token samples of the Qwen3-4B shape
# (scripts/bench/train_mfu_gpu.py's profile, Dec 4 2026): the rows are the faster path while the
# padding they add stays below this share, the variable-length kernel beyond it.
PADDED_ROWS_MAX_WASTE = 1.25


# A micro-batch whose right-padded rows add at most this share of positions to its real tokens runs as
# those rows, not packed: there is no pack to make and unmake around every layer's attention, and the
# rows' attention is SDPA's (cuDNN). Measured on the H200 at the Qwen3-4B shape, two samples of 4,160
# tokens a micro-batch: packed (the padded-rows path) 6.01 s a step, the same rows unpacked 5.77 s
# (scripts/bench/train_mfu_gpu.py, Dec 4 2026), a 4% difference; 3% of padding costs less than that.
UNPACKED_MAX_WASTE = 1.03


def worth_packing(lengths: Sequence[int], width: int) -> bool:
    """Whether rows of these real `lengths`, right-padded to `width`, run packed (see UNPACKED_MAX_WASTE)."""
    return len(lengths) * width > UNPACKED_MAX_WASTE * sum(lengths)


def attention_path(num_samples: int, total: int, max_len: int, varlen_usable: bool) -> str:
    """"varlen" or "rows": how `packed_attention` computes a pack of `num_samples` samples, `total`
    tokens, the longest `max_len` (all known on the host: no device sync)."""
    if varlen_usable and num_samples * max_len > PADDED_ROWS_MAX_WASTE * total:
        return "varlen"
    return "rows"


def _varlen_attention(fn, causal: dict, gqa: bool, has_scale: bool, query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor,
                      max_len: int, scaling: float | None) -> Tensor:
    """The same through torch's variable-length flash attention ([L, H, D] layout)."""
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))   # usually a no-op: [L, H, D] views
    options = dict(causal)
    if gqa:
        options["enable_gqa"] = True
    else:
        n_rep = q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    if scaling is not None and has_scale:
        options["scale"] = scaling
    out = fn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **options)
    return out.transpose(0, 1)[None]


def packed_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function contract: q [B, H, T, D], k/v [B, Hkv, T, D] -> ([B, T, H, D], None)."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got a batch of {query.shape[0]}")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise NotImplementedError("packed attention has no sliding window or softcap; run with --no-pack-sequences")
    varlen = _varlen_once()
    # a torch whose varlen_attn takes no scale still serves the default one, 1/sqrt(head_dim)
    default_scale = scaling is None or abs(scaling - query.shape[-1] ** -0.5) < 1e-12
    usable = varlen is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and \
        (varlen[3] or default_scale)
    max_len = int(kwargs["max_length_q"])
    if attention_path(cu_seqlens.shape[0] - 1, query.shape[2], max_len, usable) == "varlen":
        out = _varlen_attention(*varlen, query, key, value, cu_seqlens, max_len, scaling)
    else:
        out = _padded_attention(query, key, value, cu_seqlens, max_len, scaling)
    return out.transpose(1, 2).contiguous(), None


def packing_problem(model: nn.Module) -> str | None:
    """None when `packed_attention` computes this model's attention exactly; else why not."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "_attn_implementation"):
        return "not a transformers model"
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return "sliding-window attention"
    if getattr(cfg, "attn_logit_softcapping", None):
        return "attention logit softcapping"
    if getattr(cfg, "model_type", None) not in PACKING_FAMILIES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one packing was checked on"
    return None


def enable_packing(*models: nn.Module) -> str | None:
    """Switch `models` to `packed_attention`; returns why not (and leaves them as they were) when a
    model cannot pack."""
    for model in models:
        problem = packing_problem(model)
        if problem is not None:
            return problem
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention)
    _varlen_once()      # looked up now: a compiled layer that saw the lookup would recompile once it is done
    for model in models:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(ATTENTION_NAME)
        else:
            model.config._attn_implementation = ATTENTION_NAME
    return None


# Packed attention under activation recompute with torch.compiled decoder layers on CUDA (varlen kernel,
# bf16) gave logprobs up to 0.86 away from the padded forward's in tests/gpu/test_packing_gpu.py; the
# same packed step under recompute with eager layers matches the padded one (within bf16, as without
# recompute), so it is the compiled checkpointed layer with a pack's boundaries, not packing or
# recompute. That combination trains padded rows; --no-trainer-compile packs under recompute.
RECOMPUTE_ON_CUDA = ("--recompute-activations with compiled layers on CUDA: packed attention in a compiled checkpointed "
                     "layer disagreed with the padded forward on the GPU (--no-trainer-compile packs)")


def use_packing(train, *models: nn.Module | None, device: torch.device | None = None) -> bool:
    """Whether the trainer packs (--use-dynamic-batch-size without --no-pack-sequences). `models` (the
    policy, a reference) are switched to `packed_attention` whenever they can take it, packing or not:
    without a pack it is SDPA's causal attention, exact on right-padded rows, and transformers builds
    no mask for it, where for SDPA it would first read the position ids back from the device to look
    for packed sequences (a host wait at every forward). A model packing cannot serve, or a
    combination not verified on the GPU, keeps padded micro-batches, with a warning that says why."""
    problem = enable_packing(*(m for m in models if m is not None))
    if not (train.use_dynamic_batch_size and train.pack_sequences):
        return False
    cuda_recompute = (train.recompute_activations and device is not None and device.type == "cuda"
                      and train.compile_layers is not False)
    problem = RECOMPUTE_ON_CUDA if cuda_recompute else problem
    if problem is not None:
        import structlog

        structlog.get_logger().warning("packing_off", reason=problem,
                                       hint="token-budget micro-batches stay right-padded rows (rows x longest)")
        return False
    return True
