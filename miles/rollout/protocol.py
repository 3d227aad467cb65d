"""The engine seam: what the phases and the executor ask of an inference engine, and the registry
of engines `--rollout-engine` picks from.

An engine speaks token ids (see `miles.types`): prompts in, `Generation`s (ids, logprobs, the weight
version that produced them) out. The composition root (`miles/phases/init.py:pick_backends`) picks
the class once, by name, and makes it a Ray actor; nothing else names an engine. A new engine (the CUDA fast
path, SGLang) is a module of its own implementing `Engine`, plus one `ENGINES` entry; its heavy
imports stay in its module, which loads only when a run picks it.

Constructor, for every engine: `Cls(model_path, *, device, dtype, seed, **options)`, the options
being what `pick_backends` reads from the rollout flags for that engine (`--rollout-max-batch-size`
for the embedded and fast engines; `--rollout-mem-fraction` and the `--disable-*` switches for
FastEngine). Every engine actor gets its GPUs from the run's placement (miles.cluster.placement).

`--rollout-engine embedded` is the embedded engine wherever it can be fast: on CUDA it is FastEngine
(our own forward, KV cache, CUDA graphs) for the models FastEngine implements, and EmbeddedEngine
(transformers) otherwise or on CPU; `--rollout-engine fast` asks for FastEngine outright.

An engine kind that needs more around its actors (a server's options, a router in front of several
servers) has a classmethod `make_fleet(cfg: RunConfig, *, run_dir, num_engines) -> EngineFleet`: the
composition root makes the fleet once, before the engines, registers it with the disposer (so it goes
after them), passes `fleet.engine_kwargs(index, name)` to each constructor and tells it when an
engine joins or leaves.

Health (issue 17): the run probes every engine with `health()` every
`--rollout-health-check-interval` seconds, and bounds every `generate` call by
`--engine-generate-timeout`; an engine that does not answer, reports no progress, or overruns a call
is killed and restarted within the restart budget. An engine answers `health` and `abort` while a
`generate` runs in one of two ways: with `actor_threads = 2` (the composition root gives its actors
that many threads; it must then guard its model itself, as `EmbeddedEngine` does with a lock), or
as an async engine (coroutine methods: Ray runs an async actor's calls concurrently on its event
loop, with its default concurrency; the SGLang engine, which limits its own requests). The probe
skips other engines, which would answer only after the running call: FastEngine says
`actor_threads = 1` (one call at a time), so it is not probed and its abort waits for the call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from miles.types import Generation, SamplingParams

# --rollout-engine NAME -> "module:Class", imported only when a run picks it
ENGINES: dict[str, str] = {
    "embedded": "miles.rollout.engine:EmbeddedEngine",      # transformers + torch sampling, CPU or GPU
    "fast": "miles.rollout.fast_engine:FastEngine",         # Llama/Qwen2/Qwen3 forward, KV cache, CUDA graphs
    "sglang": "miles.rollout.sglang_engine:SGLangEngine",   # SGLang servers (docs/sglang.md), behind sglang-router
}
# what an engine can hand back while the trainer trains, in SGLang's names (release/resume_memory below)
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

# sequences one engine decodes at once when --rollout-max-batch-size is not given. FastEngine: 256,
# vLLM's max_num_seqs default; a decode step of a 0.5B-7B model is bound by reading the weights well
# past that, so 256 rows cost little more per step than 64 (issue 12's H200 bench: 256 requests in
# one batch), and RL rollouts bring hundreds of requests per call. EmbeddedEngine keeps its 64 (the
# CPU path, as before).
EMBEDDED_MAX_BATCH_SIZE = 64
FAST_MAX_BATCH_SIZE = 256
# FastEngine's KV cache: this share of the GPU memory free once its weights are loaded (the rest is
# left to activations and to what shares the GPU, such as the trainer on a one-GPU machine)
FAST_MEM_FRACTION = 0.5


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

    # Optional capabilities, used when the class has them (the composition root looks):
    #   load_weight_bucket(bucket: miles.weights.transport.WeightBucket) -> int | None
    #       one bucket of a CUDA IPC weight update; without it weights go through the object store
    #   release_memory(tags: Sequence[str] = MEMORY_TAGS) / resume_memory(tags = MEMORY_TAGS)
    #       free GPU memory while the trainer trains (--offload-rollout, --colocate), and take it back;
    #       each engine frees what it can of `tags` and ignores the rest (FastEngine keeps its weights,
    #       SGLang frees them too); idempotent. miles.phases.memory says when.
    #   health() -> {"busy": bool, "since_progress_s": float}
    #       answers beside a running call (see the module docstring): seconds since the running
    #       generate last made progress (0.0 idle; an idle engine first proves it can generate; the
    #       SGLang engine counts a finished request, or its server's /health_generate, as progress);
    #       the health monitor's probe
    #   abort() -> None
    #       the generate calls running now return at their next step (finish_reason "abort", with
    #       what each request generated until then)

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
        """Constructor keywords of engine `index` beyond (model_path, device, dtype, seed)."""
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
