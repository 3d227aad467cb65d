"""FastEngine's spec: our own Llama/Qwen2/Qwen3/Qwen3-MoE forward, KV cache and CUDA graphs (eager on CPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles.rollout.engines.embedded.spec import options as embedded_options
from miles.rollout.protocol import (EngineSpec, SupportsAbort, SupportsHealth, SupportsInFlightWeightSwap,
                                    SupportsMemoryRelease, SupportsWeightBucketLoad)

if TYPE_CHECKING:
    from miles.config import RunConfig


# sequences one engine decodes at once when --rollout-max-batch-size is not given: 256, vLLM's max_num_seqs
# default; a decode step of a 0.5B-7B model is bound by reading the weights well past that, so 256 rows cost
# little more per step than 64 (an H200 bench: 256 requests in one batch), and RL rollouts bring hundreds of
# requests per call
MAX_BATCH_SIZE = 256
# the KV cache: this share of the GPU memory free once its weights are loaded (the rest is left to
# activations and to what shares the GPU, such as the trainer on a one-GPU machine)
MEM_FRACTION = 0.5
CHUNKED_PREFILL_SIZE = 8192   # longer prompts are prefilled in pieces of this many tokens


def options(cfg: RunConfig) -> dict[str, Any]:
    """The embedded engine's, plus the KV cache's share of the GPU, the --disable-* switches, the
    prefill piece (--rollout-chunked-prefill-size, when given), and the positions every request may
    need (`context_len`, `_context_len`), which sizes the slots to the K/V: for rollouts and for evals,
    their context cap (--rollout-max-context-len, --eval-max-context-len: the engine caps each response
    by it) or their prompt limit + their longest response, whichever is smaller; `shared_gpu` when a
    trainer stays resident on the engine's GPU (--colocate --no-offload-rollout)."""
    r = cfg.rollout
    out = {**embedded_options(cfg), "cuda_graph": r.cuda_graph, "torch_compile": r.torch_compile,
           "attention_kernel": r.attention_kernel}
    if r.mem_fraction is not None:
        out["mem_fraction"] = r.mem_fraction
    if r.chunked_prefill_size is not None:
        out["chunked_prefill_size"] = r.chunked_prefill_size
    if r.page_size is not None:
        out["page_size"] = r.page_size
    context_len = _context_len(cfg)
    if context_len is not None:
        out["context_len"] = context_len
    if cfg.cluster.shares_gpu_resident:
        out["shared_gpu"] = True
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


MIN_PAGE_SIZE = 16    # smaller pages: a table entry and a host-side grow every few positions of every sequence


def check(cfg: RunConfig, problems: list[str]) -> None:
    """--rollout-engine fast names a model FastEngine implements (`embedded` falls back instead); its page size."""
    r = cfg.rollout
    if r.page_size is not None and r.engine != "fast":
        problems.append(f"--rollout-page-size {r.page_size} is the fast engine's paged KV cache; add --rollout-engine "
                        "fast (an SGLang server's is --sglang-page-size N)")
    if r.page_size is not None and 0 < r.page_size < MIN_PAGE_SIZE:
        problems.append(f"--rollout-page-size {r.page_size}: use {MIN_PAGE_SIZE} or more (64 suits the decode kernel)")
    if cfg.rollout.engine != "fast":
        return
    refused = refusal(cfg.model.hf_checkpoint)
    if refused:
        problems.append(f"--rollout-engine fast cannot run --hf-checkpoint {cfg.model.hf_checkpoint}: {refused}; "
                        "use --rollout-engine embedded (transformers)")


def shared_gpu_bytes(cfg: RunConfig, total_bytes: int, weight_bytes: int) -> int:
    """The KV cache and workspace the engine holds beside a resident trainer: --rollout-mem-fraction of the
    GPU less its weights (`cache.shared_plan_bytes`), and the workspace its batch and prefill sizes need."""
    from transformers import AutoConfig

    from miles.rollout.engines.fast.cache import PREFILL_TOKENS, RESERVE_BYTES, shared_held_bytes, workspace_bytes
    from miles.rollout.engines.fast.model import Arch

    config = AutoConfig.from_pretrained(cfg.model.hf_checkpoint)
    arch, r = Arch.from_config(config), cfg.rollout
    experts = getattr(config, "num_experts", None)
    moe = (config.num_experts_per_tok, config.moe_intermediate_size, experts) if experts else None
    workspace = workspace_bytes(rows=(r.max_batch_size or MAX_BATCH_SIZE) + 1, vocab=arch.vocab, hidden=arch.hidden,
                                intermediate=arch.intermediate, q_size=arch.q_size,
                                elem=4 if cfg.model.dtype == "float32" else 2,
                                prefill_tokens=max(PREFILL_TOKENS, r.chunked_prefill_size or CHUNKED_PREFILL_SIZE),
                                moe=moe, reserve=RESERVE_BYTES)
    fraction = MEM_FRACTION if r.mem_fraction is None else r.mem_fraction
    return shared_held_bytes(total_bytes=total_bytes, weight_bytes=weight_bytes, mem_fraction=fraction,
                             workspace=workspace)


# three threads: health, abort and an in-flight weight swap (--fully-async: taken between two decode steps)
# are answered while a generate call runs (the engine guards its model)
SPEC = EngineSpec(engine="miles.rollout.engines.fast.engine:FastEngine", options=options, check=check,
                  capabilities=(SupportsWeightBucketLoad, SupportsMemoryRelease, SupportsHealth, SupportsAbort,
                                SupportsInFlightWeightSwap),
                  actor_threads=3, refuses=refusal,
                  defaults={"max_batch_size": MAX_BATCH_SIZE, "mem_fraction": MEM_FRACTION,
                            "chunked_prefill_size": CHUNKED_PREFILL_SIZE},
                  weights_on_release="kept",  # updates copy into them in place (the captured graphs stay valid)
                  routing_replay=True,        # Qwen3-MoE: each sampled token's experts (miles.rollout.engines.fast.moe)
                  shared_gpu_bytes=shared_gpu_bytes)
