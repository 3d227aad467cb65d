"""Which mixture-of-experts families this build runs, and the start-up checks of an MoE run (light: read
from --hf-checkpoint's config.json, no torch). A family is one line of `MOE_FAMILIES` here plus one
module per path it runs on (the embedded engine and the torch trainer run transformers' model through
`miles.training.moe`; the fast engine its own forward, `miles.rollout.engines.fast.moe`; the megatron
backend megatron-core's MoE layers, `miles.training.megatron`; other families are refused below, by name).
docs/moe.md says what is built."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.config.checks import check

if TYPE_CHECKING:
    from miles.config import RunConfig


@dataclass(frozen=True)
class MoeFamily:
    router_class: str       # transformers' router module (softmax, top-k, norm_topk_prob) the hooks go on
    experts_fields: tuple[str, ...]   # the config's expert count (transformers 5 saves num_experts as num_local_experts)

    def experts(self, hf: dict[str, Any]) -> int:
        return next((int(hf[f]) for f in self.experts_fields if hf.get(f) is not None), 0)


MOE_FAMILIES: dict[str, MoeFamily] = {
    "qwen3_moe": MoeFamily(router_class="Qwen3MoeTopKRouter", experts_fields=("num_experts", "num_local_experts")),
}
# config fields of the MoE families this build does not run, and what each is
_OTHER_MOE_FIELDS = {
    "shared_expert_intermediate_size": "shared experts", "n_shared_experts": "shared experts",
    "topk_method": "DeepSeek's grouped routing with an expert bias", "n_routed_experts": "routed experts",
    "num_local_experts": "experts", "num_experts": "experts", "moe_intermediate_size": "experts",
}
_BUILT = ("built: qwen3_moe (Qwen3-MoE) on the embedded and fast engines, the torch trainer and --train-backend "
          "megatron, docs/moe.md")


def read_config(model_path: str) -> dict[str, Any] | None:
    path = Path(model_path) / "config.json"
    try:
        hf = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return hf if isinstance(hf, dict) else None      # another shape: the model checks name it


def moe_kind(hf: dict[str, Any] | None) -> str | None:
    """"built" (a Qwen3-MoE with experts), "dense", or the reason an MoE family is not built."""
    if hf is None:
        return "dense"
    kind = hf.get("model_type")
    family = MOE_FAMILIES.get(kind)
    if family is not None:
        return "built" if family.experts(hf) else "dense"
    found = [what for name, what in _OTHER_MOE_FIELDS.items() if hf.get(name)]
    if not found:
        return "dense"
    return (f"model_type {kind!r} is a mixture-of-experts family this build does not run yet "
            f"({', '.join(dict.fromkeys(found))}; {_BUILT})")


@check
def _moe(cfg: RunConfig, problems: list[str]) -> None:
    """An MoE checkpoint runs only where it is built; the MoE flags need an MoE checkpoint."""
    t, ckpt = cfg.train, cfg.model.hf_checkpoint
    kind = moe_kind(read_config(ckpt)) if ckpt else "dense"
    flags = [flag for flag, on in (
        ("--use-rollout-routing-replay", t.use_rollout_routing_replay), ("--use-routing-replay", t.use_routing_replay),
        ("--moe-aux-loss-coeff", t.moe_aux_loss_coeff > 0), ("--moe-z-loss-coeff", bool(t.moe_z_loss_coeff)),
        ("--moe-router-dtype", t.moe_router_dtype is not None)) if on]
    if kind == "dense":
        if flags:
            problems.append(f"{', '.join(flags)}: --hf-checkpoint {ckpt} is not a mixture-of-experts model "
                            f"(no routers to replay or train); drop them ({_BUILT})")
        return
    if kind != "built":
        problems.append(f"--hf-checkpoint {ckpt}: {kind}")
        return
    from miles.training.protocol import TRAIN_BACKENDS   # here: its checks register after this module's

    backend = TRAIN_BACKENDS.get(t.backend)     # unknown: config's check (the engine's R3: the registry's)
    if backend is not None and "moe" in backend.refuses:
        problems.append(f"--train-backend {t.backend} with --hf-checkpoint {ckpt} (Qwen3-MoE): {backend.refuses['moe']}")
    if cfg.rollout.quantization == "fp8":
        problems.append(f"--rollout-quantization fp8 with --hf-checkpoint {ckpt} (Qwen3-MoE): FP8 experts are not built "
                        "yet (docs/fp8.md); drop it (--kv-cache-dtype fp8_e4m3 works with MoE models)")
