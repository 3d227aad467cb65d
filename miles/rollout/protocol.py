"""The engine seam: what the phases and the executor ask of an inference engine, and the registry
of engines `--rollout-engine` picks from.

An engine speaks token ids (see `miles.types`): prompts in, `Generation`s (ids, logprobs, the weight
version that produced them) out. The composition root (`miles/phases/init.py:pick_backends`) picks
the class once, by name, and makes it a Ray actor; nothing else names an engine. A new engine (the CUDA fast
path, SGLang) is a module of its own implementing `Engine`, plus one `ENGINES` entry; its heavy
imports stay in its module, which loads only when a run picks it.

Constructor, for every engine: `Cls(model_path, *, device, dtype, seed)`.

Health (issue 17): the run probes every engine with `health()` every
`--rollout-health-check-interval` seconds, and bounds every `generate` call by
`--engine-generate-timeout`; an engine that does not answer, reports no progress, or overruns a call
is killed and restarted within the restart budget. An engine class that answers `health` and
`abort` while a `generate` runs says so with `actor_threads = 2` (the composition root gives its
actors that many threads; it must then guard its model itself, as `EmbeddedEngine` does with a
lock); the probe skips engines without it, which would answer only after the running call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from miles.types import Generation, SamplingParams

# --rollout-engine NAME -> "module:Class", imported only when a run picks it
ENGINES: dict[str, str] = {
    "embedded": "miles.rollout.engine:EmbeddedEngine",      # transformers + torch sampling, CPU or GPU
}


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

    def health(self) -> dict:
        """Answers at once: {"busy": bool, "since_progress_s": seconds since the running generate
        last produced a token (0.0 when idle)}; an idle engine first proves it can generate."""
        ...

    def abort(self) -> None:
        """Make the generate calls running now return at their next step (finish_reason "abort")."""
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
