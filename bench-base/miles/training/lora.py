"""LoRA for the torch trainer: low-rank adapters on the decoder's Linear layers, the base frozen.

A targeted Linear becomes a `LoraLinear`: y = x W^T + b + (alpha / r) * (drop(x) A^T) B^T, with A
[r, in] drawn as nn.Linear's default (kaiming-uniform) and B [out, r] zero, so step 0 is the base
model. The LoraLinear keeps the base's own `weight` and `bias` Parameters under their names, frozen;
its adapters are the children `lora_A` and `lora_B` (state-dict names `<module>.lora_A.weight`,
`<module>.lora_B.weight`), the only parameters that require a gradient. The forward is two plain
matmuls beside the base's: torch.compile of the decoder layers traces it as it traces the layer.

The engines never see an adapter: `merged_weights` hands out the base's names with W + (alpha / r) B A
computed one tensor at a time on read (never the whole merged model at once beside the live one), so
the object store and CUDA IPC transports, the checksums and every engine work on plain HF weights.

The KL reference, when it is the initial policy: the same model with the adapters off (`adapters_off`
sets each module's scale buffer to 0 for the pass), so no second copy of the model is kept.

Files, PEFT's layout (`save_adapter`, `load_adapter`): `adapter_model.safetensors` with keys
`base_model.model.<module>.lora_A.weight` / `.lora_B.weight` (float32), and `adapter_config.json`
(peft_type LORA, r, lora_alpha, lora_dropout, target_modules, base_model_name_or_path).

Target selection (`select_targets`, miles' `--target-modules` / `--exclude-modules`): the candidates
are the Linear modules inside the decoder layers (never the LM head or the embeddings). `all-linear`
(or none given) takes all of them; `attn` / `mlp` (miles' groups) those under a layer's attention /
MLP block; any other entry is a module-name suffix (`q_proj`, `self_attn.o_proj`) or a pattern with
`*` (`model.layers.0.*`), matched on dotted boundaries.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."
ALL_LINEAR = ("all-linear", "all_linear", "all")       # miles' aliases of every decoder Linear
GROUPS = {"attn": ("self_attn", "attn", "attention", "self_attention"), "mlp": ("mlp", "feed_forward")}
NOT_TARGETS = {"unembed": "the LM head (miles' `unembed` group) is not adapted here: its weight is tied to the "
                          "embedding in many models; drop it from --target-modules"}


@dataclass(frozen=True)
class LoraSpec:
    """What the flags ask (`from_train`): rank r > 0, alpha (scale alpha / r), dropout on the adapters'
    input while training, the target and excluded entries (empty targets: all-linear)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_train(cls, train) -> LoraSpec | None:
        """The spec of a TrainConfig, None when --lora-rank is 0 (LoRA off)."""
        if not train.lora_rank:
            return None
        return cls(rank=train.lora_rank, alpha=float(train.lora_alpha), dropout=float(train.lora_dropout),
                   targets=parse_list(train.target_modules), exclude=parse_list(train.exclude_modules))


def parse_list(value: str | None) -> tuple[str, ...]:
    """A comma list (--target-modules q_proj,v_proj) as entries, blanks dropped."""
    return tuple(dict.fromkeys(s.strip() for s in (value or "").split(",") if s.strip()))


class LoraLinear(nn.Linear):
    """A frozen Linear (the base's own Parameters) plus a trainable rank-r update B A."""

    def __init__(self, base: nn.Linear, spec: LoraSpec):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, spec.rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(spec.rank, self.out_features, bias=False, device=device, dtype=torch.float32)
        nn.init.zeros_(self.lora_B.weight)          # B = 0: the adapted model starts as the base (A keeps its init)
        self.lora_dropout = spec.dropout
        self.scaling = spec.scaling
        # a tensor, not a Python float: `adapters_off` zeroes it without a recompile of the compiled layers
        self.register_buffer("lora_scale", torch.tensor(spec.scaling, device=device), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        # the dropout applies in the forwards that train (the model stays in eval mode: no HF dropout)
        h = F.dropout(x, self.lora_dropout, training=torch.is_grad_enabled()) if self.lora_dropout else x
        return out + self.lora_B(self.lora_A(h)) * self.lora_scale

    @torch.no_grad()
    def merged_weight(self) -> Tensor:
        """W + (alpha / r) B A, float32 on the module's device (a new tensor)."""
        return torch.addmm(self.weight.float(), self.lora_B.weight, self.lora_A.weight, alpha=self.scaling)


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"--lora-rank: {type(model).__name__} has no decoder `.layers` list to put adapters on")
    prefix = next(name for name, m in model.named_modules() if m is layers)
    return prefix, layers


def candidates(model: nn.Module) -> dict[str, nn.Linear]:
    """Every Linear inside the decoder layers, by its name in `model` (the LM head is outside them)."""
    prefix, layers = _decoder_layers(model)
    return {f"{prefix}.{name}": m for name, m in layers.named_modules() if isinstance(m, nn.Linear)}


def _matches(name: str, entry: str) -> bool:
    """`entry` names `name`: the whole name or a dotted suffix of it, `*` matching within the pattern."""
    if "*" in entry:
        return fnmatch.fnmatchcase(name, entry) or fnmatch.fnmatchcase(name, f"*.{entry}")
    return name == entry or name.endswith(f".{entry}")


def _in_group(name: str, layer_prefix: str, group: str) -> bool:
    parts = name[len(layer_prefix) + 1:].split(".")     # "0.self_attn.q_proj" -> the block under the layer
    return len(parts) > 2 and parts[1] in GROUPS[group]


def select_targets(model: nn.Module, spec: LoraSpec) -> list[str]:
    """The names of the Linear modules `spec` adapts, in model order; a ValueError naming an entry that
    selects nothing (and the names it could have matched)."""
    prefix, _ = _decoder_layers(model)
    names = list(candidates(model))
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    chosen: set[str] = set()
    entries = spec.targets or ALL_LINEAR[:1]
    for entry in entries:
        if entry in NOT_TARGETS:
            raise ValueError(f"--target-modules {entry}: {NOT_TARGETS[entry]}")
        if entry in ALL_LINEAR:
            hit = set(names)
        elif entry in GROUPS:
            hit = {n for n in names if _in_group(n, prefix, entry)}
        else:
            hit = {n for n in names if _matches(n, entry)}
        if not hit:
            raise ValueError(f"--target-modules {entry} matches no Linear of the decoder layers; this model's are "
                             f"{', '.join(leaves)} (or all-linear, attn, mlp)")
        chosen |= hit
    for entry in spec.exclude:
        chosen -= {n for n in chosen if _matches(n, entry)}
    if not chosen:
        raise ValueError(f"--exclude-modules {','.join(spec.exclude)} leaves no module to adapt from --target-modules "
                         f"{','.join(entries)}")
    return [n for n in names if n in chosen]


def attach(model: nn.Module, spec: LoraSpec) -> dict[str, LoraLinear]:
    """Freeze `model` and replace each selected Linear by a LoraLinear (in place); the adapters by
    module name. Call before compiling the layers and before building the optimizer."""
    model.requires_grad_(False)
    adapted: dict[str, LoraLinear] = {}
    for name in select_targets(model, spec):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        lora = LoraLinear(getattr(parent, child), spec)
        setattr(parent, child, lora)
        adapted[name] = lora
    return adapted


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


class MergedWeights(Mapping):
    """The model's weights under HF names as the engines load them: each adapted module's weight is
    W + (alpha / r) B A, computed (float32, on the model's device) when read; the rest are the live
    tensors. Tied aliases once, no adapter tensors."""

    def __init__(self, live: Mapping[str, Tensor], adapted: Mapping[str, LoraLinear]):
        self._live = {n: t for n, t in live.items() if not is_adapter_key(n)}
        self._merged = {f"{name}.weight": m for name, m in adapted.items()}

    def __getitem__(self, name: str) -> Tensor:
        module = self._merged.get(name)
        return self._live[name] if module is None else module.merged_weight()

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)


@contextlib.contextmanager
def adapters_off(adapted: Mapping[str, LoraLinear]) -> Iterator[None]:
    """The base model inside the block: every adapter's scale is 0, so each adapted Linear gives x W^T + b
    exactly (the adapter's term adds zeros)."""
    with torch.no_grad():
        for m in adapted.values():
            m.lora_scale.fill_(0.0)
    try:
        yield
    finally:
        with torch.no_grad():
            for m in adapted.values():
                m.lora_scale.fill_(m.scaling)


# --- files (PEFT's layout) ---------------------------------------------------------------------------
def adapter_tensors(adapted: Mapping[str, LoraLinear]) -> dict[str, Tensor]:
    """{PEFT key: live adapter tensor}: base_model.model.<module>.lora_A.weight [r, in], .lora_B.weight [out, r]."""
    out = {}
    for name, m in adapted.items():
        out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.weight
        out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.weight
    return out


def adapter_config(spec: LoraSpec, modules: list[str], base_model: str, all_names: list[str]) -> dict:
    """PEFT's adapter_config.json for the adapted `modules`: target_modules as leaf names when the
    selection is every decoder Linear of those names (how PEFT and SGLang usually see it), else the full
    names (`all_names`: the candidates, `candidates`); `miles_modules` lists them all (what a resume compares)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": _leaf_targets(modules, all_names) or modules, "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "modules_to_save": None, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "base_model_name_or_path": base_model, "miles_modules": modules}


def _leaf_targets(modules: list[str], all_names: list[str]) -> list[str] | None:
    leaves = sorted({n.rsplit(".", 1)[-1] for n in modules})
    every = [n for n in all_names if n.rsplit(".", 1)[-1] in leaves]
    return leaves if every == modules else None


def save_adapter(path: Path, tensors: Mapping[str, Tensor], config: dict) -> None:
    """The adapter folder: `tensors` (CPU copies of `adapter_tensors`) and the config."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def read_adapter_config(path: Path) -> dict:
    return json.loads((path / ADAPTER_CONFIG).read_text())


def config_problems(saved: dict, spec: LoraSpec, modules: list[str], *, where: str) -> list[str]:
    """What differs between a saved adapter's config and this run's LoRA (rank, alpha, dropout, modules)."""
    problems = [f"{flag} {mine} but {where} has {saved.get(key)}" for flag, key, mine in (
        ("--lora-rank", "r", spec.rank), ("--lora-alpha", "lora_alpha", spec.alpha),
        ("--lora-dropout", "lora_dropout", spec.dropout)) if saved.get(key) is None or float(saved[key]) != mine]
    theirs = saved.get("miles_modules")
    if theirs is not None and list(theirs) != modules:
        gone, new = sorted(set(theirs) - set(modules)), sorted(set(modules) - set(theirs))
        problems.append(f"--target-modules/--exclude-modules select other modules than {where}'s (only there: "
                        f"{', '.join(gone[:3]) or '-'}; only here: {', '.join(new[:3]) or '-'})")
    return problems


def load_adapter_tensors(path: Path, adapted: Mapping[str, LoraLinear]) -> None:
    """Copy a PEFT adapter file's tensors into the live adapters (strict: the same keys and shapes,
    checked before anything is copied). PEFT files with the adapter's name in the key
    (`lora_A.default.weight`) load too."""
    from safetensors.torch import load_file

    from miles.weights.hf import copy_checked

    file = path / ADAPTER_WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no {ADAPTER_WEIGHTS}: pass a folder holding a PEFT LoRA adapter "
                                f"({ADAPTER_WEIGHTS} and {ADAPTER_CONFIG})")
    saved = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
             for k, v in load_file(str(file)).items()}
    copy_checked(adapter_tensors(adapted), saved)
