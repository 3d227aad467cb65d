"""Context parallelism without Transformer Engine: each of the CP ranks of a group holds the same
2 * CP chunks of every sequence (megatron's load-balanced split, `ParallelLayout.cp_positions`:
rank r holds chunks r and 2 CP - 1 - r), and

- `GatheredKVAttention`, the local layer spec's core attention when CP > 1 and Transformer Engine
  is absent (megatron's own `DotProductAttention` refuses CP > 1), all-gathers the keys and values
  of the whole sequence over the CP group and attends from its local queries with the causal mask
  of their true positions (a query sees the keys at positions <= its own). The gather's backward
  sums the key / value gradients of every rank's queries and keeps this rank's slice;
- `ContextSplit` picks a rank's tokens of a [B, T] batch and puts per-token results back in
  sequence order;
- `token_terms` turns a rank's logits (at its positions) into whole [B, T] logprobs and entropies
  aligned like `miles.algorithms.logprobs_from_logits`, through the shared objective's own
  functions, so every CP rank computes the whole micro-batch's loss from them.

megatron's rotary embedding slices its table for the CP rank the same way
(`get_pos_emb_on_this_cp_rank`), so feeding a rank `ContextSplit.positions` gives every token its
true rotary position. Device-agnostic: the CPU tests run it over gloo.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from miles.algorithms import entropy_from_logits
from miles.algorithms.entropy import shift_right
from miles.training.megatron.layout import ParallelLayout


def cp_positions(cp_rank: int, cp_size: int, seq_len: int) -> Tensor:
    """The positions (sorted) CP rank `cp_rank` of `cp_size` holds of a sequence of `seq_len`."""
    return ParallelLayout(cp_size, cp=cp_size).cp_positions(cp_rank, seq_len)


@functools.lru_cache(maxsize=64)
def sequence_order(cp_size: int, seq_len: int) -> Tensor:
    """The index that sorts the concatenation of every rank's positions (rank 0's first) into 0..seq_len-1."""
    gathered = torch.cat([cp_positions(r, cp_size, seq_len) for r in range(cp_size)])
    return torch.argsort(gathered)


# newer torch names it reduce_scatter_single (reduce_scatter_tensor deprecated); NCCL and gloo both have it
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather(x: Tensor, dim: int, group) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _GatherSummedGrad(torch.autograd.Function):
    """Every rank's `x` concatenated along `dim`, in rank order; backward: the gradients every rank
    sends back for the whole concatenation, summed, this rank's slice (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group) -> Tensor:
        ctx.dim, ctx.group, ctx.size = dim, group, x.shape[dim]
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        moved = grad.movedim(ctx.dim, 0).contiguous()
        out = moved.new_empty((ctx.size, *moved.shape[1:]))
        _reduce_scatter(out, moved, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


class _GatherReplicated(torch.autograd.Function):
    """Every rank's `x` concatenated along `dim`; backward: this rank's slice of the gradient, not
    summed. Right only when every rank computes the same function of the concatenation (the CP
    ranks' identical loss): each rank's own gradient already is the whole gradient of its slice."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group) -> Tensor:
        ctx.dim, ctx.size, ctx.rank = dim, x.shape[dim], dist.get_rank(group)
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.narrow(ctx.dim, ctx.rank * ctx.size, ctx.size).contiguous(), None, None


def _attention_class():
    from megatron.core.transformer.module import MegatronModule

    class GatheredKVAttention(MegatronModule):
        """Core attention of one CP rank (see the module docstring). Takes and returns what megatron's
        `DotProductAttention` does: query [sq, b, np, hn], key and value [sk, b, ng, hn] (this rank's
        tokens, sq = sk = S / CP) -> context [sq, b, np * hn]."""

        def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                     attention_dropout: float | None = None, softmax_scale: float | None = None,
                     cp_comm_type: str | None = None, pg_collection=None):
            super().__init__(config=config)
            dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            if dropout or config.apply_query_key_layer_scaling or config.softmax_type != "vanilla" \
                    or config.window_size is not None:
                raise ValueError("context parallelism without Transformer Engine supports plain causal softmax "
                                 "attention (no attention dropout, query-key layer scaling, softmax offsets or "
                                 "sliding windows); install Transformer Engine or use --context-parallel-size 1")
            from megatron.core import parallel_state

            self.group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
            self.tp_group = getattr(pg_collection, "tp", None) or parallel_state.get_tensor_model_parallel_group()
            tp = self.tp_group.size()
            self.heads = config.num_attention_heads // tp
            self.groups = config.num_query_groups // tp
            self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

        def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    attn_mask_type=None, attention_bias: Tensor | None = None, packed_seq_params=None) -> Tensor:
            if packed_seq_params is not None or attention_bias is not None or attention_mask is not None:
                raise ValueError("context-parallel attention without Transformer Engine takes causal, unpacked "
                                 "sequences without an attention mask or bias")
            return gathered_kv_attention(query, key, value, self.group, heads_per_group=self.heads // self.groups,
                                         scale=self.softmax_scale)

    return GatheredKVAttention


def gathered_kv_attention(query: Tensor, key: Tensor, value: Tensor, group, *, heads_per_group: int,
                          scale: float) -> Tensor:
    """Causal attention of this CP rank's queries [sq, b, np, hn] over every rank's keys and values
    [sk, b, ng, hn] (gathered over `group`) -> [sq, b, np * hn]."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = query.shape[0] * cp
    order = sequence_order(cp, seq_len).to(query.device)
    # [S, b, ng, hn] in sequence order; gradients summed over the ranks whose queries read them
    key = _GatherSummedGrad.apply(key, 0, group).index_select(0, order)
    value = _GatherSummedGrad.apply(value, 0, group).index_select(0, order)
    if heads_per_group > 1:                 # grouped-query attention: each key/value head serves several queries
        key = key.repeat_interleave(heads_per_group, dim=2)
        value = value.repeat_interleave(heads_per_group, dim=2)
    q_pos = cp_positions(rank, cp, seq_len).to(query.device)
    mask = q_pos[:, None] >= torch.arange(seq_len, device=query.device)[None, :]       # [sq, S]
    # [s, b, n, h] -> [b, n, s, h]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)   # [b, np, sq, hn]
    sq, b = query.shape[:2]
    return context.permute(2, 0, 1, 3).reshape(sq, b, -1)


def __getattr__(name: str):
    # the module class subclasses megatron's MegatronModule: built on first use, megatron-core being optional
    if name == "GatheredKVAttention":
        cls = _attention_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


@dataclass(frozen=True)
class ContextSplit:
    """This rank's place in its CP group (`size` ranks; `group` None only when size is 1)."""

    rank: int
    size: int
    group: object = None

    def positions(self, seq_len: int, device: torch.device | None = None) -> Tensor:
        return cp_positions(self.rank, self.size, seq_len).to(device)

    def local(self, x: Tensor) -> Tensor:
        """This rank's columns of a [B, T] tensor."""
        return x.index_select(1, self.positions(x.shape[1], x.device))

    def whole(self, x: Tensor, *, replicated_grad: bool = False) -> Tensor:
        """[B, T] in sequence order from every rank's local [B, T / CP] columns. With
        `replicated_grad`, differentiable for a loss every CP rank computes alike (see `_GatherReplicated`)."""
        seq_len = x.shape[1] * self.size
        gathered = (_GatherReplicated.apply(x, 1, self.group) if replicated_grad
                    else _all_gather(x, 1, self.group))
        return gathered.index_select(1, sequence_order(self.size, seq_len).to(x.device))


def token_terms(split: ContextSplit, objective, logits: Tensor, tokens: Tensor,
                with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """Whole-sequence [B, T] logprobs of `tokens` [B, T] and (with `with_entropy`) entropies from this
    rank's logits [B, T / CP, V] at its positions, aligned to tokens (position t: the logits at
    t - 1; 0 at position 0), equal on every CP rank and differentiable through this rank's logits.

    Each local position p scores the next token, tokens[p + 1], with the objective's own functions:
    `logprobs_from_logits(logits, targets)` pairs logits[:, j - 1] with targets[:, j], so targets
    shifted by one column score every local position but the last, which a two-column call scores.
    """
    b, n, _ = logits.shape
    seq_len = tokens.shape[1]
    pos = split.positions(seq_len, tokens.device)
    nxt = tokens.index_select(1, (pos + 1).clamp(max=seq_len - 1))   # the last position's target is unused
    head = objective.logprobs(logits, torch.cat([nxt[:, :1], nxt[:, :-1]], dim=1))[:, 1:]
    last = objective.logprobs(logits[:, -1:].expand(b, 2, -1), nxt[:, -1:].expand(b, 2))[:, 1:]
    lp = split.whole(torch.cat([head, last], dim=1), replicated_grad=True)
    ent = None
    if with_entropy:
        with torch.set_grad_enabled(objective.entropy_has_grad and torch.is_grad_enabled()):
            head_e = entropy_from_logits(logits, objective.temperature)[:, 1:]
            last_e = entropy_from_logits(logits[:, -1:].expand(b, 2, -1), objective.temperature)[:, 1:]
            ent = split.whole(torch.cat([head_e, last_e], dim=1), replicated_grad=True)
    # values at logit positions -> at token positions (shift right by one)
    return shift_right(lp), None if ent is None else shift_right(ent)
