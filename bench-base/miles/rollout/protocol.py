"""The engine seam: what the phases and the executor ask of an inference engine, the optional
abilities an engine declares, and the spec each engine is registered with.

An engine speaks token ids (see `miles.types`): prompts in, `Generation`s (ids, logprobs, the weight
version that produced them) out. Each engine is a package of `miles.rollout.engines` with one
`EngineSpec` (its `spec.py`), registered under its `--rollout-engine` name in
`miles.rollout.engines.registry.ENGINES`; the composition root (`miles.phases.init.pick_backends`)
picks the spec once and makes its class a Ray actor; nothing else names an engine. The spec says
everything the run needs to know about the engine without importing it:

- `engine`: the class, "module:Class", imported only when a run picks it (its heavy imports stay there);
- `options(cfg)`: its constructor options from the config, the one way they arrive. Constructor, for
  every engine: `Cls(model_path, *, device, dtype, seed, **options, **fleet.engine_kwargs(...))`;
- `fleet`: for an engine kind that needs more around its actors (a router in front of several
  servers), "module:function" `(cfg, *, run_dir, num_engines) -> EngineFleet`; the composition root
  makes the fleet once, before the engines, registers it with the disposer (so it goes after them),
  passes `fleet.engine_kwargs(index, name)` (per-engine wiring: work folder, router address) to each
  constructor and tells it when an engine joins or leaves;
- `check(cfg, problems)`: the engine's own flags, run by `miles.config.validate` before Ray starts;
- `capabilities`: the optional abilities below (runtime-checkable Protocols) the class implements;
  the phases ask `spec.supports(SupportsX)`, never the class (a unit test holds each declaration to
  the class);
- `actor_threads`: the engine actor's threads (None: Ray's default, one for a plain actor; an async
  actor runs its coroutine calls concurrently on its event loop);
- `tensor_parallel`: one engine may span GPUs (--rollout-num-gpus-per-engine > 1);
- `refuses(hf_checkpoint)`: why the engine cannot run a model (None: it can);
- `prefer_on_gpus`: the engine that replaces this one on GPUs for the models it does not refuse.

`--rollout-engine embedded` is the embedded engine wherever it can be fast: on GPUs it is FastEngine
(our own forward, KV cache, CUDA graphs) for the models FastEngine implements, and EmbeddedEngine
(transformers) otherwise or on CPU; `--rollout-engine fast` asks for FastEngine outright. Every
engine actor gets its GPUs from the run's placement (miles.cluster.placement).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    import torch

    from miles.config import RunConfig
    from miles.types import Generation, SamplingParams
    from miles.weights.transport import WeightBucket

# what an engine can hand back while the trainer trains, in SGLang's names (SupportsMemoryRelease)
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class EngineUnresponsive(RuntimeError):
    """An engine call ran past --engine-generate-timeout, or a probe found the engine hung. `engine` is
    its index in the run's list. Pickles (it crosses the executor actor's boundary)."""

    def __init__(self, message: str, engine: int = -1):
        super().__init__(message)
        self.engine = engine

    def __reduce__(self):
        return type(self), (str(self), self.engine)


class Engine(Protocol):
    """An inference engine. Methods are called through a Ray actor handle (`.remote`) in a run."""

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 max_new_tokens: Sequence[int] | None = None) -> list[Generation]:
        """One Generation per prompt, in order; `params.seed` makes a call reproducible.
        `max_new_tokens`, one per prompt, caps each prompt's response (else params.max_new_tokens)."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load the trainer's weights (HF names) and stamp them with `version`."""
        ...

    def weights_checksum(self) -> str:
        """`miles.weights.checksum.state_dict_checksum` of the weights as the engine holds them."""
        ...

    def weights_dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in (the trainer's checksum is taken in it)."""
        ...

    def weight_version(self) -> int:
        """0 for the weights loaded from disk, then the version of the last `update_weights`."""
        ...

    def dispose(self) -> None:
        """Free what the engine holds (model, KV cache, server process). Idempotent."""
        ...

    # the tokenizer the engine serves with (tests and host programs read responses through it)
    @property
    def eos_token_id(self) -> int: ...

    @property
    def pad_token_id(self) -> int: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class TokenizerAccessors:
    """The protocol's tokenizer accessors, read from the engine's `tokenizer` (a mixin of engines)."""

    tokenizer: Any

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int:
        """The tokenizer's pad id, or EOS when it has none (padding is masked out either way)."""
        pad = self.tokenizer.pad_token_id
        return self.eos_token_id if pad is None else pad

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


class EngineFleet(Protocol):
    """Run-level support of one engine kind (see the module docstring); a disposer resource."""

    resource_name: str

    def engine_kwargs(self, index: int, name: str) -> dict[str, Any]:
        """Engine `index`'s wiring into the fleet (work folder, router address), beyond its options."""
        ...

    async def joined(self, index: int, engine: Any) -> None:
        """Engine `index` (an actor handle) is ready and holds the run's weights."""
        ...

    async def left(self, index: int) -> None:
        """Engine `index` is gone (dead, being replaced)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the trace records about the fleet (addresses, pids)."""
        ...

    async def dispose(self) -> None: ...


# -- optional abilities: an engine's spec declares the ones its class implements ----------------------

@runtime_checkable
class SupportsWeightBuckets(Protocol):
    """Weights in CUDA IPC buckets (colocated on GPUs); without it weights go through the object store."""

    def load_weight_bucket(self, bucket: WeightBucket) -> int | None:
        """One bucket of a weight update (miles.weights.transport)."""
        ...


@runtime_checkable
class SupportsMemoryRelease(Protocol):
    """Frees GPU memory while the trainer trains (--offload-rollout, --colocate) and takes it back; each
    engine frees what it can of `tags` and ignores the rest (FastEngine keeps its weights, SGLang frees
    them too); idempotent. miles.phases.memory says when."""

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None: ...

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None: ...


@runtime_checkable
class SupportsHealth(Protocol):
    """Answers the health monitor's probe beside a running generate call (two actor threads, guarding
    its model itself, or an async engine): seconds since the running generate last made progress
    (0.0 idle; an idle engine first proves it can generate). An engine without it is not probed; its
    hung calls are still found by --engine-generate-timeout."""

    def health(self) -> dict[str, Any]:
        """{"busy": bool, "since_progress_s": float}"""
        ...


@runtime_checkable
class SupportsAbort(Protocol):
    """The generate calls running now return at their next step (finish_reason "abort", with what each
    request generated until then); answered beside them, as health."""

    def abort(self) -> None: ...


@dataclass(frozen=True)
class EngineSpec:
    """One engine, as the run sees it (see the module docstring)."""

    engine: str                                             # "module:Class" (an Engine)
    options: Callable[[RunConfig], dict[str, Any]]          # constructor options from the config
    capabilities: tuple[type, ...] = ()                     # the Supports* Protocols the class implements
    fleet: str | None = None                                # "module:function" -> EngineFleet
    check: Callable[[RunConfig, list[str]], None] | None = None   # its own flags, before Ray starts
    actor_threads: int | None = None
    tensor_parallel: bool = False
    # hf_checkpoint -> None when the engine implements that model, else why not (None: every model)
    refuses: Callable[[str], str | None] | None = None
    # on GPUs, this engine gives way to that one (a name in ENGINES) for the models it does not refuse
    prefer_on_gpus: str | None = None

    def supports(self, capability: type) -> bool:
        return capability in self.capabilities
