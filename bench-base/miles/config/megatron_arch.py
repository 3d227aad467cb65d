"""Megatron flags given to a run, checked before anything starts.

A miles launch script describes its model to Megatron-LM with architecture flags; here the model is
built from `--hf-checkpoint`'s config.json, so each such flag must say what config.json says
(`megatron_flags.CHECKED`); a flag with one possible value here must have it (`REQUIRED`). Megatron's
full per-layer recomputation (`--recompute-granularity full`) is `--recompute-activations`.
Pure: reads config.json, imports nothing of miles above config.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .megatron_flags import ALIASES, CHECKED, DEST_PREFIX, REQUIRED, SETS

QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "olmo2", "gemma3_text")   # HF families with q_norm / k_norm


def pop_megatron_values(values: dict[str, Any]) -> dict[str, Any]:
    """Take the Megatron flags' values (argparse dests or config-file keys) out of `values`, by flag name;
    `--recompute-granularity full` sets recompute_activations in `values`."""
    given = [k for k in values if k.startswith(DEST_PREFIX)]
    out = {k[len(DEST_PREFIX):].replace("_", "-"): values.pop(k) for k in given}
    if out.get("recompute-granularity") == "full":
        values["recompute_activations"] = True
    for name, (dest, value) in SETS.items():
        if out.get(name):
            values.setdefault(dest, value)      # an explicit flag of this build's wins
    for name, dest in ALIASES.items():
        if name in out:
            values.setdefault(dest, out.pop(name))
    return out


def precision_problems(given: dict[str, Any], dtype: str | None) -> list[str]:
    """--fp16 sets --dtype float16 (`SETS`): given with --bf16 or with another --dtype, the run would have
    two precisions; one line naming both. `dtype`: the run's --dtype after `pop_megatron_values`."""
    if not given.get("fp16"):
        return []
    if given.get("bf16"):
        return ["--fp16 and --bf16 ask for two precisions: give one (--fp16 is --dtype float16; bf16 is "
                "--dtype bfloat16, or auto on GPUs)"]
    if dtype != "float16":
        return [f"--fp16 (--dtype float16) and --dtype {dtype} ask for two precisions: drop one of them"]
    return []


def megatron_problems(given: dict[str, Any], hf_checkpoint: str | None) -> list[str]:
    """One line per Megatron flag whose value this run cannot honour."""
    problems = [f"--{name} {given[name]}: {flag.note}; here only {flag.required} (drop the flag)"
                for name, flag in REQUIRED.items() if name in given and not _same(given[name], flag.required)]
    checked = {name: v for name, v in given.items() if name in CHECKED}
    if not checked or not hf_checkpoint:
        return problems
    config_file = Path(hf_checkpoint) / "config.json"
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return problems          # the --hf-checkpoint check reports an unreadable folder
    hf = hf.get("text_config", hf)      # multimodal configs keep the language model's apart
    for name, value in checked.items():
        expected = hf_value(name, hf)
        if not _same(value, expected):
            shown = "given" if value is True else value
            problems.append(f"--{name} {shown} differs from --hf-checkpoint's config.json ({CHECKED[name].hf}: "
                            f"{_show(expected)}): the model is built from {config_file}; fix the flag, or point "
                            "--hf-checkpoint at the model the script describes")
    return problems


def hf_value(name: str, hf: dict[str, Any]) -> Any:
    """What the Megatron flag `name` is for the HF model of config `hf` (a switch: whether it holds)."""
    heads = hf.get("num_attention_heads")
    kv_heads = hf.get("num_key_value_heads") or heads
    rope = hf.get("rope_parameters") or {}          # transformers >= 5 keeps RoPE's values here
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    theta = hf.get("rope_theta", rope.get("rope_theta"))
    table = {
        "num-layers": hf.get("num_hidden_layers"),
        "hidden-size": hf.get("hidden_size"),
        "ffn-hidden-size": hf.get("intermediate_size"),
        "num-attention-heads": heads,
        "num-query-groups": kv_heads,
        "group-query-attention": kv_heads is not None and heads is not None and kv_heads < heads,
        "kv-channels": hf.get("head_dim") or (hf["hidden_size"] // heads if heads and "hidden_size" in hf else None),
        "qk-layernorm": hf.get("model_type") in QK_NORM_MODEL_TYPES,
        "rotary-base": theta,
        "rotary-percent": hf.get("partial_rotary_factor", 1.0),
        "use-rotary-position-embeddings": theta is not None,
        "position-embedding-type": "rope" if theta is not None else "learned_absolute",
        "use-rope-scaling": scaling is not None,
        "rotary-scaling-factor": (scaling or {}).get("factor"),
        "rope-scaling-factor": (scaling or {}).get("factor"),
        "rope-type": "yarn" if (scaling or {}).get("rope_type", (scaling or {}).get("type")) == "yarn" else "rope",
        "max-position-embeddings": hf.get("max_position_embeddings"),
        "normalization": "LayerNorm" if "layer_norm_eps" in hf and "rms_norm_eps" not in hf else "RMSNorm",
        "norm-epsilon": hf.get("rms_norm_eps", hf.get("layer_norm_eps")),
        "swiglu": hf.get("hidden_act", hf.get("hidden_activation")) in ("silu", "swish"),
        "disable-bias-linear": not hf.get("mlp_bias", False) and not hf.get("attention_bias", False),
        "add-qkv-bias": hf.get("model_type") == "qwen2" or bool(hf.get("attention_bias", False)),
        "untie-embeddings-and-output-weights": not hf.get("tie_word_embeddings", True),
        "vocab-size": hf.get("vocab_size"),
        "padded-vocab-size": hf.get("vocab_size"),
    }
    return table[name]


def _same(given: Any, expected: Any) -> bool:
    if isinstance(given, bool) or isinstance(expected, bool) or expected is None:
        return given == expected
    if isinstance(expected, (int, float)):
        try:
            return math.isclose(float(given), float(expected), rel_tol=1e-9, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    return str(given).lower() == str(expected).lower()


def _show(value: Any) -> str:
    return {True: "yes", False: "no", None: "not set"}.get(value, str(value)) if isinstance(value, (bool, type(None))) \
        else str(value)
