"""`--rollout-engine NAME` -> the engine's spec (`miles.rollout.protocol.EngineSpec`), the engine a run
actually gets (`engine_to_run`), and the checks every engine shares, stated once in terms of the specs'
attributes: what the picked engine can take (tensor parallelism, a skipped weight sync) and each
engine's own flags (`EngineSpec.check`). Outside an engine's package, this is the one module that names
engines.

The spec modules are light (no torch, no Ray): this registry loads on every parse of the flags, to
check them before Ray starts. An engine's class loads only when a run picks it.
"""

from __future__ import annotations

from miles.config import RunConfig
from miles.config.checks import check
from miles.config.schema import ENGINE_NAMES
from miles.rollout.engines.embedded.spec import SPEC as EMBEDDED
from miles.rollout.engines.fast.spec import SPEC as FAST
from miles.rollout.engines.sglang.spec import SPEC as SGLANG
from miles.rollout.protocol import EngineSpec, SupportsInFlightWeightSwap

ENGINES: dict[str, EngineSpec] = {
    "embedded": EMBEDDED,   # transformers + torch sampling, CPU or GPU; FastEngine on GPUs for the models it implements
    "fast": FAST,           # Llama/Qwen2 forward, KV cache, CUDA graphs
    "sglang": SGLANG,       # SGLang servers (docs/sglang.md), behind sglang-router
}
assert tuple(ENGINES) == ENGINE_NAMES, "the flag's choices are the registry's names"


def engine_to_run(cfg: RunConfig, *, on_gpus: bool) -> tuple[str, str | None]:
    """The ENGINES name the run uses, and why the preferred one was refused (None: taken, or none).

    On GPUs an engine whose spec prefers another gives way to it for the models it implements
    (`embedded` becomes FastEngine; else it stays EmbeddedEngine, as on CPU). `fast` asked outright is
    FastEngine anywhere (CPU too: eager, what CI tests). Everything that depends on the engine that runs
    (the composition root, the memory plan) asks here, never the asked name.
    """
    asked = cfg.rollout.engine
    preferred = ENGINES[asked].prefer_on_gpus
    if preferred is None or not on_gpus:
        return asked, None
    if cfg.fully_async and not ENGINES[preferred].supports(SupportsInFlightWeightSwap):
        return asked, (f"--fully-async swaps weights under the requests in flight, which the {preferred} engine "
                       "does not implement yet (docs/fully-async.md)")
    refuses = ENGINES[preferred].refuses
    refused = refuses(cfg.model.hf_checkpoint) if refuses is not None else None
    return (asked, refused) if refused else (preferred, None)


def _quantization_config(path: str) -> dict:
    """config.json's quantization_config ({} if none; json only: this module loads on every parse)."""
    import json
    from pathlib import Path

    try:
        return json.loads((Path(path) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return {}


@check
def _precision(cfg: RunConfig, problems: list[str]) -> None:
    """--kv-cache-dtype fp8_e4m3 needs an engine with its own KV cache (fast; SGLang's servers take it too)."""
    r = cfg.rollout
    # the flags' choices, for values from a --config file (argparse checks the command line's)
    if r.quantization not in (None, "none", "fp8"):
        problems.append(f"--rollout-quantization {r.quantization}: use fp8 or none")
    if r.kv_cache_dtype not in ("auto", "fp8_e4m3"):
        problems.append(f"--kv-cache-dtype {r.kv_cache_dtype}: use auto or fp8_e4m3 (scale 1; docs/fp8.md)")
    q = _quantization_config(cfg.model.hf_checkpoint)
    if q and (q.get("quant_method") != "fp8" or q.get("weight_block_size") != [128, 128]):
        problems.append(f"--hf-checkpoint {cfg.model.hf_checkpoint}: quantization_config {q.get('quant_method')!r} with "
                        f"weight_block_size {q.get('weight_block_size')}: only FP8 checkpoints with 128x128 blocks "
                        "(Qwen3-FP8's layout) are read here; use the bf16 checkpoint with --rollout-quantization fp8")
    if cfg.train.backend == "megatron" and q.get("quant_method") == "fp8":
        problems.append(f"--hf-checkpoint {cfg.model.hf_checkpoint} is FP8 (quantization_config fp8): the megatron "
                        "backend does not read FP8 checkpoints; use --train-backend torch (it dequantizes them) or "
                        "a bf16 checkpoint with --rollout-quantization fp8")
    if r.kv_cache_dtype != "auto" and r.engine == "embedded" and cfg.model.device == "cpu":
        problems.append(f"--kv-cache-dtype {r.kv_cache_dtype}: the embedded engine keeps transformers' KV cache in "
                        "--dtype; use --rollout-engine fast (its own cache, FP8 emulated on the CPU) or drop the flag")


@check
def _routing_replay(cfg: RunConfig, problems: list[str]) -> None:
    """R3 reads the experts the engine recorded: an engine that does not capture them cannot feed it."""
    engine = ENGINES.get(cfg.rollout.engine)        # unknown: the flag's choices say so
    if cfg.train.use_rollout_routing_replay and engine is not None and not engine.routing_replay:
        problems.append(f"--use-rollout-routing-replay with --rollout-engine {cfg.rollout.engine}: the engine's "
                        "routed-experts capture is not wired into the samples yet; use --rollout-engine "
                        f"{' / '.join(n for n, e in ENGINES.items() if e.routing_replay)}")


@check
def _engines(cfg: RunConfig, problems: list[str]) -> None:
    for engine in ENGINES.values():             # each checks its own flags, picked or not
        if engine.check is not None:
            engine.check(cfg, problems)
    if cfg.debug_skip_weight_update and cfg.cluster.offloads_rollout and cfg.rollout.engine in ENGINES \
            and ENGINES[cfg.rollout.engine].weights_on_release == "dropped":
        problems.append(f"--debug-skip-weight-update with --rollout-engine {cfg.rollout.engine} and --offload / "
                        "--offload-rollout / --colocate: its engines drop their weights while the trainer trains and "
                        "only a weight sync gives them back; drop the offload flags or --debug-skip-weight-update")
    spec, n = ENGINES.get(cfg.rollout.engine), cfg.cluster.rollout_num_gpus_per_engine   # unknown: config's check
    if spec is not None and n != 1 and not spec.tensor_parallel:
        one = " and ".join(name for name, s in ENGINES.items() if not s.tensor_parallel)
        problems.append(f"--rollout-num-gpus-per-engine {n}: the {one} engines run on one GPU each (no tensor "
                        f"parallelism); use 1 and more engines, or --rollout-engine "
                        f"{' / '.join(name for name, s in ENGINES.items() if s.tensor_parallel)}")
