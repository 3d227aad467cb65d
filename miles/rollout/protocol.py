"""The engine seam: what the phases and the executor ask of an inference engine, and the registry
of engines `--rollout-engine` picks from.

An engine speaks token ids (see `miles.types`): prompts in, `Generation`s (ids, logprobs, the weight
version that produced them) out. The composition root (`miles/phases/init.py:pick_backends`) picks
the class once, by name, and makes it a Ray actor; nothing else names an engine. A new engine (the CUDA fast
path, SGLang) is a module of its own implementing `Engine`, plus one `ENGINES` entry; its heavy
imports stay in its module, which loads only when a run picks it.

Constructor, for every engine: `Cls(model_path, *, device, dtype, seed)`. An engine kind that needs
more around its actors (a server's options, GPUs, a router in front of several servers) has a
classmethod `make_fleet(cfg: RunConfig, *, run_dir) -> EngineFleet`: the composition root makes the
fleet once, before the engines, registers it with the disposer (so it goes after them), passes
`fleet.engine_kwargs(index, name)` to each constructor and tells it when an engine joins or leaves.

Memory (optional): `release_memory(tags)` / `resume_memory(tags)` with tags from `MEMORY_TAGS`, both
idempotent, for --offload-rollout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from miles.types import Generation, SamplingParams

# --rollout-engine NAME -> "module:Class", imported only when a run picks it
ENGINES: dict[str, str] = {
    "embedded": "miles.rollout.engine:EmbeddedEngine",      # transformers + torch sampling, CPU or GPU
    "sglang": "miles.rollout.sglang_engine:SGLangEngine",   # SGLang servers (docs/sglang.md), behind sglang-router
}
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")         # what --offload-rollout releases, in SGLang's names


class Engine(Protocol):
    """An inference engine. Methods are called through a Ray actor handle (`.remote`) in a run."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One Generation per prompt, in order; `params.seed` makes a call reproducible."""
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


class EngineFleet(Protocol):
    """Run-level support of one engine kind (see the module docstring); a disposer resource."""

    resource_name: str

    def engine_kwargs(self, index: int, name: str) -> dict[str, Any]:
        """Constructor keywords of engine `index` beyond (model_path, device, dtype, seed)."""
        ...

    def actor_options(self) -> dict[str, Any]:
        """Ray options of each engine actor (the GPUs it asks for)."""
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
