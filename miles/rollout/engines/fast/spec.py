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
    need (`context_len`), which sizes the slots to the K/V: --rollout-max-context-len (the engine caps
    each response by it), or with --max-prompt-len the longest prompt + the longest response the
    rollout or an eval asks for, whichever is smaller."""
    r = cfg.rollout
    out = {**embedded_options(cfg), "mem_fraction": r.mem_fraction, "cuda_graph": r.cuda_graph,
           "torch_compile": r.torch_compile, "attention_kernel": r.attention_kernel}
    if r.chunked_prefill_size is not None:
        out["chunked_prefill_size"] = r.chunked_prefill_size
    needs = [] if r.max_context_len is None else [r.max_context_len]
    if cfg.data.max_prompt_len is not None:
        responses = [r.max_response_len, cfg.eval.max_response_len, *(d.max_response_len for d in cfg.eval.datasets)]
        needs.append(cfg.data.max_prompt_len + max(n for n in responses if n is not None))
    if needs:
        out["context_len"] = min(needs)
    return out


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
