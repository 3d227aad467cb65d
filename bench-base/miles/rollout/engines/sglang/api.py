"""SGLang's HTTP contract, as miles uses it: the launch command line, request bodies and response parsing.

Pure functions, no I/O: the client (`client`) sends what these build, the engine
(`engine`) turns what comes back into `Generation`s. Every field name here is taken from
SGLang's own source, version `SGLANG_VERSION` (`sglang/srt/entrypoints/http_server.py`,
`sglang/srt/managers/io_struct.py`, the `/generate` schema `sglang/api/v1/api_types.py`, the launch
flags under `sglang/srt/arg_groups/fields/`):

- `/generate` ignores unknown top-level keys but rejects unknown `sampling_params` keys (HTTP 400,
  body `{"error": "unknown field `x`, expected one of ..."}`); a request that fails later checks
  answers 400 `{"error": {"message": ...}}`.
- Control endpoints take msgspec structs as JSON bodies: unknown keys are ignored, a missing required
  key is a 400 `{"object": "error", "message": ..., "type": "Bad Request", "param": null, "code": 400}`.
  Because unknown keys are silently ignored, the builders here send only fields SGLang declares
  (the fake server in tests/fakes records any other key, and the unit tests assert there is none).
- With `--skip-tokenizer-init` a response is `{"output_ids": [...], "meta_info": {...}}`; `meta_info`
  carries `finish_reason` (`{"type": "stop"|"length"|"abort", ...}`), `output_token_logprobs`
  (`[[logprob, token_id, null], ...]` when `return_logprob`), `weight_version` (a string, set by
  `--weight-version` and by every weight update that names one) and, when an update happened while
  the request ran, `weight_versions` spans `[{"version", "start", "end"}]`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from miles.rollout.protocol import MEMORY_TAGS
from miles.types import Generation, SamplingParams

SGLANG_VERSION = "0.5.23"           # the version whose source these names were read from
# MEMORY_TAGS (miles.rollout.protocol) are SGLang's own names: sglang/srt/constants.py GPU_MEMORY_TYPE_*
PAUSE_MODES = ("abort", "retract", "in_place")          # PauseGenerationReqInput.mode
# flags miles sets itself; passing them through --sglang-* would contradict what miles assumes
RESERVED_FLAGS = ("model-path", "model", "host", "port", "tp-size", "tensor-parallel-size", "dtype", "device",
                  "random-seed", "skip-tokenizer-init", "weight-version", "enable-memory-saver")
_SEED_SPACE = 2**31
# /health_generate checks its scheduler's output once a second (its first look a second after the
# request): a health probe needs at least twice that to get an answer from a healthy server
MIN_HEALTH_CHECK_TIMEOUT_S = 2.0


class SGLangResponseError(RuntimeError):
    """A response that does not have the shape SGLang's contract promises, or an aborted request."""


# --- launch ----------------------------------------------------------------------------------------
def server_argv(python: str, model_path: str, *, host: str, port: int, tp_size: int, dtype: str,
                seed: int, memory_saver: bool, device: str = "auto", extra: Sequence[str] = ()) -> list[str]:
    """`python -m sglang.launch_server ...`: token ids in and out (`--skip-tokenizer-init`), weight
    version "0" for the weights on disk, then the user's pass-through flags. `device` auto leaves
    SGLang to detect it."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
            "--port", str(port), "--tp-size", str(tp_size), "--dtype", dtype, "--random-seed", str(seed),
            "--skip-tokenizer-init", "--weight-version", "0"]
    if device != "auto":
        argv += ["--device", device]
    if memory_saver:
        argv.append("--enable-memory-saver")      # release/resume_memory_occupation need it
    return argv + list(extra)


def passthrough_flags(flags: Mapping[str, Any]) -> list[str]:
    """`{"mem-fraction-static": 0.7, "disable-radix-cache": True}` (from --sglang-mem-fraction-static
    0.7 --sglang-disable-radix-cache) → SGLang's own flags. Flags miles sets itself are refused."""
    reserved = sorted(f for f in flags if f in RESERVED_FLAGS)
    if reserved:
        raise ValueError(reserved_flag_problem(reserved[0]))
    argv: list[str] = []
    for name, value in flags.items():
        if value is True:
            argv.append(f"--{name}")
        elif value is not False and value is not None:
            argv += [f"--{name}", *(map(str, value) if isinstance(value, (list, tuple)) else [str(value)])]
    return argv


def reserved_flag_problem(flag: str) -> str:
    return (f"--sglang-{flag} is set by miles itself (model path, host/port, --device/--dtype/--seed, tp size "
            f"from --rollout-num-gpus-per-engine, token-id I/O, weight versions, --offload-rollout); drop it")


# --- /generate -------------------------------------------------------------------------------------
def request_seed(seed: int, index: int) -> int:
    """The `sampling_seed` of request `index` of a call seeded with `seed`: a hash, so that the
    executor's per-engine seeds (seed + engine) never give two requests of one group the same stream."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % _SEED_SPACE


def sampling_params(params: SamplingParams, seed: int | None) -> dict[str, Any]:
    """SGLang's `sampling_params` (top_k -1 means off in both). With --skip-tokenizer-init no
    detokenizer trims the stop token, so output_ids end with it, as the trainer expects."""
    out: dict[str, Any] = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                           "top_p": params.top_p, "top_k": params.top_k}
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.min_new_tokens:
        out["min_new_tokens"] = params.min_new_tokens
    if seed is not None:
        out["sampling_seed"] = seed
    return out


def generate_body(input_ids: Sequence[int], params: SamplingParams, *, rid: str, seed: int | None) -> dict[str, Any]:
    """One non-streaming request, output logprobs only (`logprob_start_len` -1)."""
    return {"rid": rid, "input_ids": list(input_ids), "sampling_params": sampling_params(params, seed),
            "return_logprob": True, "logprob_start_len": -1, "stream": False}


def parse_generation(body: Any, *, rid: str, abort_asked: bool = False) -> Generation:
    """A `/generate` response → Generation. A malformed body raises SGLangResponseError naming the
    request; so does an aborted one, unless the engine asked for the abort (`abort_asked`: then it is
    what the request generated until then, finish_reason "abort")."""
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict) or "output_ids" not in body:
        raise SGLangResponseError(f"request {rid}: not a /generate response with output_ids and meta_info "
                                  f"(was the server started with --skip-tokenizer-init?): {str(body)[:300]}")
    meta = body["meta_info"]
    ids = [int(t) for t in body["output_ids"]]
    entries = meta.get("output_token_logprobs") or []
    if len(entries) != len(ids) or any(int(e[1]) != t for e, t in zip(entries, ids)):
        raise SGLangResponseError(f"request {rid}: output_token_logprobs ({len(entries)}) do not match "
                                  f"output_ids ({len(ids)})")
    return Generation(response_ids=ids, logprobs=[float(e[0]) for e in entries],
                      finish_reason=_finish_reason(meta.get("finish_reason"), rid, abort_asked),
                      weight_version=weight_version_of(meta, rid))


def score_body(input_ids: Sequence[int]) -> dict[str, Any]:
    """Score a whole sequence without generating (on-policy distillation's teacher, miles'
    `on_policy_distillation._score_payload`): greedy, no new token, the logprob of every input token
    (`logprob_start_len` 0 returns `meta_info.input_token_logprobs` from the first input token on)."""
    return {"input_ids": list(input_ids),
            "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
            "return_logprob": True, "logprob_start_len": 0}


def parse_input_logprobs(body: Any, response_ids: Sequence[int], *, url: str) -> list[float]:
    """The logprobs of the last `len(response_ids)` input tokens out of a `score_body` answer.
    `input_token_logprobs` is `[[logprob, token_id, null], ...]`, one per input token, the first
    entry's logprob null (no token precedes it); each kept entry's id must be the response's."""
    meta = body.get("meta_info") if isinstance(body, dict) else None
    entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    n = len(response_ids)
    if not isinstance(entries, list) or len(entries) < n + 1:
        raise SGLangResponseError(f"{url}: expected meta_info.input_token_logprobs for {n} response tokens after "
                                  f"the prompt (logprob_start_len 0), got {str(body)[:300]}")
    kept = entries[len(entries) - n:] if n else []
    ids = [int(e[1]) for e in kept]
    if ids != [int(t) for t in response_ids]:
        raise SGLangResponseError(f"{url}: input_token_logprobs are of tokens {ids[:8]}..., not the response's "
                                  f"{list(response_ids)[:8]}...")
    return [float(e[0]) for e in kept]


def _finish_reason(reason: Any, rid: str, abort_asked: bool) -> str:
    kind = reason.get("type") if isinstance(reason, dict) else None
    if kind in ("stop", "length") or (kind == "abort" and abort_asked):
        return kind
    if kind == "abort":
        raise SGLangResponseError(f"request {rid} was aborted by the server: {reason.get('message')} "
                                  f"(status {reason.get('status_code')})")
    raise SGLangResponseError(f"request {rid}: unexpected finish_reason {reason!r}")


def weight_version_of(meta: Mapping[str, Any], rid: str) -> int:
    """The oldest weight version that produced any of the request's tokens (spans when an update
    happened mid-request, else `weight_version`): staleness is counted from it."""
    spans = meta.get("weight_versions") or []
    versions = [s["version"] for s in spans] or [meta.get("weight_version")]
    try:
        return min(int(v) for v in versions)
    except (TypeError, ValueError):
        raise SGLangResponseError(f"request {rid}: weight version {versions!r} is not an integer; miles "
                                  f"starts servers with --weight-version 0 and names every update") from None


# --- control endpoints -----------------------------------------------------------------------------
def check_tags(tags: Sequence[str]) -> list[str]:
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad or not tags:
        raise ValueError(f"memory tags {list(tags)!r}: use one or more of {', '.join(MEMORY_TAGS)}")
    return list(tags)


def disk_update_body(model_path: str, version: int) -> dict[str, Any]:
    """UpdateWeightFromDiskReqInput; the server flushes its cache after loading (`flush_cache`)."""
    return {"model_path": model_path, "weight_version": str(version), "flush_cache": True}
