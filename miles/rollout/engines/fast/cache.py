"""The fast engine's memory: the KV cache plan and tensor, shape buckets, and captured decode graphs.

Layout: one tensor [2, layers, slots, kv_heads, max_len, head_dim] allocated once (per slot, not
paged). A slot holds one sequence at positions 0..max_len-1, so decode attention reads a plain
strided slice `cache[:B, :, :L]` with no page-table gather: it runs as one stock attention kernel,
is captured in a CUDA graph as is, and the same code runs on CPU in CI. The price is memory
reserved up to max_len for every slot, so max_len is bounded by what fits (`plan_positions`);
RL rollouts know their prompt and response limits, which is what max_len should be: given them
(`context_len`), the engine runs as many slots as hold that many positions each (`plan_slots`),
so long answers lower the slot count (sequences queue for a free slot) instead of being refused.

Paged (`--rollout-page-size`, SGLang's --page-size): `PagedKVCache`, one tensor [2, layers, pages,
kv_heads, page, head_dim] and a page table [slots, pages per sequence] on the device. A sequence holds
pages for the positions it has reached (plus a few steps ahead), not for max_len, so as many sequences
run as the batch size allows while their K/V fits, and a long-answer rollout no longer runs in waves of
slots sized for the longest answer; when the pages run out the engine preempts the newest sequence and
prefills it again later (`miles.rollout.engines.fast.engine`). Page 0 is a sink: rows of the table no
sequence owns point at it, so the writes of idle slots and of padding land there, never in a page
another sequence holds.

Decode steps run over the first B slots (B a batch bucket >= the highest busy slot) and attend
over the first L positions (L a span bucket >= the longest busy sequence), so one graph per
(B, L) serves many steps; the engine keeps busy slots low (refills fill the lowest free slot
first, and the tail is compacted) so B shrinks as sequences finish.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable

import structlog
import torch
from torch import Tensor

log = structlog.get_logger().bind(role="engine", engine="fast")

GiB = 1 << 30
PREFILL_TOKENS = 8192    # padded prompt tokens per prefill forward (bounds its activations)
RESERVE_BYTES = GiB // 2  # CUDA context, cuBLAS workspaces, graph pools
MIN_POSITIONS = 16       # a cache that holds fewer positions per slot is surely a misconfiguration
POSITION_ALIGN = 64      # automatic max_len is rounded down to this (aligned cache rows)


def free_memory(device: torch.device) -> int:
    """Bytes free on `device` now (CUDA: the driver's count; CPU: available physical memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def workspace_bytes(*, rows: int, vocab: int, hidden: int, intermediate: int, q_size: int, elem: int,
                    prefill_tokens: int, moe: tuple[int, int, int] | None = None, reserve: int = 0) -> int:
    """Memory the KV cache must leave free: logits, noise and sampling temporaries for `rows` rows, one
    prefill's activations (`prefill_tokens` tokens: a batch of whole prompts or a piece of a long one),
    an MoE model's sorted copies of each (token, expert) pair (`moe`: top-k, the experts' intermediate
    size, experts), and a fixed `reserve` (CUDA context, cuBLAS workspaces, graph pools)."""
    sampling = rows * vocab * (elem + 4 * 4)
    prefill = prefill_tokens * (3 * intermediate + 6 * hidden + 3 * q_size) * elem
    if moe is not None:
        top_k, moe_intermediate, n_experts = moe
        prefill += prefill_tokens * top_k * (3 * moe_intermediate + 3 * hidden) * elem + prefill_tokens * n_experts * 4
    return sampling + prefill + reserve


def shared_plan_bytes(total_bytes: int, weight_bytes: int) -> int:
    """The memory an engine sharing its GPU with a resident trainer (--colocate --no-offload-rollout) plans
    its KV cache from, in place of what is free when it starts (which depends on how far the trainer has
    got): the GPU's total less its own weights. The cache takes --rollout-mem-fraction of it, the trainer
    what the engine leaves (`shared_held_bytes`)."""
    return max(0, total_bytes - weight_bytes)


def shared_held_bytes(*, total_bytes: int, weight_bytes: int, mem_fraction: float, workspace: int) -> int:
    """What an engine sharing its GPU holds beside its weights: its KV cache and its workspace."""
    return int(shared_plan_bytes(total_bytes, weight_bytes) * mem_fraction) + workspace


def cache_budget(free_bytes: int, mem_fraction: float, workspace_bytes: int) -> int:
    """The KV cache's bytes: mem_fraction of free memory. Raises ValueError, naming the flags, when the
    rest cannot hold the workspace."""
    budget = int(free_bytes * mem_fraction)
    if free_bytes - budget < workspace_bytes:
        raise ValueError(
            f"--rollout-mem-fraction {mem_fraction} leaves {(free_bytes - budget) / GiB:.2f} GiB of the "
            f"{free_bytes / GiB:.2f} GiB free for activations and logits, which need about "
            f"{workspace_bytes / GiB:.2f} GiB; lower --rollout-mem-fraction or --rollout-max-batch-size")
    return budget


def plan_positions(*, free_bytes: int, mem_fraction: float, slots: int, bytes_per_position: int,
                   model_limit: int | None, max_context_len: int | None, workspace_bytes: int,
                   needed: int | None = None) -> int:
    """Positions per slot (max_len) of a KV cache of `slots` sequences in mem_fraction of free memory.

    max_context_len None: as many as fit, capped at the model's limit, rounded down to POSITION_ALIGN but
    never below `needed` (the positions every request may need, which `plan_slots` made fit). Raises
    ValueError, naming the flags, when the asked-for cache or the workspace left beside it does not fit.
    """
    budget = cache_budget(free_bytes, mem_fraction, workspace_bytes)
    fit = budget // (slots * bytes_per_position)
    if max_context_len is not None:
        if max_context_len < 2:
            raise ValueError(f"--rollout-max-context-len must be >= 2 (a prompt token and an answer), "
                             f"got {max_context_len}")
        if model_limit is not None and max_context_len > model_limit:
            raise ValueError(f"--rollout-max-context-len {max_context_len} exceeds the model's "
                             f"{model_limit} positions")
        if max_context_len > fit:
            need = slots * max_context_len * bytes_per_position
            raise ValueError(
                f"a KV cache for --rollout-max-batch-size {slots} x --rollout-max-context-len "
                f"{max_context_len} needs {need / GiB:.2f} GiB, but --rollout-mem-fraction {mem_fraction} "
                f"of the {free_bytes / GiB:.2f} GiB free is {budget / GiB:.2f} GiB (fits {fit} positions "
                f"per slot); lower the batch size or the context length, or raise the fraction")
        return max_context_len
    n = fit if model_limit is None else min(fit, model_limit)
    if n < MIN_POSITIONS:
        raise ValueError(
            f"--rollout-mem-fraction {mem_fraction} of the {free_bytes / GiB:.2f} GiB free holds only {n} "
            f"positions per slot for --rollout-max-batch-size {slots}; raise the fraction or lower the batch size")
    aligned = n - n % POSITION_ALIGN
    return n if n == model_limit or n < POSITION_ALIGN or aligned < (needed or 0) else aligned


def plan_slots(*, free_bytes: int, mem_fraction: float, max_slots: int, bytes_per_position: int,
               context_len: int) -> int:
    """Slots (sequences decoded at once) whose K/V of `context_len` positions each fit in
    mem_fraction of free memory, at most `max_slots`: admission by K/V memory. A long-answer run
    whose every sequence cannot hold `context_len` positions in `max_slots` slots runs fewer slots
    (the others queue and start as slots free up) instead of having its requests refused.
    Raises ValueError, naming the flags, when not even one sequence fits."""
    budget = int(free_bytes * mem_fraction)
    fit = budget // (context_len * bytes_per_position)
    if fit < 1:
        raise ValueError(
            f"one sequence of {context_len} positions (--max-prompt-len + --rollout-max-response-len) needs "
            f"{context_len * bytes_per_position / GiB:.2f} GiB of KV cache, more than --rollout-mem-fraction "
            f"{mem_fraction} of the {free_bytes / GiB:.2f} GiB free ({budget / GiB:.2f} GiB); raise the fraction or "
            f"shorten the prompts or responses")
    return min(max_slots, fit)


def plan_pages(*, free_bytes: int, mem_fraction: float, page: int, bytes_per_position: int, max_len: int,
               workspace_bytes: int) -> int:
    """Pages of `page` positions in mem_fraction of free memory, the sink page included. Raises ValueError,
    naming the flags, when the workspace left beside them does not fit or they cannot hold one sequence of
    `max_len` positions."""
    budget = cache_budget(free_bytes, mem_fraction, workspace_bytes)
    pages = budget // (page * bytes_per_position)
    if (pages - 1) * page < max_len:
        raise ValueError(
            f"--rollout-mem-fraction {mem_fraction} of the {free_bytes / GiB:.2f} GiB free holds "
            f"{max(pages - 1, 0) * page} positions of K/V in pages of {page} (--rollout-page-size), less than one "
            f"sequence of {max_len} (--max-prompt-len + --rollout-max-response-len, or --rollout-max-context-len); "
            f"raise the fraction or shorten the prompts or responses")
    return pages


def batch_buckets(slots: int) -> list[int]:
    """Decode batch sizes that get a graph: powers of two and their midpoints, capped at `slots`.

    Never 1: a compiled step specialises size-1 dimensions, and one spare slot costs nothing.
    """
    sizes = {2, 4}
    b = 8
    while b < slots:
        sizes |= {b, b + b // 2}
        b *= 2
    top = max(slots, 2)
    return sorted({min(s, top) for s in sizes} | {top})


def span_buckets(max_len: int) -> list[int]:
    """Attention spans that get a graph: 64, 96, 128, 192, ... (at most a third read in vain), up to max_len."""
    spans, s = set(), 64
    while s < max_len:
        spans |= {s, s + s // 2}
        s *= 2
    return sorted({min(x, max_len) for x in spans} | {max_len})


def bucket(n: int, buckets: list[int]) -> int:
    return buckets[bisect.bisect_left(buckets, n)]


class KVCache:
    """K and V of `slots` sequences, all layers, allocated once (zeroed: attention multiplies
    masked-out values by 0, and 0 * NaN from uninitialised memory would be NaN)."""

    def __init__(self, *, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.max_len = max_len
        self.data = torch.zeros((2, layers, slots, kv_heads, max_len, head_dim), dtype=dtype, device=device)
        self.layers = [(self.data[0, i], self.data[1, i]) for i in range(layers)]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def move(self, src: list[int], dst: list[int], span: int) -> None:
        """Copy the first `span` positions of slots `src` into slots `dst` (all layers), one slot at a
        time: an indexed copy of all of them would first gather them into a temporary, as large as
        their whole cache (GBs for long answers), and only at the tail of some calls."""
        for s, d in zip(src, dst):
            self.data[:, :, d, :, :span].copy_(self.data[:, :, s, :, :span])


SINK = 0     # the page no sequence owns (a paged cache's idle rows and padding write there)


class PagedKVCache:
    """K and V in pages of `page` positions, all layers (zeroed, as KVCache), and the page table
    [rows, pages per sequence] on the device with its host copy (`held`): which pages each row's
    sequence holds, in position order. Rows are the engine's slots; the table is a static tensor
    (captured decode graphs read it by address), changed in place."""

    def __init__(self, *, layers: int, rows: int, pages: int, page: int, kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.page, self.pages, self.max_len = page, pages, max_len
        self.data = torch.zeros((2, layers, pages, kv_heads, page, head_dim), dtype=dtype, device=device)
        self.layers = [(self.data[0, i], self.data[1, i]) for i in range(layers)]
        self.table = torch.full((rows, -(-max_len // page)), SINK, dtype=torch.long, device=device)
        self.held: list[list[int]] = [[] for _ in range(rows)]
        self._free: list[int] = []                        # popped from the end: low pages first
        self._pending: list[tuple[int, int, int]] = []    # (row, column, page) not on the device yet
        self.reset()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.table.numel() * self.table.element_size()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page)

    def short_of(self, row: int, positions: int) -> bool:
        """Whether `row` holds fewer pages than positions 0..positions-1 (capped at max_len) take."""
        return self.pages_for(min(positions, self.max_len)) > len(self.held[row])

    def grow(self, row: int, positions: int) -> bool:
        """Hold pages for positions 0..positions-1 of `row` (capped at max_len); False, holding nothing
        more, when too few are free. New pages reach the device at `flush`."""
        held = self.held[row]
        need = self.pages_for(min(positions, self.max_len)) - len(held)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            self._pending.append((row, len(held), self._free[-1]))
            held.append(self._free.pop())
        return True

    def flush(self) -> None:
        """Write the pages `grow` gave since the last flush into the device table (one copy)."""
        if self._pending:
            rows, cols, pages = torch.tensor(self._pending, dtype=torch.long).T.contiguous()
            if self.table.device.type == "cuda":
                rows, cols, pages = (t.pin_memory().to(self.table.device, non_blocking=True)
                                     for t in (rows, cols, pages))
            self.table[rows, cols] = pages
            self._pending.clear()

    def release(self, row: int) -> None:
        """Give `row`'s pages back; its table row points at the sink again (stream-ordered before any
        later step, so its idle writes never reach a page handed to another sequence)."""
        if self.held[row]:
            self._free.extend(reversed(self.held[row]))
            self.held[row] = []
            self._pending = [p for p in self._pending if p[0] != row]
            self.table[row].fill_(SINK)

    def reset(self) -> None:
        """Every page free, every row at the sink (a call's start)."""
        self.held = [[] for _ in self.held]
        self._free = list(range(self.pages - 1, SINK, -1))
        self._pending.clear()
        self.table.fill_(SINK)

    def move(self, src: list[int], dst: list[int], span: int) -> None:
        """Rows `src`'s sequences into rows `dst` (free ones): their table rows move, no K/V is copied."""
        self.flush()
        for s, d in zip(src, dst):
            self.held[d], self.held[s] = self.held[s], []
        index = torch.tensor([src, dst], dtype=torch.long).to(self.table.device)
        self.table[index[1]] = self.table[index[0]]
        self.table[index[0]] = SINK


class DecodeGraphs:
    """Runs `step(b, span)` (which must read and write only static buffers) for a (b, span) bucket:
    replaying a CUDA graph captured on first use, or eagerly when graphs are off."""

    def __init__(self, step: Callable[[int, int], None], *, enabled: bool):
        self._step = step
        self.enabled = enabled
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if enabled else None
        # one side stream for every capture's warm-up: cuBLAS keeps a workspace (MBs, never freed) per
        # stream it runs on, and a fresh torch.cuda.Stream() per capture would add one per new bucket
        self._side = torch.cuda.Stream() if enabled else None

    def __len__(self) -> int:
        return len(self._graphs)

    def captured(self) -> dict[tuple[int, int], torch.cuda.CUDAGraph]:
        """(batch, span) -> graph, for the graphs captured so far."""
        return dict(self._graphs)

    def run(self, b: int, span: int) -> None:
        if not self.enabled:
            self._step(b, span)
            return
        graph = self._graphs.get((b, span))
        if graph is None:
            try:
                graph = self._graphs[(b, span)] = self._capture(b, span)
            except Exception as e:  # noqa: BLE001 - graphs only save launches; the eager step computes the same
                log.warning("cuda_graph_capture_failed", batch=b, span=span, error=repr(e)[:2000], fallback="eager")
                self.enabled = False
                self._graphs.clear()
                self._step(b, span)
                return
        graph.replay()

    def _capture(self, b: int, span: int) -> torch.cuda.CUDAGraph:
        # the warm-up runs the real step once (it rewrites each busy slot's K/V at its current
        # position with the same values the replay writes, so it changes no state)
        side = self._side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(b, span)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(b, span)
        return graph

    def clear(self) -> None:
        self._graphs.clear()
        if self.enabled:
            self._pool = torch.cuda.graph_pool_handle()


class Snapshot:
    """A copy of the device's `active` flags taken without waiting: read it a few steps later. A
    call with stop strings has each slot's newest tokens copied with them (`extra`)."""

    def __init__(self, slots: int, device: torch.device):
        cuda = device.type == "cuda"
        self._host = torch.zeros(slots, dtype=torch.bool, pin_memory=cuda)
        self._extra: Tensor | None = None      # host buffer of the last `extra`, made at its first use
        self._has_extra = False
        self._event = torch.cuda.Event() if cuda else None
        self.step = -1

    def take(self, active: Tensor, step: int, extra: Tensor | None = None) -> None:
        blocking = self._event is None
        self._host.copy_(active, non_blocking=not blocking)
        self._has_extra = extra is not None
        if extra is not None:
            if self._extra is None or self._extra.shape != extra.shape or self._extra.dtype != extra.dtype:
                self._extra = torch.empty(extra.shape, dtype=extra.dtype, pin_memory=not blocking)
            self._extra.copy_(extra, non_blocking=not blocking)
        if self._event is not None:
            self._event.record()
        self.step = step

    def read(self) -> tuple[list[bool], Tensor | None]:
        """(the active flags, the `extra` taken with them or None)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist(), (self._extra if self._has_extra else None)
