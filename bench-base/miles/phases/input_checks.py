"""What `init` checks on the driver before any actor starts, beyond loading the data: the model's
weight files, a --load checkpoint against the model, the user's functions, and what a new user gets
wrong without an error (a reward that needs labels and no --label-key).

Errors are `ConfigError`s naming the input and the fix (exit 2, before anything starts); what is
probably wrong but may be meant is a warning (`init` traces it and the progress display shows it).
Weight files are checked from their safetensors headers (8-byte length, JSON header, then the data):
no tensor is read, so a 70B checkpoint is checked in milliseconds.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Callable

from miles.config import ConfigError, RunConfig

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
LABEL_KEYS = ("label", "answer", "solution", "ground_truth", "target", "reference", "output")   # what a label is called
_HEADER_LIMIT = 100 * 2**20          # safetensors caps its header at 100 MB


def safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header; ConfigError when the file is cut short or corrupt."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{file}: {size} bytes, too short for a safetensors file; it is truncated: "
                              "copy or download it again")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _HEADER_LIMIT):
            raise ConfigError(f"{file}: its header says {n} bytes but the file has {size}; it is truncated or not a "
                              "safetensors file: copy or download it again")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file}: unreadable safetensors header ({exc}); copy or download it again") from exc
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
        shapes = {k: tuple(v["shape"]) for k, v in tensors.items()}
    except (KeyError, TypeError, ValueError, IndexError) as exc:     # valid JSON, not a safetensors header
        raise ConfigError(f"{file}: corrupt safetensors header ({type(exc).__name__}: {exc}); copy or download "
                          "it again") from exc
    if 8 + n + end != size:
        raise ConfigError(f"{file}: {size} bytes, but its header describes {8 + n + end}; the file is "
                          f"{'truncated' if size < 8 + n + end else 'corrupt'}: copy or download it again")
    return shapes


def model_shapes(folder: str | Path, flag: str) -> dict[str, tuple[int, ...]] | None:
    """Shapes of an HF folder's safetensors weights (one file or the shards of an index), each file
    checked; None when the weights are in another format (pytorch_model.bin: loaded as they are)."""
    root = Path(folder)
    if (root / SAFETENSORS_INDEX).is_file():
        shards = sorted(set(json.loads((root / SAFETENSORS_INDEX).read_text()).get("weight_map", {}).values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise ConfigError(f"{flag} {folder}: {SAFETENSORS_INDEX} lists {len(missing)} missing shard(s) "
                              f"({', '.join(missing[:3])}); copy or download them")
        files = [root / s for s in shards]
    elif (root / SAFETENSORS).is_file():
        files = [root / SAFETENSORS]
    else:
        if not any(root.glob("*.bin")) and not any(root.glob("*.safetensors")):
            raise ConfigError(f"{flag} {folder}: no model weights ({SAFETENSORS} or pytorch_model.bin); pass the "
                              "folder save_pretrained wrote")
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            shapes.update(safetensors_shapes(file))
        except ConfigError as exc:
            raise ConfigError(f"{flag} {folder}: {exc}") from None
    return shapes


def check_checkpoint_fits(cfg: RunConfig, model: dict[str, tuple[int, ...]] | None) -> None:
    """The checkpoint --load resumes from holds weights of --hf-checkpoint's shapes. The candidates are
    `_resume`'s (init.py): newest first, incomplete ones passed over, and so is one whose weights file
    fails its sha256 (corrupt, not another model: `_resume` skips it too, unless --no-verify-load).
    Files are hashed here only when their header already looks wrong."""
    from miles.checkpoint.checkpointer import TRAINER_DIR
    from miles.checkpoint.store import CheckpointStore

    if not cfg.checkpoint.load or model is None:
        return
    for _, path, incomplete in CheckpointStore(cfg.checkpoint.load).newest_first():
        if incomplete:
            continue
        weights = path / TRAINER_DIR / SAFETENSORS
        if not weights.is_file():
            return
        try:
            what = _differences(safetensors_shapes(weights), model)
        except ConfigError:
            if _fails_sha256(cfg, path, f"{TRAINER_DIR}/{SAFETENSORS}"):
                continue
            raise
        if what and _fails_sha256(cfg, path, f"{TRAINER_DIR}/{SAFETENSORS}"):
            continue
        if what:
            raise ConfigError(f"--load {cfg.checkpoint.load}: the checkpoint {path.name} is of another model than "
                              f"--hf-checkpoint {cfg.model.hf_checkpoint}: {what}; resume with the --hf-checkpoint "
                              "it was trained from, or point --load elsewhere")
        return


def _differences(saved: dict[str, tuple[int, ...]], model: dict[str, tuple[int, ...]]) -> str:
    """How two sets of weight shapes differ, in words ("" when they do not)."""
    differ = [f"{k} {list(saved[k])} vs {list(v)}" for k, v in model.items() if k in saved and saved[k] != v]
    only = sorted((set(saved) ^ set(model)) - {"lm_head.weight"})     # tied embeddings: the head travels once
    return "; ".join(filter(None, [
        f"{len(differ)} tensor(s) differ in shape ({'; '.join(differ[:3])})" if differ else "",
        f"{len(only)} tensor name(s) in only one of them ({', '.join(only[:3])})" if only else ""]))


def _fails_sha256(cfg: RunConfig, path: Path, name: str) -> bool:
    """--load verifies contents (the default) and checkpoint file `name` does not match its manifest."""
    from miles.checkpoint.store import manifest_files, verify_files

    return cfg.reliability.verify_load and bool(verify_files(path, manifest_files(path, name)))


def check_user_functions(cfg: RunConfig) -> None:
    """Import the custom loss, TIS and policy-loss reducer functions here, so a bad one fails before the
    trainer starts."""
    from miles.user_code import check_signature, import_user_function

    a = cfg.algorithm
    for flag, path, shape in (
            ("--custom-loss-function-path", a.custom_loss_function_path, "fn(logprobs, batch, reduce)"),
            ("--custom-tis-function-path", a.custom_tis_function_path, "fn(train_logprobs, rollout_logprobs, mask)")):
        if path:
            check_signature(import_user_function(path, flag), flag, path, 3, shape)
    if a.pg_loss_reducer_path:
        from miles.training.pg_reducer import load_reducer
        load_reducer(a.pg_loss_reducer_path)


def label_warnings(cfg: RunConfig, reward_fn: Callable[..., Any], first_row_keys: list[str] | None) -> list[str]:
    """A reward that reads labels while --label-key is unset: an error for a built-in reward, a warning
    for a custom one (it may not need them), naming the keys the rows have that no flag reads."""
    from miles.rollout.rewards import BOXED_REWARDS, LABEL_FREE_REWARDS, REWARD_FUNCTIONS
    from miles.user_code import display_name, takes_parameter

    d = cfg.data
    builtin = getattr(reward_fn, "__wrapped__", reward_fn)      # boxed_<type> wraps its built-in
    if d.label_key is not None or cfg.algorithm.loss_type == "sft_loss" or cfg.load_debug_rollout_data \
            or any(builtin is REWARD_FUNCTIONS[k] for k in LABEL_FREE_REWARDS):
        return []
    unread = [k for k in first_row_keys or [] if k not in (d.input_key, d.metadata_key)]
    hint = next((k for k in unread if k in LABEL_KEYS), unread[0] if unread else None)
    fix = f"set --label-key {hint}" if hint else "set --label-key to the column with the reference answers"
    if builtin in (*REWARD_FUNCTIONS.values(), *BOXED_REWARDS.values()):
        raise ConfigError(f"--rm-type {cfg.rollout.rm_type} compares each response with a label, but --label-key is "
                          f"not set{f'; the rows also have {unread}' if unread else ''}: {fix}")
    warnings = []
    label_param = takes_parameter(reward_fn, 2)
    if label_param is not None and not label_param.startswith("_"):
        warnings.append(f"--custom-rm-path {display_name(reward_fn)} takes a label ({label_param!r}) but --label-key "
                        f"is not set: it gets None for every prompt; {fix}")
    if unread:
        warnings.append(f"--prompt-data {d.prompt_data}: the rows have keys {unread} that no flag reads "
                        f"(--input-key {d.input_key!r}); if one holds the reference answers, {fix}")
    return warnings


def first_row_keys(path: str) -> list[str] | None:
    """The keys of the data's first row (JSONL) or its columns (parquet), read cheaply."""
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq
        return list(pq.ParquetFile(p).schema_arrow.names)
    with open(p, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    row = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    return None
                return sorted(row) if isinstance(row, dict) else None
    return None


def check_context_len(cfg: RunConfig, prompts: list[Any], source: str, *, evaluation: bool = False) -> None:
    """--rollout-max-context-len (for an eval dataset: --eval-max-context-len, else that) leaves room for at
    least one response token after every prompt."""
    flag, limit, drop = "--rollout-max-context-len", cfg.rollout.max_context_len, "--max-prompt-len"
    if evaluation:
        drop = "--eval-max-prompt-len"
        if cfg.eval.max_context_len is not None:
            flag, limit = "--eval-max-context-len", cfg.eval.max_context_len
    if limit is None:
        return
    long = [p for p in prompts if len(p.prompt_ids) >= limit]
    if long:
        rows = ", ".join(str(p.index + 1) for p in long[:5]) + (", ..." if len(long) > 5 else "")
        raise ConfigError(f"{source}: {len(long)} of {len(prompts)} prompts (rows {rows}) have "
                          f"{flag} {limit} tokens or more, leaving no room for a response; raise "
                          f"it or drop them with {drop} {limit - 1}")
