"""FastEngine's spec: our own Llama/Qwen2 forward, KV cache and CUDA graphs (eager on CPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles.rollout.engines.embedded.spec import options as embedded_options
from miles.rollout.protocol import (EngineSpec, SupportsAbort, SupportsHealth, SupportsMemoryRelease,
                                    SupportsWeightBuckets)

if TYPE_CHECKING:
    from miles.config import RunConfig


def options(cfg: RunConfig) -> dict[str, Any]:
    """The embedded engine's, plus the KV cache's share of the GPU, the --disable-* switches, the
    prefill piece (--rollout-chunked-prefill-size, when given), and the positions every request may
    need (`context_len`, `_context_len`), which sizes the slots to the K/V: for rollouts and for evals,
    their context cap (--rollout-max-context-len, --eval-max-context-len: the engine caps each response
    by it) or their prompt limit + their longest response, whichever is smaller."""
    r = cfg.rollout
    out = {**embedded_options(cfg), "mem_fraction": r.mem_fraction, "cuda_graph": r.cuda_graph,
           "torch_compile": r.torch_compile, "attention_kernel": r.attention_kernel}
    if r.chunked_prefill_size is not None:
        out["chunked_prefill_size"] = r.chunked_prefill_size
    context_len = _context_len(cfg)
    if context_len is not None:
        out["context_len"] = context_len
    return out


def _context_len(cfg: RunConfig) -> int | None:
    """The positions any request may need: the larger of a rollout request's and an eval request's, each
    the smaller of its context cap and its prompt limit + its longest response (None: one is unbounded)."""
    r, e = cfg.rollout, cfg.eval

    def bound(context: int | None, prompt: int | None, responses: list[int | None]) -> int | None:
        bounds = [] if context is None else [context]
        if prompt is not None:
            bounds.append(prompt + max(n for n in responses if n is not None))
        return min(bounds) if bounds else None

    rollout = bound(r.max_context_len, cfg.data.max_prompt_len, [r.max_response_len])
    evals = bound(r.max_context_len if e.max_context_len is None else e.max_context_len,
                  cfg.data.max_prompt_len if e.max_prompt_len is None else e.max_prompt_len,
                  [e.max_response_len or r.max_response_len, *(d.max_response_len for d in e.datasets)])
    return None if rollout is None or evals is None else max(rollout, evals)


def refusal(hf_checkpoint: str) -> str | None:
    """None when FastEngine implements the checkpoint's model; else why not."""
    from transformers import AutoConfig

    from miles.rollout.engines.fast.model import supports

    try:
        config = AutoConfig.from_pretrained(hf_checkpoint)
    except (OSError, ValueError) as exc:
        return f"its config does not load ({exc})"
    return supports(config)


def check(cfg: RunConfig, problems: list[str]) -> None:
    """--rollout-engine fast names a model FastEngine implements (`embedded` falls back instead)."""
    if cfg.rollout.engine != "fast":
        return
    refused = refusal(cfg.model.hf_checkpoint)
    if refused:
        problems.append(f"--rollout-engine fast cannot run --hf-checkpoint {cfg.model.hf_checkpoint}: {refused}; "
                        "use --rollout-engine embedded (transformers)")


# two threads: health and abort are answered while a generate call runs (the engine guards its model)
SPEC = EngineSpec(engine="miles.rollout.engines.fast.engine:FastEngine", options=options, check=check,
                  capabilities=(SupportsWeightBuckets, SupportsMemoryRelease, SupportsHealth, SupportsAbort),
                  actor_threads=2, refuses=refusal)
