"""Weight transports: how the trainer's weights reach the engines, chosen once at start-up.

- `object_store` (CPU, and the fallback): the trainer hands `weights()` (CPU float32 copies, a
  `HostWeights`) to Ray's object store; each engine loads the dict (`EmbeddedEngine.update_weights`).
  `HostWeights` pickles each tensor as a flat numpy byte array, which Ray moves out of band (one
  copy into the store, none out of it) instead of through torch's own pickling of storages (the CPU
  demo's 4 MB model went from one actor to another in 12 ms instead of 27).
- `cuda_ipc` (engines colocated with the trainer on CUDA): the trainer casts its weights to the
  engines' dtype into flat device buffers ("buckets") of at most `--update-weight-buffer-size` bytes,
  and sends each bucket as a CUDA IPC handle plus per-tensor (name, shape, dtype, offset) metadata.
  The engine maps the trainer's buffer and copies each tensor into its own by name. No byte goes
  through host memory; a few hundred bytes of handle and metadata go through Ray.

The bucket protocol, one bucket at a time so that the extra device memory is one bucket:

    sender = BucketSender(lambda: model_weights(model), dtype=torch.bfloat16, bucket_bytes=512 << 20, ipc=True)
    for i in range(sender.num_buckets):             # the driver (miles.phases.weights) runs this loop
        bucket = sender.bucket(i, version)           # trainer: fill bucket i, keep it alive
        receiver.load(bucket)                        # every engine: copy it in (WeightReceiver)
        sender.release(i)                            # trainer, once every engine has acknowledged

A bucket that does not travel by IPC carries its bytes (`payload`), so the same protocol runs on CPU
(tests, in-process engines). Version stamping is the receiver's: the version is set when the last
bucket of a version is in; `--check-weight-update-equal` compares the engine's `state_dict_checksum`
with the trainer's in the engine's dtype, whatever the transport.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

TRANSPORTS = ("object_store", "cuda_ipc")
DEFAULT_BUCKET_BYTES = 512 * 1024 ** 2   # miles' --update-weight-buffer-size default
ALIGN = 256   # bytes: every tensor starts at a multiple, so a view in any dtype is aligned (as cudaMalloc's)


class HostWeights(dict):
    """{name: CPU tensor} that pickles as numpy byte arrays (Ray's zero-copy path) and unpickles as a
    plain dict of tensors with the same names, dtypes, shapes and bytes. What arrives may be backed by
    read-only shared memory: receivers copy from it, never write into it."""

    def __reduce__(self):
        names = list(self)
        tensors = [self[n].detach().contiguous() for n in names]
        return _host_weights_from_bytes, (names, [str(t.dtype).removeprefix("torch.") for t in tensors],
                                          [tuple(t.shape) for t in tensors],
                                          [t.reshape(-1).view(torch.uint8).numpy() for t in tensors])


def _host_weights_from_bytes(names: list[str], dtypes: list[str], shapes: list[tuple[int, ...]],
                             arrays: list) -> dict[str, Tensor]:
    import warnings

    with warnings.catch_warnings():     # Ray's arrays are read-only; the tensors are only read (see above)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {n: torch.from_numpy(a).view(getattr(torch, d)).reshape(s)
                for n, d, s, a in zip(names, dtypes, shapes, arrays)}


def choose_transport(*, colocate: bool, device_type: str) -> str:
    """cuda_ipc when engines share the trainer's GPUs, else the object store."""
    return "cuda_ipc" if colocate and device_type == "cuda" else "object_store"


@dataclass(frozen=True)
class TensorMeta:
    name: str                 # HF name (miles.weights.hf.model_weights)
    shape: tuple[int, ...]
    dtype: torch.dtype        # the dtype in the bucket (the engine's, for floating-point tensors)
    offset: int               # bytes from the start of the bucket, a multiple of ALIGN

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)


@dataclass(frozen=True)
class BucketPlan:
    metas: tuple[TensorMeta, ...]
    nbytes: int


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_buckets(weights: Mapping[str, Tensor], *, dtype: torch.dtype, bucket_bytes: int) -> list[BucketPlan]:
    """Greedy, in the dict's order: a tensor joins the current bucket while the bucket stays within
    `bucket_bytes`; a tensor larger than that gets a bucket of its own. Floating-point tensors are
    cast to `dtype`, others keep theirs."""
    if bucket_bytes < 1:
        raise ValueError(f"--update-weight-buffer-size must be >= 1 byte, got {bucket_bytes}")
    plans: list[BucketPlan] = []
    metas: list[TensorMeta] = []
    end = 0
    for name, t in weights.items():
        meta = TensorMeta(name, tuple(t.shape), dtype if t.is_floating_point() else t.dtype, 0)
        start = _aligned(end)
        if metas and start + meta.nbytes > bucket_bytes:
            plans.append(BucketPlan(tuple(metas), end))
            metas, start = [], 0
        metas.append(TensorMeta(meta.name, meta.shape, meta.dtype, start))
        end = start + meta.nbytes
    if metas:
        plans.append(BucketPlan(tuple(metas), end))
    return plans


def _view(flat: Tensor, meta: TensorMeta) -> Tensor:
    return flat[meta.offset:meta.offset + meta.nbytes].view(meta.dtype).view(meta.shape)


def fill_bucket(plan: BucketPlan, weights: Mapping[str, Tensor], *, device: torch.device | str) -> Tensor:
    """A new uint8 [plan.nbytes] buffer on `device` holding each tensor of `plan`, cast, at its offset."""
    flat = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    with torch.no_grad():
        for meta in plan.metas:
            _view(flat, meta).copy_(weights[meta.name].detach())
    return flat


def bucket_views(plan: BucketPlan | tuple[TensorMeta, ...], flat: Tensor) -> dict[str, Tensor]:
    """{name: view into `flat`} for every tensor of the bucket (views, not copies)."""
    metas = plan.metas if isinstance(plan, BucketPlan) else plan
    return {m.name: _view(flat, m) for m in metas}


@dataclass(frozen=True)
class WeightBucket:
    """What travels for one bucket: picklable (Ray, multiprocessing). Exactly one of `payload`
    (the bytes) and `ipc` (a CUDA IPC handle of the trainer's buffer) is set."""
    index: int
    count: int                # buckets in this version
    version: int
    metas: tuple[TensorMeta, ...]
    payload: Tensor | None = None
    ipc: tuple | None = None  # torch.multiprocessing.reductions.reduce_tensor's args for rebuild_cuda_tensor
    device_uuid: str | None = None   # the GPU the buffer lives on (device indices differ between processes)
    # (device_uuid, ipc) of copies of the same bytes on other GPUs (a trainer on several ranks, one
    # copy per rank's GPU): an engine maps the copy on a GPU it sees
    peers: tuple[tuple[str, tuple], ...] = ()

    def open(self) -> Tensor:
        """The bucket's bytes: the payload, or the trainer's buffer (on a GPU this process sees) mapped
        into this process."""
        if self.payload is not None:
            return self.payload
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        copies = ((self.device_uuid, self.ipc), *self.peers)
        for uuid, ipc in copies:
            index = _local_device_index(uuid)
            if index is not None:
                args = list(ipc)
                args[_IPC_DEVICE_ARG] = index
                return rebuild_cuda_tensor(*args)
        raise RuntimeError(f"this process sees none of the GPUs {[u for u, _ in copies]} that hold the trainer's "
                           "weight bucket; CUDA IPC needs the engine on a trainer GPU (--colocate), else use the "
                           "object store")


_IPC_DEVICE_ARG = 6   # position of the device index in reduce_tensor's args for CUDA tensors


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _local_device_index(uuid: str | None) -> int | None:
    """This process's index of the GPU `uuid`; None when it does not see that GPU."""
    for i in range(torch.cuda.device_count()):
        if _device_uuid(i) == uuid:
            return i
    return None


class BucketSender:
    """The trainer's side: fills buckets from the live weights and keeps each alive until `release`.

    A resource: `dispose` frees every live bucket; the trainer that creates it owns it (and
    registers it with whatever disposes of the trainer). The plan is made once, on first use: the
    weights' names, shapes and dtypes do not change during a run.
    """

    def __init__(self, weights: Callable[[], Mapping[str, Tensor]], *, dtype: torch.dtype,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, ipc: bool = False):
        self._weights, self.dtype, self.bucket_bytes, self.ipc = weights, dtype, bucket_bytes, ipc
        self._plans: list[BucketPlan] | None = None
        self._live: dict[int, Tensor] = {}     # index -> buffer an engine may still be reading

    @property
    def plans(self) -> list[BucketPlan]:
        if self._plans is None:
            self._plans = plan_buckets(self._weights(), dtype=self.dtype, bucket_bytes=self.bucket_bytes)
        return self._plans

    @property
    def num_buckets(self) -> int:
        return len(self.plans)

    def bucket(self, index: int, version: int) -> WeightBucket:
        """Fill bucket `index` with the current weights (cast) and return what travels."""
        weights = self._weights()
        plan = self.plans[index]
        # IPC shares the trainer's device buffer; anything else travels as host bytes
        flat = fill_bucket(plan, weights, device=next(iter(weights.values())).device if self.ipc else "cpu")
        self._live[index] = flat
        meta = dict(index=index, count=len(self.plans), version=int(version), metas=plan.metas)
        if not self.ipc:
            return WeightBucket(**meta, payload=flat)
        if flat.device.type != "cuda":
            raise ValueError(f"the cuda_ipc transport needs the trainer's weights on CUDA, they are on {flat.device}")
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.current_stream(flat.device).synchronize()    # the bytes are written before anyone maps them
        _, args = reduce_tensor(flat)
        return WeightBucket(**meta, ipc=args, device_uuid=_device_uuid(flat.device.index or 0))

    def release(self, index: int | None = None) -> None:
        """Drop bucket `index` (every engine acknowledged it), or all of them."""
        for i in ([index] if index is not None else list(self._live)):
            self._live.pop(i, None)
        if self.ipc and torch.cuda.is_available():
            torch.cuda.ipc_collect()     # free buffers whose last IPC reference just went

    @property
    def live_buckets(self) -> list[int]:
        return sorted(self._live)

    def dispose(self) -> None:
        """Free every live bucket. The weights themselves are the trainer's."""
        self.release()


class WeightReceiver:
    """The engine's side: copies buckets into its tensors by name, and stamps the version when the
    last bucket of a version is in. Any engine whose weights have HF names can use it.

    Strict like `miles.weights.hf.load_weights`: every name and shape of a bucket is checked before
    any of it is copied; a version is complete only when every tensor arrived exactly once.
    """

    def __init__(self, named: Mapping[str, Tensor]):
        self._named = named
        self._pending: tuple[int, set[str], int] | None = None   # (version, names loaded, next index)

    def load(self, bucket: WeightBucket) -> int | None:
        """Copy `bucket` in; returns its version once the version is complete, else None. A bucket 0
        starts a version afresh (a sync retried after an engine restart begins again)."""
        if bucket.index == 0:
            self._pending = None
        version, loaded, expected = self._pending or (bucket.version, set(), 0)
        if bucket.version != version or bucket.index != expected:
            raise ValueError(f"weight bucket {bucket.index}/{bucket.count} of version {bucket.version} arrived "
                             f"while bucket {expected} of version {version} was expected; the sender must send "
                             f"a version's buckets in order, one version at a time")
        self._check(bucket, loaded)
        flat = bucket.open()
        with torch.no_grad():
            for name, view in bucket_views(bucket.metas, flat).items():
                self._named[name].copy_(view)
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()   # copied before the sender may free it
        del flat
        loaded |= {m.name for m in bucket.metas}
        if bucket.index + 1 < bucket.count:
            self._pending = (version, loaded, bucket.index + 1)
            return None
        self._pending = None
        missing = sorted(set(self._named) - loaded)
        if missing:
            raise ValueError(f"weights version {version} is complete but {len(missing)} tensors were not sent "
                             f"(e.g. {', '.join(missing[:3])}); trainer and engine must hold the same architecture")
        return version

    def _check(self, bucket: WeightBucket, loaded: set[str]) -> None:
        problems = []
        for m in bucket.metas:
            if m.name not in self._named:
                problems.append(f"{m.name}: not a tensor of this engine")
            elif tuple(self._named[m.name].shape) != m.shape:
                problems.append(f"{m.name}: shape {m.shape} vs engine {tuple(self._named[m.name].shape)}")
            elif m.name in loaded:
                problems.append(f"{m.name}: sent twice in one version")
        if problems:
            self._pending = None
            raise ValueError(f"weight bucket {bucket.index} of version {bucket.version} does not fit the engine: "
                             + "; ".join(problems[:3]))


def load_weight_buckets(named: Mapping[str, Tensor], buckets) -> int:
    """Load a whole version's buckets, in order, into `named`; returns the version."""
    receiver = WeightReceiver(named)
    version = None
    for bucket in buckets:
        version = receiver.load(bucket)
    if version is None:
        raise ValueError("the buckets did not complete a weight version (last bucket missing)")
    return version
