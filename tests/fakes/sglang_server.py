"""A fake SGLang server for tests only: SGLang 0.5.23's HTTP contract, none of its model.

What it shares with the real server (facts read from sglang 0.5.23's http_server.py, io_struct.py and
api/v1/api_types.py): the endpoints, their request fields, which fields are required, how a bad
request is answered (status code and body shape), the `/generate` response shape under
`--skip-tokenizer-init`, weight versions, memory tags, the weights checker's actions. What it does
not: a model. Tokens and logprobs are a deterministic hash of (weights, prompt, seed, position), so
a weight update changes what it generates and the same seed gives the same tokens.

Like SGLang, it ignores unknown top-level keys of a body; unlike SGLang it records them (`ignored` in
each call record), so tests can assert that miles sends none. It also starts a child process (SGLang
starts scheduler and detokenizer processes), so tests see whether a teardown reaches the whole group.

Test knobs are launch flags SGLang does not have (a run passes them as --sglang-fake-...): --fake-startup-delay
(seconds /health_generate answers 503), --fake-token-delay (seconds per generated token), --fake-never-stop
(never emit a stop token: every request runs to max_new_tokens). A request with `return_logprob` and
`logprob_start_len` >= 0 gets `input_token_logprobs` too (a hash, as for output tokens). Every call is printed
to stdout (the server's log) as `FAKE_CALL {json}`, and GET /fake/calls returns them. On demand, POST /fake/hang
`{"generate": true, "health": true}` makes the server hang as a stuck SGLang scheduler does: `/generate`
requests (running and new) make no more progress, and `/health` and `/health_generate` answer 503 only
after `health_timeout_s` (SGLang's SGLANG_HEALTH_CHECK_TIMEOUT, 20 s: its health check waits that long
for any output of the scheduler); false undoes either. GET /fake/state says how many health checks were
asked, which requests are running, and what hangs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

from aiohttp import web

VERSION = "0.5.23+fake"
HEALTH_CHECK_TIMEOUT_S = 20.0     # sglang http_server.py HEALTH_CHECK_TIMEOUT (env SGLANG_HEALTH_CHECK_TIMEOUT)
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
SAMPLING_FIELDS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
                   "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
                   "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                   "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
                   "sampling_seed", "custom_params", "beam_width", "watermark", "choice")
GENERATE_FIELDS = (    # GenerateReqInput's fields (io_struct.py); others are ignored by SGLang, recorded here
    "rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
    "mm_content_hashes", "use_audio_in_video", "video_config", "sampling_params", "watermark", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode",
    "return_text_in_logprobs", "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64", "stream", "log_metrics", "return_hidden_states", "return_routed_experts",
    "routed_experts_start_len", "return_indexer_topk", "modalities", "session_params", "lora_path", "lora_id",
    "custom_logit_processor", "positional_embed_overrides", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank",
    "routing_key", "conversation_id", "http_worker_ipc", "background", "require_reasoning", "max_thinking_tokens",
    "priority", "extra_key", "no_logs", "custom_labels", "return_bytes", "return_entropy", "return_prompt_token_ids",
    "external_trace_header", "received_time", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
    "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool", "cache_salt", "kv_hints")
_BASE = ("rid", "http_worker_ipc")      # BaseReq's fields, on every control struct
# endpoint → (required fields, optional fields) of its io_struct request
CONTROL_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "/update_weights_from_disk": (("model_path",), ("load_format", "abort_all_requests", "weight_version", "is_async",
                                  "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step",
                                  "flush_cache", "manifest")),
    "/update_weights_from_tensor": (("serialized_named_tensors",), ("load_format", "flush_cache", "abort_all_requests",
                                    "weight_version", "selector", "torch_empty_cache")),
    "/update_weights_from_distributed": (("names", "dtypes", "shapes"), ("group_name", "flush_cache",
                                         "abort_all_requests", "weight_version", "load_format", "selector",
                                         "torch_empty_cache")),
    "/init_weights_update_group": (("master_address", "master_port", "rank_offset", "world_size"),
                                   ("group_name", "backend")),
    "/destroy_weights_update_group": ((), ("group_name",)),
    "/update_weight_version": (("new_version",), ("abort_all_requests",)),
    "/pause_generation": ((), ("mode",)),
    "/continue_generation": ((), ("torch_empty_cache",)),
    "/release_memory_occupation": ((), ("tags",)),
    "/resume_memory_occupation": ((), ("tags",)),
    "/abort_request": ((), ("abort_all", "finished_reason", "abort_message", "weight_versions")),
    "/weights_checker": ((), ("action", "allow_quant_error", "skip_tensor_list", "selector")),
}


def error_response(message: str, status: int = 400) -> web.Response:
    """http_server._create_error_response: {"error": {"message": ...}}."""
    return web.json_response({"error": {"message": message}}, status=status)


def validation_error(errors: list[dict[str, Any]]) -> web.Response:
    """A RequestValidationError, which SGLang answers with 400 and its ErrorResponse shape."""
    return web.json_response({"object": "error", "message": f"{len(errors)} validation error(s): {errors}",
                              "type": "Bad Request", "param": None, "code": 400}, status=400)


def success_response(ok: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": ok, "message": message, **extra}, status=200 if ok else 400)


# --- weights -----------------------------------------------------------------------------------------
def read_safetensors(folder: str) -> dict[str, dict[str, Any]]:
    """name → {dtype, shape, digest} of every tensor in the folder's *.safetensors, read from the
    file format itself (8-byte header length, JSON header, raw bytes): no torch in this process."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            digest = hashlib.sha256(data[8 + n + start:8 + n + end]).hexdigest()
            out[name] = {"dtype": info["dtype"], "shape": info["shape"], "digest": digest}
    return out


def overall_digest(weights: dict[str, dict[str, Any]]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(str(weights[name]["digest"]).encode())
    return h.hexdigest()


_REBUILD_MODULES = ("torch.multiprocessing.reductions", "torch._utils", "sglang.srt.utils.patch_torch")


class _Rebuilt:
    """What a tensor-rebuild function was called with (the fake never maps the memory)."""

    def __init__(self, kind: str, args: tuple):
        self.kind, self.args = kind, args

    def describe(self) -> dict[str, Any]:
        if self.kind == "rebuild_cuda_tensor":     # (cls, size, stride, offset, storage_cls, dtype, device, ...)
            return {"shape": list(self.args[1]), "dtype": self.args[5], "device": self.args[6]}
        if self.kind == "rebuild_tensor":          # (cls, storage, (offset, size, stride, requires_grad))
            storage = self.args[1]
            dtype = storage.args[1] if isinstance(storage, _Rebuilt) and len(storage.args) > 1 else None
            return {"shape": list(self.args[2][1]), "dtype": dtype, "device": "cpu"}
        return {"kind": self.kind}


class PayloadUnpickler(pickle.Unpickler):
    """SGLang's SafeUnpickler allow-list (the part a tensor payload uses), with torch's rebuild
    functions replaced by recorders: globals outside it fail as SGLang's do."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in ("dict", "list", "tuple", "str", "int", "float", "bool", "bytes"):
            return {"dict": dict, "list": list, "tuple": tuple, "str": str, "int": int, "float": float,
                    "bool": bool, "bytes": bytes}[name]
        if (module, name) == ("types", "SimpleNamespace"):
            return types.SimpleNamespace
        if (module, name) in (("copyreg", "__newobj__"), ("copyreg", "_reconstructor"), ("copyreg", "__newobj_ex__")):
            return super().find_class(module, name)
        if (module, name) == ("torch", "Size"):
            return tuple
        if module == "torch" and name[0].islower():
            return name                            # a dtype: keep its name
        if module in _REBUILD_MODULES and name.lstrip("_").startswith("rebuild"):
            kind = "rebuild_cuda_tensor" if "cuda_tensor" in name else name
            return lambda *args: _Rebuilt(kind, args)
        if (module, name) in (("multiprocessing.resource_sharer", "DupFd"), ("torch", "Tensor"),
                              ("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage"),
                              ("torch.storage", "TypedStorage")):
            return _Opaque
        raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


class _Opaque:
    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def describe_payload(b64: str, load_format: str | None) -> list[dict[str, Any]]:
    """The named tensors one rank's payload carries: name, shape, dtype (and device for CUDA)."""
    obj = PayloadUnpickler(io.BytesIO(base64.b64decode(b64, validate=True))).load()
    if load_format == "flattened_bucket":
        flat = obj["flattened_tensor"].describe()
        if flat.get("dtype") != "uint8" or len(flat.get("shape", [])) != 1:
            raise ValueError(f"flattened_tensor must be 1-D uint8, got {flat}")
        out = []
        for m in obj["metadata"]:
            if not 0 <= m.start_idx <= m.end_idx <= flat["shape"][0] or m.end_idx - m.start_idx != m.numel:
                raise ValueError(f"metadata of {m.name}: [{m.start_idx}, {m.end_idx}) numel {m.numel} does not "
                                 f"fit a {flat['shape'][0]}-byte bucket")
            out.append({"name": m.name, "shape": list(m.shape), "dtype": m.dtype, "device": flat.get("device")})
        return out
    return [{"name": name, **t.describe()} for name, t in obj]


# --- the server -----------------------------------------------------------------------------------
class FakeSGLang:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        config = json.loads((Path(args.model_path) / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        eos = config.get("eos_token_id")
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.weights = read_safetensors(args.model_path)
        self.weight_version = args.weight_version
        self.snapshot: dict[str, dict[str, Any]] | None = None
        self.released: set[str] = set()
        self.paused: str | None = None            # the pause mode while paused
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.running: dict[str, bool] = {}        # rid → aborted?
        self.group: str | None = None
        self.calls: list[dict[str, Any]] = []
        self.ready_at = time.monotonic() + args.fake_startup_delay
        self.token_delay = args.fake_token_delay
        self.never_stop = args.fake_never_stop
        self.counter = 0
        self.progressing = asyncio.Event()        # cleared by /fake/hang: the scheduler makes no progress
        self.progressing.set()
        self.health_hung = False
        self.health_timeout_s = HEALTH_CHECK_TIMEOUT_S
        self.health_checks = 0

    def record(self, request: web.Request, body: Any, ignored: list[str], status: int) -> None:
        call = {"endpoint": request.path, "method": request.method, "body": body, "ignored": ignored,
                "status": status, "port": self.args.port, "pid": os.getpid(), "ts": time.time()}
        self.calls.append(call)
        print("FAKE_CALL " + json.dumps(call), flush=True)

    # -- generation ------------------------------------------------------------------------------
    async def generate(self, body: dict[str, Any]) -> web.Response:
        problem = _sampling_contract_error(body.get("sampling_params"))
        if problem:
            return web.json_response({"error": problem}, status=400)
        if body.get("text") is None and body.get("input_ids") is None and body.get("input_embeds") is None:
            return error_response("Either text, input_ids or input_embeds should be provided.")
        if body.get("input_ids") is None:
            return error_response("The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
                                  "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False.")
        ids = body["input_ids"]
        if not ids or isinstance(ids[0], list):
            return error_response("input_ids cannot be empty." if not ids else "the fake serves single requests only")
        sp = dict(body.get("sampling_params") or {})
        problem = _sampling_value_error(sp)
        if problem:
            return error_response(problem)
        if "kv_cache" in self.released or "weights" in self.released:
            return error_response(f"memory released ({sorted(self.released)}): resume_memory_occupation first", 500)
        rid = body.get("rid") or f"fake-{self.counter}"
        self.counter += 1
        self.running[rid] = False
        try:
            out = await self._decode(rid, ids, sp, bool(body.get("return_logprob")))
            start = body.get("logprob_start_len", -1)
            if body.get("return_logprob") and isinstance(start, int) and 0 <= start < len(ids):
                out["meta_info"]["input_token_logprobs"] = self.input_logprobs(ids, start)
            return web.json_response(out)
        finally:
            self.running.pop(rid, None)

    async def _decode(self, rid: str, ids: list[int], sp: dict[str, Any], logprobs: bool) -> dict[str, Any]:
        max_new = int(sp.get("max_new_tokens", 128))
        stops = self.eos_ids | set(sp.get("stop_token_ids") or [])
        greedy = float(sp.get("temperature", 1.0)) == 0.0
        seed = 0 if greedy else sp.get("sampling_seed", f"unseeded-{self.counter}")
        out, lps, reason = [], [], {"type": "length", "length": max_new}
        start_version = self.weight_version
        for k in range(max_new):
            await self._wait_runnable()
            if self.running.get(rid):
                reason = {"type": "abort", "message": "Abort in running batch", "status_code": 200}
                break
            h = int.from_bytes(hashlib.blake2b(f"{overall_digest(self.weights)}|{self.weight_version}|{ids}|{out}|"
                                               f"{seed}".encode(), digest_size=8).digest(), "big")
            out.append(h % self.vocab_size)
            if self.never_stop and out[-1] in stops:
                out[-1] = next(t for t in range(self.vocab_size) if t not in stops)
            lps.append(-0.01 - (h >> 16) % 1000 / 250.0)
            if out[-1] in stops:
                reason = {"type": "stop", "matched": out[-1]}
                break
        meta: dict[str, Any] = {"id": rid, "finish_reason": reason, "prompt_tokens": len(ids),
                                "weight_version": self.weight_version, "completion_tokens": len(out),
                                "cached_tokens": 0, "num_retractions": 0, "reasoning_tokens": 0}
        if start_version != self.weight_version:
            meta["weight_versions"] = [{"version": start_version, "start": 0, "end": 1},
                                       {"version": self.weight_version, "start": 1, "end": len(out)}]
        if logprobs:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out)]
        return {"output_ids": out, "meta_info": meta}

    def input_logprobs(self, ids: list[int], start: int) -> list[list[Any]]:
        """SGLang's `input_token_logprobs` from `logprob_start_len` `start` on: `[logprob, token_id, null]`
        per input token, the first input token's logprob null (nothing precedes it). The fake's logprob
        of token i is a hash of (weights, the tokens before it, the token) in [-4.01, -0.01]."""
        digest = overall_digest(self.weights)
        out = []
        for i in range(start, len(ids)):
            h = int.from_bytes(hashlib.blake2b(f"{digest}|{ids[:i]}|{ids[i]}".encode(), digest_size=8).digest(), "big")
            out.append([None if i == 0 else -0.01 - h % 1000 / 250.0, ids[i], None])
        return out

    async def _wait_runnable(self) -> None:
        if self.token_delay:
            await asyncio.sleep(self.token_delay)
        await self.resumed.wait()
        await self.progressing.wait()

    # -- control ---------------------------------------------------------------------------------
    async def control(self, endpoint: str, body: dict[str, Any]) -> web.Response:
        handler = getattr(self, "do_" + endpoint.strip("/"))
        return await handler(body)

    async def do_pause_generation(self, body: dict[str, Any]) -> web.Response:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return validation_error([{"type": "literal_error", "loc": ("body", "mode"),
                                      "msg": "Input should be 'abort', 'retract' or 'in_place'"}])
        if mode == "abort":
            for rid in self.running:
                self.running[rid] = True
        self.paused = mode
        self.resumed.clear()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def do_continue_generation(self, body: dict[str, Any]) -> web.Response:
        self.paused = None
        self.resumed.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def do_flush_cache(self, body: dict[str, Any]) -> web.Response:
        if self.running and self.paused in (None, "in_place"):
            return web.Response(text="Flush cache failed.\n", status=400)
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    async def do_update_weights_from_disk(self, body: dict[str, Any]) -> web.Response:
        if "weights" in self.released:
            return success_response(False, "weights are released; resume_memory_occupation(tags=['weights']) first",
                                    num_paused_requests=0)
        try:
            new = read_safetensors(body["model_path"])
        except (OSError, ValueError) as exc:
            return success_response(False, f"Failed to get weights iterator: {exc}.", num_paused_requests=0)
        problems = _weights_mismatch(self.weights, new)
        if problems:
            return success_response(False, f"Failed to update weights: {problems}. Rolling back to original "
                                           f"weights.", num_paused_requests=0)
        self.weights = new
        return self._updated(body, "Succeeded to update model weights.", num_paused_requests=0)

    async def do_update_weights_from_tensor(self, body: dict[str, Any]) -> web.Response:
        payloads = body["serialized_named_tensors"]
        if len(payloads) != self.args.tp_size:
            return error_response(f"list index out of range (one payload per TP rank: {len(payloads)} given, "
                                  f"tp_size {self.args.tp_size})", 500)
        if "weights" in self.released:
            return success_response(False, "weights are released; resume them first")
        try:
            tensors = [describe_payload(p, body.get("load_format")) for p in payloads]
        except Exception as exc:   # noqa: BLE001  (SGLang reports any loading error as success False)
            return success_response(False, f"Failed to update weights: {exc}")
        problems = _weights_mismatch(self.weights, {t["name"]: t for t in tensors[0]}, partial=True)
        if problems:
            return success_response(False, f"Failed to update weights: {problems}")
        for t in tensors[0]:
            self.weights[t["name"]] = {"dtype": t["dtype"], "shape": t["shape"], "digest": f"ipc@{body.get('weight_version')}"}
        self.last_tensors = tensors
        return self._updated(body, "Success", tensors=tensors[0])

    async def do_init_weights_update_group(self, body: dict[str, Any]) -> web.Response:
        self.group = body.get("group_name", "weight_update_group")
        return success_response(True, "Succeeded to initialize custom process group.")

    async def do_destroy_weights_update_group(self, body: dict[str, Any]) -> web.Response:
        ok = self.group == body.get("group_name", "weight_update_group")
        self.group = None if ok else self.group
        return success_response(ok, "Succeeded to destroy custom process group." if ok else "group not found")

    async def do_update_weights_from_distributed(self, body: dict[str, Any]) -> web.Response:
        # the real server now receives a NCCL broadcast; the fake only checks the request and the group
        if self.group != body.get("group_name", "weight_update_group"):
            return success_response(False, f"process group {body.get('group_name', 'weight_update_group')} is not "
                                           f"initialized: call /init_weights_update_group first")
        if not len(body["names"]) == len(body["dtypes"]) == len(body["shapes"]):
            return success_response(False, "names, dtypes and shapes differ in length")
        return self._updated(body, "Succeeded to update parameter online.")

    def _updated(self, body: dict[str, Any], message: str, **extra: Any) -> web.Response:
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
            message += f" Weight version updated to {body['weight_version']}."
        return success_response(True, message, **{k: v for k, v in extra.items() if k != "tensors"})

    async def do_update_weight_version(self, body: dict[str, Any]) -> web.Response:
        self.weight_version = body["new_version"]
        return success_response(True, f"Weight version updated to {body['new_version']}",
                                new_version=body["new_version"])

    async def do_release_memory_occupation(self, body: dict[str, Any]) -> web.Response:
        if self.running and self.paused is None:
            return error_response("release_memory_occupation should be called only when server is idle.")
        self.released |= set(body.get("tags") or MEMORY_TAGS)
        return web.json_response(None)

    async def do_resume_memory_occupation(self, body: dict[str, Any]) -> web.Response:
        tags = body.get("tags") or list(MEMORY_TAGS)
        missing = [t for t in tags if t not in self.released]
        if missing:
            return error_response(repr(missing[0]))       # SGLang: KeyError from offload_tags.remove
        self.released -= set(tags)
        return web.json_response(None)

    async def do_abort_request(self, body: dict[str, Any]) -> web.Response:
        for rid in self.running:
            if body.get("abort_all") or rid == body.get("rid"):
                self.running[rid] = True
        return web.Response(status=200)

    async def do_weights_checker(self, body: dict[str, Any]) -> web.Response:
        action = body.get("action", "checksum")
        if action == "snapshot":
            self.snapshot = {k: dict(v) for k, v in self.weights.items()}
        elif action == "reset_tensors":
            self.weights = {k: {**v, "digest": f"random-{k}"} for k, v in self.weights.items()}
        elif action == "compare":
            if self.snapshot is None:
                return success_response(False, "AssertionError: no snapshot: call action snapshot first")
            bad = [f"name={n} expect={self.snapshot[n]['digest'][:12]} actual={self.weights[n]['digest'][:12]}"
                   for n in sorted(self.snapshot) if self.weights[n]["digest"] != self.snapshot[n]["digest"]]
            self.snapshot = None
            if bad:
                return success_response(False, "check tensor equality failed:\n" + "\n".join(bad))
        elif action == "checksum":
            digest = hashlib.sha256(overall_digest(self.weights).encode()).hexdigest()
            return web.json_response({"success": True, "message": "Success", "per_engine_checksum": digest})
        else:
            return success_response(False, f"Unsupported action={action!r}")
        return success_response(True, "Success")


def _sampling_contract_error(sp: Any) -> str | None:
    """The /generate schema's text for a sampling_params violation (unknown keys are rejected)."""
    if sp is None:
        return None
    if not isinstance(sp, dict):
        return "invalid type: sequence, expected struct SamplingParams" if isinstance(sp, list) else \
            f"invalid type: {type(sp).__name__}, expected struct SamplingParams"
    for key, value in sp.items():
        if key not in SAMPLING_FIELDS:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
            return f"unknown field `{key}`, expected one of {listed}"
        if key in ("max_new_tokens", "top_k", "sampling_seed") and value is not None and \
                (not isinstance(value, int) or isinstance(value, bool)):
            return f"invalid type: {json.dumps(value)}, expected i64"
        if key in ("temperature", "top_p") and value is not None and \
                (not isinstance(value, (int, float)) or isinstance(value, bool)):
            return f"invalid type: {json.dumps(value)}, expected f64"
    return None


def _sampling_value_error(sp: dict[str, Any]) -> str | None:
    """SamplingParams.verify's messages for the fields miles sends."""
    t, p, k = sp.get("temperature", 1.0), sp.get("top_p", 1.0), sp.get("top_k", -1)
    if t < 0:
        return f"temperature must be a non-negative finite number, got {t}."
    if not 0.0 < p <= 1.0:
        return f"top_p must be in (0, 1], got {p}."
    if k < 1 and k != -1:
        return f"top_k must be -1 (disable) or at least 1, got {k}."
    if sp.get("max_new_tokens", 128) < 0:
        return f"max_new_tokens must be at least 0, got {sp['max_new_tokens']}."
    return None


def _weights_mismatch(have: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]], partial: bool = False) -> str:
    unknown = sorted(set(new) - set(have))
    missing = [] if partial else sorted(set(have) - set(new))
    shapes = [n for n in new if n in have and list(new[n]["shape"]) != list(have[n]["shape"])]
    parts = [f"{label} {names[:3]}" for label, names in (("unknown", unknown), ("missing", missing),
                                                          ("wrong shape", shapes)) if names]
    return "; ".join(parts)


def _check_control(endpoint: str, body: Any) -> tuple[web.Response | None, list[str]]:
    required, optional = CONTROL_FIELDS[endpoint]
    if not isinstance(body, dict):
        return validation_error([{"type": "dict_type", "loc": ("body",), "msg": "Input should be a valid dictionary"}]), []
    missing = [f for f in required if f not in body]
    if missing:
        return validation_error([{"type": "missing", "loc": ("body", f), "msg": "Field required"}
                                 for f in missing]), []
    return None, [k for k in body if k not in (*required, *optional, *_BASE)]


def make_app(fake: FakeSGLang) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        fake.health_checks += 1
        if time.monotonic() < fake.ready_at:
            return web.Response(status=503)
        if fake.health_hung:                     # no scheduler output within SGLang's health check timeout
            await asyncio.sleep(fake.health_timeout_s)
            return web.Response(status=503)
        return web.Response(status=200)

    async def generate(request: web.Request) -> web.Response:
        body = await _json(request)
        ignored = [k for k in body if k not in GENERATE_FIELDS] if isinstance(body, dict) else []
        resp = await fake.generate(body) if isinstance(body, dict) else \
            web.json_response({"error": "invalid type: sequence, expected struct GenerateRequest"}, status=400)
        fake.record(request, body, ignored, resp.status)
        return resp

    async def control(request: web.Request) -> web.Response:
        body = await _json(request) if request.can_read_body else {}
        if request.path == "/flush_cache":
            resp, ignored = await fake.do_flush_cache(body), []
        else:
            resp, ignored = _check_control(request.path, body)
            resp = resp or await fake.control(request.path, body)
        fake.record(request, body, ignored, resp.status)
        return resp

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": fake.args.model_path, "served_model_name": fake.args.model_path,
                                  "tokenizer_path": None, "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": fake.weight_version, "load_format": "auto"})

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": fake.args.model_path, "tp_size": fake.args.tp_size, "dp_size": 1,
                                  "skip_tokenizer_init": True, "version": VERSION, "frontend": "python",
                                  "internal_states": [{}], "weight_version": fake.weight_version})

    async def calls(request: web.Request) -> web.Response:
        return web.json_response(fake.calls)

    async def hang(request: web.Request) -> web.Response:
        body = await _json(request) or {}
        if "generate" in body:
            (fake.progressing.clear if body["generate"] else fake.progressing.set)()
        fake.health_hung = bool(body.get("health", fake.health_hung))
        fake.health_timeout_s = float(body.get("health_timeout_s", fake.health_timeout_s))
        print("FAKE_HANG " + json.dumps(body), flush=True)
        return await state(request)

    async def state(request: web.Request) -> web.Response:
        return web.json_response({"health_checks": fake.health_checks, "running": sorted(fake.running),
                                  "generate_hung": not fake.progressing.is_set(), "health_hung": fake.health_hung})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_route("POST", "/generate", generate)
    app.router.add_route("PUT", "/generate", generate)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    app.router.add_get("/fake/calls", calls)
    app.router.add_post("/fake/hang", hang)
    app.router.add_get("/fake/state", state)
    for path in CONTROL_FIELDS:
        app.router.add_post(path, control)
    for path in ("/flush_cache", "/release_memory_occupation", "/resume_memory_occupation", "/weights_checker"):
        app.router.add_get(path, control)
    app.router.add_post("/flush_cache", control)
    return app


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The launch flags the fake knows, under SGLang's names; anything else is an argparse error."""
    p = argparse.ArgumentParser(prog="sglang serve")
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--random-seed", type=int)
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--log-level", default="info")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--nccl-port", type=int)
    p.add_argument("--device")
    p.add_argument("--fake-startup-delay", type=float, default=0.0)     # test knobs, not SGLang's
    p.add_argument("--fake-token-delay", type=float, default=0.0)
    p.add_argument("--fake-never-stop", action="store_true")
    return p.parse_args(argv)


# the stand-in for SGLang's scheduler and detokenizer, which die with the server (PR_SET_PDEATHSIG, as SGLang
# sets it in its subprocesses) even when the server is killed alone, by the death of the engine that owns it
_CHILD = """import ctypes, os, signal, sys, time
if sys.platform.startswith("linux"):
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[1]):                   # the server died before the line above
        sys.exit(0)
time.sleep(10**6)
"""


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    # SGLang runs scheduler/detokenizer subprocesses; this one stands for them in teardown checks
    subprocess.Popen([sys.executable, "-c", _CHILD, str(os.getpid()), f"fake-sglang-child-{args.port}",
                      args.model_path])
    print(f"fake sglang {VERSION} serving {args.model_path} on {args.host}:{args.port}", flush=True)
    web.run_app(make_app(FakeSGLang(args)), host=args.host, port=args.port, print=None,
                handle_signals=True, shutdown_timeout=1.0)
