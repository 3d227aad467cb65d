"""The embedded engine's fast path: our own Llama/Qwen2/Qwen3/Qwen3-MoE forward, a KV cache allocated once, continuous
batching, device-side sampling and CUDA-graph decode steps. Same interface as `EmbeddedEngine`.

One `generate` call queues all its requests. A request takes a free cache slot (lowest first): a
batched prefill writes its prompt's K/V and samples its first token; then every decode step feeds
one token per busy slot. Stop tokens and each request's max_new_tokens (its own cap, bounded by
max_context_len minus its prompt) are decided on the device (`advance`); the host learns which
slots finished from a copy of the `active` flags taken every `CHECK_EVERY` steps and read
`SNAPSHOT_LAG` steps later (the GPU is never left idle waiting for the host), and knows without
asking when a slot reaches its cap. Freed slots are refilled at once from the queue; when the
queue is empty, busy slots are moved down so the decode batch shrinks.

Stop strings are text, so the host checks them (`_StopWatch`): each snapshot brings every slot's
newest `STOP_WINDOW` tokens too, a request whose decoded tail holds a stop string is cut after the
token that completed it (the embedded engine's rule) and its slot is freed, and what no snapshot
saw is checked when the call ends. A stopped sequence runs on for the steps until its snapshot is
read (at most CHECK_EVERY + SNAPSHOT_LAG tokens, discarded).

Chunked prefill: a prompt longer than `chunked_prefill_size` takes its slot but is not prefilled
with the others. Each turn of the loop prefills one piece of it (`_piece`: one row, at most that
many tokens), whose queries attend to the K/V the earlier pieces left in the slot and causally to
the piece itself, then runs the decode step of the running sequences; the last piece samples the
first token and the slot joins the decode batch. So a piece's activations are bounded by the
chunk, not the prompt (its attention reads the slot's K/V so far under an implicit bottom-right
causal mask, where a whole prompt's prefill builds a [P, P] one), and a long prompt does not
stall the others.
Greedy outputs equal the unchunked engine's (the logits agree to float rounding); sampled ones
for a seed are reproducible but not the unchunked engine's, whose first draws come at other steps.

Health and abort (`miles.rollout.engines.guard`, as the embedded engine): the actor runs on three
threads (the third for an in-flight swap), a lock keeps one model call at a time, each turn of the
loop stamps a heartbeat that `health()` reads, and `abort()` makes a running call return at its next turn (the unfinished
requests end with "abort" and what they generated).

In-flight weight swap (`SupportsInFlightWeightSwap`, --fully-async; `EngineGuard.swap_weights` on a
third actor thread): a pending swap is taken at the top of the loop, between two decode steps, where
every running sequence has sampled its last token and not fed it back; the weights are copied in
place (the captured graphs stay valid) and every forward from that step on (decode steps, prefills,
pieces of long prompts) is the new version's. The KV cache stays: K/V already written were computed
by the old weights. Each request's tokens get their versions from the step they were sampled at
(`_Call.token_versions`: the first token at its prefill's step s, token j at decode step s + j - 1).

Decode steps over (batch bucket, span bucket) are captured as CUDA graphs on first use; weights
are updated in place, so the graphs stay valid. `cuda_graph=False` runs the same steps eagerly,
and on CPU everything runs eagerly in float32 (that is what CI tests).

A mixture-of-experts model (Qwen3-MoE, `miles.rollout.engines.fast.moe`): each sampled token's experts,
per MoE layer, are those of the position whose logits sampled it (the embedded engine's convention):
the prefill's last prompt position for the first token, then each decode step's, which the step (a
captured graph or not) writes into a static buffer and `advance` files beside the token.
`Generation.routed_experts` carries them, one numpy array [tokens, MoE layers, k] per request. The experts run as
grouped matmuls where the kernel is usable (CUDA, Hopper, bf16), else as a per-expert loop, which is not
capturable: decode then runs eagerly on CUDA (logged).

Randomness and results follow `EmbeddedEngine`'s contract (see its module docstring): the same
seed, weights, prompts, params and engine settings give the same samples.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import structlog
import torch
from torch import Tensor

from miles.rollout.engines.fast import attention as fast_attention
from miles.rollout.engines.guard import EngineGuard
from miles.rollout.engines.embedded.engine import EmbeddedEngine, EngineDisposedError, _budget, _eos_ids, _StopStrings
from miles.rollout.engines.fast.cache import (PREFILL_TOKENS, RESERVE_BYTES, DecodeGraphs, GiB, KVCache, PagedKVCache,
                                              Snapshot, batch_buckets, bucket, free_memory, plan_pages, plan_positions,
                                              plan_slots, shared_plan_bytes, span_buckets, workspace_bytes)
from miles.rollout.engines.fast.model import Arch, Forward, compile_for, pack_weights, supports
from miles.rollout.engines.fast.sampling import (LENGTH, STOP, CallOutputs, Sampler, advance, bar_stops, greedy,
                                                 make_sampler, race, stop_table)
from miles.rollout.engines.fast.spec import CHUNKED_PREFILL_SIZE, MAX_BATCH_SIZE, MEM_FRACTION
from miles.rollout.protocol import MEMORY_TAGS, TokenizerAccessors
from miles.types import Generation, SamplingParams
from miles.weights import fp8
from miles.weights.checksum import state_dict_checksum
from miles.weights.hf import copy_checked, load_causal_lm, load_tokenizer, resolve_device, resolve_dtype
from miles.weights.transport import WeightBucket, WeightReceiver

log = structlog.get_logger().bind(role="engine", engine="fast")
_CACHE_TAGS = {"kv_cache", "cuda_graph"}     # the MEMORY_TAGS this engine releases (graphs go with the cache)
_FINISH = {STOP: "stop", LENGTH: "length"}   # a request without either when the call returns was aborted

CHECK_EVERY = 8          # steps between copies of the device's `active` flags to the host
SNAPSHOT_LAG = 2         # steps between taking such a copy and reading it (the GPU stays busy meanwhile)
# newest tokens per slot copied with each snapshot when a call has stop strings: more than a slot makes
# between two snapshots (CHECK_EVERY decode steps and a prefill's first token)
STOP_WINDOW = 2 * CHECK_EVERY
# a paged cache: every GROW_EVERY steps each running sequence is given the pages its next GROW_EVERY
# positions need (a sequence admitted between two such steps gets as many beyond its prompt)
GROW_EVERY = 8
GROUPED_TOLERANCE = 0.05  # relative max difference of the grouped experts from the loop's at start-up (bf16 sums)
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}   # --kv-cache-dtype (None: the model's dtype)


class FastEngine(EngineGuard, TokenizerAccessors):
    def __init__(self, model_path: str, *, device: str = "auto", dtype: str = "auto", seed: int = 0,
                 max_batch_size: int = MAX_BATCH_SIZE, mem_fraction: float = MEM_FRACTION,
                 max_context_len: int | None = None, context_len: int | None = None,
                 cuda_graph: bool = True, torch_compile: bool = True, attention_kernel: bool = True,
                 chunked_prefill_size: int = CHUNKED_PREFILL_SIZE, quantization: str | None = None,
                 kv_cache_dtype: str = "auto", shared_gpu: bool = False, page_size: int | None = None, model=None):
        """`mem_fraction`: the part of the memory free after the weights that the KV cache may take;
        `max_context_len`: prompt + response positions per slot (None: the model's limit, or what
        fits); `context_len` (without max_context_len): the positions every request may need (the
        run's longest prompt + response); when `max_batch_size` slots of it do not fit, the engine
        runs as many slots as do (`plan_slots`, a `kv_slots_reduced` warning); `cuda_graph` /
        `torch_compile` / `attention_kernel` (the length-aware decode
        attention): CUDA only, off for debugging or comparison; `chunked_prefill_size`: a prompt
        longer than this is prefilled in pieces of this many tokens, one piece per decode step
        of the other sequences (SGLang's --chunked-prefill-size); `model`: the HF model already built
        (in the engine's dtype, on its device or the CPU) instead of loading it from `model_path`, which
        still gives the config and the tokenizer (benchmarks build random large models on the GPU);
        `quantization` "fp8" (--rollout-quantization):
        the decoder's Linear weights in e4m3 with 128 x 128 block scales (`miles.weights.fp8`; an FP8
        checkpoint loads as it is); `kv_cache_dtype` "fp8_e4m3" (--kv-cache-dtype): K/V stored in e4m3
        with scale 1 (SGLang's default without scale files), read back to the compute dtype by attention;
        `shared_gpu` (--colocate --no-offload-rollout: a trainer resident on the same GPU): the KV cache
        is planned from the GPU's total memory less the engine's weights (`shared_plan_bytes`), not from
        what is free when the engine starts, so its share does not depend on how far the trainer got;
        `page_size` (--rollout-page-size): a paged KV cache of pages this many positions long
        (`PagedKVCache`): `max_batch_size` sequences run while their K/V fits, each holding pages for the
        positions it has reached, and the newest is preempted (prefilled again later, its tokens kept) when
        the pages run out; None: every slot holds `max_len` positions from its start."""
        from transformers import AutoConfig

        self._init_guard()
        # the options' ranges are the config's rules (miles.config.validate), checked once, at parse time
        self.chunked_prefill_size = chunked_prefill_size
        quantization = fp8.engine_quantization(quantization, model_path)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: use one of {', '.join(KV_CACHE_DTYPES)}")
        self.quantization, self.kv_cache_dtype_name = quantization, kv_cache_dtype
        reason = supports(AutoConfig.from_pretrained(model_path))
        if reason:
            raise ValueError(f"FastEngine cannot run {model_path}: {reason}; use EmbeddedEngine")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_batch_size = max_batch_size
        self.cache_dtype = KV_CACHE_DTYPES[kv_cache_dtype] or self.dtype
        self.fp8_kernel = fp8.select_kernel(self.device, self.dtype) if quantization == "fp8" else None
        self._load(model_path, seed, model)
        cuda = self.device.type == "cuda"
        free, per_position = free_memory(self.device), self.arch.kv_bytes_per_position(self.cache_dtype)
        self.shared_gpu = shared_gpu and cuda
        if self.shared_gpu:
            weights = sum(t.numel() * t.element_size() for t in self._weights.named.values())
            free = shared_plan_bytes(torch.cuda.mem_get_info(self.device)[1], weights)
        self.page_size, self.kv_pages = page_size, None
        needed = None        # the positions every request may need (a run's context_len), when known
        if page_size is not None:
            self.max_len, self.kv_pages = self._plan_pages(free, mem_fraction, per_position, max_context_len,
                                                           context_len)
        elif context_len is not None and max_context_len is None:
            needed = context_len if self._max_positions is None else min(context_len, self._max_positions)
            slots = plan_slots(free_bytes=free, mem_fraction=mem_fraction, max_slots=max_batch_size,
                               bytes_per_position=per_position, context_len=needed)
            if slots < max_batch_size:
                log.warning("kv_slots_reduced", slots=slots, asked=max_batch_size, context_len=needed,
                            hint="the KV cache holds this many sequences of context_len positions; the others "
                                 "queue for a free slot (raise --rollout-mem-fraction for more)")
                self.max_batch_size = max_batch_size = slots
        if page_size is None:
            self.max_len = plan_positions(
                free_bytes=free, mem_fraction=mem_fraction, slots=max_batch_size,
                bytes_per_position=per_position, model_limit=self._max_positions,
                max_context_len=max_context_len, workspace_bytes=self._workspace_bytes(), needed=needed)
        self._scratch = max_batch_size   # one extra cache slot that absorbs padding rows' writes
        self._state = _SlotState(max_batch_size + 1, self.device)
        self._snapshot = Snapshot(max_batch_size + 1, self.device)
        variant = (("_fp8" if self.quantization == "fp8" else "") + ("_kv8" if self.cache_dtype != self.dtype else "")
                   + ("_paged" if page_size is not None else ""))
        self._forward = Forward(self.arch, self._weights, compiled=torch_compile and cuda, variant=variant,
                                length_aware=attention_kernel and fast_attention.usable(self.arch.head_dim, self.dtype,
                                                                                        self.device))
        self._set_buckets()
        self._use_compiled(self._forward.compiled)
        self.moe_experts = self._pick_experts() if self._weights.moe is not None else None
        if cuda_graph and cuda and self.moe_experts == "loop":
            log.warning("moe_decode_eager", reason="the experts' per-expert loop reads its group sizes on the host "
                        "(not capturable); decode steps run eagerly, without CUDA graphs")
            cuda_graph = False
        self._graphs = DecodeGraphs(self._decode_forward, enabled=cuda_graph and cuda)
        self._cache: KVCache | None = None
        self.last_stats: dict = {}       # of the last generate call: decode steps, graphs, prefills, seconds
        self.resume_memory()
        self.compile_seconds = self._warm_up() if cuda else 0.0
        log.info("engine_ready", model=model_path, device=str(self.device), dtype=str(self.dtype),
                 slots=max_batch_size, max_len=self.max_len, kv_cache_gib=round(self._cache.nbytes / GiB, 2),
                 page_size=page_size, kv_pages=self.kv_pages,
                 cuda_graph=self._graphs.enabled, compiled=self._forward.compiled,
                 length_aware_attention=self._forward.length_aware, moe_experts=self.moe_experts,
                 quantization=quantization, fp8_kernel=self.fp8_kernel, kv_cache_dtype=str(self.cache_dtype))

    def _load(self, model_path: str, seed: int, model=None) -> None:
        # load on the CPU and copy fused tensors to the device: the device never holds two copies
        if model is None:
            model = load_causal_lm(model_path, device=torch.device("cpu"), dtype=self.dtype)
        elif model.dtype != self.dtype:
            raise ValueError(f"the model given is {model.dtype}, the engine's dtype {self.dtype}")
        self._tokenizer = load_tokenizer(model_path)
        self._eos_ids = _eos_ids(model, self._tokenizer)
        self.arch = Arch.from_config(model.config)
        self._vocab_size, self._max_positions = self.arch.vocab, self.arch.max_positions
        source = None
        if fp8.is_fp8_checkpoint(model_path) and self.quantization == "fp8":   # its e4m3 weights as they are
            source = fp8.read_checkpoint_tensors(model_path)
        self._weights = pack_weights(model, self.arch, self.device, fp8=self.quantization == "fp8",
                                     fp8_source=source)
        if self.quantization == "fp8" and self.device.type == "cuda":
            torch.cuda.empty_cache()   # the bf16 copies it replaced: the KV cache plan reads the driver's free memory
        del model
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._version = 0
        self._receiver: WeightReceiver | None = None   # bucketed updates, made at the first

    def _plan_pages(self, free: int, mem_fraction: float, per_position: int, max_context_len: int | None,
                    context_len: int | None) -> tuple[int, int]:
        """(max_len, pages) of a paged cache: a sequence's positions are the context cap, else the run's
        longest prompt + response, else the model's limit, else what the pages hold."""
        limit = self._max_positions
        if max_context_len is not None and limit is not None and max_context_len > limit:
            raise ValueError(f"--rollout-max-context-len {max_context_len} exceeds the model's {limit} positions")
        wanted = max_context_len if max_context_len is not None else context_len
        if wanted is not None and limit is not None:
            wanted = min(wanted, limit)
        pages = plan_pages(free_bytes=free, mem_fraction=mem_fraction, page=self.page_size,
                           bytes_per_position=per_position, max_len=wanted or self.page_size,
                           workspace_bytes=self._workspace_bytes())
        max_len = wanted or min(limit or (pages - 1) * self.page_size, (pages - 1) * self.page_size)
        # no more than every slot's sequence at max_len can use (and the sink)
        return max_len, min(pages, self.max_batch_size * -(-max_len // self.page_size) + 1)

    def _workspace_bytes(self) -> int:
        """Memory the KV cache must leave free (`workspace_bytes`) for a full batch and this engine's
        prefill size."""
        moe = self._weights.moe
        return workspace_bytes(rows=self.max_batch_size + 1, vocab=self.arch.vocab, hidden=self.arch.hidden,
                               intermediate=self.arch.intermediate, q_size=self.arch.q_size,
                               elem=torch.empty((), dtype=self.dtype).element_size(),
                               prefill_tokens=max(PREFILL_TOKENS, self.chunked_prefill_size),
                               moe=None if moe is None else (moe.top_k, moe.intermediate, moe.n_experts),
                               reserve=RESERVE_BYTES if self.device.type == "cuda" else 0)

    def _pick_experts(self) -> str:
        """"grouped" (one torch._grouped_mm per projection, capturable) where it runs and agrees with the
        per-expert loop on a probe through the first MoE layer; else "loop" (logged)."""
        from miles.rollout.engines.fast import moe as fast_moe

        w = self._weights
        reason = fast_moe.grouped_eligible(self.device, self.dtype, w.moe, self.arch.hidden)
        if reason is None:
            first = next(layer for layer in w.moe_layers if layer is not None)
            try:
                err = fast_moe.grouped_matches_loop(first, w.moe)
                if not err < GROUPED_TOLERANCE:
                    reason = f"a probe's grouped result differs from the loop's by {err:.3g} (relative)"
            except Exception as e:  # noqa: BLE001 - a kernel that does not run here leaves the loop, which is correct
                reason = f"torch._grouped_mm failed: {repr(e)[:500]}"
        if reason is None:
            self._forward.experts = fast_moe.experts_grouped
            return "grouped"
        self._forward.experts = fast_moe.experts_loop
        if self.device.type == "cuda":      # on the CPU the loop is the path, nothing to say
            log.info("moe_experts_loop", reason=reason)
        return "loop"

    def _set_buckets(self) -> None:
        """Decode batch buckets, and span buckets: one (the whole slot) when the attention kernel
        reads each sequence's own length, so only the batch size keys a graph."""
        self._batch_buckets = batch_buckets(self.max_batch_size)
        self._span_buckets = [self.max_len] if self._forward.length_aware else span_buckets(self.max_len)

    def _warm_up(self) -> float:
        """Check the attention kernel and compile the layer and sampling kernels now (for dynamic
        batch and span sizes), not in the first call. Both are optimisations of the same math: if
        one fails, log it and run the stock path. Returns the seconds spent."""
        t0 = time.perf_counter()
        if self._forward.length_aware and not self._attention_kernel_ok():
            self._forward.length_aware = False
            self._set_buckets()
        if self._forward.compiled:
            try:
                self._compile_shapes()
            except Exception as e:  # noqa: BLE001 - any compiler failure leaves the eager path, which is correct
                log.warning("torch_compile_failed", error=repr(e)[:2000], fallback="eager")
                self._use_compiled(False)
                self._graphs.clear()
        return time.perf_counter() - t0

    def _use_compiled(self, compiled: bool) -> None:
        """The layer pieces and the samplers' kernels, compiled (for this model and dtype) or eager."""
        self._forward.use_compiled(compiled)
        self._greedy, self._race = (tuple(_compiled(f, self.arch, self.dtype) for f in (greedy, race))
                                    if compiled else (greedy, race))

    def _attention_kernel_ok(self) -> bool:
        a = self.arch
        try:
            ok = fast_attention.matches_sdpa(a.n_kv_heads, a.group, a.head_dim, self.dtype, self.device,
                                             min(self.max_len, 8192) if self.page_size else self.max_len,
                                             cache_dtype=self.cache_dtype, page=self.page_size)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot build leaves the stock attention call
            log.warning("attention_kernel_failed", error=repr(e)[:2000], fallback="sdpa")
            return False
        if not ok:
            log.warning("attention_kernel_mismatch", fallback="sdpa")
        return ok

    @torch.inference_mode()
    def _compile_shapes(self) -> None:
        one = torch.ones((), device=self.device)
        spans = self._span_buckets[:2]
        for b, span in ((self._batch_buckets[-1], spans[0]), (2, spans[-1])):
            self._decode_forward(b, span)
            self._greedy(self._logits[:b])
            self._race(self._logits[:b], self._noise[:b].exponential_(), one)
        for n, p in ((2, 2), (3, 5)):   # built like a real prefill's inputs (the guards check strides too)
            ids, lens, _, slots = self._prefill_inputs([([self.pad_token_id] * p, 0, self._scratch)] * n)
            self._forward.prefill(ids, lens, slots, self._cache.layers, table=self._table)
            # a piece is one row (a size-1 batch dim: its own compiled variant, built here too)
            self._forward.prefill(ids[:1], lens[:1], slots[:1], self._cache.layers, starts=torch.zeros_like(lens[:1]),
                                  span=p, table=self._table)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- memory --------------------------------------------------------------------------------
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Free the KV cache, the logits/noise buffers and the decode graphs when `tags` names either
        (the weights stay whatever `tags` says: updates copy into them in place, which keeps the
        captured graphs valid), e.g. while a colocated trainer trains. Idempotent; `resume_memory`
        brings them back."""
        with self._holding():
            self._release(tags)

    def _release(self, tags: Sequence[str]) -> None:
        if self._cache is None or not _CACHE_TAGS & set(tags):
            return
        cuda = self.device.type == "cuda"
        expected = self._cache.nbytes if cuda else 0
        before = torch.cuda.memory_allocated(self.device) if cuda else 0
        self._graphs.clear()
        self._cache = self._logits = self._noise = self._forward.decode_routed = None
        # a full gc.collect() costs ~0.4 s in a process full of compiled code: run it only when dropping
        # the references did not free the cache (something in a reference cycle still holds it)
        collected = cuda and before - torch.cuda.memory_allocated(self.device) < expected
        if collected:
            gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        log.info("memory_released", gc_collect=collected)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Allocate what `release_memory` freed (same sizes as at construction) when `tags` names the
        KV cache or the graphs ("weights" alone: nothing to do, they stayed). Idempotent."""
        with self._holding():
            self._resume(tags)

    def _resume(self, tags: Sequence[str]) -> None:
        self._live_weights()
        if self._cache is not None or not _CACHE_TAGS & set(tags):
            return
        a, rows = self.arch, self.max_batch_size + 1
        try:
            if self.page_size is None:
                self._cache = KVCache(layers=a.n_layers, slots=rows, kv_heads=a.n_kv_heads, max_len=self.max_len,
                                      head_dim=a.head_dim, dtype=self.cache_dtype, device=self.device)
            else:
                self._cache = PagedKVCache(layers=a.n_layers, rows=rows, pages=self.kv_pages, page=self.page_size,
                                           kv_heads=a.n_kv_heads, max_len=self.max_len, head_dim=a.head_dim,
                                           dtype=self.cache_dtype, device=self.device)
            with torch.inference_mode():  # like every tensor a step makes (one set of compiled guards)
                self._logits = torch.empty((max(self._batch_buckets[-1], rows), a.vocab), dtype=self.dtype,
                                           device=self.device)
                self._noise = torch.empty((rows, a.vocab), dtype=torch.float32, device=self.device)
                moe = self._weights.moe
                if moe is not None:    # each decode step's experts, per slot and MoE layer (a graph writes it)
                    self._forward.decode_routed = torch.zeros((max(self._batch_buckets[-1], rows), len(moe.layers),
                                                               moe.top_k), dtype=torch.int16, device=self.device)
        except torch.cuda.OutOfMemoryError as e:
            self._cache = self._logits = self._noise = self._forward.decode_routed = None
            shared = "" if not self.shared_gpu else (
                " (it shares the GPU with a resident trainer: --rollout-mem-fraction is its share of the GPU's "
                "memory less its weights, and the trainer holds more than the rest)")
            size = (f"{self.max_batch_size} slots x {self.max_len} positions" if self.page_size is None else
                    f"{self.kv_pages} pages of {self.page_size} positions")
            raise ValueError(f"the engine's KV cache ({size}) "
                             f"does not fit in the memory free now{shared}; free memory first (a colocated trainer?) "
                             f"or lower --rollout-mem-fraction / --rollout-max-batch-size") from e

    @property
    def _table(self) -> Tensor | None:
        """A paged cache's page table (all rows), None for the slot layout."""
        return self._cache.table if self.page_size is not None else None

    # --- tokenizer accessors -------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self._tokenizer

    # --- weights -------------------------------------------------------------------------------
    def weight_version(self) -> int:
        """0 for the weights loaded from disk, then the version of the last `update_weights`."""
        return self._version

    def update_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Copy the trainer's `model_weights` dict (HF names, any device/dtype) into the engine's own
        tensors in place, so captured graphs stay valid. Names and shapes are checked strictly
        before anything is copied (ValueError naming them)."""
        with self._holding():
            self._load_weights(state_dict)
            self._version = int(version)
        log.info("weights_updated", version=self._version)

    def _load_weights(self, state_dict: Mapping[str, Tensor]) -> None:
        """Copy into the engine's tensors in place (the lock held): `update_weights`, and an in-flight swap
        (`EngineGuard.swap_weights`) between two decode steps, where the captured graphs, which read the
        weights by address, stay valid."""
        with torch.inference_mode():      # the engine's tensors may be inference tensors
            if self.quantization == "fp8":
                state_dict = fp8.as_quantized(state_dict, self.dtype)
            copy_checked(self._live_weights().named, state_dict)

    def load_weight_bucket(self, bucket: WeightBucket) -> int | None:
        """One bucket of a bucketed update (CUDA IPC, miles.weights.transport), copied in place into
        the engine's tensors (graphs stay valid); returns the version once its last bucket is in."""
        with self._holding(), torch.inference_mode():   # not under a generate (health and abort run beside it)
            if self._receiver is None:
                self._receiver = WeightReceiver(self._live_weights().named)
            version = self._receiver.load(bucket)
            if version is not None:
                self._version = version
        if version is not None:
            log.info("weights_updated", version=version, buckets=bucket.count)
        return version

    def _weights_checksum_locked(self) -> str:
        """`state_dict_checksum` of the weights under their HF names in the engine's dtype: the same
        as the embedded engine's for the same weights."""
        return state_dict_checksum(self._live_weights().named)

    def weights_dtype(self) -> torch.dtype:
        return self.dtype

    def _live_weights(self):
        if self._weights is None:
            raise EngineDisposedError("the engine was disposed; create a new FastEngine")
        return self._weights

    def dispose(self) -> None:
        """Free the weights, the KV cache, the graphs and the tokenizer. Idempotent. The actor is the run's."""
        self.abort()                    # a running call stops at its next step instead of holding the lock
        with self._holding():
            if self._weights is None:
                return
            self._release(MEMORY_TAGS)
            self._weights = self._forward = self._tokenizer = None
        if self.device.type == "cuda":      # see miles.rollout.engines.embedded.engine.EmbeddedEngine.dispose
            gc.collect()
            torch.cuda.empty_cache()

    # --- generation ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 max_new_tokens: Sequence[int] | None = None) -> list[Generation]:
        """One Generation per prompt, in order; all prompts are queued and served by continuous batching.
        `max_new_tokens` (one per prompt) caps each prompt's response; else `params.max_new_tokens`;
        `params.max_context_len` caps prompt + response (as the embedded engine). Requests with
        different caps share the decode batch (a multi-turn rollout's turns each have their own).
        `params.stop` strings end a response at the token that completes one (see the module).

        Randomness: the engine's generator (seeded at construction, advancing call after call), or
        a fresh one seeded with `params.seed` for this call only.

        `abort()` (on the actor's other thread) makes a running call return at its next step: the
        requests not finished end with "abort" and what they generated so far.
        """
        epoch = self._abort_epoch
        caps = [params.max_new_tokens] * len(prompts) if max_new_tokens is None else [int(c) for c in max_new_tokens]
        with self._holding():
            self._live_weights()
            if self._cache is None:
                raise RuntimeError("the engine's memory is released; call resume_memory() before generate()")
            self._check(prompts, params, caps)
            if not prompts:
                return []
            return self._generate(prompts, params, [_budget(params, len(p), c) for p, c in zip(prompts, caps)], epoch)

    def _probe_ready(self) -> bool:
        return self._weights is not None and self._cache is not None   # released for a trainer: nothing to run

    def _probe(self) -> None:
        self._generate([[self.eos_token_id]], SamplingParams(temperature=0.0, max_new_tokens=1), [1], self._abort_epoch)

    def _generate(self, prompts: list[list[int]], params: SamplingParams, caps: list[int],
                  epoch: int) -> list[Generation]:
        gen = self._generator if params.seed is None else \
            torch.Generator(device=self.device).manual_seed(params.seed)
        version = self._version
        t0 = time.perf_counter()
        with torch.inference_mode():  # every tensor a step sees is an inference tensor: one set of compiled guards
            sampler = make_sampler(params, self._noise, gen, fused_greedy=self._greedy, fused_race=self._race)
            is_stop = stop_table(self._eos_ids | set(params.stop_token_ids), self._vocab_size, self.device)
            moe = self._weights.moe
            out = CallOutputs(len(prompts), max(caps), self.device,
                              None if moe is None else (len(moe.layers), moe.top_k, moe.n_experts))
            watch = _StopWatch(_StopStrings(self._tokenizer, params.stop), len(prompts)) if params.stop else None
            # SamplingParams.tail_cut_share of the batch: the call's requests, or the slots when fewer
            tail_cut = int(params.tail_cut_share * min(len(prompts), self.max_batch_size))
            call = _Call(prompts, caps, sampler, is_stop, out, watch, params.min_new_tokens, tail_cut)
            steps = self._run(call, epoch)
            tokens, logprobs, lengths, reasons = out.to_host()
        if watch is not None:
            watch.finish(tokens, lengths, reasons)
        t_routed = time.perf_counter()
        routed = out.routed_to_host(lengths) or [None] * len(prompts)
        t_routed = time.perf_counter() - t_routed
        self.last_stats = dict(decode_steps=steps, graphs=len(self._graphs), prefills=call.prefills,
                               prefill_pieces=call.pieces, seconds=time.perf_counter() - t0,
                               routing_to_host_seconds=t_routed, fp8_kernel=self.fp8_kernel,
                               kv_cache_dtype=str(self.cache_dtype), preemptions=call.preemptions)
        if call.preemptions:
            log.info("kv_preemptions", preempted=call.preemptions, requests=len(prompts), pages=self.kv_pages,
                     hint="the paged KV cache ran out of pages: the newest sequences were prefilled again later "
                          "(more --rollout-mem-fraction or a lower --rollout-max-batch-size avoids it)")
        gens = [Generation(t[:n], lp[:n], _FINISH.get(r, "abort"), version, e)
                for t, lp, n, r, e in zip(tokens, logprobs, lengths, reasons, routed)]
        if call.swaps:      # weights swapped in flight: each request's tokens by the version that gave them
            for req, g in enumerate(gens):
                if req in call.started and g.response_ids:
                    versions = call.token_versions(req, len(g.response_ids), version)
                    g.weight_version = versions[0]      # its oldest (the embedded engine's: the call's)
                    g.token_versions = versions if len(set(versions)) > 1 else None
            self.last_stats["swaps"] = [v for _, v in call.swaps]
        return gens

    def _check(self, prompts: list[list[int]], params: SamplingParams, caps: list[int]) -> None:
        # the embedded engine's checks and messages (it reads only _vocab_size and _max_positions)
        EmbeddedEngine._check(self, prompts, params, caps)
        for i, (p, cap) in enumerate(zip(prompts, caps)):
            budget = _budget(params, len(p), cap)
            if len(p) + budget > self.max_len:
                raise ValueError(
                    f"bad generate request: prompt {i} ({len(p)} tokens) + max_new_tokens "
                    f"{budget} exceeds the KV cache's {self.max_len} positions per slot; "
                    f"shorten the prompt (--max-prompt-len) or the response (--rollout-max-response-len, "
                    f"or cap both with --rollout-max-context-len), or raise --rollout-mem-fraction")

    def _run(self, call: _Call, epoch: int) -> int:
        """The continuous-batching loop; returns the number of decode steps. It returns early when
        `abort()` changed the epoch the call started under (the unfinished requests keep reason 0)."""
        paged = self._cache if self.page_size is not None else None
        table = _Slots(self.max_batch_size, on_free=None if paged is None else paged.release)
        self._state.reset(spare=len(call.prompts))
        if paged is not None:
            paged.reset()
        queue, step, pending = deque(range(len(call.prompts))), 0, False
        while True:
            self._heartbeat = time.monotonic()
            if self._abort_epoch != epoch:
                return step
            # a token boundary for every running sequence (its last token sampled, not fed back yet): a
            # pending in-flight swap loads here, and every forward from this step on is the new version's
            if self._swap is not None and self._take_swap(paused=table.busy()):
                call.swaps.append((step, self._version))
            checkpoint = step % CHECK_EVERY == SNAPSHOT_LAG
            if pending and checkpoint:
                active, newest = self._snapshot.read()
                if call.watch is not None:
                    self._stop_strings(table, call, newest)
                table.finish(active, self._snapshot.step)
                pending = False
            table.expire(step)
            if queue and table.busy() < table.n and (checkpoint or not table.running):
                if not self._refill(table, queue, step, call) and not table.busy():
                    raise RuntimeError("the paged KV cache admitted no request with nothing running (a bug: "
                                       "its plan holds one sequence of max_len positions)")
                table.expire(step)   # requests with max_new_tokens 1 are done at their prefill
            if table.filling:        # one piece of a long prompt per decode step of the others
                self._piece(table, step, call)
                table.expire(step)
            if not table.running:
                if table.filling or queue:   # pieces to prefill, or requests behind ones done at their prefill
                    continue
                return step
            if len(table.running) <= call.tail_cut and not queue and not table.filling:
                return step          # the tail cut: the few still running end "abort" with what they have
            if checkpoint and not queue and not table.filling:
                self._compact(table, step)
            if paged is not None:
                if step % GROW_EVERY == 0:
                    self._grow(table, queue, step, call)
                    if not table.running:
                        continue     # all preempted but one being filled: its pieces go on
                paged.flush()
            if not pending and step % CHECK_EVERY == 0:
                newest = None if call.watch is None else call.watch.newest(self._state, call.out)
                self._snapshot.take(self._state.active, step, newest)
                pending = True
            self._decode(table, step, call)
            step += 1

    def _decode(self, table: _Slots, step: int, call: _Call) -> None:
        b = bucket(table.top(), self._batch_buckets)
        self._graphs.run(b, bucket(table.span(step), self._span_buckets))
        st = self._state
        logits = self._logits[:b]
        if call.min_new_tokens:
            bar_stops(logits, st.ngen[:b] < call.min_new_tokens, call.is_stop)
        tokens, logprobs = call.sampler(logits)
        routed = None if self._forward.decode_routed is None else self._forward.decode_routed[:b]
        still, n = advance(tokens, logprobs, st.active[:b], st.req[:b], st.ngen[:b], call.out, call.is_stop,
                           call.cap_table, routed)
        st.pos[:b] += still
        st.active[:b] = still
        st.ngen[:b] = n
        st.cur_tok[:b] = tokens

    def _decode_forward(self, b: int, span: int) -> None:
        """The graph-captured part of a decode step: static buffers in, logits [b, V] out."""
        table = self._table
        self._forward.decode(self._state.cur_tok[:b], self._state.pos[:b], span, self._cache.layers,
                             self._logits[:b], None if table is None else table[:b])

    def _refill(self, table: _Slots, queue: deque, step: int, call: _Call) -> int:
        """Start queued requests in the free slots: prefill, in length-sorted chunks, and first tokens.
        A prompt longer than `chunked_prefill_size` only takes its slot here; `_piece` prefills it.
        A paged cache admits requests in queue order while their prompts' pages fit beside a page of
        headroom for each sequence that will still grow (the first that does not waits, and those behind it).
        Returns the number of requests started."""
        free = table.free()[:len(queue)]
        if self.page_size is None:
            admitted = [(queue.popleft(), s) for s in free]
        else:
            cache, admitted = self._cache, []
            growing = sum(cache.short_of(s, q.prompt_len + q.cap - 1) for s, q in table.running.items()) \
                + len(table.filling)
            for slot in free:
                req = queue[0]
                prompt = len(call.prompt_of(req))
                last = prompt + call.caps[req] - call.done(req) - 1     # the positions it ends with
                need = min(prompt + GROW_EVERY, last)
                if cache.free_pages - cache.pages_for(need) < growing:
                    break
                admitted.append((queue.popleft(), slot))
                cache.grow(slot, need)
                growing += cache.short_of(slot, last)
                if not queue:
                    break
            cache.flush()
        pairs = sorted(admitted, key=lambda rs: len(call.prompt_of(rs[0])))
        chunk: list[tuple[int, int]] = []
        for req, slot in pairs:  # sorted by length: this prompt is the chunk's widest
            if len(call.prompt_of(req)) > self.chunked_prefill_size:
                table.fill(req, slot)
                # decode steps feed every slot below the batch's top, idle ones too: this one's
                # write goes to the next piece's first position, which that piece overwrites
                self._state.pos[slot] = 0
                continue
            if chunk and len(call.prompt_of(req)) * (len(chunk) + 1) > PREFILL_TOKENS:
                self._prefill(chunk, call)
                chunk = []
            chunk.append((req, slot))
            self._start(table, slot, step, req, call)
        if chunk:
            self._prefill(chunk, call)
        return len(admitted)

    def _start(self, table: _Slots, slot: int, step: int, req: int, call: _Call) -> None:
        """Request `req` runs in `slot` from `step` (its first token, or its first after a preemption)."""
        done = call.done(req)
        table.start(slot, len(call.prompt_of(req)), step, req, call.caps[req] - done)
        call.started.setdefault(req, []).append((step, done))

    def _prefill(self, chunk: list[tuple[int, int]], call: _Call) -> None:
        rows = [(call.prompt_of(r), r, s) for r, s in chunk]
        if len(rows) == 1:  # a second row in the scratch slot: no size-1 dims (compiled kernels stay generic)
            rows.append(([self.pad_token_id], len(call.prompts), self._scratch))
        ids, lens, reqs, slots = self._prefill_inputs(rows)
        call.prefills += 1
        logits = self._forward.prefill(ids, lens, slots, self._cache.layers, table=self._table)
        self._first_tokens(logits, reqs, slots, lens, call, self._forward.prefill_routed, call.generated(rows))

    def _piece(self, table: _Slots, step: int, call: _Call) -> None:
        """Prefill the next piece of the first long prompt being filled: its queries attend to the
        earlier pieces' K/V in its slot. The last piece samples the first token and starts the slot."""
        req, slot, done = table.filling[0]
        prompt = call.prompt_of(req)
        size = min(self.chunked_prefill_size, len(prompt) - done)
        # one row, no scratch row padded to its width (that would double a piece's work); a 1-token
        # last piece is padded to 2 (no size-1 length dim), its pad's K/V written at the first decode
        # position, which that decode step overwrites before any query reads it
        rows = [(prompt[done:done + size], req, slot), ([self.pad_token_id], len(call.prompts), self._scratch)]
        ids, lens, reqs, slots = self._prefill_inputs(rows)
        starts = _to_device(torch.tensor([done, 0], dtype=torch.long), self.device)
        logits = self._forward.prefill(ids[:1], lens[:1], slots[:1], self._cache.layers, starts=starts[:1],
                                       span=done + ids.shape[1], table=self._table)
        call.pieces += 1
        done += size
        if done < len(prompt):
            table.filling[0][2] = done
            self._state.pos[slot] = done
            return
        table.filling.popleft()
        # the sampler sees two rows, the second (the scratch slot's) a copy: its kernels keep no size-1 dim
        routed = self._forward.prefill_routed
        if routed is not None:
            routed = routed.expand(2, *routed.shape[1:])
        self._first_tokens(logits.expand(2, -1).contiguous(), reqs, slots, starts + lens, call, routed,
                           call.generated(rows))
        self._start(table, slot, step, req, call)

    def _first_tokens(self, logits: Tensor, reqs: Tensor, slots: Tensor, lens: Tensor, call: _Call,
                      routed: Tensor | None = None, done: list[int] | None = None) -> None:
        """Sample the first token of each prefilled row (prompt lengths `lens`) and start its slot
        (`routed` [rows, MoE layers, k]: an MoE model's experts of each row's last prompt position;
        `done`: the tokens each row's request had generated before (a preempted one's, else 0))."""
        st = self._state
        ngen = torch.zeros_like(reqs) if not any(done or ()) else _to_device(torch.tensor(done), self.device)
        st.req[slots], st.ngen[slots], st.pos[slots] = reqs, ngen, lens
        if call.min_new_tokens:     # a first token is never a stop under min_new_tokens >= 1
            bar_stops(logits, ngen < call.min_new_tokens, call.is_stop)
        tokens, logprobs = call.sampler(logits)
        still, n = advance(tokens, logprobs, slots != self._scratch, reqs, ngen, call.out,
                           call.is_stop, call.cap_table, routed)
        st.active[slots], st.ngen[slots], st.cur_tok[slots] = still, n, tokens

    def _prefill_inputs(self, rows: list[tuple[list[int], int, int]]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(prompt, request, slot) rows -> ids [n, P] right-padded, lens, reqs, slots [n], on the device."""
        width = max(2, max(len(p) for p, _, _ in rows))
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        for i, (p, _, _) in enumerate(rows):
            ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        meta = torch.tensor([[len(p), r, s] for p, r, s in rows], dtype=torch.long)
        ids, meta = _to_device(ids, self.device), _to_device(meta, self.device)
        lens, reqs, slots = meta.unbind(1)
        return ids, lens, reqs, slots

    def _stop_strings(self, table: _Slots, call: _Call, newest: Tensor) -> None:
        """Check the snapshot's newest tokens for stop strings; free the slots of the requests cut."""
        def fetch(req: int, start: int, end: int) -> list[int]:   # tokens no snapshot brought (a sync)
            return call.out.tokens[req, start:end].tolist()

        for req in call.watch.check(newest, len(call.prompts), fetch):
            slot = table.slot_of(req)
            if slot is not None:            # still running: stop it on the device, its slot is free now
                self._state.active[slot] = False
                table.drop(slot)

    def _compact(self, table: _Slots, step: int) -> None:
        """Move busy slots into free lower ones when that lets the decode batch bucket shrink."""
        busy = len(table.running)
        if not busy or bucket(table.top(), self._batch_buckets) <= bucket(busy, self._batch_buckets):
            return
        movers = sorted(s for s in table.running if s >= busy)
        holes = [s for s in range(busy) if s not in table.running]
        self._cache.move(movers, holes, table.span(step))   # a paged cache moves table rows, not K/V
        src, dst = (_to_device(torch.tensor(x, dtype=torch.long), self.device) for x in (movers, holes))
        self._state.move(src, dst)
        table.move(movers, holes)


    def _grow(self, table: _Slots, queue: deque, step: int, call: _Call) -> None:
        """Give each running sequence the pages its next GROW_EVERY decode steps write, oldest first;
        when too few are free, preempt the newest running sequence (it goes back to the queue's front
        with what it generated) until they suffice."""
        cache, last = self._cache, step + GROW_EVERY - 1
        for slot, q in sorted(table.running.items(), key=lambda sq: (sq[1].start, sq[0])):
            # the decode step t writes position prompt_len + t - start; the last is at t = start + cap - 2
            need = q.prompt_len + min(last - q.start, q.cap - 2) + 1
            while slot in table.running and not cache.grow(slot, need):
                self._preempt(table, queue, max(table.running, key=lambda s: (table.running[s].start, s)), call)

    def _preempt(self, table: _Slots, queue: deque, slot: int, call: _Call) -> None:
        """Free `slot`'s pages; its request, still generating, goes back to the front of the queue, to be
        prefilled again with its prompt and the tokens it has (its outputs so far stay). A sync: rare."""
        q, st = table.running[slot], self._state
        active, generated = (int(v) for v in torch.stack([st.active[slot].long(), st.ngen[slot]]).tolist())
        table.drop(slot)
        if not active:          # it had ended on the device (a stop token or its cap): nothing to resume
            return
        st.active[slot] = False
        call.resume(q.req, call.out.tokens[q.req, :generated].tolist())
        queue.appendleft(q.req)
        log.debug("kv_preempted", request=q.req, generated=generated, free_pages=self._cache.free_pages)


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    """Host -> device without waiting for the GPU's queue (pinned staging on CUDA)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _compiled(fn, arch: Arch, dtype: torch.dtype):
    """`compile_for(fn, arch, dtype)` with the leading (batch) dimension of its tensor arguments dynamic."""
    compiled = compile_for(fn, arch, dtype)

    def call(*args):
        for a in args:
            if isinstance(a, Tensor) and a.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args)

    return call


class _Call:
    """What one generate call's steps share."""

    def __init__(self, prompts: list[list[int]], caps: list[int], sampler: Sampler, is_stop: Tensor,
                 out: CallOutputs, watch: _StopWatch | None = None, min_new_tokens: int = 0, tail_cut: int = 0):
        self.prompts, self.caps, self.sampler, self.is_stop, self.out = prompts, caps, sampler, is_stop, out
        self.watch, self.min_new_tokens, self.tail_cut = watch, min_new_tokens, tail_cut
        # each request's max_new_tokens on the device, and the spare row's (never reached: idle slots)
        self.cap_table = _to_device(torch.tensor([*caps, max(caps)], dtype=torch.long), out.lengths.device)
        self.prefills = 0   # prefill forwards of whole prompts (a batch each)
        self.pieces = 0     # prefill forwards of pieces of long prompts
        # request -> (step, tokens it had) of each start: its first token's prefill, and a prefill again
        # after each preemption (a paged cache's)
        self.started: dict[int, list[tuple[int, int]]] = {}
        self.swaps: list[tuple[int, int]] = []      # (step, version): in-flight swaps taken during the call
        self.resumed: dict[int, list[int]] = {}     # preempted request -> its prompt + the tokens it had
        self.preemptions = 0

    def prompt_of(self, req: int) -> list[int]:
        """What request `req`'s next prefill feeds: its prompt, and after a preemption the tokens it had."""
        return self.resumed.get(req, self.prompts[req])

    def done(self, req: int) -> int:
        """The tokens request `req` had generated at its last preemption (0 if never preempted, and for the
        scratch row's spare request)."""
        return len(self.resumed[req]) - len(self.prompts[req]) if req in self.resumed else 0

    def generated(self, rows: list[tuple[list[int], int, int]]) -> list[int]:
        """The tokens each (prompt, request, slot) row's request had generated (0 but after a preemption)."""
        return [self.done(req) for _, req, _ in rows]

    def resume(self, req: int, tokens: list[int]) -> None:
        """Request `req` was preempted having generated `tokens`: its next prefill feeds them after its prompt."""
        self.resumed[req] = self.prompts[req] + tokens
        self.preemptions += 1

    def token_versions(self, req: int, n: int, version: int) -> list[int]:
        """The version of each of request `req`'s first `n` tokens (`version`: the call's at its start).
        A start at step s with d tokens generated before it (0, or a preempted request's) gives token d
        from that prefill and token j > d from the decode step s + j - d - 1; a swap taken at step t is the
        version of every forward of steps >= t."""
        out, starts = [], self.started[req]
        for j in range(n):
            s, d = next((s, d) for s, d in reversed(starts) if d <= j)
            at, v = s + max(j - d - 1, 0), version
            for t, new in self.swaps:
                if t <= at:
                    v = new
            out.append(v)
        return out


class _StopWatch:
    """Stop strings of one call, checked on the host. `newest` (on the device, at each snapshot) gathers
    each slot's request, token count and newest STOP_WINDOW tokens; `check` (when the snapshot is read)
    adds the tokens not seen yet to each request's host copy and finds the requests whose text reached a
    stop string; `finish` checks what no snapshot saw and cuts the outputs."""

    def __init__(self, stops: _StopStrings, requests: int):
        self.stops = stops
        self.seen: list[list[int]] = [[] for _ in range(requests)]   # each request's tokens checked so far
        self.cut: dict[int, int] = {}                                # request -> its length, cut at a stop string
        self._columns: Tensor | None = None

    def newest(self, state: _SlotState, out: CallOutputs) -> Tensor:
        """[slots, 2 + STOP_WINDOW] on the device: request, tokens generated, then the newest tokens (the
        first ones repeated while a request has fewer)."""
        if self._columns is None:
            self._columns = torch.arange(STOP_WINDOW, device=state.ngen.device) - STOP_WINDOW
        cols = (state.ngen[:, None] + self._columns).clamp(min=0)
        return torch.cat([state.req[:, None], state.ngen[:, None], out.tokens[state.req[:, None], cols]], dim=1)

    def check(self, newest: Tensor, spare: int, fetch) -> list[int]:
        """The requests cut by this snapshot's tokens. `fetch(req, start, end)` reads tokens from the
        device that fell out of the window (not expected: the window outlasts a check's steps)."""
        cut = []
        for req, n, *window in newest.tolist():
            if req == spare or req in self.cut or n <= len(self.seen[req]):
                continue
            seen, start = self.seen[req], len(self.seen[req])
            if start < n - STOP_WINDOW:
                seen.extend(fetch(req, start, n))
            else:
                seen.extend(window[STOP_WINDOW - n + start:])
            k = self.stops.first_hit(seen, start, n)
            if k is not None:
                self.cut[req] = k + 1
                cut.append(req)
        return cut

    def finish(self, tokens: list[list[int]], lengths: list[int], reasons: list[int]) -> None:
        """Check each request's tokens no snapshot saw, and cut every request that hit a stop string
        (in place: its length, and STOP as its reason)."""
        for req, (ids, n) in enumerate(zip(tokens, lengths)):
            if req not in self.cut:
                k = self.stops.first_hit(ids, len(self.seen[req]), n)
                if k is not None:
                    self.cut[req] = k + 1
        for req, n in self.cut.items():
            lengths[req], reasons[req] = n, STOP


class _SlotState:
    """Per-slot decode state on the device [slots]: what the graphs and `advance` read and write."""

    def __init__(self, slots: int, device: torch.device):
        def zeros(dtype):
            return torch.zeros(slots, dtype=dtype, device=device)

        self.pos = zeros(torch.long)      # where the next fed token goes (= tokens in the cache)
        self.cur_tok = zeros(torch.long)  # the token to feed next
        self.active = zeros(torch.bool)   # still generating
        self.req = zeros(torch.long)      # the request served (the outputs' spare row when none)
        self.ngen = zeros(torch.long)     # tokens generated so far

    def reset(self, spare: int) -> None:
        self.active.zero_()
        self.req.fill_(spare)
        self.ngen.zero_()

    def move(self, src: Tensor, dst: Tensor) -> None:
        for t in (self.pos, self.cur_tok, self.active, self.req, self.ngen):
            t[dst] = t[src]
        self.active[src] = False


class _Seq(NamedTuple):
    prompt_len: int
    start: int      # the step it started at (its prefill's)
    req: int
    cap: int        # its max_new_tokens


class _Slots:
    """The host's view of the slots: which request's sequence is where, and bounds on its length
    (exact while it runs; it may have stopped on the device already)."""

    def __init__(self, n: int, on_free=None):
        self.n = n
        self.running: dict[int, _Seq] = {}           # slot -> the sequence in it
        self.filling: deque[list[int]] = deque()     # [request, slot, tokens prefilled] of long prompts
        self._on_free = on_free                      # called with each slot its sequence leaves (a paged cache's)

    def free(self) -> list[int]:
        taken = set(self.running) | {slot for _, slot, _ in self.filling}
        return [s for s in range(self.n) if s not in taken]

    def busy(self) -> int:
        return len(self.running) + len(self.filling)

    def fill(self, req: int, slot: int) -> None:
        """`slot` is taken by a long prompt, prefilled piece by piece before it runs."""
        self.filling.append([req, slot, 0])

    def start(self, slot: int, prompt_len: int, step: int, req: int, cap: int) -> None:
        self.running[slot] = _Seq(prompt_len, step, req, cap)

    def expire(self, step: int) -> None:
        """Drop sequences that reached their cap: the first token comes from the prefill, so the last
        decode step of one started at `start` is start + cap - 2."""
        for s in [s for s, q in self.running.items() if q.start + q.cap - 2 < step]:
            self.drop(s)

    def finish(self, active: list[bool], snapshot_step: int) -> None:
        """Drop sequences the device had stopped at `snapshot_step` (not those started since)."""
        for s in [s for s, q in self.running.items() if q.start <= snapshot_step and not active[s]]:
            self.drop(s)

    def slot_of(self, req: int) -> int | None:
        return next((s for s, q in self.running.items() if q.req == req), None)

    def drop(self, slot: int) -> None:
        del self.running[slot]
        if self._on_free is not None:
            self._on_free(slot)

    def top(self) -> int:
        return max(self.running) + 1

    def span(self, step: int) -> int:
        """Cache positions the next decode step attends over, at most (the longest busy sequence)."""
        return max(min(q.prompt_len + step - q.start, q.prompt_len + q.cap - 2) + 1 for q in self.running.values())

    def move(self, src: list[int], dst: list[int]) -> None:
        for s, d in zip(src, dst):
            self.running[d] = self.running.pop(s)
