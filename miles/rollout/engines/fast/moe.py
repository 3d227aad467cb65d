"""Qwen3-MoE in the fast engine: the router, the experts of one layer as grouped matmuls, the weights.

A sparse layer (transformers' `Qwen3MoeSparseMoeBlock`) routes each token to `top_k` of `n_experts`
experts: softmax over the router's logits (in float32), top-k, renormalised to sum 1 when
`norm_topk_prob`, the weights cast back to the model dtype; the layer's output is the weighted sum of
those experts' SwiGLU MLPs (`moe_intermediate_size` wide). `decoder_sparse_step` and `mlp_only_layers`
pick the sparse layers; the others are the dense MLP of `intermediate_size` (the fast forward's own).

Experts, two interchangeable implementations of the same arithmetic over the same layout:
- **grouped** (`experts_grouped`): the T x k (token, expert) pairs sorted by expert (a stable
  argsort), each group's end offset found on the device (`searchsorted`: no host sync), then one
  `torch._grouped_mm` for every expert's gate+up projection and one for every expert's down
  projection. No shape depends on the routing, so a decode step with it is captured in a CUDA graph.
  Used on CUDA GPUs of compute capability >= 9.0 (Hopper: CUTLASS's grouped GEMM; older GPUs run
  torch's host-looping fallback) in bfloat16, with hidden and intermediate sizes multiples of 16
  (the kernel's 16-byte alignment), and when a start-up probe agrees with the loop (`grouped_usable`).
- **loop** (`experts_loop`): the same sorted pairs, one matmul pair per expert over its contiguous
  slice. Its slice bounds come to the host (a sync per layer), so it is not captured: the CPU path,
  and CUDA where the grouped kernel is not usable (then decode runs eagerly, logged by the engine).

Weights: transformers 5 keeps each layer's experts as two 3-D parameters, `mlp.experts.gate_up_proj`
[E, 2I, H] (gate rows then up rows: gate and up already fused, one matmul) and `mlp.experts.down_proj`
[E, H, I]; the router is `mlp.gate.weight` [E, H]. The engine holds those very tensors (on its device),
so the HF names address them for in-place weight updates and byte-exact checksums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

MOE_FAMILY = "qwen3_moe"
GROUPED_ALIGN = 16          # hidden and intermediate sizes the grouped kernel path asks for (16-byte rows and more)


@dataclass(frozen=True)
class MoeArch:
    """The expert shapes and routing constants of a Qwen3-MoE config."""

    n_experts: int
    top_k: int
    norm_topk_prob: bool
    intermediate: int               # moe_intermediate_size
    layers: tuple[int, ...]         # decoder layer indices of the sparse (MoE) layers, ascending

    @classmethod
    def from_config(cls, config) -> MoeArch | None:
        """None for a dense model (another family, or a Qwen3-MoE config with no sparse layer)."""
        if getattr(config, "model_type", None) != MOE_FAMILY:
            return None
        layers = sparse_layers(config)
        if not layers:
            return None
        return cls(n_experts=int(config.num_experts), top_k=int(config.num_experts_per_tok),
                   norm_topk_prob=bool(config.norm_topk_prob), intermediate=int(config.moe_intermediate_size),
                   layers=layers)

    def index(self, layer: int) -> int | None:
        """The MoE layer number (0..L-1, the routing's layer axis) of decoder layer `layer`; None when dense."""
        return self.layers.index(layer) if layer in self.layers else None


def sparse_layers(config) -> tuple[int, ...]:
    """transformers' rule (Qwen3MoeDecoderLayer): layer i is sparse when it is not in `mlp_only_layers`,
    the model has experts and (i + 1) is a multiple of `decoder_sparse_step`."""
    experts = int(getattr(config, "num_experts", 0) or 0)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return tuple(i for i in range(config.num_hidden_layers)
                 if experts > 0 and i not in dense and (i + 1) % step == 0)


def supports_moe(config) -> str | None:
    """None when the fast forward implements this Qwen3-MoE config's experts; else why not."""
    moe = MoeArch.from_config(config)
    if moe is None:
        return None
    if not 0 < moe.top_k <= moe.n_experts:
        return f"num_experts_per_tok {moe.top_k} is not in 1..num_experts ({moe.n_experts})"
    return None


@dataclass
class MoeLayerWeights:
    router: Tensor      # [E, H]        mlp.gate.weight
    gate_up: Tensor     # [E, 2I, H]    mlp.experts.gate_up_proj (gate rows, then up rows)
    down: Tensor        # [E, H, I]     mlp.experts.down_proj


def check_layout(model, moe: MoeArch) -> None:
    """Raises ValueError unless transformers keeps this model's experts as `pack_moe_layer` reads them:
    [gate; up] concatenated along the output rows, not transposed (transformers 5's Qwen3-MoE)."""
    for i in moe.layers:
        experts = model.model.layers[i].mlp.experts
        if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
            raise ValueError(f"model.layers.{i}.mlp.experts stores its weights transposed or gate/up interleaved "
                             f"(this transformers' layout); the fast forward reads [E, 2I, H] with gate rows then "
                             f"up rows; use the EmbeddedEngine")


def pack_moe_layer(src: dict[str, Tensor], named: dict[str, Tensor], prefix: str, moe: MoeArch, hidden: int,
                   device: torch.device) -> MoeLayerWeights:
    """The sparse layer `prefix` ("model.layers.{i}.")'s router and experts on `device`, registered under
    their HF names (the tensors themselves: updates copy into them in place)."""
    names = {"router": prefix + "mlp.gate.weight", "gate_up": prefix + "mlp.experts.gate_up_proj",
             "down": prefix + "mlp.experts.down_proj"}
    shapes = {"router": (moe.n_experts, hidden), "gate_up": (moe.n_experts, 2 * moe.intermediate, hidden),
              "down": (moe.n_experts, hidden, moe.intermediate)}
    out = {}
    for key, name in names.items():
        if name not in src:
            raise ValueError(f"the fast forward expects Qwen3-MoE experts as transformers 5 stores them; {name} is "
                             f"missing (an older transformers' per-expert layout?); use the EmbeddedEngine")
        t = src[name]
        if tuple(t.shape) != shapes[key]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, the config says {shapes[key]}")
        out[key] = named[name] = t.to(device).contiguous()
    return MoeLayerWeights(**out)


# --- the router ----------------------------------------------------------------------------------

def route(h: Tensor, router: Tensor, moe: MoeArch) -> tuple[Tensor, Tensor]:
    """h [T, H] (normed hidden states) -> (weights [T, k] in h's dtype, experts [T, k] int64), as
    transformers' Qwen3MoeTopKRouter: softmax in float32, top-k, renormalised when norm_topk_prob."""
    logits = F.linear(h, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


# --- the experts ---------------------------------------------------------------------------------

def sort_by_expert(ids: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """ids [T, k] -> (order [T * k]: the flattened (token, slot) pairs sorted by expert, stably;
    ends [E] int32: the end of each expert's group in that order). All on the device, no host sync."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts = torch.arange(n_experts, device=ids.device, dtype=flat.dtype)
    ends = torch.searchsorted(flat[order], experts, right=True, out_int32=True)
    return order, ends


def combine(y: Tensor, order: Tensor, weights: Tensor) -> Tensor:
    """y [T * k, H] (expert outputs in `order`) -> [T, H]: each token's outputs, weighted, summed."""
    t, k = weights.shape
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return (unsorted.view(t, k, -1) * weights[..., None]).sum(dim=1)


def _grouped_mm(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """x [M, K] rows grouped by `ends`, w [E, N, K] -> [M, N]: group e's rows times w[e].T."""
    return torch._grouped_mm(x, w.transpose(1, 2), offs=ends)


def experts_grouped(h: Tensor, ids: Tensor, weights: Tensor, w: MoeLayerWeights) -> Tensor:
    """The experts' weighted sum [T, H] for h [T, H] routed to ids [T, k] with weights [T, k]: one
    grouped matmul for gate+up, one for down (shapes fixed by T and k alone: capturable)."""
    k = ids.shape[1]
    order, ends = sort_by_expert(ids, w.gate_up.shape[0])
    xs = h[order // k]
    gate, up = _grouped_mm(xs, w.gate_up, ends).chunk(2, dim=-1)
    return combine(_grouped_mm(F.silu(gate) * up, w.down, ends), order, weights)


def experts_loop(h: Tensor, ids: Tensor, weights: Tensor, w: MoeLayerWeights) -> Tensor:
    """`experts_grouped`'s result by one matmul pair per expert over its contiguous slice of the sorted
    pairs (the group bounds go to the host: not capturable)."""
    k = ids.shape[1]
    order, ends = sort_by_expert(ids, w.gate_up.shape[0])
    xs = h[order // k]
    y = torch.empty_like(xs)
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            gate, up = F.linear(xs[start:end], w.gate_up[e]).chunk(2, dim=-1)
            y[start:end] = F.linear(F.silu(gate) * up, w.down[e])
        start = end
    return combine(y, order, weights)


def grouped_eligible(device: torch.device, dtype: torch.dtype, moe: MoeArch, hidden: int) -> str | None:
    """None when `experts_grouped` may run here; else why the loop runs instead."""
    if device.type != "cuda":
        return f"device {device.type} (grouped matmuls: CUDA)"
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if dtype != torch.bfloat16:
        return f"dtype {str(dtype).removeprefix('torch.')} (the grouped kernel: bfloat16)"
    cc = torch.cuda.get_device_capability(device)
    if cc < (9, 0):
        return f"compute capability {cc[0]}.{cc[1]} (the grouped kernel: >= 9.0, Hopper)"
    if hidden % GROUPED_ALIGN or moe.intermediate % GROUPED_ALIGN:
        return (f"hidden {hidden} / moe_intermediate_size {moe.intermediate} not multiples of {GROUPED_ALIGN} "
                f"(the grouped kernel's alignment)")
    return None


@torch.inference_mode()
def grouped_matches_loop(w: MoeLayerWeights, moe: MoeArch, tokens: int = 64, seed: int = 0) -> float:
    """Max |grouped - loop| / max |loop| over random tokens through one layer's real experts (a start-up probe:
    raises if the grouped kernel does not run here)."""
    g = torch.Generator(device=w.gate_up.device).manual_seed(seed)
    hidden = w.gate_up.shape[2]
    h = torch.randn((tokens, hidden), generator=g, device=w.gate_up.device).to(w.gate_up.dtype)
    weights, ids = route(h, w.router, moe)
    want = experts_loop(h, ids, weights, w).float()
    got = experts_grouped(h, ids, weights, w).float()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
