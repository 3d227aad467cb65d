"""Hand the trainer's GPU memory to a colocated engine and take it back (--offload-train).

`HostOffload.offload()` drops the gradients, moves the optimizer state (AdamW's exp_avg and
exp_avg_sq: twice the float32 parameters) and, optionally, the parameters themselves into host
buffers, and returns the freed blocks to CUDA (`empty_cache`), so that another process (the engine)
can allocate them. `onload()` brings the parameters back; the optimizer state stays on the host
from the first offload on, and `step()` streams it through the device a chunk of parameters at a
time (`chunk_bytes` of float32 parameters: their moments copied in, the optimizer's own update run
on just those parameters, the moments copied back; on CUDA the next chunk's copy in and the last
one's copy out run on side streams beside the update). The bytes crossing the bus per iteration are
the same as bringing the whole state back for the step and sending it out again, but the device
never holds more than two chunks of it: an 8B model's 64 GB of moments need not fit beside its 32 GB
of float32 weights, 32 GB of gradients and a colocated engine.

Values are bit-for-bit the same: the update is the optimizer's own `step()` over each chunk (AdamW
is element-wise, so a chunk's update does not depend on the others), and a round trip copies. On a
machine without CUDA the same code runs with host "device" tensors: the copies still happen, which is
what the CPU tests check.

A load while offloaded (a resume: miles.checkpoint.restore offloads first) ends with the state in the host
buffers whichever way it came: `load_state_dict` here fills them directly (the one-process file), and
any `optimizer.load_state_dict` (torch's, which DCP's sharded and whole-file loads under FSDP call)
is followed by a hook that copies what it put on the device into them, so the first rollout after a
resume has the GPU memory.

Host buffers are allocated once (pinned when CUDA is there, which makes the copies asynchronous and
fast) and reused by every later offload and step; `dispose` drops them. They are carved out of a few
power-of-two slabs (`HostArena`), sized at the offload from the state about to move: torch's pinned
allocator would round each buffer up to a power of two (for the 8.1 B-parameter MoE in `HostArena`'s
docstring, 87.7 GB pinned for 64.8 GB of moments). Parameters stay the same
`nn.Parameter` objects (only `.data` moves), so the optimizer's references stay valid.

Under FSDP2 (the torch trainer on several ranks) the parameters and their optimizer state are
DTensors: a rank moves its own shard (the DTensor's local tensor) and the state stays a DTensor of the
same mesh, placements and global shape around the host shard, so the optimizer, the sharded
checkpoint and the next streamed step see what they saw before. (Only the optimizer state: the
weights of a DTensor model stay where FSDP keeps them.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from miles.training.torch.shards import around, local, step_shards

_WEIGHTS = ".data"                  # the key of a parameter's own host buffer (beside its moments' names)
DEFAULT_CHUNK_BYTES = 1 << 30       # float32 parameters per streamed update: 2 GiB of moments on the device
ALIGN_BYTES = 512                   # a multiple of every dtype's size: each view's offset allows `.view(dtype)`
FIRST_SLAB_BYTES = 64 << 20         # a small model pins little
MAX_SLAB_BYTES = 4 << 30            # few slabs for a large one; a larger request gets a slab of its own


def _pow2ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _aligned(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def _first_fit(room: list[int], nbytes: int) -> int | None:
    return next((i for i, free in enumerate(room) if free >= nbytes), None)


class HostArena:
    """Exact-size host tensors carved out of a few slabs, each one `torch.empty` of a power of two of
    bytes. PyTorch's pinned-memory allocator rounds every allocation up to the next power of two (torch
    2.11; newer ones can be told not to, `pinned_max_round_threshold_mb`), so one pinned buffer per moment
    pins up to twice its bytes; a slab that is a power of two already is pinned as it is.

    A request takes `ALIGN_BYTES`-aligned bytes at the free tail of the first slab with room (first fit),
    else of a new slab: the first `FIRST_SLAB_BYTES` (or the request's power of two), each later one twice
    the last, up to `MAX_SLAB_BYTES`; a request above that gets a slab of its power of two, whose tail
    later requests fill. A tensor handed out is the slab's bytes `[off, off + n)` under a storage of
    exactly those bytes (`torch.from_numpy` over the slab's numpy view, which holds the slab), so that
    `torch.save` writes its bytes and not its slab's. Its memory is the slab's: pinned when the slab is
    (CUDA finds the pointer inside the pinned allocation), so its non-blocking copies are asynchronous; the
    pinned allocator does not know it as one of its blocks and records no event for it (`HostOffload`
    synchronizes before anyone reuses or frees the memory). Space is never given back: a slab is freed
    when neither the arena nor any tensor carved from it holds it any more.

    `reserve` sizes the slabs once from the requests about to come, in their order: it lays them out
    first fit in `MAX_SLAB_BYTES` slabs and makes each slab the power of two its bytes need, so those
    requests, made in that order, land where it planned and make no further slab. A total alone cannot
    say how the requests pack: for the model below, slabs sized from the total of its moments left two
    requests over (two more slabs, 71.4 GB in all).

    The waste, planned or grown: every slab but the newest kept less free tail than the request that
    opened the next one (first fit would have put it there), so it is below (slabs - 1) x the largest
    request plus the newest slab's free tail (planned: under its used bytes, its power-of-two rounding;
    grown: under its size). In the worst case (requests just over half a slab) that is about twice the
    bytes, as torch's rounding; with many requests well below `MAX_SLAB_BYTES` it is a few percent.

    Qwen3-30B-A3B's shapes cut to 12 layers (8.1 B float32 parameters: fused experts of 128 x 1536 x 2048
    and 128 x 2048 x 768, embedding and lm_head of 151936 x 2048), AdamW's two moments
    (tests/unit/test_host_arena.py computes them):
      - the moments:                                     64,798,236,672 bytes (64.8 GB)
      - pinned one buffer each (torch's rounding):       87,736,885,248 bytes (87.7 GB)
      - pinned by the arena after `reserve`:             68,719,476,736 bytes (68.7 GB: 16 slabs of 4 GiB)
    Grown without `reserve` (the first streamed step of --optimizer-cpu-offload makes the state chunk by
    chunk) it pins 70,866,960,384 bytes (17 slabs)."""

    def __init__(self, *, pin: bool, device: str = "cpu"):
        self.pin = pin
        self._device = device           # "meta" lays the slabs out without memory (the tests' full-size numbers)
        self._slabs: list[Tensor] = []  # uint8, a power of two of bytes each
        self._ends: list[int] = []      # bytes handed out from the front of each slab

    @property
    def allocated_bytes(self) -> int:
        return sum(slab.numel() for slab in self._slabs)

    @property
    def used_bytes(self) -> int:
        """The bytes handed out, each request rounded up to `ALIGN_BYTES`."""
        return sum(self._ends)

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialized tensor of `shape` and `dtype` in a slab (one of no elements takes none)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=self._device)
        i = _first_fit(self._room(), _aligned(nbytes))
        if i is None:
            i = self._add_slab(self._grown_size(nbytes))
        start = self._ends[i]
        self._ends[i] += _aligned(nbytes)
        view = self._slabs[i][start:start + nbytes]
        if view.device.type == "cpu":
            # a storage of its own, exactly its bytes, over the slab's memory (numpy's array keeps the slab
            # alive): torch.save writes a tensor's whole storage, so a checkpoint of the state (the
            # one-process optimizer.pt) would otherwise hold whole slabs, and DCP clones each view it saves
            view = torch.from_numpy(view.numpy())
        return view.view(dtype).view(shape)

    def reserve(self, sizes: Iterable[int]) -> None:
        """Make the slabs that requests of `sizes` bytes, made in this order, will fill (beside the free
        tails of the slabs there already): `empty` then places them as planned and makes no slab. Requests
        made otherwise still get their bytes, maybe in further slabs."""
        room = self._room()
        planned: list[int] = []         # bytes each new slab will hold
        for nbytes in (_aligned(n) for n in sizes if n):
            i = _first_fit(room, nbytes)
            if i is None:
                room.append(max(MAX_SLAB_BYTES, _pow2ceil(nbytes)))
                planned.append(0)
                i = len(room) - 1
            room[i] -= nbytes
            if i >= len(self._slabs):
                planned[i - len(self._slabs)] += nbytes
        for nbytes in planned:
            self._add_slab(_pow2ceil(nbytes))

    def _room(self) -> list[int]:
        return [slab.numel() - end for slab, end in zip(self._slabs, self._ends)]

    def _grown_size(self, nbytes: int) -> int:
        if nbytes > MAX_SLAB_BYTES:
            return _pow2ceil(nbytes)
        if not self._slabs:
            return max(FIRST_SLAB_BYTES, _pow2ceil(nbytes))
        return min(MAX_SLAB_BYTES, max(_pow2ceil(nbytes), 2 * self._slabs[-1].numel()))

    def _add_slab(self, nbytes: int) -> int:
        self._slabs.append(torch.empty(nbytes, dtype=torch.uint8, device=self._device, pin_memory=self.pin))
        self._ends.append(0)
        return len(self._slabs) - 1


class HostOffload:
    """Owned by the trainer that creates it; `dispose` frees the host buffers (it does not onload)."""

    resource_name = "trainer_offload"

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None, *, weights: bool = False,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, resident: bool = False):
        if weights and model is None:
            raise ValueError("offloading the weights needs the model")
        if weights and any(local(p) is not p for p in model.parameters()):
            raise ValueError("offloading a sharded (DTensor) model's weights is not supported: FSDP keeps them")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self._optimizer, self._model, self._weights = optimizer, model, weights
        self._chunk_bytes = chunk_bytes
        self._host: dict[tuple[int, str], Tensor] = {}     # (id of the owning param, key) -> host buffer
        self._arenas: dict[tuple[bool, bool], HostArena] = {}  # (the weights', pinned) -> where the buffers are carved
        self._device: dict[int, torch.device] = {}        # id of a param -> where its weights live when onloaded
        self.offloaded = False
        self._resident = resident       # the state lives on the host from the first step (--optimizer-cpu-offload)
        # every `optimizer.load_state_dict` (torch's, and DCP's `set_optimizer_state_dict` of the sharded
        # and whole-file loads under FSDP) puts the state on the parameters' device: rehosted right after
        self._load_hook = optimizer.register_load_state_dict_post_hook(self._rehost_loaded)
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None   # (fetch, write-back): CUDA's step

    @property
    def holds_state(self) -> bool:
        """Whether the optimizer state belongs in the host buffers now: handed off (`offload`), or
        resident there for the whole run (`resident`: --optimizer-cpu-offload). A load then fills the
        buffers and never puts the whole state on the device."""
        return self.offloaded or self._resident

    # --- the optimizer state ----------------------------------------------------------------------
    @staticmethod
    def _moments(state: dict) -> Iterator[str]:
        """The state's per-element tensors (AdamW's scalar step stays where the optimizer keeps it)."""
        return (k for k, v in list(state.items()) if isinstance(v, Tensor) and k != "step")

    def _to_host(self, param: Tensor, state: dict) -> None:
        """`param`'s optimizer state into its host buffers (made at the first call)."""
        for name in self._moments(state):
            value = state[name]
            shard = local(value)
            host = self._host.get((id(param), name))
            if host is not None and shard.device.type == "cpu" and shard.data_ptr() == host.data_ptr():
                continue          # there already (a DTensor's local may be a view of the buffer: not `is`)
            host = self._buffer((id(param), name), shard, pin=local(param).is_cuda)
            host.copy_(shard, non_blocking=shard.is_cuda)
            state[name] = around(value, host)

    def _rehost_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """After a load while offloaded: the state the load put on the device into the host buffers, so
        the rollout that follows has the GPU memory (`offload()` would return early: offloaded already).
        What the load held on the device goes back to CUDA once the loader drops it (DCP's loads keep
        it until they return): the next `offload()` empties the cache again."""
        if not self.holds_state:
            return                # not handed off: the next streamed step moves the state to the host
        self._state_to_host()

    def _state_to_host(self) -> None:
        """Every moment of the optimizer state into its host buffers, their slabs sized once beforehand."""
        self._reserve(self._state_buffers())
        for param, state in self._optimizer.state.items():
            self._to_host(param, state)
        self._settle()

    def _buffer(self, key: tuple[int, str], like: Tensor, *, pin: bool) -> Tensor:
        if self._stale(key, like):
            # a replaced buffer's bytes are not reused (a shape or dtype change is rare: a load of another
            # layout); they go with their slab
            self._host[key] = self._arena(key, pin).empty(like.shape, like.dtype)
        return self._host[key]

    def _stale(self, key: tuple[int, str], like: Tensor) -> bool:
        host = self._host.get(key)
        return host is None or host.shape != like.shape or host.dtype != like.dtype

    def _arena(self, key: tuple[int, str], pin: bool) -> HostArena:
        """Pinned when the parameter the buffer serves is on CUDA (its copies are then asynchronous and
        fast), whatever device the values come from: a checkpoint's state loaded to the CPU
        (`load_state_dict`) fills pinned buffers too. The weights are carved from slabs of their own:
        dropping their buffers (`dispose` after an onload) frees their slabs whatever the optimizer state
        still holds."""
        group = (key[1] == _WEIGHTS, pin)
        if group not in self._arenas:
            self._arenas[group] = HostArena(pin=pin)
        return self._arenas[group]

    def _reserve(self, wanted: Iterable[tuple[tuple[int, str], Tensor, bool]]) -> None:
        """The slabs sized once for the buffers `_buffer` is about to make for `wanted` ((key, tensor,
        pinned) triples, in the order it will be asked for them): `HostArena.reserve`."""
        sizes: dict[HostArena, list[int]] = {}
        for key, like, pin in wanted:
            if self._stale(key, like):
                sizes.setdefault(self._arena(key, pin), []).append(like.numel() * like.element_size())
        for arena, planned in sizes.items():
            arena.reserve(planned)

    def _state_buffers(self) -> list[tuple[tuple[int, str], Tensor, bool]]:
        """(key, local tensor, pinned) of every moment of the optimizer state, in `_to_host`'s order."""
        return [((id(param), name), local(state[name]), local(param).is_cuda)
                for param, state in self._optimizer.state.items() for name in self._moments(state)]

    def step(self) -> None:
        """One optimizer step with the state streamed through the parameters' device, `chunk_bytes` of
        parameters at a time; the state ends in the host buffers. On CUDA the copies overlap the
        updates (`_step_overlapped`); elsewhere each chunk comes in, steps and goes back in turn."""
        opt = self._optimizer
        params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
        chunks = list(self._chunks(params))
        if chunks and local(chunks[0][0]).is_cuda:
            self._step_overlapped(chunks)
        else:
            for chunk in chunks:
                self._fetch(chunk)
                step_shards(opt, chunk)
                for p in chunk:
                    self._to_host(p, opt.state[p])
        self._settle()

    def _fetch(self, chunk: list[Tensor]) -> list[Tensor]:
        """`chunk`'s optimizer state onto its parameters' device (a first step finds none: the optimizer
        makes it there, in `step_shards`); the device tensors."""
        fetched = []
        for p in chunk:
            state = self._optimizer.state[p]
            for name in self._moments(state):
                value = state[name]
                shard = local(value).to(local(p).device, non_blocking=True)
                state[name] = around(value, shard)
                fetched.append(shard)
        return fetched

    def _step_overlapped(self, chunks: list[list[Tensor]]) -> None:
        """The streamed step on CUDA with the copies beside the updates: chunk i+1's state comes in on a
        fetch stream while chunk i steps on the current stream, and chunk i goes back to the pinned
        buffers on a write-back stream while chunk i+1 steps (the host-to-device and device-to-host
        copies use the two directions of the bus at once). The same updates in the same order: the
        values are the serial loop's.

        Memory: before fetching chunk i+1 the host waits until chunk i-1 is written back (its device
        copies already dropped), so at most two chunks' state is on the device at once, the one
        stepping or going back and the next coming in: 2 x 2 x chunk_bytes of AdamW moments (4 GiB
        at the default), plus the update's temporaries for one chunk (up to chunk_bytes); the serial
        loop held one chunk's state."""
        opt = self._optimizer
        device = local(chunks[0][0]).device
        compute = torch.cuda.current_stream(device)
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        fetch, back = self._streams

        def prefetch(chunk: list[Tensor]) -> torch.cuda.Event:
            # the host buffers are not written in this step before their chunk is stepped, and the last
            # step's writes were synchronized (`_settle`): the copies need not wait for anything
            with torch.cuda.stream(fetch):
                for t in self._fetch(chunk):    # allocated on the fetch stream: the allocator must not hand
                    t.record_stream(compute)    # its blocks out again before the update that uses them is done
                return fetch.record_event()

        ready, written = prefetch(chunks[0]), None
        for i, chunk in enumerate(chunks):
            compute.wait_event(ready)
            if i + 1 < len(chunks):
                if written is not None:
                    written.synchronize()       # chunk i-1 on the host, its device blocks free: two chunks at most
                ready = prefetch(chunks[i + 1])
            step_shards(opt, chunk)
            back.wait_stream(compute)           # the update is done before it is copied out
            with torch.cuda.stream(back):
                for p in chunk:
                    state = opt.state[p]
                    for name in self._moments(state):
                        local(state[name]).record_stream(back)
                    self._to_host(p, state)     # non-blocking into the pinned buffers; the device copies dropped
            written = back.record_event()       # behind the allocator's events for the dropped copies

    def load_state_dict(self, saved: dict) -> None:
        """An optimizer state dict (`optimizer.state_dict()`, loaded to the CPU) straight into the host
        buffers: a resumed run with --offload-train never holds the whole state on the device, which
        torch's `load_state_dict` would put there (at 8B, 64 GB beside a colocated engine). The
        hyperparameters of each group are restored as torch restores them; the parameters are matched
        in order. Not for a sharded (DTensor) optimizer, whose checkpoint is loaded by its ranks."""
        opt = self._optimizer
        params = [p for group in opt.param_groups for p in group["params"]]
        ids = [i for group in saved["param_groups"] for i in group["params"]]
        if len(saved["param_groups"]) != len(opt.param_groups) or len(ids) != len(params):
            raise ValueError(f"the saved optimizer state has {len(ids)} parameters in {len(saved['param_groups'])} "
                             f"groups, this optimizer {len(params)} in {len(opt.param_groups)}: not this model's")
        if any(local(p) is not p for p in params):
            raise ValueError("loading a sharded (DTensor) optimizer state through HostOffload is not supported")
        for group, kept in zip(opt.param_groups, saved["param_groups"]):
            group.update({k: v for k, v in kept.items() if k != "params"})
        opt.state.clear()
        for i, p in zip(ids, params):
            if i not in saved["state"]:
                continue
            state = opt.state[p]
            for k, v in saved["state"][i].items():     # torch's casting rule: moments take the parameter's dtype
                if isinstance(v, Tensor):
                    v = v.to(p.dtype) if k != "step" and v.is_floating_point() else v.clone()   # not shared with `saved`
                state[k] = v
        self._state_to_host()

    def _chunks(self, params: list[Tensor]) -> Iterator[list[Tensor]]:
        chunk, size = [], 0
        for p in params:
            nbytes = local(p).numel() * p.element_size()
            if chunk and size + nbytes > self._chunk_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(p)
            size += nbytes
        if chunk:
            yield chunk

    # --- the hand-offs ------------------------------------------------------------------------------
    def offload(self) -> int:
        """Gradients dropped; the optimizer state (and the weights) to host memory. Returns the bytes of
        trainer state in host memory now, off the GPU while the engines run (the state moves only the
        first time: afterwards it is there already). Idempotent."""
        if self.offloaded:
            self._settle()        # what a load held on the device while offloaded (`_rehost_loaded`) back to CUDA
            return 0
        if self._model is not None:
            for p in self._model.parameters():
                p.grad = None             # recomputed by the next backward; zero_grad(set_to_none) drops them anyway
        weights = [((id(p), _WEIGHTS), p.data, p.is_cuda) for p in self._model.parameters()] if self._weights else []
        self._reserve(self._state_buffers() + weights)
        held = 0
        for param, state in self._optimizer.state.items():
            self._to_host(param, state)
            held += sum(local(state[n]).numel() * state[n].element_size() for n in self._moments(state))
        if self._weights:
            for param in self._model.parameters():
                self._device[id(param)] = param.device
                host = self._buffer((id(param), _WEIGHTS), param.data, pin=param.is_cuda)
                host.copy_(param.data, non_blocking=param.is_cuda)
                param.data = host
                held += host.numel() * host.element_size()
        self._settle()
        self.offloaded = True
        return held

    def onload(self) -> int:
        """The weights back to where they were (the optimizer state stays: `step` streams it); bytes
        moved. Idempotent."""
        if not self.offloaded:
            return 0
        moved = 0
        if self._weights:
            for param in self._model.parameters():
                device = self._device[id(param)]
                host = param.data
                param.data = host.to(device, non_blocking=device.type == "cuda", copy=True)
                moved += host.numel() * host.element_size()
        self._settle()
        self.offloaded = False
        return moved

    def _settle(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()      # the copies are done before anyone reads or reuses the memory
            torch.cuda.empty_cache()      # freed blocks go back to CUDA, where a colocated engine can take them

    def dispose(self) -> None:
        """Drop the host buffers that nothing holds any more (the optimizer's state stays with it: the
        optimizer is the trainer's, which drops both), and the arenas: a slab's memory goes back when
        the last view of it goes (each buffer holds its slab's storage), the state's with the optimizer's
        state."""
        self._load_hook.remove()
        self._streams = None
        self._arenas = {}
        held = {id(v) for s in self._optimizer.state.values() for v in s.values() if isinstance(v, Tensor)}
        self._host = {k: v for k, v in self._host.items() if id(v) in held}

