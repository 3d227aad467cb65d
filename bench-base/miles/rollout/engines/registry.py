"""`--rollout-engine NAME` -> the engine's spec (`miles.rollout.protocol.EngineSpec`), and the checks
every engine shares: what the picked engine can take (tensor parallelism) and each engine's own flags.

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
from miles.rollout.protocol import EngineSpec

ENGINES: dict[str, EngineSpec] = {
    "embedded": EMBEDDED,   # transformers + torch sampling, CPU or GPU; FastEngine on GPUs for the models it implements
    "fast": FAST,           # Llama/Qwen2 forward, KV cache, CUDA graphs
    "sglang": SGLANG,       # SGLang servers (docs/sglang.md), behind sglang-router
}
assert tuple(ENGINES) == ENGINE_NAMES, "the flag's choices are the registry's names"


@check
def _engines(cfg: RunConfig, problems: list[str]) -> None:
    for engine in ENGINES.values():             # each checks its own flags, picked or not
        if engine.check is not None:
            engine.check(cfg, problems)
    spec, n = ENGINES.get(cfg.rollout.engine), cfg.cluster.rollout_num_gpus_per_engine   # unknown: config's check
    if spec is not None and n != 1 and not spec.tensor_parallel:
        one = " and ".join(name for name, s in ENGINES.items() if not s.tensor_parallel)
        problems.append(f"--rollout-num-gpus-per-engine {n}: the {one} engines run on one GPU each (no tensor "
                        f"parallelism); use 1 and more engines, or --rollout-engine "
                        f"{' / '.join(name for name, s in ENGINES.items() if s.tensor_parallel)}")
