"""What `init` checks on the driver before any actor starts (`check_inputs`): the tokenizer, the prompt
or SFT files and the eval sets, the model's weight files, a --load checkpoint against the model (its
sha256 too: `miles.checkpoint.restore.hash_before_start`), the user's functions and the reward services,
and what a new user gets wrong without an error (a reward that needs labels and no --label-key).

Errors are `ConfigError`s naming the input and the fix (exit 2, before anything starts); what is
probably wrong but may be meant is a warning (`init` traces it and the progress display shows it).
Weight files are checked from their safetensors headers (8-byte length, JSON header, then the data):
no tensor is read, so a 70B checkpoint is checked in milliseconds.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from miles.checkpoint.resume import check_load_folder
from miles.checkpoint.restore import hash_before_start
from miles.config import ConfigError, EvalDataset, RunConfig
from miles.config.schema import parse_opd_teachers
from miles.config.user_functions import USER_FUNCTIONS
from miles.data.prompts import load_prompts
from miles.data.sft import load_sft_data
from miles.rollout.remote_reward import check_reachable
from miles.rollout.rewards import REMOTE_RM, load_reward_fn
from miles.rollout.scoring import Rewards
from miles.rollout.tools import load_tool_kit, load_tool_specs
from miles.weights.hf import load_tokenizer

if TYPE_CHECKING:
    from miles.phases.context import TrainingContext

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
    `miles.checkpoint.restore.resume`'s: newest first, incomplete ones passed over, and so is one whose
    weights file fails its sha256 (corrupt, not another model: `resume` skips it too, unless --no-verify-load).
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
    """Every user function the run sets, imported by its loader and checked to take its arguments here, on
    the driver, so a bad one fails before any actor starts (the table: miles.config.user_functions)."""
    from miles.runtime.machine import import_object

    for fn in USER_FUNCTIONS:
        path = getattr(getattr(cfg, fn.section), fn.field)
        if path and fn.loader:
            import_object(fn.loader)(path)


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


async def _check_generation_and_rewards(cfg: RunConfig, prompts: list) -> None:
    """The tool functions import and have the right signatures (the other user functions:
    check_user_functions); the rewards exist (the per-sample types the data names too) and their
    services answer, as do the OPD teacher servers (--opd-type sglang)."""
    g = cfg.generate
    if g.execute_tool_function_path:     # with its specs and parser (the other user functions: check_user_functions)
        load_tool_kit(g.execute_tool_function_path, specs_path=g.tool_specs_path, parser=g.tool_call_parser,
                      timeout_s=g.tool_timeout_s)
    rewards = Rewards(cfg.rollout)
    rewards.check_prompts(prompts)
    try:
        await rewards.check_services()
    finally:
        await rewards.close()
    if cfg.algorithm.opd_from_servers:       # --opd-type sglang: every teacher server answers before anything starts
        for name, url in parse_opd_teachers(cfg.algorithm.opd_teacher_urls).items():
            await check_reachable(url, timeout_s=10.0, attempts=cfg.rollout.rm_max_retries + 1,
                                  backoff_s=cfg.rollout.rm_retry_backoff_s, flag="--opd-teacher-urls",
                                  what=f"the server of teacher {name!r}",
                                  why_needed="--opd-type sglang asks it for every trained sample's logprobs")


async def check_inputs(ctx: TrainingContext) -> tuple[Any, list, dict[str, list], dict[int, tuple[int, ...]] | None]:
    """Everything that can be wrong with the input, found before any actor exists."""
    cfg = ctx.cfg
    folder = check_load_folder(cfg.checkpoint.load, allow_fresh_start=cfg.checkpoint.allow_fresh_start,
                               step=cfg.checkpoint.ckpt_step, exit_on_missing=cfg.checkpoint.exit_on_missing)
    hash_before_start(ctx, folder)
    check_checkpoint_fits(cfg, model_shapes(cfg.model.hf_checkpoint, "--hf-checkpoint"))
    try:
        tokenizer = load_tokenizer(cfg.model.hf_checkpoint)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--hf-checkpoint {cfg.model.hf_checkpoint}: cannot load its tokenizer: {exc}") from exc
    sft_responses = None
    tools = load_tool_specs(cfg.generate.tool_specs_path) if cfg.generate.tool_specs_path else None
    if cfg.algorithm.loss_type == "sft_loss":      # rollouts read the data's responses instead of generating
        prompts, sft_responses = load_sft_data(cfg.data, tokenizer)
    else:
        prompts = load_prompts(cfg.data, tokenizer, tools=tools)
    check_context_len(cfg, prompts, f"--prompt-data {cfg.data.prompt_data}")
    eval_sets = {d.name: _eval_prompts(cfg, d, tokenizer, tools) for d in cfg.eval.sets()}
    r = cfg.rollout
    # what label_warnings reads (a reward service, remote_rm, gets the label as it is, or None)
    reward_fn = load_reward_fn(r.rm_type, r.custom_rm_path) if r.custom_rm_path or r.rm_type != REMOTE_RM else None
    check_user_functions(cfg)          # every one of miles.config.user_functions, by its loader
    await _check_generation_and_rewards(cfg, [*prompts, *(p for ps in eval_sets.values() for p in ps)])
    for flag, size in (("--rollout-batch-size", cfg.rollout.batch_size),
                       ("--over-sampling-batch-size", cfg.rollout.over_sampling_batch_size)):
        if size is not None and size > len(prompts):
            raise ConfigError(f"{flag} {size} is larger than the {len(prompts)} prompts of {cfg.data.prompt_data}")
    warnings = label_warnings(cfg, reward_fn, first_row_keys(cfg.data.prompt_data)) if reward_fn else []
    for warning in warnings:
        ctx.tracer.emit("warning", code="label_key", message=warning)
    if warning := fp8_warning(cfg):
        ctx.tracer.emit("warning", code="fp8_without_tis", message=warning)
    ctx.tracer.emit("inputs_checked", prompts=len(prompts), eval_sets={k: len(v) for k, v in eval_sets.items()})
    return tokenizer, prompts, eval_sets, sft_responses


def fp8_warning(cfg: RunConfig) -> str | None:
    """FP8 rollout (weights or KV cache) without an off-policy correction: say so once at start-up."""
    from miles.weights.fp8 import engine_quantization

    r, a = cfg.rollout, cfg.algorithm
    on = [f for f, v in (("--rollout-quantization fp8", engine_quantization(r.quantization, cfg.model.hf_checkpoint)),
                         (f"--kv-cache-dtype {r.kv_cache_dtype}", r.kv_cache_dtype != "auto")) if v]
    if not on or a.use_tis or a.custom_tis_function_path:
        return None
    return (f"{' and '.join(on)} samples from a model that differs from the trainer's (bf16/fp32) one, and no "
            "correction is on: add --use-tis (truncated importance sampling; or an MIS rule through "
            "--custom-tis-function-path); the gap shows as logprob_diff_rollout and train_rollout_k3_kl")


def _eval_prompts(cfg: RunConfig, d: EvalDataset, tokenizer: Any, tools: list | None) -> list:
    """An eval dataset's prompts, read with its own keys (--eval-config) or the run's, long ones dropped by
    --eval-max-prompt-len (else --max-prompt-len)."""
    keys = {k: getattr(d, k) for k in ("input_key", "label_key", "metadata_key") if getattr(d, k) is not None}
    if cfg.eval.max_prompt_len is not None:            # --eval-max-prompt-len: the evals' own limit
        keys["max_prompt_len"] = cfg.eval.max_prompt_len
    prompts = load_prompts(replace(cfg.data, prompt_data=d.path, **keys), tokenizer, tools=tools)
    check_context_len(cfg, prompts, f"eval dataset {d.name} ({d.path})", evaluation=True)
    return prompts
