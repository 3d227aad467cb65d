"""The embedded inference engine: transformers + torch sampling in the caller's process (CPU or GPU).

Token ids in, token ids + per-token logprobs out. Prompts are batched left-padded (attention mask,
position ids counted from each prompt's first real token, so they match the trainer's right-padded
forward), then a KV-cached loop of `model(...)` calls samples one token per step. Rows that stop are
dropped from the batch and the cache, so a long answer does not make the finished ones cost compute.

Logprobs are log_softmax(logits / temperature) at the sampled token, the quantity the trainer
recomputes (`miles.algorithms.logprobs_from_logits`); greedy decoding (temperature 0) reports them
at temperature 1. Top-p / top-k truncate the distribution that is sampled from, but the reported
logprobs are of the untruncated one, as the trainer cannot see the truncation either.

Memory (colocated with a trainer on the GPU): `release_memory` moves the weights to host memory and
returns the CUDA cache (the KV cache of the last call, freed but still cached by torch), so the
trainer can take the GPU; `resume_memory` brings the weights back. Outputs do not change across a
release/resume (the same tensors' values, copied).

Health and abort (`miles.rollout.engines.guard`): the actor runs on two threads; a lock keeps one
model call at a time, every decode step stamps a heartbeat, `health()` reads it without the lock
(or, idle, runs a one-token generate), and `abort()` makes the running calls stop at their next step.

A mixture-of-experts model (Qwen3-MoE: miles.training.moe, docs/moe.md): each sampled token's experts, per
MoE layer, are recorded from the forward whose logits sampled it (`Generation.routed_experts`), for the
trainer's routing replay (R3).

A plain class; the composition root makes it a Ray actor.
"""

from __future__ import annotations

import gc
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from torch import Tensor

from miles.rollout.engines.embedded.spec import MAX_BATCH_SIZE
from miles.rollout.engines.guard import EngineGuard
from miles.rollout.protocol import MEMORY_TAGS, TokenizerAccessors
from miles.training.moe import Routing, engine_routed, router_modules
from miles.types import Generation, SamplingParams, sampling_problems
from miles.weights import fp8
from miles.weights.checksum import state_dict_checksum
from miles.weights.hf import (copy_checked, load_causal_lm, load_tokenizer, load_weights, model_weights,
                              resolve_device, resolve_dtype)
from miles.weights.transport import WeightBucket, WeightReceiver

log = structlog.get_logger().bind(role="engine")

Sampler = Callable[[Tensor, torch.Generator], tuple[Tensor, Tensor]]  # logits [b, V] → (tokens [b], logprobs [b])


class EngineDisposedError(RuntimeError):
    pass


class EmbeddedEngine(EngineGuard, TokenizerAccessors):
    def __init__(self, model_path: str, *, device: str = "auto", dtype: str = "auto", seed: int = 0,
                 max_batch_size: int = MAX_BATCH_SIZE, quantization: str | None = None,
                 kv_cache_dtype: str = "auto"):
        """`quantization` (--rollout-quantization): "fp8" emulates FP8 weights (the decoder's Linear weights
        are held as e4m3 with 128 x 128 block scales, and the model computes with their dequantized
        values, in --dtype), "none" does not, None follows the checkpoint (an FP8 one stays FP8).
        `kv_cache_dtype`: "auto" only (transformers' cache; FastEngine has the FP8 one)."""
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: the embedded engine keeps transformers' KV cache "
                             "in its dtype; FastEngine (--rollout-engine fast) has the FP8 cache")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_batch_size = max_batch_size
        self._model = load_causal_lm(model_path, device=self.device, dtype=self.dtype)
        self._fp8: dict[str, Tensor] | None = None    # e4m3 weights and scales the model computes with (dequantized)
        if fp8.engine_quantization(quantization, model_path) == "fp8":
            stored = fp8.read_checkpoint_tensors(model_path) if fp8.is_fp8_checkpoint(model_path) else \
                fp8.quantize_state_dict(model_weights(self._model))     # an FP8 checkpoint's tensors as they are
            self._fp8 = {n: t.to(self.device) for n, t in fp8.quantized_part(stored).items()}
            self._apply_fp8(self._fp8)
        self._tokenizer = load_tokenizer(model_path)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._version = 0
        self._receiver: WeightReceiver | None = None   # bucketed updates, made at the first
        self._eos_ids = _eos_ids(self._model, self._tokenizer)
        self._vocab_size = self._model.config.vocab_size
        self._max_positions = getattr(self._model.config, "max_position_embeddings", None)
        # transformers 5 renamed the cache argument; pick the name once
        params = inspect.signature(self._model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # a mixture-of-experts model: each sampled token's experts, per MoE layer (Generation.routed_experts)
        self._routing = Routing(self._model) if router_modules(self._model) else None
        self._init_guard()
        self._weights_on_host = False        # release_memory moved them off the GPU
        log.info("engine_ready", model=model_path, device=str(self.device), dtype=str(self.dtype),
                 quantization="fp8 (emulated: dequantized weights)" if self._fp8 is not None else None,
                 cpu_threads=torch.get_num_threads() if self.device.type == "cpu" else None)

    # --- tokenizer accessors -------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self._tokenizer

    # --- weights -------------------------------------------------------------------------------
    def weight_version(self) -> int:
        """0 for the weights loaded from disk, then the version of the last `update_weights`."""
        return self._version

    def update_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Load the trainer's `model_weights` dict (any device/dtype; cast to the engine's).

        Names and shapes are checked strictly before anything is copied (ValueError naming them).
        """
        with self._holding():
            self._load_weights(state_dict)
            self._version = int(version)
        log.info("weights_updated", version=self._version)

    def _load_weights(self, state_dict: Mapping[str, Tensor]) -> None:
        """Into the model (the lock held): `update_weights`, and an in-flight swap (`EngineGuard.swap_weights`)."""
        if self._fp8 is None:
            load_weights(self._live_model(), state_dict)
        else:       # FP8 bytes and scales as sent, or quantized here from plain weights; then dequantized
            state_dict = fp8.as_quantized(state_dict, self.dtype)
            copy_checked(self._held(), state_dict)
            self._apply_fp8(state_dict)

    def load_weight_bucket(self, bucket: WeightBucket) -> int | None:
        """One bucket of a bucketed update (CUDA IPC, miles.weights.transport): copied into the
        model's tensors by name; the version is set when the version's last bucket is in (returned)."""
        with self._holding():       # not under a generate running on the health thread's side
            if self._receiver is None:
                self._receiver = WeightReceiver(self._held())
            version = self._receiver.load(bucket)
            if self._fp8 is not None:
                self._apply_fp8({m.name: None for m in bucket.metas})
            if version is not None:
                self._version = version
        if version is not None:
            log.info("weights_updated", version=version, buckets=bucket.count)
        return version

    def _weights_checksum_locked(self) -> str:
        """`state_dict_checksum` of the engine's weights, in the engine's dtype (FP8: the e4m3 bytes and scales
        it holds): equal to `Trainer.weights_checksum(dtype=engine.weights_dtype())` right after a sync."""
        return state_dict_checksum(self._held())

    def weights_dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in (bfloat16 on CUDA by default)."""
        return self.dtype

    # --- generation ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 max_new_tokens: Sequence[int] | None = None) -> list[Generation]:
        """One Generation per prompt, in order. Batches of at most `max_batch_size` prompts.
        `max_new_tokens` (one per prompt) caps each prompt's response; else `params.max_new_tokens`.

        Randomness: the engine's generator (seeded at construction, advancing call after call),
        or a fresh one seeded with `params.seed` for this call only. The same seed, weights,
        prompts and params give the same samples.
        """
        epoch = self._abort_epoch
        caps = [params.max_new_tokens] * len(prompts) if max_new_tokens is None else [int(c) for c in max_new_tokens]
        with self._holding():
            return self._generate_locked(prompts, params, caps, epoch)

    def _generate_locked(self, prompts: list[list[int]], params: SamplingParams, caps: list[int],
                         epoch: int) -> list[Generation]:
        model = self._live_model()
        if self._weights_on_host:
            raise RuntimeError("the engine's memory is released; call resume_memory() before generate()")
        self._check(prompts, params, caps)
        gen = self._generator if params.seed is None else torch.Generator(device=self.device).manual_seed(params.seed)
        sampler = _make_sampler(params)
        stop_ids = torch.tensor(sorted(self._eos_ids | set(params.stop_token_ids)), dtype=torch.long,
                                device=self.device)
        stops = _StopStrings(self._tokenizer, params.stop) if params.stop else None
        out: list[Generation] = []
        for i in range(0, len(prompts), self.max_batch_size):
            chunk = slice(i, i + self.max_batch_size)
            budgets = [_budget(params, len(p), cap) for p, cap in zip(prompts[chunk], caps[chunk])]
            cut = int(params.tail_cut_share * len(budgets))     # this batch's share (SamplingParams.tail_cut_share)
            out += self._generate_batch(model, prompts[chunk], budgets, sampler, gen, stop_ids, stops, epoch,
                                        params.min_new_tokens, cut)
        return out

    # --- health (EngineGuard's health() and abort()) ---------------------------------------------
    def _probe_ready(self) -> bool:
        return not self._weights_on_host     # released for a colocated trainer: nothing to run, nothing hung

    def _probe(self) -> None:
        self._generate_locked([[self.eos_token_id]], SamplingParams(temperature=0.0, max_new_tokens=1), [1],
                              self._abort_epoch)

    @torch.inference_mode()
    def _generate_batch(self, model, prompts: list[list[int]], budgets: list[int], sampler: Sampler,
                        gen: torch.Generator, stop_ids: Tensor, stops: _StopStrings | None,
                        epoch: int, min_new_tokens: int = 0, tail_cut: int = 0) -> list[Generation]:
        from transformers import DynamicCache

        ids, attn = _left_pad(prompts, self.pad_token_id, self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self._forward(model, ids, attn, pos, cache)
        routed = self._routed(ids.shape)
        next_pos = pos[:, -1] + 1
        rows = list(range(len(prompts)))     # original index of each row still in the batch
        gens = [Generation([], [], "length", self._version, None if routed is None else []) for _ in prompts]
        logits_version = self._version        # the version whose forward gave `logits`
        swapped = False
        for step in range(max(budgets)):
            if step < min_new_tokens:   # every row has `step` tokens: none may stop yet (SGLang's min_new_tokens)
                logits[:, stop_ids] = float("-inf")
            tokens, logprobs = sampler(logits, gen)
            stopped = torch.isin(tokens, stop_ids)
            done = []
            for i, (row, t, lp, s) in enumerate(zip(rows, tokens.tolist(), logprobs.tolist(), stopped.tolist())):
                gens[row].response_ids.append(t)
                gens[row].logprobs.append(lp)
                if swapped:
                    if gens[row].token_versions is None:
                        gens[row].token_versions = [gens[row].weight_version] * (len(gens[row].response_ids) - 1)
                    gens[row].token_versions.append(logits_version)
                if routed is not None:
                    gens[row].routed_experts.append(routed[i])
                s = s or (stops is not None and stops.hit(gens[row].response_ids))
                if s:
                    gens[row].finish_reason = "stop"
                done.append(s or len(gens[row].response_ids) >= budgets[row])   # a row's budget ends it too
            self._heartbeat = time.monotonic()
            keep = ~torch.tensor(done, device=tokens.device)
            if not keep.any():
                break
            if self._abort_epoch != epoch or int(keep.sum()) <= tail_cut:   # aborted, or the tail cut
                for row, k in zip(rows, keep.tolist()):
                    if k:
                        gens[row].finish_reason = "abort"
                break
            if not keep.all():  # drop finished rows from the batch and the KV cache
                idx = keep.nonzero().squeeze(-1)
                cache.batch_select_indices(idx)
                attn, tokens, next_pos = attn[idx], tokens[idx], next_pos[idx]
                rows = [r for r, k in zip(rows, keep.tolist()) if k]
            if self._swap is not None and self._take_swap(paused=len(rows)):   # a token boundary: the rows
                swapped = True                                                 # in flight pause for new weights
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
            logits_version = self._version
            logits = self._forward(model, tokens[:, None], attn, next_pos[:, None], cache)
            routed = self._routed((tokens.shape[0], 1))
            next_pos = next_pos + 1
        return gens

    def _forward(self, model, ids: Tensor, attn: Tensor, pos: Tensor, cache) -> Tensor:
        """Logits of the last position, float32 [b, V]; `cache` grows by ids.shape[1] positions."""
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                    logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[:, -1, :].float()

    def _routed(self, shape: tuple[int, int]) -> list[list[list[int]]] | None:
        """Per row of the last [rows, width] forward, the experts of its last position (the one whose logits
        sample its next token), per MoE layer; None for a dense model."""
        if self._routing is None:
            return None
        return engine_routed(self._routing, shape[0], shape[1]).tolist()

    def _check(self, prompts: list[list[int]], params: SamplingParams, caps: list[int] | None = None) -> None:
        caps = [params.max_new_tokens] * len(prompts) if caps is None else caps
        problems = _param_problems(params)
        if len(caps) != len(prompts) or any(c < 1 for c in caps):
            problems.append(f"max_new_tokens must give each of the {len(prompts)} prompts a cap >= 1, got {caps[:8]}")
        for i, (p, cap) in enumerate(zip(prompts, caps)):
            if len(p) == 0:
                problems.append(f"prompt {i} is empty; every prompt needs at least one token")
            elif min(p) < 0 or max(p) >= self._vocab_size:
                problems.append(f"prompt {i} has token ids outside [0, {self._vocab_size}): "
                                f"min {min(p)}, max {max(p)}")
            elif params.max_context_len is not None and len(p) >= params.max_context_len:
                problems.append(f"prompt {i} ({len(p)} tokens) leaves no room for a response under "
                                f"max_context_len {params.max_context_len}")
            elif self._max_positions and len(p) + _budget(params, len(p), cap) > self._max_positions:
                problems.append(f"prompt {i} ({len(p)} tokens) + max_new_tokens {_budget(params, len(p), cap)} "
                                f"exceeds the model's {self._max_positions} positions; shorten the "
                                f"prompt (--max-prompt-len) or the response length")
        if problems:
            raise ValueError("bad generate request: " + "; ".join(problems[:5]))

    # --- memory --------------------------------------------------------------------------------
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Give the GPU back while a colocated trainer trains: "weights" moves the model to host memory;
        any tag returns torch's cached blocks (what the last call's KV cache left). Idempotent; a CPU
        engine has nothing to give. `resume_memory` brings the weights back."""
        if self.device.type != "cuda":
            return
        with self._holding():
            model = self._live_model()
            if "weights" in tags and not self._weights_on_host:
                model.to("cpu")
                if self._fp8 is not None:
                    self._fp8 = {n: t.to("cpu") for n, t in self._fp8.items()}
                self._weights_on_host = True
                self._receiver = None       # its views are of the tensors that just moved
        gc.collect()                        # a reference cycle may still hold the last call's cache
        torch.cuda.empty_cache()
        log.info("memory_released", tags=list(tags), weights_on_host=self._weights_on_host,
                 allocated_gib=round(torch.cuda.memory_allocated(self.device) / 2**30, 3))

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Bring the weights back to the GPU when `tags` names them (the KV cache is allocated by each
        call, the graphs are none). Idempotent."""
        with self._holding():
            model = self._live_model()
            if "weights" in tags and self._weights_on_host:
                model.to(self.device)
                if self._fp8 is not None:
                    self._fp8 = {n: t.to(self.device) for n, t in self._fp8.items()}
                self._weights_on_host = False
                self._receiver = None

    def _held(self) -> dict[str, Tensor]:
        """The weights the engine holds under HF names: the model's, with FP8 emulation the e4m3 Linear
        weights and their `_scale_inv` in place of the dequantized ones."""
        live = model_weights(self._live_model())
        if self._fp8 is None:
            return live
        return {**{n: t for n, t in live.items() if not fp8.is_quantized_name(n)}, **self._fp8}

    @torch.no_grad()
    def _apply_fp8(self, names) -> None:
        """Dequantize into the model's Linear weights each FP8 weight whose scale is among `names` (a
        bucket's scale follows its weight, in the same bucket or the next)."""
        live = model_weights(self._live_model())
        for name in names:
            if name.endswith(fp8.SCALE_SUFFIX):
                weight = name[:-len(fp8.SCALE_SUFFIX)]
                live[weight].copy_(fp8.dequantize_blocks(self._fp8[weight], self._fp8[name], live[weight].dtype))

    def _live_model(self):
        if self._model is None:
            raise EngineDisposedError("the engine was disposed; create a new EmbeddedEngine")
        return self._model

    def dispose(self) -> None:
        """Free the model and the tokenizer (and the CUDA cache). Idempotent. The actor is the run's."""
        self.abort()                    # a running call stops at its next step instead of holding the lock
        with self._lock:
            self._model = None
            self._tokenizer = None
        # on CUDA, what a reference cycle still holds must be collected before empty_cache can hand
        # it back to the device (a colocated trainer takes it). On the CPU dropping the references
        # frees the tensors, a cycle goes at the next automatic collection (an actor's process ends
        # right after), and a full collect costs ~0.25 s in a process with torch and transformers
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()


def _eos_ids(model, tokenizer) -> set[int]:
    """The tokenizer's EOS plus the generation config's (chat models often list several)."""
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for e in (tokenizer.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])):
        if e is not None:
            ids.add(int(e))
    return ids


def _budget(params: SamplingParams, prompt_len: int, cap: int | None = None) -> int:
    """New tokens a prompt may get: its cap (default max_new_tokens), capped by max_context_len minus the prompt."""
    cap = params.max_new_tokens if cap is None else cap
    if params.max_context_len is None:
        return cap
    return max(1, min(cap, params.max_context_len - prompt_len))


class _StopStrings:
    """Stop strings, checked on the decoded tail of a response after each token (a string can span
    tokens, so the tail is as many tokens as the longest stop string has characters, plus one)."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self._tokenizer, self._stops = tokenizer, tuple(stops)
        self._window = max(len(s) for s in stops) + 1

    def hit(self, ids: list[int], end: int | None = None) -> bool:
        """Whether the tail of `ids[:end]` holds a stop string."""
        end = len(ids) if end is None else end
        tail = self._tokenizer.decode(ids[max(0, end - self._window):end], skip_special_tokens=False)
        return any(s in tail for s in self._stops)

    def first_hit(self, ids: list[int], start: int, end: int) -> int | None:
        """The first k in [start, end) at which `hit(ids, k + 1)`, or None; for checking many new
        tokens at once (the fast engine's): one decode of them and the tail before them rules out
        most batches, and only a batch whose text holds a stop string is checked token by token.
        (A tail's decoded text is the end of any longer run's: byte-level BPE decodes bytes, which
        resynchronize at the first whole character; so a batch without the string has no hit.)"""
        if start >= end:
            return None
        text = self._tokenizer.decode(ids[max(0, start - self._window + 1):end], skip_special_tokens=False)
        if not any(s in text for s in self._stops):
            return None
        return next((k for k in range(start, end) if self.hit(ids, k + 1)), None)


def _left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """→ ids [B, P] int64 and attention mask [B, P] int64, prompts flush right."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attn[i, width - len(p):] = 1
    return ids.to(device), attn.to(device)


def _param_problems(params: SamplingParams) -> list[str]:
    # a call's own params (a custom generate function builds them): the one rule of the sampling knobs
    problems = sampling_problems(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    if params.max_new_tokens < 1:
        problems.append(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if params.min_new_tokens < 0:
        problems.append(f"min_new_tokens must be >= 0, got {params.min_new_tokens}")
    if not 0.0 <= params.tail_cut_share < 1.0:
        problems.append(f"tail_cut_share must be in [0, 1) (0: off), got {params.tail_cut_share}")
    return problems


@dataclass(frozen=True)
class _Sampling:
    temperature: float
    top_p: float
    top_k: int

    def __call__(self, logits: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        scaled = logits / self.temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        probs = torch.softmax(_truncate(scaled, self.top_k, self.top_p), dim=-1)
        tokens = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _greedy(logits: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    tokens = logits.argmax(dim=-1)
    return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def _make_sampler(params: SamplingParams) -> Sampler:
    if params.temperature == 0:
        return _greedy
    return _Sampling(params.temperature, params.top_p, params.top_k)


def _truncate(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """Top-k then top-p (nucleus) filtering: removed logits become -inf; the top token always stays."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already cover top_p
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled
