"""Hugging Face causal LMs on both sides of weight sync: loading, and the weight dict engines load.

The trainer and the embedded engine load the same HF folder and exchange weights as a flat
`{name: tensor}` dict. `model_weights` defines that dict: the model's `state_dict` names (HF names,
as in `model.safetensors`) with tied aliases dropped (with tied embeddings `lm_head.weight` *is*
`model.embed_tokens.weight`, so it travels once). `load_weights` is its strict inverse.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from miles.config.schema import DTYPES

_DTYPES = {name: getattr(torch, canonical) for name, canonical in DTYPES.items()}


def resolve_device(device: str) -> torch.device:
    """"auto" → cuda if available else cpu; anything else as torch understands it ("cuda:1")."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available; use --device cpu or auto")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto" → float32 on CPU, bfloat16 on CUDA; else float32 | bfloat16 | float16 (or fp32, bf16, fp16)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


def load_causal_lm(path: str, *, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """`AutoModelForCausalLM` from an HF folder, on `device` in `dtype`, in eval mode (no dropout:
    train-side logprobs must be those of the distribution the engine samples from)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def model_weights(model: nn.Module) -> dict[str, Tensor]:
    """The live tensors (not copies) of `model` under HF names, tied aliases dropped."""
    seen: set[int] = set()
    out: dict[str, Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:  # a tied parameter is one object listed under two names
            seen.add(id(t))
            out[name] = t
    return out


def _mismatch(expected: Mapping[str, Tensor], given: Mapping[str, Tensor]) -> list[str]:
    problems = []
    missing = [n for n in expected if n not in given]
    unexpected = [n for n in given if n not in expected]
    if missing:
        problems.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
    shapes = [f"{n}: {tuple(given[n].shape)} vs model {tuple(t.shape)}"
              for n, t in expected.items() if n in given and given[n].shape != t.shape]
    if shapes:
        problems.append(f"{len(shapes)} with the wrong shape ({'; '.join(shapes[:3])})")
    return problems


def load_weights(model: nn.Module, state_dict: Mapping[str, Tensor]) -> None:
    """Copy `state_dict` into `model` in place, converting dtype and device.

    Strict: the names must be exactly `model_weights(model)`'s and every shape must match, checked
    before anything is copied, so a bad dict leaves the model untouched. In-place copies keep tied
    parameters tied and keep any optimizer's references to the parameters valid.
    """
    copy_checked(model_weights(model), state_dict)


def copy_checked(live: Mapping[str, Tensor], state_dict: Mapping[str, Tensor]) -> None:
    """Copy `state_dict` into the `live` tensors in place (dtype and device converted), after checking
    every name and shape first: a bad dict raises ValueError naming them and leaves `live` untouched."""
    problems = _mismatch(live, state_dict)
    if problems:
        raise ValueError("weights do not fit the model: " + "; ".join(problems)
                         + ". Send the dict that miles.weights.hf.model_weights gives for the same architecture")
    with torch.no_grad():
        for name, t in live.items():
            t.copy_(state_dict[name])
