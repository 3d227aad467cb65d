"""`--eval-config FILE`: eval datasets as miles declares them, in YAML.

    eval:                          # or these keys at the top level
      defaults:                    # for every dataset; a dataset's own value wins
        n_samples_per_eval_prompt: 4
        temperature: 0.6
      datasets:                    # a list of entries with a name, or a mapping name -> entry
        - name: gsm8k
          path: data/gsm8k_test.jsonl
          rm_type: math
          label_key: answer
          max_response_len: 512

Keys of an entry (and of `defaults`): path, n_samples_per_eval_prompt, temperature, top_p, top_k,
max_response_len, stop, stop_token_ids, input_key, label_key, metadata_key, rm_type. What an entry
leaves out comes from the run's flags (--n-samples-per-eval-prompt, --eval-temperature, --eval-top-p,
--eval-top-k, --eval-max-response-len, --rollout-stop, --input-key, --label-key, ...; the reward: --custom-rm-path
or --rm-type). A relative path is read from the working directory, else next to the YAML file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .schema import EvalDataset

# YAML key -> (EvalDataset field, type)
KEYS: dict[str, tuple[str, type]] = {
    "path": ("path", str), "n_samples_per_eval_prompt": ("n_samples_per_prompt", int),
    "temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
    "max_response_len": ("max_response_len", int), "stop": ("stop", str), "stop_token_ids": ("stop_token_ids", int),
    "input_key": ("input_key", str), "label_key": ("label_key", str), "metadata_key": ("metadata_key", str),
    "rm_type": ("rm_type", str),
}
NOT_YET = {"tool_key": "tools", "custom_generate_function_path": "custom generation",
           "metadata_overrides": "metadata overrides", "min_new_tokens": "a minimum response length",
           "multimodal_keys": "multimodal rows"}
LISTS = ("stop", "stop_token_ids")


def load_eval_config(path: str, problems: list[str]) -> tuple[EvalDataset, ...]:
    """The datasets of `path`; what is wrong is appended to `problems` (and those entries left out)."""
    flag = f"--eval-config {path}"
    p = Path(path)
    if not p.is_file():
        problems.append(f"{flag}: no such file")
        return ()
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        problems.append(f"{flag}: not valid YAML: {exc}")
        return ()
    section = raw.get("eval", raw) if isinstance(raw, dict) else None
    if not isinstance(section, dict):
        problems.append(f"{flag}: expected a mapping with an `eval` section (eval: {{defaults: ..., datasets: ...}})")
        return ()
    defaults = section.get("defaults") or {}
    entries = _entries(section.get("datasets"), flag, problems)
    if not isinstance(defaults, dict):
        problems.append(f"{flag}: eval.defaults must be a mapping of keys to values")
        defaults = {}
    if not entries and not problems:
        problems.append(f"{flag}: no datasets under eval.datasets")
    out = []
    for entry in entries:
        dataset = _dataset({**defaults, **entry}, f"{flag}: dataset {entry.get('name')!r}", p.parent, problems)
        if dataset is not None:
            out.append(dataset)
    names = [d.name for d in out]
    if len(set(names)) != len(names):
        problems.append(f"{flag}: dataset names must be unique, got {names}")
    return tuple(out)


def _entries(datasets: Any, flag: str, problems: list[str]) -> list[dict[str, Any]]:
    if datasets is None:
        return []
    if isinstance(datasets, dict):       # miles accepts name -> entry too
        return [{"name": name, **(entry or {})} for name, entry in datasets.items()]
    if isinstance(datasets, list) and all(isinstance(e, dict) and "name" in e for e in datasets):
        return [dict(e) for e in datasets]
    problems.append(f"{flag}: eval.datasets must be a list of entries with a `name`, or a mapping name -> entry")
    return []


def _dataset(entry: dict[str, Any], where: str, base: Path, problems: list[str]) -> EvalDataset | None:
    before = len(problems)
    values: dict[str, Any] = {"name": str(entry.pop("name"))}
    for key, value in entry.items():
        if key in NOT_YET:
            problems.append(f"{where}: {key} ({NOT_YET[key]}) is not supported yet; remove it")
        elif key not in KEYS:
            problems.append(f"{where}: unknown key {key!r}; the keys are name, {', '.join(KEYS)}")
        elif value is not None:
            field, kind = KEYS[key]
            converted = _convert(value, kind, key in LISTS)
            if converted is None:
                problems.append(f"{where}: {key} must be {'a list of ' if key in LISTS else 'a '}{kind.__name__}, "
                                f"got {value!r}")
            values[field] = converted
    if "path" not in values:
        problems.append(f"{where}: no path")
    if len(problems) > before:
        return None
    values["path"] = _relative(values["path"], base)
    return EvalDataset(**values)


def _convert(value: Any, kind: type, is_list: bool) -> Any:
    items = value if isinstance(value, list) else [value]
    if not is_list and isinstance(value, list):
        return None
    try:
        converted = [x if kind is str and isinstance(x, str) else kind(x) for x in items]
    except (TypeError, ValueError):
        return None
    if kind is str and not all(isinstance(x, str) for x in items):
        return None
    if kind is int and any(isinstance(x, float) and not x.is_integer() for x in items):
        return None
    return tuple(converted) if is_list else converted[0]


def _relative(path: str, base: Path) -> str:
    if Path(path).is_absolute() or Path(path).exists() or not (base / path).exists():
        return path
    return str(base / path)
