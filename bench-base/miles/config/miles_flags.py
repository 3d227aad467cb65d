"""miles' flags that this build recognizes but does not take, each with its one-line fate.

Every flag of miles' argument parser (radixark/miles @ 31f1ca96, `MILES_FLAGS`; plus the Megatron
flags its launch scripts pass, `MEGATRON_FLAGS`) is either implemented here with miles' meaning (it
is in `miles.config.flags.FLAGS`) or listed in `REFUSED` / `REFUSED_PREFIXES`: a launch script that
passes it stops before anything starts (exit 2) with one line per flag, saying what the flag does in
miles and what to use here. A flag name that is neither is an unknown flag (argparse's error).

A flag that becomes implemented leaves its refused row (tests/unit/test_miles_flags.py fails while a
flag is both implemented and refused).

`python -m miles.config.flags` prints the "coming from miles" table of docs/coming-from-miles.md.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from . import megatron_lm
from .megatron_flags import ACCEPTED, ALIASES, CHECKED, FAMILIES, REQUIRED, SETS, SETS_NOTES, family_of

NOT_YET = "not supported yet"
_NO_ROUTER = ("no miles router here: the executor spreads requests over the engines (SGLang's: the run's "
              "sglang-router, --sglang-router-policy); drop it")
_OWN_ROUTER = "with --rollout-engine sglang the run starts its own sglang-router (more than one engine): drop it"
# --sglang-<flag> [VALUE] that is not refused below is SGLang's own server flag, passed to each server
# as --<flag> [VALUE] (miles.config.flags.split_passthrough; miles exposes every ServerArgs field so)
PASSTHROUGH_PREFIX = "sglang-"
_FULLY_ASYNC = f"{NOT_YET}: --machine async overlaps rollout r+1 with training on r (--update-weights-interval N)"
_EVAL_FLEET = f"{NOT_YET}: evals run on the rollout engines (--machine async overlaps them with training)"
_FT = f"{NOT_YET}: dead or hung engines are restarted by default (--engine-max-restarts, --rollout-health-check-*)"
_AGENTIC = f"{NOT_YET}: multi-turn tool use is --generate-execute-tool-function-path (docs/agents.md)"
_FSDP_RANKS = f"{NOT_YET}: the torch backend's ranks form one FSDP2 group, each a contiguous share of every batch's rows"
_WEIGHT_SYNC = f"{NOT_YET}: weights go to the engines through Ray's object store (CUDA IPC buckets with --colocate)"

# flag (without dashes) -> "what it does in miles; what to use here"
REFUSED: dict[str, str] = {
    # -- driver, async and fault tolerance ---------------------------------------------------------
    "fully-async": f"a persistent rollout producer with a staleness filter; {_FULLY_ASYNC}",
    "max-weight-staleness": f"the fully-async staleness bound; {_FULLY_ASYNC}",
    "async-max-concurrent-samples": f"fully-async concurrency cap; {_FULLY_ASYNC}",
    "async-data-buffer-capacity-factor": f"fully-async buffer size; {_FULLY_ASYNC}",
    "async-unused-samples-handler": f"fully-async: retry or drop stale samples; {_FULLY_ASYNC}",
    "custom-async-data-buffer-path": f"fully-async: a custom sample buffer; {_FULLY_ASYNC}",
    "rollout-submission-granularity": f"fully-async: submit groups or samples; {_FULLY_ASYNC}",
    "pause-generation-mode": f"how generation pauses for a weight update; {NOT_YET}: a weight sync waits "
                             "for the rollout in flight",
    "ft-components": f"which parts fault tolerance covers; {_FT}",
    "control-server-port": f"FastAPI control server for fault-tolerance cells; {NOT_YET}",
    "mini-ft-controller-enable": f"suspends and resumes unhealthy train cells; {NOT_YET}",
    "ci-ft-test-actions": f"injects faults into train cells in CI; {NOT_YET}: --inject-fault STATE:KIND rehearses "
                          "failures here",
    "check-weight-update-selector": "which weights --check-weight-update-equal compares; here it compares a "
                                    "checksum of all of them: drop it",
    "check-weight-update-skip-list": "weights --check-weight-update-equal skips; here it compares a checksum of "
                                     "all of them: drop it",
    "check-weight-update-allow-quant-error": f"tolerance for quantized engines in the weight check; {NOT_YET} "
                                             "(engines hold exact copies here)",
    # -- placement and engines --------------------------------------------------------------------
    "critic-num-nodes": f"nodes for the critic; {NOT_YET}: PPO's critic runs on the trainer's GPUs, one rank beside "
                        "each policy rank (--actor-num-nodes x --actor-num-gpus-per-node): drop it",
    "critic-num-gpus-per-node": f"GPUs per node for the critic; {NOT_YET}: PPO's critic runs on the trainer's GPUs, "
                                "one rank beside each policy rank (--actor-num-nodes x --actor-num-gpus-per-node): drop it",
    "prefill-num-servers": f"prefill/decode disaggregation; {NOT_YET}",
    "rollout-external": f"uses SGLang servers started elsewhere; {NOT_YET}",
    "rollout-external-engine-addrs": f"addresses of SGLang servers started elsewhere; {NOT_YET}",
    "pin-rollout-manager-to-head": "pins miles' RolloutManager actor to the head node; here the rollout "
                                   "executor is one CPU actor of the run: drop it",
    "sglang-config": "a YAML of SGLang models and server groups; here one model, whose server flags are "
                     "given as --sglang-* flags: drop it",
    "sglang-router-ip": f"the address of a running sglang-router; {_OWN_ROUTER}",
    "sglang-router-port": f"the port of a running sglang-router; {_OWN_ROUTER}",
    "use-miles-router": f"miles' own HTTP router in front of the engines; {_NO_ROUTER}",
    "miles-router-timeout": f"miles router request timeout; {_NO_ROUTER}",
    "miles-router-max-connections": f"miles router connection cap; {_NO_ROUTER}",
    "miles-router-health-check-failure-threshold": f"miles router health checks; {_NO_ROUTER}",
    # -- rollout: batches, hooks, multi-turn, data ---------------------------------------------------
    "custom-agent-function-path": f"an agent loop on session servers; {_AGENTIC}",
    "use-session-server": f"token-in/token-out session servers for agents; {_AGENTIC}",
    "tito-model": f"the session servers' tokenizer model; {_AGENTIC}",
    "tool-key": f"the tools of each row; {_AGENTIC}",
    "multimodal-keys": f"images and other media of each row; {NOT_YET}: prompts are text",
    "data-source-path": f"replaces the prompt data source; {NOT_YET}: --prompt-data is a .jsonl or .parquet file",
    "disable-rollout-global-dataset": f"lets a custom rollout function bring its own data; {NOT_YET}",
    "object-store-backend": "how samples travel to the trainer (ray | mooncake); here always Ray's object "
                            "store: drop it",
    "custom-convert-samples-to-train-data-path": "returns the dict of lists miles' Megatron actors read; here the "
                                                 "trainer packs Samples, reading no dict: set fields in "
                                                 "--rollout-sample-filter-path, advantages in "
                                                 "--custom-reward-post-process-path",
    "rollout-buffer-url": "parsed but never read by miles: drop it",
    "fetch-trajectory-retry-times": "parsed but never read by miles: drop it",
    "min-batch-collection-ratio": "parsed but never read by miles: drop it",
    "rollout-task-type": "parsed but never read by miles: drop it",
    # -- training -------------------------------------------------------------------------------------
    "custom-model-provider-path": f"a custom Megatron model provider; {NOT_YET}: the model is "
                                  "AutoModelForCausalLM from --hf-checkpoint",
    "custom-megatron-before-train-step-hook-path": f"a Megatron train-step hook; {NOT_YET}",
    "custom-megatron-post-save-hook-path": f"a hook after each Megatron save; {NOT_YET}",
    "ref-ckpt-step": "the step of a Megatron --ref-load checkpoint; here --ref-load is an HF folder: drop it",
    "observe-training-entropy": "logs the policy entropy; here it is always logged (metric entropy): drop it",
    "get-mismatch-metrics": "logs train/rollout logprob mismatch; here always logged (logprob_diff_rollout, "
                            "train_rollout_k3_kl): drop it",
    "keep-old-actor": "keeps the pre-update policy for off-policy PPO; here old logprobs are computed before "
                      "each rollout's steps (or taken from the engine with --use-rollout-logprobs): drop it",
    "true-on-policy-mode": f"bitwise-equal rollout and training numerics; {NOT_YET}",
    "recompute-logprobs-via-prefill": f"recomputes rollout logprobs with a prefill pass; {NOT_YET}",
    "use-rollout-indexer-replay": "replays the rollout's sparse-attention indexer top-k in training (DeepSeek-V3.2/V4); "
                                  "this build trains dense models with full attention: drop it",
    "allgather-cp": "all-gather context parallelism for sparse-attention models (DeepSeek-V3.2, GLM-5); here dense "
                    "models' is --context-parallel-size (--train-backend megatron): drop it",
    "data-pad-size-multiplier": "pads each packed (thd) batch's length to a multiple of N for miles' Megatron actors; "
                                "here batches are right-padded to their longest row: drop it",
    "experts-shared-outer-loras": "a LoRA layout of MoE experts (adapters shared across experts); not built "
                                  "here (LoRA: --lora-rank): drop it",
    "balance-by-flops": f"balances FLOPs across data-parallel ranks; {_FSDP_RANKS}: drop it",
    "qkv-format": "Megatron's packed (thd) or padded (bshd) layout; here batches are right-padded: drop it",
    "enable-mtp-training": f"trains the multi-token-prediction head; {NOT_YET}",
    # LoRA's options beyond the ones LoRA takes here (--lora-rank ...: docs/algorithms.md "LoRA")
    "lora-type": "Megatron's fused (lora) or split (canonical_lora) adapter layout; here the adapters sit on the HF "
                 "model's own q/k/v and gate/up projections (canonical_lora's layout): drop it",
    "lora-sync-from-tensor": "ships the adapter to SGLang from tensors; here every sync sends the merged weights "
                             "(W + alpha/R B A) by the usual transport: drop it",
    "lora-base-cpu-backup": "a CPU mirror of SGLang's frozen base so that only the adapter is shipped; here every "
                            "sync sends the merged weights: drop it",
    "lora-train-only": f"trains the adapter while the engines keep the frozen base; {NOT_YET} "
                       "(--debug-skip-weight-update keeps the engines on the initial weights)",
    "indep-dp": f"one independent cell per data-parallel replica; {_FSDP_RANKS}",
    # -- weight sync and memory --------------------------------------------------------------------
    "update-weight-transfer-mode": f"broadcast, p2p or disk-delta weight sync; {_WEIGHT_SYNC}",
    "p2p-transfer-num-workers": f"RDMA weight-sync workers; {_WEIGHT_SYNC}",
    "p2p-transfer-timeout": f"RDMA weight-sync timeout; {_WEIGHT_SYNC}",
    "update-weight-disk-dir": f"disk-delta weight sync folder; {_WEIGHT_SYNC}",
    "update-weight-local-checkpoint-dir": f"disk-delta weight sync engine folder; {_WEIGHT_SYNC}",
    "offload-rollout-level": f"what engine memory is offloaded; {NOT_YET}: --offload-rollout frees the KV cache",
    "offload-train-target": f"offload the trainer to cpu or disk; {NOT_YET}: --offload-train moves it to host memory",
    "offload-train-disk-dir": f"the trainer's disk-offload folder; {NOT_YET}: --offload-train moves it to host memory",
    **{f"extra-high-precision-layers-{side}": f"{side} weight names left unquantized when miles quantizes the weights "
                                               f"it sends to FP8/INT4 engines; {NOT_YET}: the engines get the trainer's "
                                               f"weights in --dtype: drop it" for side in ("hf", "megatron")},
    "stream-optimizer-state-to-disk": f"streams optimizer state to disk; {NOT_YET}",
    "rematerialize-param-from-master-weight": f"rebuilds bf16 params from fp32 master weights; {NOT_YET}",
    # -- checkpoints and eval --------------------------------------------------------------------------
    "eval-num-gpus": f"a dedicated eval fleet; {_EVAL_FLEET}",
    "eval-hf-dir": f"HF snapshots for the eval fleet; {_EVAL_FLEET}",
    "eval-max-in-flight": f"evals in flight on the eval fleet; {_EVAL_FLEET}",
    "eval-overflow-policy": f"backpressure or skip when the eval fleet is busy; {_EVAL_FLEET}",
    "eval-keep-snapshots": f"eval-fleet snapshots kept; {_EVAL_FLEET}",
    # -- tracking and debugging --------------------------------------------------------------------------
    "use-prometheus": f"exports metrics to Prometheus; {NOT_YET}: metrics.jsonl, --use-tensorboard, "
                      "--use-wandb, --use-mlflow",
    "use-miles-dashboard": f"miles' web dashboard; {NOT_YET}: miles plot RUN_DIR and miles trace show RUN_DIR",
    "dumper-enable": f"tensor dumps inside Megatron; {NOT_YET}: --save-debug-train-data dumps the train batches",
    "profile-target": f"torch profiler targets; {NOT_YET}",
    "enable-event-analyzer": f"miles' event analyzer; {NOT_YET}: miles trace show RUN_DIR reads the run's trace",
    "debug-deterministic-collective": f"deterministic NCCL collectives; {NOT_YET}",
    "ci-inject-rollout-data-path": "replays recorded rollouts with live engines; here "
                                   "--load-debug-rollout-data replays them without engines",
    # -- eval and tracking flags miles' eval config and launch scripts read, beyond the inventory ------
    **{f"eval-{key}": f"the eval datasets' {key.replace('-', '_')}; here set it per dataset in --eval-config "
                      f"(defaults or a dataset's entry)" for key in ("input-key", "label-key")},
    "eval-tool-key": f"the eval datasets' tools; {_AGENTIC}",
    "eval-custom-rm-path": f"a reward for evals only; {NOT_YET}: a dataset's rm_type in --eval-config picks a "
                           "built-in one",
    # -- the FSDP backend's and the launch scripts' run flags ----------------------------------------
    "fsdp-cpu-offload": f"FSDP parameters and optimizer state on the CPU; {NOT_YET} for the parameters: "
                        "--optimizer-cpu-offload keeps the optimizer state in host memory",
    "wandb-host": "the W&B server; here set WANDB_BASE_URL: drop it",
    "use-distributed-post": "sends the engine requests from Ray actors on every node; here the rollout executor "
                            "sends them (SGLang: through the run's sglang-router): drop it",
}

# Megatron flags miles' launch scripts pass (MODEL_ARGS, PERF_ARGS, OPTIMIZER_ARGS): the architecture
# flags (checked against --hf-checkpoint's config.json), the kernel switches (accepted) and the model
# families this build does not train are in miles.config.megatron_flags; those this build
# implements (--lr, --min-lr, --lr-decay-style, --lr-warmup-iters, --lr-decay-iters, --weight-decay,
# --weight-decay-incr-style, --start-weight-decay, --end-weight-decay, --decoupled-lr, --decoupled-min-lr,
# --adam-beta1, --adam-beta2, --adam-eps, --lr-warmup-fraction, --clip-grad, --seed, --micro-batch-size,
# --global-batch-size, --load, --save, --save-interval, --ref-load, --no-save-optim, --no-load-optim, --no-load-rng,
# --finetune, --recompute-activations, --optimizer-cpu-offload, and for --train-backend megatron
# --tensor/--pipeline/--context-parallel-size, --sequence-parallel) are in FLAGS; the others are here.
MEGATRON_REFUSED: dict[str, str] = {
    # --tensor/--pipeline/--context-parallel-size, --sequence-parallel and --decoder-first/last-pipeline-num-layers
    # are FLAGS (--train-backend megatron); --fp16 sets --dtype float16 (megatron_flags.SETS)
}

# families: any flag starting with the prefix
REFUSED_PREFIXES: dict[str, str] = {
    "eval-sglang-": f"an SGLang option of the eval fleet; {_EVAL_FLEET}",
    "router-": f"an sglang_router option; {_NO_ROUTER}",
    "session-": f"a session-server option for agents; {_AGENTIC}",
    "multi-lora-": f"multi-LoRA training; {NOT_YET}",
    "ci-disable-": "turns off one of --ci-test's checks; here they go together: drop --ci-test or this flag",
}

# Every flag of miles' parser (radixark/miles @ 31f1ca96; families by a representative member), by
# concern, and --mask-offpolicy-in-partial-rollout, --opd-kl-coef, --opd-teacher-key and the LoRA flags beyond
# --lora-rank/--target-modules (a later miles' parser has them: miles/utils/lora/arguments.py), and, on the last
# three lines, flags of a later miles' parser that its run and model scripts pass. The test checks each one's fate.
MILES_FLAGS: tuple[str, ...] = tuple("""
fully-async max-weight-staleness async-max-concurrent-samples async-data-buffer-capacity-factor
async-unused-samples-handler custom-async-data-buffer-path rollout-submission-granularity pause-generation-mode
check-weight-update-equal check-weight-update-selector check-weight-update-skip-list
check-weight-update-allow-quant-error ci-test debug-exit-after-rollout
eval-function-path eval-num-gpus eval-hf-dir eval-max-in-flight eval-overflow-policy eval-keep-snapshots
pin-rollout-manager-to-head control-server-port mini-ft-controller-enable colocate
sglang-config sglang-server-concurrency sglang-cuda-graph-backend-prefill sglang-router-ip sglang-router-port
sglang-router-policy sglang-router-request-timeout-secs sglang-mem-fraction-static router-policy
prefill-num-servers rollout-external rollout-external-engine-addrs rollout-num-gpus num-gpus-per-node
rollout-num-gpus-per-engine actor-num-nodes actor-num-gpus-per-node critic-num-nodes critic-num-gpus-per-node
use-miles-router miles-router-timeout miles-router-max-connections miles-router-health-check-failure-threshold
rollout-temperature rollout-top-p rollout-top-k rollout-max-response-len rollout-max-context-len rollout-stop
rollout-stop-token-ids rollout-seed
rollout-batch-size n-samples-per-prompt over-sampling-batch-size dynamic-sampling-filter-path partial-rollout
mask-offpolicy-in-partial-rollout buffer-filter-path rollout-sample-filter-path rollout-all-samples-process-path
rollout-function-path custom-generate-function-path custom-config-path
generate-max-turns generate-tool-specs-path generate-tool-call-parser generate-execute-tool-function-path
custom-agent-function-path use-session-server tito-model session-server-port
rm-type rm-url custom-rm-path group-rm reward-key custom-reward-post-process-path
disable-rewards-normalization disable-grpo-std-normalization
prompt-data input-key label-key metadata-key tool-key multimodal-keys
apply-chat-template apply-chat-template-kwargs chat-template-path
rollout-shuffle data-source-path disable-rollout-global-dataset
object-store-backend custom-convert-samples-to-train-data-path
rollout-buffer-url fetch-trajectory-retry-times min-batch-collection-ratio rollout-task-type
train-backend megatron-to-hf-mode custom-model-provider-path custom-megatron-before-train-step-hook-path
custom-megatron-post-save-hook-path
loss-type custom-loss-function-path eps-clip eps-clip-high eps-clip-c use-opsm
custom-pg-loss-reducer-function-path calculate-per-token-loss
advantage-estimator normalize-advantages gamma lambd value-clip critic-load critic-save critic-lr
num-critic-only-steps
kl-coef use-kl-loss kl-loss-coef kl-loss-type use-unbiased-kl ref-load ref-ckpt-step ref-update-interval
entropy-coef observe-training-entropy
use-rollout-logprobs use-tis tis-clip tis-clip-low custom-tis-function-path get-mismatch-metrics keep-old-actor
skip-actor-forward-only true-on-policy-mode recompute-logprobs-via-prefill use-rollout-routing-replay
global-batch-size num-steps-per-rollout micro-batch-size use-dynamic-batch-size max-tokens-per-gpu
log-probs-max-tokens-per-gpu use-dynamic-global-batch-size balance-data balance-by-flops qkv-format
use-opd opd-type opd-kl-coef opd-teacher-load opd-teacher-urls opd-teacher-key lora-rank target-modules multi-lora-rank
lora-alpha lora-dropout lora-type exclude-modules lora-adapter-path lora-sync-from-tensor lora-base-cpu-backup
lora-train-only
enable-mtp-training indep-dp
update-weight-transfer-mode p2p-transfer-num-workers p2p-transfer-timeout update-weight-disk-dir
update-weight-local-checkpoint-dir update-weight-buffer-size update-weights-interval debug-skip-weight-update
offload offload-train offload-rollout offload-rollout-level offload-train-target offload-train-disk-dir
train-memory-margin-bytes stream-optimizer-state-to-disk rematerialize-param-from-master-weight
load save save-interval async-save no-save-optim start-rollout-id save-hf save-trigger-sentinel
eval-prompt-data eval-config eval-interval skip-eval-before-train eval-temperature eval-max-response-len
eval-max-prompt-len eval-max-context-len n-samples-per-eval-prompt eval-sglang-mem-fraction-static log-passrate
ci-metric-checker-key ci-metric-checker-threshold
use-fault-tolerance ft-components rollout-health-check-interval rollout-health-check-timeout
rollout-health-check-first-wait ci-ft-test-actions
use-wandb use-tensorboard use-mlflow use-prometheus use-miles-dashboard
custom-rollout-log-function-path log-reward-category mfu-peak-tflops
debug-rollout-only debug-train-only save-debug-rollout-data load-debug-rollout-data save-debug-train-data
dump-details ci-inject-rollout-data-path dumper-enable profile-target enable-event-analyzer
debug-deterministic-collective
ci-disable-kl-checker ci-save-grad-norm ci-load-grad-norm ci-save-model-hash ci-check-model-hash
hf-checkpoint num-rollout num-epoch rollout-max-prompt-len
no-offload-train no-offload-rollout offload-train-disk-chunk-mb allgather-cp data-pad-size-multiplier
experts-shared-outer-loras extra-high-precision-layers-hf extra-high-precision-layers-megatron use-distributed-post
use-rollout-indexer-replay
""".split())


# miles' --rm-type values this build does not have (miles/rollout/rm_hub): what each is; what to use
MILES_RM_TYPES: dict[str, str] = {
    "ifbench": "IFBench instruction-following checks (allenai/IFBench, which miles clones from GitHub at run time; "
               "this build fetches no code at run time): install IFBench's checks and call them from a reward of "
               "your own, --custom-rm-path module:function (docs/algorithms.md, Rewards)",
}


def rm_type_problem(rm_type: str, here: Iterable[str]) -> str:
    """The line for an --rm-type this build does not have: miles' meaning and what to use, or the list."""
    name = rm_type.removeprefix("boxed_")
    if name in MILES_RM_TYPES:
        return f"--rm-type {rm_type} is miles' {MILES_RM_TYPES[name]}"
    return f"--rm-type {rm_type}: no such reward type; use one of {', '.join(here)} (or --custom-rm-path)"


# miles' values with another name here: dest -> {miles' value: this build's}
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "train_backend": {"fsdp": "torch"},   # miles' FSDP backend trains the HF model, as --train-backend torch does
    "dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"},   # the short names torch users write
}


def miles_value_aliases(values: Mapping[str, object]) -> dict[str, object]:
    """The flag values (by argparse dest) that miles spells differently, in this build's spelling."""
    return {dest: VALUE_ALIASES[dest][v] for dest, v in values.items()
            if dest in VALUE_ALIASES and v in VALUE_ALIASES[dest]}


def all_refused() -> dict[str, str]:
    """Every exact-name refusal: miles', those of the Megatron flags miles' scripts pass, and Megatron-LM's."""
    return {**megatron_lm.REFUSED_LINES, **REFUSED, **MEGATRON_REFUSED}


def fate(name: str) -> str | None:
    """The fate of a refused flag (`name` without dashes; `no-X` is X's), or None if not refused."""
    table = all_refused()
    for candidate in (name, name.removeprefix("no-")):
        if candidate in table:
            return table[candidate]
        if (family := family_of(candidate)) is not None:
            return f"{family}: {FAMILIES[family].line}"
        for prefix in sorted(REFUSED_PREFIXES, key=len, reverse=True):
            if candidate.startswith(prefix):
                return REFUSED_PREFIXES[prefix]
    return None


def passed_through(name: str) -> str:
    """What happens to a flag that is neither implemented nor refused: an SGLang server flag, or unknown."""
    if name.startswith(PASSTHROUGH_PREFIX) and fate(name) is None:
        return f"passed to each SGLang server as --{name[len(PASSTHROUGH_PREFIX):]} (--rollout-engine sglang)"
    return "unknown"


def refusal_line(name: str) -> str:
    return f"--{name} is a miles flag this build does not take: {fate(name)}"


def refusal_lines(names: Iterable[str]) -> list[str]:
    """One line per refused flag; the flags of one refused Megatron family share one line."""
    by_family: dict[str, list[str]] = {}
    for name in dict.fromkeys(names):
        family = family_of(name) or family_of(name.removeprefix("no-"))     # a family's own no- switch too
        by_family.setdefault(family or f"--{name}", []).append(name)
    lines = []
    for key, members in by_family.items():
        if key.startswith("--"):
            lines.append(refusal_line(members[0]))
        else:
            flags = ", ".join(f"--{m}" for m in members)
            lines.append(f"{flags} {'is a' if len(members) == 1 else 'are'} miles flag{'s' * (len(members) > 1)} "
                         f"this build does not take: {fate(members[0])}")
    return lines


def refused_in(argv: Iterable[str]) -> tuple[list[str], list[str]]:
    """Sort the tokens argparse did not recognize: (refused flag names, other tokens as given). A
    token that is not a flag is a refused flag's value when one precedes it, else unrecognized."""
    refused, unknown, after_refused = [], [], False
    for token in argv:
        if not token.startswith("--") or token == "--":
            if not after_refused:
                unknown.append(token)
            continue
        name, eq, _ = token[2:].partition("=")
        is_refused = fate(name) is not None
        (refused if is_refused else unknown).append(name if is_refused else token)
        # a refused switch (Megatron-LM's kinds) has no values: a token after it is a stray
        after_refused = is_refused and not eq and megatron_lm.takes_values(name)
    return refused, unknown


def markdown(implemented: Mapping[str, str]) -> str:
    """The "coming from miles" tables: `implemented` maps flag names to their help lines."""
    lines = ["| miles flag | here |", "|---|---|"]
    for name in sorted(set(MILES_FLAGS) | set(REFUSED)):
        here = ("implemented: " + implemented[name] if name in implemented else
                f"implemented: {SETS_NOTES[name]}" if name in SETS else
                f"accepted: {ACCEPTED[name].note}" if name in ACCEPTED else fate(name) or passed_through(name))
        lines.append(f"| `--{name}` | {here.replace('|', '/')} |")
    lines += ["", "| flag family | here |", "|---|---|"]
    lines += [f"| `--{prefix}*` | {text} |" for prefix, text in sorted(REFUSED_PREFIXES.items())]
    lines += ["", "| Megatron flag | here |", "|---|---|"]
    rows = {name: text for name, text in MEGATRON_REFUSED.items()}
    rows |= {name: f"checked: must equal --hf-checkpoint's config.json ({f.hf})" for name, f in CHECKED.items()}
    rows |= {name: f"accepted with {f.required} only: {f.note}" for name, f in REQUIRED.items()}
    rows |= {name: f"accepted: {f.note}" for name, f in ACCEPTED.items() if name not in MILES_FLAGS}
    rows |= {name: f"implemented: {SETS_NOTES[name]}" for name in SETS if name not in MILES_FLAGS}
    rows |= {name: f"implemented: Megatron-LM's name of --{dest.replace('_', '-')}" for name, dest in ALIASES.items()}
    lines += [f"| `--{name}` | {text.replace('|', '/')} |" for name, text in sorted(rows.items())]
    lines += ["", "| Megatron family | flags | here |", "|---|---|---|"]
    for family, f in FAMILIES.items():     # a family's names its prefixes cover are not listed again
        flags = [f"`--{p}*`" for p in f.prefixes] + [f"`--{n}`" for n in f.names if not n.startswith(f.prefixes)]
        lines.append(f"| {family} | {', '.join(flags)} | {f.line} |")
    lines += ["", "| Megatron-LM flags (beyond miles' scripts), accepted | flags | here |", "|---|---|---|"]
    lines += [f"| {name} | {', '.join(f'`--{n}`' for n in g.flags)} | accepted: {g.line} |"
              for name, g in megatron_lm.ACCEPTED.items()]
    lines += ["", "| Megatron-LM flag (beyond miles' scripts) | here |", "|---|---|"]
    lines += [f"| `--{name}` | {text} |" for name, text in sorted(megatron_lm.REFUSED_LINES.items())]
    return "\n".join(lines) + "\n"

