"""Mixture-of-experts routing on the transformers model, shared by the embedded engine and the torch trainer.

`Routing(model, ...)` puts a forward hook on each MoE layer's router (the family's router class:
`MOE_FAMILIES`; Qwen3-MoE's `Qwen3MoeTopKRouter`, a softmax over the experts, top-k, renormalised
when `norm_topk_prob`). transformers' model code is not forked: the hook sees the router's input and
output and, only when asked to, returns its own (scores, indices) in the router's output format.

- **record** (always): per forward, each MoE layer's applied experts [N, k] (N = the flattened token
  positions the router saw: B x T of a padded forward), the router's own top-k and its logits.
  The engine keeps, per sampled token, the experts of the position that produced its logits (the row's
  last position of that forward): `Generation.routed_experts` [R][L][k], `Sample.rollout_routed_experts`.
- **replay** (`replay` [N, L, k], -1 where a position is not replayed): the experts of each position are
  the given ones instead of the router's own top-k; the gate weights are still the router's softmax,
  taken at the replayed experts and renormalised as `norm_topk_prob` says, so the router gets
  gradients (R3: `--use-rollout-routing-replay`; `--use-routing-replay`: the old-logprob pass's).
- **router in float32** (`--moe-router-dtype fp32`): the logits are recomputed in float32 from the
  router's weight and input (the gate weights stay float32 into the experts' weighted sum).

The trainer's losses and metrics (`aux_losses`, `RoutingStats`) read what the hooks recorded:
Megatron's load-balancing loss (`aux_loss`: coeff x E / (k T^2) x sum_e P_e n_e, P_e the summed
router probability of expert e over the T tokens, n_e the tokens routed to it; `seq_aux_loss`: the same
per sequence, averaged over sequences), the z-loss (coeff x mean_t logsumexp(logits_t)^2), each summed
over the MoE layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles.training.moe_checks import MOE_FAMILIES

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")


def router_modules(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, router) of each MoE layer of a model of a built family, in layer order;
    [] for a dense model."""
    config = getattr(model, "config", None)
    family = MOE_FAMILIES.get(getattr(config, "model_type", None))
    if family is None or not family.experts(config.to_dict()):
        return []
    out = []
    for name, module in model.named_modules():
        if type(module).__name__ == family.router_class:
            layer = next((int(p) for p in name.split(".") if p.isdigit()), None)
            out.append((layer, module))
    return sorted(out, key=lambda pair: pair[0])


@dataclass
class _Layer:
    applied: Tensor | None = None     # [N, k] int64: the experts the layer used
    own: Tensor | None = None         # [N, k] int64: the router's own top-k
    logits: Tensor | None = None      # [N, E] float32 (with their gradients in a training forward)


class Routing:
    """The hooks on one model's routers (see the module docstring). `layers` are the decoder layer
    indices of the MoE layers, in order; replay tensors and records index MoE layers 0..L-1."""

    def __init__(self, model: nn.Module, *, router_fp32: bool = False):
        routers = router_modules(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no MoE layers of a built family "
                             f"({', '.join(MOE_FAMILIES)})")
        self.layers = [layer for layer, _ in routers]
        self.top_k = int(routers[0][1].top_k)
        self.num_experts = int(routers[0][1].num_experts)
        self.router_fp32 = router_fp32
        self.replay: Tensor | None = None
        self.records = [_Layer() for _ in routers]
        self._handles = [router.register_forward_hook(self._hook(i)) for i, (_, router) in enumerate(routers)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def begin(self, replay: Tensor | None = None) -> None:
        """Before a forward: the experts to replay ([N, L, k], -1: the router's own). It stays set until
        the next `begin`, so a recomputed forward (activation checkpointing) routes as the first did."""
        if replay is not None and (replay.dim() != 3 or replay.shape[1:] != (len(self.layers), self.top_k)):
            raise ValueError(f"replayed experts must be [N, {len(self.layers)}, {self.top_k}], got {tuple(replay.shape)}")
        self.replay = None if replay is None else replay.long()
        self.records = [_Layer() for _ in self.layers]

    def applied(self) -> Tensor:
        """[N, L, k] the experts each position used in the last forward, per MoE layer."""
        return torch.stack([r.applied for r in self.records], dim=1)

    def own(self) -> Tensor:
        """[N, L, k] the routers' own top-k in the last forward (what they would have used unreplayed)."""
        return torch.stack([r.own for r in self.records], dim=1)

    def _hook(self, slot: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
            logits, scores, indices = output
            if self.router_fp32:
                hidden = args[0].reshape(-1, module.weight.shape[1])
                with torch.autocast(hidden.device.type, enabled=False):     # a bf16 trainer's autocast too
                    logits = F.linear(hidden.float(), module.weight.float())
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            own = indices if not self.router_fp32 else torch.topk(probs, self.top_k, dim=-1).indices
            record = self.records[slot]
            record.own = own.detach()
            record.logits = logits.float()
            replay = None if self.replay is None else self.replay[:, slot]
            if replay is not None and replay.shape[0] != own.shape[0]:
                raise ValueError(f"replayed experts cover {replay.shape[0]} positions; the router saw {own.shape[0]}")
            if replay is None and not self.router_fp32:
                record.applied = indices.detach()
                return None                     # the router's own output, untouched
            chosen = own if replay is None else torch.where(replay[:, :1] >= 0, replay, own)
            weights = probs.gather(-1, chosen)
            if module.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if not self.router_fp32:
                weights = weights.to(logits.dtype)
            record.applied = chosen.detach()
            return logits, weights, chosen
        return hook


# --- the trainer's losses -------------------------------------------------------------------------
def load_balancing_loss(logits: Tensor, experts: Tensor, num_experts: int, top_k: int,
                        sequences: Tensor | None = None, weight: Tensor | None = None,
                        num_sequences: int | None = None) -> Tensor:
    """Megatron's switch load-balancing loss (without its coefficient) of one layer: logits [T, E], the experts
    the tokens were routed to [T, k]; E / (k T^2) x sum_e P_e n_e. With `sequences` [T] (each token's sequence
    id): the same per sequence (its own T), averaged over the sequences that have tokens (seq_aux_loss).
    `weight` [T] 0/1 counts only the positions it marks (the real tokens, padding 0), by masked sums; with
    `num_sequences` (the ids are 0..num_sequences-1) nothing reads a count back to the host."""
    probs = torch.softmax(logits.float(), dim=-1)
    routed = probs.new_zeros(probs.shape).scatter_(1, experts, 1.0)           # [T, E] 0/1 (top-k: distinct)
    w = probs.new_ones(probs.shape[0]) if weight is None else weight.to(probs.dtype)
    probs, routed = probs * w[:, None], routed * w[:, None]
    if sequences is None:
        t = w.sum()
        return (probs.sum(0) * routed.sum(0)).sum() * num_experts / (top_k * t * t)
    if num_sequences is None:
        ids, seq = torch.unique(sequences, return_inverse=True)
        num_sequences = len(ids)
    else:
        seq = sequences
    p = probs.new_zeros(num_sequences, num_experts).index_add_(0, seq, probs)
    n = probs.new_zeros(num_sequences, num_experts).index_add_(0, seq, routed)
    t = probs.new_zeros(num_sequences).index_add_(0, seq, w)
    has = (t > 0).to(probs.dtype)
    return ((p * n).sum(1) * num_experts / (top_k * t.clamp(min=1) ** 2) * has).sum() / has.sum()


def z_loss(logits: Tensor, weight: Tensor | None = None) -> Tensor:
    """ST-MoE's router z-loss (without its coefficient) of one layer: mean_t logsumexp(logits_t)^2 (over the
    positions `weight` [T] 0/1 marks, when given)."""
    lse2 = torch.logsumexp(logits.float(), dim=-1).square()
    if weight is None:
        return lse2.mean()
    w = weight.to(lse2.dtype)
    return (lse2 * w).sum() / w.sum()


def aux_losses(routing: Routing, real: Tensor, sequences: Tensor, *, aux_coeff: float, balancing: str,
               z_coeff: float | None, num_sequences: int | None = None) -> dict[str, Tensor]:
    """The router losses of the last forward, summed over the MoE layers and scaled by their coefficients:
    `moe_aux_loss` (when aux_coeff > 0 and a balancing type other than none), `moe_z_loss` (z_coeff > 0).
    `real` [N] bool: the positions that are tokens (not padding); `sequences` [N]: their sequence ids, 0 to
    `num_sequences` - 1 (the rows). Masked sums over all N positions: no boolean index (a host sync a layer)."""
    out: dict[str, Tensor] = {}
    use_aux = aux_coeff > 0 and balancing != "none"
    if use_aux:
        seq = sequences if balancing == "seq_aux_loss" else None
        out["moe_aux_loss"] = aux_coeff * sum(
            load_balancing_loss(r.logits, r.applied, routing.num_experts, routing.top_k, seq, real, num_sequences)
            for r in routing.records)
    if z_coeff:
        out["moe_z_loss"] = z_coeff * sum(z_loss(r.logits, real) for r in routing.records)
    return out


# --- metrics --------------------------------------------------------------------------------------
def expert_counts(applied: Tensor, num_experts: int, weight: Tensor | None = None) -> Tensor:
    """[L, E] float32: how many of the positions' top-k picks in `applied` [n, L, k] went to each expert, per
    layer (each position's picks counted `weight` [n] times: 0 leaves a padding position out). One scatter-add:
    a one-hot of the picks would be an [n, L, k, E] int64 tensor (1.6 GB for 16k positions of the 12-layer
    Qwen3-30B-A3B cut, 128 experts, top-8)."""
    n, layers, k = applied.shape
    flat = applied.transpose(0, 1).reshape(layers, -1)                   # [L, n * k]
    ones = torch.ones((n, layers, k), device=applied.device) if weight is None else \
        weight.float()[:, None, None].expand(n, layers, k)
    return torch.zeros(layers, num_experts, device=applied.device).scatter_add_(
        1, flat, ones.transpose(0, 1).reshape(layers, -1))


@dataclass
class RoutingStats:
    """Sums over a rollout's trainer forwards (on the model's device; read once by `metrics`)."""

    tokens: Tensor | None = None          # [L, E] tokens routed to each expert
    entropy: Tensor | None = None         # summed router entropy over tokens and layers
    positions: Tensor | int = 0           # real positions x layers the entropy covers (a device sum until read)
    compared: Tensor | None = None        # positions with rollout routing (x layers)
    differ: Tensor | None = None          # of them, those where the router's own top-k differs from the rollout's
    compared_tokens: Tensor | None = None
    differ_tokens: Tensor | None = None   # positions where any layer differs
    replayed: Tensor | None = None        # positions x layers that ran replayed experts

    def add(self, routing: Routing, real: Tensor, rollout: Tensor | None, replayed: bool) -> None:
        """One forward's routing: `real` [N] bool, `rollout` [N, L, k] (-1: none) the rollout's experts. Masked
        sums, not boolean indexing: an index by a mask reads its count back to the host (a sync), and this runs
        after every forward of an MoE model."""
        with torch.no_grad():
            applied, own = routing.applied(), routing.own()
            weight = real.float()
            self._sum("tokens", expert_counts(applied, routing.num_experts, weight))
            ent = sum((-(lp.exp() * lp).sum(-1) * weight).sum() for lp in (torch.log_softmax(r.logits.detach(), dim=-1)
                                                                            for r in routing.records))
            self._sum("entropy", ent)
            self._sum("positions", real.sum() * len(routing.layers))
            if rollout is not None:
                ref = rollout.long()
                has = (ref[:, :, 0] >= 0) & real[:, None]                                   # [N, L]
                differ = (own.sort(-1).values != ref.sort(-1).values).any(-1) & has
                self._sum("compared", has.sum())
                self._sum("differ", differ.sum())
                self._sum("compared_tokens", has.any(-1).sum())
                self._sum("differ_tokens", differ.any(-1).sum())
                if replayed:
                    self._sum("replayed", has.sum())

    _SCALARS = ("entropy", "compared", "differ", "compared_tokens", "differ_tokens", "replayed")

    def raw(self, layers: int, experts: int) -> dict[str, float]:
        """The sums as floats under fixed keys (0 where nothing was seen), to sum over ranks."""
        tokens = self.tokens.tolist() if self.tokens is not None else [[0.0] * experts for _ in range(layers)]
        out = {f"tokens/{i}/{e}": float(v) for i, row in enumerate(tokens) for e, v in enumerate(row)}
        out.update({name: 0.0 if getattr(self, name) is None else float(getattr(self, name)) for name in self._SCALARS})
        out["positions"] = float(self.positions)      # one read, with the others
        return out

    @classmethod
    def from_raw(cls, raw: dict[str, float], layers: int, experts: int) -> RoutingStats:
        stats = cls(tokens=torch.tensor([[raw[f"tokens/{i}/{e}"] for e in range(experts)] for i in range(layers)])
                    if raw["positions"] else None, positions=int(raw["positions"]))
        for name in cls._SCALARS:
            setattr(stats, name, torch.tensor(raw[name]))
        if not raw["positions"]:
            stats.entropy = None
        return stats

    def _sum(self, name: str, value: Tensor) -> None:
        old = getattr(self, name)
        setattr(self, name, value if old is None else old + value)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.tokens is not None:
            per_layer_max = self.tokens.max(dim=1).values
            per_layer_mean = self.tokens.mean(dim=1)
            for i, (mx, mean) in enumerate(zip(per_layer_max.tolist(), per_layer_mean.tolist())):
                out[f"moe/layer{i}/tokens_per_expert_max"] = mx
                out[f"moe/layer{i}/tokens_per_expert_mean"] = mean
            out["moe/expert_load_max_over_mean"] = float((per_layer_max / per_layer_mean.clamp(min=1e-9)).mean())
        if self.entropy is not None and float(self.positions):
            out["moe/router_entropy"] = float(self.entropy) / float(self.positions)
        if self.compared is not None and int(self.compared) > 0:
            out["moe/routing_mismatch"] = float(self.differ) / float(self.compared)
            out["moe/routing_mismatch_tokens"] = float(self.differ_tokens) / max(float(self.compared_tokens), 1.0)
            out["moe/routing_replayed"] = 0.0 if self.replayed is None else float(self.replayed) / float(self.compared)
        return out


def engine_routed(routing: Routing, rows: int, width: int) -> Tensor:
    """[rows, L, k] the experts of each row's last position in the last forward of a [rows, width]
    input (the position whose logits the engine samples the row's next token from)."""
    return routing.applied().view(rows, width, len(routing.layers), routing.top_k)[:, -1]


# --- the torch trainer's side ---------------------------------------------------------------------
class TrainerMoe:
    """What the torch trainer adds for an MoE model: its forward wrapped (replay, records, stats), the
    router losses of each training micro-batch, the old-logprob pass's routing (--use-routing-replay)
    and the rollout's routing metrics. `of` is None for a dense model."""

    def __init__(self, model: nn.Module, *, rollout_replay: bool, old_replay: bool, aux_coeff: float,
                 balancing: str, z_coeff: float | None, router_fp32: bool):
        self.model = model
        self.routing = Routing(model, router_fp32=router_fp32)
        self.rollout_replay, self.old_replay = rollout_replay, old_replay
        self.aux_coeff, self.balancing, self.z_coeff = aux_coeff, balancing, z_coeff
        self.stats = RoutingStats()
        self.counting = True            # False: a data-parallel rank's padding micro-batch (no stats, no loss terms)
        self._losses: dict[str, Tensor] = {}
        self._loss_sums: dict[str, Tensor | float] = {name: 0.0 for name in self._loss_names()}
        self._loss_count = 0

    def _loss_names(self) -> list[str]:
        return ([] if self.aux_coeff <= 0 or self.balancing == "none" else ["moe_aux_loss"]) + \
            (["moe_z_loss"] if self.z_coeff else [])

    @classmethod
    def of(cls, model: nn.Module, train) -> TrainerMoe | None:
        """From the trainer's TrainConfig; None when the model has no MoE layers."""
        if not router_modules(model):
            return None
        return cls(model, rollout_replay=train.use_rollout_routing_replay, old_replay=train.use_routing_replay,
                   aux_coeff=train.moe_aux_loss_coeff, balancing=train.moe_router_load_balancing_type,
                   z_coeff=train.moe_z_loss_coeff, router_fp32=train.moe_router_dtype == "fp32")

    def replay_for(self, mb, training: bool) -> Tensor | None:
        """[b, w, L, k] the experts a forward of `mb` replays (-1: the router's own), or None: R3's rollout
        experts; in a training forward under --use-routing-replay the old pass's where R3 has none."""
        replay = mb.routed_experts if self.rollout_replay else None
        if training and self.old_replay and mb.old_routed_experts is not None:
            old = mb.old_routed_experts
            replay = old if replay is None else torch.where(replay[..., :1] >= 0, replay, old)
        return replay

    def wrap(self, forward: Callable) -> Callable:
        """`forward` (miles.training.torch.forward's) with this model's routing set up before and read after."""
        def routed_forward(model, mb, entropy, entropy_grad):
            if model is not self.model:          # the reference or the teacher: their own routers
                return forward(model, mb, entropy, entropy_grad)
            training = torch.is_grad_enabled()
            replay = self.replay_for(mb, training)
            flat = lambda t: None if t is None else t.reshape(-1, *t.shape[2:])     # noqa: E731
            self.routing.begin(flat(replay))
            out = forward(model, mb, entropy, entropy_grad)
            real = mb.attention_mask.reshape(-1).bool()
            if self.counting:
                self.stats.add(self.routing, real, flat(mb.routed_experts), replayed=replay is not None)
            self._losses = {}
            if training:
                rows = torch.arange(mb.tokens.shape[0], device=real.device).repeat_interleave(mb.tokens.shape[1])
                self._losses = aux_losses(self.routing, real, rows, aux_coeff=self.aux_coeff,
                                          balancing=self.balancing, z_coeff=self.z_coeff,
                                          num_sequences=mb.tokens.shape[0])
            return out
        return routed_forward

    def router_loss(self, micro_batches: int) -> Tensor | None:
        """The last training forward's router losses, over the step's `micro_batches` (their mean over the
        micro-batches is the step's); None when off."""
        if not self._losses:
            return None
        if self.counting:             # summed on the device; `metrics` reads them once
            for name, value in self._losses.items():
                self._loss_sums[name] = self._loss_sums[name] + value.detach()
            self._loss_count += 1
        return sum(self._losses.values()) / micro_batches

    def record_old(self, out: Tensor | None, rows: Tensor, mb, batch) -> Tensor | None:
        """--use-routing-replay: the old-logprob pass's experts of `mb` (rows `rows` of `batch`) into `out`."""
        if not self.old_replay:
            return None
        if out is None:
            out = self.no_routing(batch)
        b, w = mb.tokens.shape
        if rows.numel():
            out[rows, :w] = self.routing.applied().view(b, w, len(self.routing.layers), self.routing.top_k)
        return out

    def no_routing(self, batch) -> Tensor:
        """[B, T, L, k] of -1 (no recorded routing) for `batch`."""
        return torch.full((*batch.tokens.shape, len(self.routing.layers), self.routing.top_k), -1,
                          dtype=torch.long, device=batch.tokens.device)

    def metrics(self, reduce: Callable[[dict[str, float]], dict[str, float]] | None = None) -> dict[str, float]:
        """The rollout's routing metrics (`moe/...`) and router losses (mean per micro-batch); then reset.
        `reduce` sums the raw counts over data-parallel ranks (every rank calls it, with the same keys)."""
        raw = self.stats.raw(len(self.routing.layers), self.routing.num_experts)
        raw.update({f"loss/{name}": float(total) for name, total in self._loss_sums.items()},
                   loss_count=float(self._loss_count))
        if reduce is not None:
            raw = reduce(raw)
        out = RoutingStats.from_raw(raw, len(self.routing.layers), self.routing.num_experts).metrics()
        out.update({f"moe/{name}": raw[f"loss/{name}"] / max(raw["loss_count"], 1.0) for name in self._loss_names()})
        self.stats, self._loss_count = RoutingStats(), 0
        self._loss_sums = {name: 0.0 for name in self._loss_names()}
        return out
