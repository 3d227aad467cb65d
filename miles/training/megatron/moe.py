"""Routing on one megatron rank's MoE layers: replay (R3, --use-routing-replay), records, routing metrics
and the router losses' bookkeeping, on megatron-core's own TopKRouter.

megatron-core's `topk_routing_with_score_function` asks the router's `router_replay` object for the top-k
(`get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)`); megatron's own
RouterReplay replays whole layers. `LayerReplay` stands in its place: it computes the router's own top-k,
takes the replayed experts where a position has them (-1: the router's own), and returns the router's
scores gathered at the experts it chose. megatron then makes the gate weights from those scores as for
its own choice: softmax over the k chosen logits (Qwen3-MoE's renormalised `norm_topk_prob`) or the
probabilities themselves (`moe_router_pre_softmax`), so the router keeps its gradient, as on the torch
trainer (`miles.training.moe`).

A router sees a micro-batch as [T, b] (sequence first), flattened: position (t, r) is row t * b + r.
Replay tensors and records are kept in miles' [b, T] order and transposed here. The MoE layers are
counted 0..L-1 over the whole model (`ModelSpec.moe_layers`); a pipeline stage holds some of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from miles.training.megatron.conversion import ModelSpec


def _to_router_order(t: Tensor) -> Tensor:
    """[b, T, ...] -> [T * b, ...] (megatron's sequence-first flattening)."""
    return t.transpose(0, 1).reshape(-1, *t.shape[2:])


def _from_router_order(t: Tensor, b: int) -> Tensor:
    """[T * b, ...] -> [b, T, ...]."""
    return t.reshape(-1, b, *t.shape[1:]).transpose(0, 1)


class LayerReplay:
    """One MoE layer's `router_replay`: see the module docstring."""

    def __init__(self, owner: MegatronRouting, slot: int):
        self.owner, self.slot = owner, slot

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups=None, group_topk=None, default_compute_topk=None):
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        replay = self.owner.replay_of(self.slot, scores.shape[0])
        chosen = own if replay is None else torch.where(replay[:, :1] >= 0, replay.to(own.device), own)
        self.owner.record(self.slot, scores, own, chosen)
        return scores.gather(1, chosen), chosen


class MegatronRouting:
    """The `LayerReplay`s of one model's routers and what they saw in the current micro-batch."""

    def __init__(self, gpt: torch.nn.Module, spec: ModelSpec):
        from megatron.core.transformer.moe.router import TopKRouter

        self.spec = spec
        self.num_layers, self.top_k, self.num_experts = len(spec.moe_layers), spec.top_k, spec.num_experts
        self.slots: list[int] = []
        for module in gpt.modules():
            if isinstance(module, TopKRouter):
                slot = spec.moe_layers.index(module.layer_number - 1)      # layer_number: global, from 1
                module.router_replay = LayerReplay(self, slot)
                self.slots.append(slot)
        self._replay: Tensor | None = None      # [T * b, L, k] of the current micro-batch
        self._records: dict[int, tuple[Tensor, Tensor, Tensor]] = {}    # slot -> (own, applied, log-probs)
        self._b = 1

    def begin(self, b: int, replay: Tensor | None) -> None:
        """Before a micro-batch's forward: its rows `b` and the experts to replay ([b, T, L, k], -1: own)."""
        self._b = b
        self._replay = None if replay is None else _to_router_order(replay.long())
        self._records = {}

    def replay_of(self, slot: int, n: int) -> Tensor | None:
        if self._replay is None:
            return None
        if self._replay.shape[0] != n:
            raise ValueError(f"replayed experts cover {self._replay.shape[0]} positions; the router saw {n}")
        return self._replay[:, slot]

    def record(self, slot: int, scores: Tensor, own: Tensor, chosen: Tensor) -> None:
        with torch.no_grad():
            s = scores.detach().float()
            # scores: the router logits, or (moe_router_pre_softmax, without norm_topk_prob) its probabilities
            log_probs = torch.log_softmax(s, -1) if self.spec.norm_topk_prob else torch.log(s.clamp(min=1e-30))
            self._records[slot] = (own.detach(), chosen.detach(), log_probs)

    def applied(self) -> dict[int, Tensor]:
        """slot -> [b, T, k] the experts each position used in the last forward (this stage's MoE layers)."""
        return {slot: _from_router_order(rec[1], self._b) for slot, rec in self._records.items()}

    def stats(self, real: Tensor, rollout: Tensor | None,
              replayed: bool) -> tuple[dict[str, float], tuple[Tensor, Tensor] | None]:
        """The last forward's routing counts, as the torch trainer's `RoutingStats.raw` keys (this stage's
        layers; every layer's keys present): `real` [b, T] bool, `rollout` [b, T, L, k] (-1: none). With a
        rollout, also the per-token flags (any of this stage's layers had the rollout's routing; any differed),
        [real tokens] int8 each: a token's "any layer" spans the pipeline stages (`token_counts`)."""
        out = {f"tokens/{i}/{e}": 0.0 for i in range(self.num_layers) for e in range(self.num_experts)}
        out.update(entropy=0.0, compared=0.0, differ=0.0, compared_tokens=0.0, differ_tokens=0.0, replayed=0.0,
                   positions=0.0)
        mask = _to_router_order(real.bool())
        ref = None if rollout is None else _to_router_order(rollout.long())[mask]
        any_differ, any_has = None, None
        for slot, (own, applied, log_probs) in self._records.items():
            counts = F.one_hot(applied[mask], self.num_experts).sum(dim=(0, 1)).tolist()
            for e, c in enumerate(counts):
                out[f"tokens/{slot}/{e}"] = float(c)
            lp = log_probs[mask]
            out["entropy"] += float(-(lp.exp() * lp).sum())
            out["positions"] += float(mask.sum())
            if ref is not None:
                layer_ref = ref[:, slot]
                has = layer_ref[:, 0] >= 0
                differ = (own[mask].sort(-1).values != layer_ref.sort(-1).values).any(-1) & has
                out["compared"] += float(has.sum())
                out["differ"] += float(differ.sum())
                if replayed:
                    out["replayed"] += float(has.sum())
                any_has = has if any_has is None else any_has | has
                any_differ = differ if any_differ is None else any_differ | differ
        if ref is None:
            return out, None
        n = int(mask.sum())
        zeros = torch.zeros(n, dtype=torch.int8, device=mask.device)
        flags = (zeros, zeros) if any_has is None else (any_has.to(torch.int8), any_differ.to(torch.int8))
        return out, flags


def token_counts(flags: list[tuple[Tensor, Tensor]], group, count: bool) -> tuple[float, float]:
    """(tokens with rollout routing in any MoE layer, tokens where any layer's own top-k differs) from this
    rank's per-forward flags, OR-ed over the pipeline stages of `group` (every stage walks the same
    micro-batches in the same order; None: one stage); (0, 0) unless `count`."""
    import torch.distributed as dist

    if not flags:
        return 0.0, 0.0
    has = torch.cat([f[0] for f in flags]).int()
    differ = torch.cat([f[1] for f in flags]).int()
    if group is not None:
        both = torch.stack([has, differ])
        dist.all_reduce(both, group=group)
        has, differ = both[0], both[1]
    return (float((has > 0).sum()), float((differ > 0).sum())) if count else (0.0, 0.0)


def add_raw(total: dict[str, float] | None, one: dict[str, float]) -> dict[str, float]:
    if total is None:
        return dict(one)
    return {k: total[k] + one[k] for k in total}


def tracked_router_losses(coeffs: dict[str, float]) -> dict[str, float]:
    """megatron-core's tracked router losses since the last call (its tracker holds each loss divided by
    its coefficient, per layer, summed over the micro-batches), times their coefficients, summed over this
    rank's layers; the tracker is zeroed. `coeffs`: tracker name -> coefficient."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    out = {}
    for name, coeff in coeffs.items():
        entry = tracker.get(name)
        out[name] = 0.0 if entry is None else float(entry["values"].sum()) * coeff
        if entry is not None:
            entry["values"].zero_()
    return out
