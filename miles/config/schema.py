"""Typed run configuration: one frozen dataclass per concern, built from flags, YAML or code.

Every component receives its own slice (`RolloutConfig`, `TrainConfig`, ...), never the whole
`RunConfig`. Flag names are miles' (`--rollout-batch-size` is `RolloutConfig.batch_size`); the
mapping lives in `miles/config/flags.py`. Validation collects every problem and raises one `ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Collection, Mapping

from miles.algorithms.names import AdvantageEstimator, KlLossType, LossAggMode, LossType
from miles.config.user_functions import USER_FUNCTIONS

# the names --rollout-engine and --train-backend take; the registries behind them (miles.rollout.engines.registry.ENGINES,
# miles.training.protocol.TRAIN_BACKENDS) have exactly these keys
ENGINE_NAMES = ("embedded", "fast", "sglang")
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")   # sglang-router 0.3 --policy
TRAIN_BACKEND_NAMES = ("torch", "megatron")
# miles' FSDP backend's --attn-implementation values (HF's attn_implementation names); accepted, no effect here
ATTN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "sdpa", "eager", "flex_attention")
MEGATRON_TO_HF_MODES = ("raw", "bridge")   # miles' --megatron-to-hf-mode values
SECRET = {"secret": True}   # field metadata: as_dict (config.yaml, trackers' run config) writes "<redacted>"
# --opd-type: where the OPD teacher scores the samples (miles' names: megatron = inside the trainer)
OPD_TYPES = ("sglang", "megatron")
OPD_DEFAULT_TEACHER = "default"     # --opd-teacher-urls: the teacher of samples that name none (miles' reserved name)


def parse_opd_teachers(entries: tuple[str, ...]) -> dict[str, str]:
    """--opd-teacher-urls NAME=URL ... -> {name: url}; a bare URL is the 'default' teacher's. Splits at the
    first '=' (miles'), so a URL's query string survives; ValueError on a malformed or repeated entry."""
    teachers: dict[str, str] = {}
    for entry in entries:
        name, sep, url = entry.partition("=") if not entry.startswith(("http://", "https://")) else ("", "", entry)
        name, url = (name.strip() or OPD_DEFAULT_TEACHER), url.strip()
        if (sep and not name) or not url.startswith(("http://", "https://")):
            raise ValueError(f"--opd-teacher-urls entry {entry!r}: expected NAME=URL (or a bare URL) with an "
                             "http:// or https:// URL")
        if name in teachers:
            raise ValueError(f"--opd-teacher-urls names teacher {name!r} twice")
        teachers[name] = url
    return teachers

# every function a run loads by path: flag -> (config section, field), from the one table
# (miles.config.user_functions). What actors import, so what a run on an attached cluster ships; a config
# file's relative file paths are read relative to the file
USER_FUNCTION_FLAGS: dict[str, tuple[str, str]] = {f.flag: (f.section, f.field) for f in USER_FUNCTIONS}


class ConfigError(ValueError):
    """Bad configuration or input. `problems` lists each one; the CLI exits with code 2."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(f"  - {p}" for p in self.problems) if len(self.problems) > 1 else self.problems[0])


# --dtype's names (and their short forms) -> the dtype; miles.weights.hf.resolve_dtype maps these to torch's
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def trainer_ranks(actor_num_nodes: int, actor_num_gpus_per_node: int) -> int:
    """The one rule of the trainer's ranks (`ClusterConfig.trainer_ranks`, the placement's request):
    --actor-num-nodes x --actor-num-gpus-per-node, one per trainer GPU (or CPU process)."""
    return actor_num_nodes * actor_num_gpus_per_node


def uses_gpus(device: str, cluster_gpus: int) -> bool:
    """The one rule of where a run computes: --device cuda, or --device auto in a cluster with GPUs."""
    return cluster_gpus > 0 if device == "auto" else device.startswith("cuda")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    hf_checkpoint: str                  # --hf-checkpoint: HF-format folder (model + tokenizer)
    device: str = "auto"                # --device: auto | cpu | cuda
    dtype: str = "auto"                 # --dtype: auto (fp32 on CPU, bf16 on GPU) | float32 | bfloat16 | float16 (--fp16)

    @property
    def on_gpus(self) -> bool | None:
        """Whether engines and trainers run on GPUs: True for --device cuda, False for cpu, None for
        auto, which the cluster decides (`uses_gpus`)."""
        return None if self.device == "auto" else self.device.startswith("cuda")

    def uses_gpus(self, cluster_gpus: int) -> bool:
        return uses_gpus(self.device, cluster_gpus)

    @property
    def float16(self) -> bool:
        """--fp16 (--dtype float16): the trainers compute in float16 under loss scaling."""
        return DTYPES.get(self.dtype) == "float16"


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    prompt_data: str                    # --prompt-data: .jsonl or .parquet
    input_key: str = "input"            # --input-key
    label_key: str | None = None        # --label-key
    metadata_key: str | None = None     # --metadata-key
    apply_chat_template: bool = False   # --apply-chat-template
    rollout_shuffle: bool = False       # --rollout-shuffle / --no-rollout-shuffle (miles: off)
    max_prompt_len: int | None = None   # --max-prompt-len: drop longer prompts (tokens)
    response_key: str = "response"      # --response-key: the response's key in SFT data (--loss-type sft_loss)
    chat_template_path: str | None = None  # --chat-template-path: a Jinja chat template instead of the tokenizer's
    apply_chat_template_kwargs: dict[str, Any] | None = None  # --apply-chat-template-kwargs: JSON, to the template


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    batch_size: int                     # --rollout-batch-size: prompts per rollout
    n_samples_per_prompt: int = 1       # --n-samples-per-prompt (miles: 1)
    max_response_len: int = 64          # --rollout-max-response-len
    temperature: float = 1.0            # --rollout-temperature
    top_p: float = 1.0                  # --rollout-top-p
    top_k: int = -1                     # --rollout-top-k
    num_engines: int | None = None      # --rollout-num-engines (None: the placement picks, cluster/auto_layout.py)
    engine: str = "embedded"            # --rollout-engine: one of ENGINE_NAMES
    rm_type: str = "math"               # --rm-type
    custom_rm_path: str | None = None   # --custom-rm-path module:function
    seed: int | None = None             # --rollout-seed (None: --seed; read it as RunConfig.rollout_seed)
    engine_max_restarts: int = 3        # --engine-max-restarts: restarts of dead engines allowed ...
    engine_restart_window_s: float = 600.0  # --engine-restart-window: ... within any window of this many seconds
    dynamic_sampling_filter_path: str | None = None  # --dynamic-sampling-filter-path: keep a group iff filter(group)
    over_sampling_batch_size: int | None = None  # --over-sampling-batch-size: prompts per sampling round (None: batch_size)
    dynamic_sampling_max_rounds: int = 8  # --dynamic-sampling-max-rounds: then fill up with filtered-out groups
    # --partial-rollout (miles.rollout.partial): the groups dynamic sampling aborts are continued next rollout
    partial_rollout: bool = False
    mask_offpolicy_in_partial_rollout: bool = False  # --mask-offpolicy-in-partial-rollout: train only the last part
    buffer_filter_path: str | None = None  # --buffer-filter-path: fn(ctx, rollout_id, buffer, num_groups) -> groups
    # miles' rollout hooks (miles.rollout.hooks), module:function each
    sample_filter_path: str | None = None  # --rollout-sample-filter-path: fn(ctx, groups) marks samples in place
    all_samples_process_path: str | None = None  # --rollout-all-samples-process-path: fn(ctx, all_groups)
    reward_post_process_path: str | None = None  # --custom-reward-post-process-path: fn(ctx, samples) -> (raw, adv)
    log_function_path: str | None = None  # --custom-rollout-log-function-path: fn(ctx, samples, metrics, time_s)
    custom_config_path: str | None = None  # --custom-config-path: YAML of extra arguments (flags, custom keys)
    # its keys that name no flag, read by custom functions as ctx.KEY (miles.user_code.CustomArgs)
    custom_args: Mapping[str, Any] = field(default_factory=dict)
    log_reward_category: str | None = None  # --log-reward-category KEY: share of samples per metadata[KEY]
    overlong_buffer_len: int | None = None  # --overlong-buffer-len: DAPO overlong penalty over the last N tokens
    overlong_penalty_factor: float = 1.0  # --overlong-penalty-factor: the penalty at max_response_len
    stop: tuple[str, ...] = ()          # --rollout-stop: stop strings (the response ends with the one it hit)
    stop_token_ids: tuple[int, ...] = ()  # --rollout-stop-token-ids: stop tokens besides EOS
    max_context_len: int | None = None  # --rollout-max-context-len: prompt + response tokens at most
    # the engine's limits and switches (each engine's spec says which it reads: its options)
    max_batch_size: int | None = None   # --rollout-max-batch-size: sequences one engine decodes at once (None: its own)
    mem_fraction: float | None = None   # --rollout-mem-fraction: the KV cache's share of free GPU memory (None: the engine's)
    cuda_graph: bool = True             # --disable-cuda-graph: decode steps run eagerly
    torch_compile: bool = True          # --disable-torch-compile: the layers' pieces run eagerly
    attention_kernel: bool = True       # --disable-attention-kernel: decode attention by the stock SDPA call
    chunked_prefill_size: int | None = None  # --rollout-chunked-prefill-size: FastEngine's prefill piece (None: its own)
    page_size: int | None = None        # --rollout-page-size: FastEngine's paged KV cache, positions a page (None: per slot)
    # --rollout-quantization (miles' --fp8-rollout; SGLang's --quantization): fp8 = the engines' decoder Linear
    # weights in e4m3 with 128x128 block scales; none; None: as --hf-checkpoint is stored (an FP8 one stays FP8)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"        # --kv-cache-dtype: FastEngine's KV cache, auto (the compute dtype) | fp8_e4m3
    # rewards beyond --rm-type / --custom-rm-path
    rm_url: str | None = None           # --rm-url: the reward service --rm-type remote_rm posts to
    rm_timeout_s: float = 30.0          # --rm-timeout: seconds per remote reward request
    rm_max_retries: int = 3             # --rm-max-retries: retries of a remote reward request that failed transiently
    rm_retry_backoff_s: float = 0.5     # --rm-retry-backoff: seconds before the first retry, doubling after each
    group_rm: bool = False              # --group-rm: the --custom-rm-path function scores a prompt's responses at once
    reward_key: str | None = None       # --reward-key: the entry of a dict-valued reward to train on
    # engine health
    engine_generate_timeout_s: float = 600.0  # --engine-generate-timeout: one engine call past it counts as hung
    health_check_interval_s: float = 30.0     # --rollout-health-check-interval: probe every engine this often (0: off)
    health_check_timeout_s: float = 30.0      # --rollout-health-check-timeout: an engine that does not answer (or
    #                                           makes no progress) within it is killed and restarted
    health_check_first_wait_s: float = 0.0    # --rollout-health-check-first-wait: before the first probe
    use_fault_tolerance: bool = False         # --use-fault-tolerance: miles' switch for the two above, on here by
    #                                           default; given, validate refuses the flags that turn them off

    @property
    def num_samples(self) -> int:
        return self.batch_size * self.n_samples_per_prompt


MULTI_TURN_GENERATE = "miles.rollout.multi_turn:generate"   # the generate function of multi-turn tool use


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """How one sample (or the whole rollout) is generated when it takes more than one engine call:
    a custom generate function, multi-turn with tools, or a custom rollout function."""

    custom_generate_function_path: str | None = None  # --custom-generate-function-path: async fn(ctx, sample, params)
    rollout_function_path: str | None = None  # --rollout-function-path: async fn(ctx, rollout_id) -> groups
    server_concurrency: int = 512       # --sglang-server-concurrency: requests in flight per engine (any engine)
    sample_timeout_s: float | None = None   # --rollout-sample-timeout: a sample past it is aborted
    rollout_timeout_s: float | None = None  # --rollout-timeout: samples unfinished by then are aborted
    max_turns: int = 16                 # --generate-max-turns: model turns of a multi-turn sample
    tool_specs_path: str | None = None  # --generate-tool-specs-path: OpenAI-style tool specs (.json or module:attr)
    execute_tool_function_path: str | None = None  # --generate-execute-tool-function-path: async fn(name, args) -> str
    tool_call_parser: str = "qwen25"    # --generate-tool-call-parser: how tool calls are read from the model's text
    tool_timeout_s: float = 60.0        # --generate-tool-timeout: a tool call past it fails its sample

    @property
    def generate_function_path(self) -> str | None:
        """The per-sample generate function: --custom-generate-function-path, else multi-turn with
        tools when a tool executor is given, else None (one engine call per sample)."""
        if self.custom_generate_function_path:
            return self.custom_generate_function_path
        return MULTI_TURN_GENERATE if self.execute_tool_function_path else None


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    advantage_estimator: AdvantageEstimator = "grpo"  # --advantage-estimator
    disable_grpo_std_normalization: bool = False  # --disable-grpo-std-normalization
    disable_rewards_normalization: bool = False   # --disable-rewards-normalization: GRPO/GSPO/++-baseline on raw rewards
    loss_type: LossType = "policy_loss"  # --loss-type policy_loss | sft_loss
    eps_clip: float = 0.2               # --eps-clip
    eps_clip_high: float | None = None  # --eps-clip-high (DAPO clip-higher); None: same as eps_clip
    eps_clip_c: float | None = None     # --eps-clip-c (dual clip)
    use_kl_loss: bool = False           # --use-kl-loss
    kl_loss_coef: float = 0.0           # --kl-loss-coef
    kl_loss_type: KlLossType = "k1"     # --kl-loss-type k1 | k2 | k3 | low_var_kl (miles: k1)
    entropy_coef: float = 0.0           # --entropy-coef
    normalize_advantages: bool = False  # --normalize-advantages: whiten over the rollout's response tokens
    compute_advantages_and_returns: bool = True  # --disable-compute-advantages-and-returns (sft_loss only: none needed)
    # --loss-agg-mode token_mean | seq_mean_token_mean | seq_mean_token_sum_norm; miles' default is the
    # per-sample mean (--calculate-per-token-loss off), --calculate-per-token-loss is token_mean
    loss_agg_mode: LossAggMode = "seq_mean_token_mean"
    kl_coef: float = 0.0                # --kl-coef: KL penalty in the token rewards (ppo, reinforce_plus_plus)
    ref_load: str | None = None         # --ref-load: HF folder of the reference model (None: the initial policy)
    ref_update_interval: int | None = None  # --ref-update-interval: reference := policy every N rollouts
    gamma: float = 1.0                  # --gamma: discount (ppo, reinforce_plus_plus)
    lambd: float = 1.0                  # --lambd: GAE lambda (ppo)
    value_clip: float = 0.2             # --value-clip: PPO value clipping (ppo); 0 disables
    num_critic_only_steps: int = 0      # --num-critic-only-steps: rollouts that train only the critic (ppo)
    use_rollout_logprobs: bool = False  # --use-rollout-logprobs: the engine's logprobs are the PPO ratio's old logprobs
    skip_actor_forward_only: bool = False  # --skip-actor-forward-only: no no-grad pass for the old logprobs
    use_tis: bool = False               # --use-tis: truncated importance sampling, exp(old - rollout) per token
    tis_clip: float = 2.0               # --tis-clip: upper bound of the TIS weight
    tis_clip_low: float = 0.0           # --tis-clip-low: lower bound of the TIS weight
    use_opsm: bool = False              # --use-opsm: off-policy sequence masking (DeepSeek-V3.2)
    opsm_delta: float = 1e-4            # --opsm-delta: OPSM's threshold on a sequence's mean old - new logprob
    use_unbiased_kl: bool = False       # --use-unbiased-kl: KL loss weighted by exp(logp - old_logp) per token
    custom_loss_function_path: str | None = None  # --custom-loss-function-path (--loss-type custom_loss)
    custom_tis_function_path: str | None = None   # --custom-tis-function-path: the TIS weights (--use-tis)
    pg_loss_reducer_path: str | None = None  # --custom-pg-loss-reducer-function-path: miles' reducer of the policy loss
    # on-policy distillation (docs/algorithms.md, OPD): advantages -= opd_kl_coef * (student - teacher logprob)
    use_opd: bool = False               # --use-opd
    opd_type: str | None = None         # --opd-type: one of OPD_TYPES (megatron: the teacher runs in the trainer)
    opd_kl_coef: float = 1.0            # --opd-kl-coef (miles' default 1.0)
    opd_teacher_load: str | None = None  # --opd-teacher-load: HF folder of the teacher (--opd-type megatron)
    opd_teacher_urls: tuple[str, ...] = ()  # --opd-teacher-urls: NAME=URL (or URL) teacher servers (--opd-type sglang)
    opd_teacher_key: str = "opd_teacher"  # --opd-teacher-key: the sample metadata key naming its teacher

    @property
    def needs_critic(self) -> bool:
        """PPO's advantages read a learned critic's values (GAE); every other estimator trains without one."""
        return self.advantage_estimator == "ppo"

    @property
    def opd_in_trainer(self) -> bool:
        """--use-opd --opd-type megatron: the trainer holds the teacher and scores each rollout's samples."""
        return self.use_opd and self.opd_type == "megatron"

    @property
    def opd_from_servers(self) -> bool:
        """--use-opd --opd-type sglang: the rollout asks the teacher servers for the samples' logprobs."""
        return self.use_opd and self.opd_type == "sglang"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    lr: float = 1e-6                    # --lr
    weight_decay: float = 0.0           # --weight-decay
    adam_beta1: float = 0.9             # --adam-beta1
    adam_beta2: float = 0.999           # --adam-beta2
    adam_eps: float = 1e-8              # --adam-eps
    clip_grad: float = 1.0              # --clip-grad (max grad norm; 0 disables)
    global_batch_size: int | None = None  # --global-batch-size: samples per optimizer step (None: whole rollout)
    micro_batch_size: int = 1           # --micro-batch-size: samples per forward/backward
    seed: int = 0                       # --seed
    backend: str = "torch"              # --train-backend: one of TRAIN_BACKEND_NAMES
    critic_lr: float | None = None      # --critic-lr: the critic's learning rate (None: --lr)
    lr_decay_style: str = "constant"    # --lr-decay-style constant | linear | cosine | inverse-square-root | WSD
    lr_warmup_iters: int = 0            # --lr-warmup-iters: optimizer steps of linear warmup
    lr_warmup_fraction: float | None = None  # --lr-warmup-fraction: warmup as a share of --lr-decay-iters (warmup_steps)
    lr_warmup_init: float = 0.0         # --lr-warmup-init: the rate warmup starts from
    lr_wsd_decay_iters: int | None = None  # --lr-wsd-decay-iters: WSD's decay phase, the last steps before --lr-decay-iters
    lr_wsd_decay_style: str = "exponential"  # --lr-wsd-decay-style exponential | linear | cosine | minus_sqrt
    lr_decay_iters: int | None = None   # --lr-decay-iters: the step where linear/cosine decay reaches --min-lr
    min_lr: float = 0.0                 # --min-lr
    decoupled_lr: float | None = None   # --decoupled-lr: the input embedding's and output layer's rate (None: --lr)
    decoupled_min_lr: float | None = None  # --decoupled-min-lr: their rate at the end of the decay (None: --min-lr)
    weight_decay_incr_style: str = "constant"  # --weight-decay-incr-style constant | linear | cosine
    start_weight_decay: float | None = None  # --start-weight-decay: the linear/cosine weight decay's first value
    end_weight_decay: float | None = None    # --end-weight-decay: its value from --lr-decay-iters on
    use_dynamic_batch_size: bool = False  # --use-dynamic-batch-size: micro-batches by token budget, not sample count
    max_tokens_per_gpu: int | None = None  # --max-tokens-per-gpu: a micro-batch's tokens (real ones packed, else rows x longest)
    log_probs_max_tokens_per_gpu: int | None = None  # --log-probs-max-tokens-per-gpu: the no-grad forwards' budget
    pack_sequences: bool = True         # --no-pack-sequences: token-budget micro-batches as padded rows, not one packed row
    recompute_activations: bool = False  # --recompute-activations: activation checkpointing of every layer
    log_probs_chunk_size: int | None = None  # --log-probs-chunk-size: rows per chunk of the chunked logprobs
    compile_layers: bool | None = None  # --trainer-compile / --no-trainer-compile (None: on for the torch trainer on CUDA)
    weight_shadows: bool = False        # --trainer-weight-shadows: Linear weights cast once a step, not once a micro-batch
    grad_accum_fusion: bool = False     # --gradient-accumulation-fusion: shadows whose weight gradients add up in the matmul
    optimizer_cpu_offload: bool = False  # --optimizer-cpu-offload: AdamW's state in host memory from the first step on
    offload_chunk_mb: int | None = None  # --offload-train-disk-chunk-mb: MiB of fp32 parameters a streamed step moves at once
    mfu_peak_tflops: float | None = None  # --mfu-peak-tflops: the peak the `mfu` train metric divides by
    # float16 loss scaling (--fp16; miles.training.torch.loss_scale): Megatron-LM's flags and defaults, but the
    # start is torch's GradScaler's 2^16: Megatron-LM's 2^32 skips the first ~18 steps, a rollout's update each
    loss_scale: float | None = None     # --loss-scale: a fixed scale (None: dynamic)
    initial_loss_scale: float = 2.0 ** 16  # --initial-loss-scale: the dynamic scale's start (Megatron-LM's: 2^32)
    min_loss_scale: float = 1.0         # --min-loss-scale: the dynamic scale's floor
    loss_scale_window: int = 1000       # --loss-scale-window: clean steps before the scale doubles
    hysteresis: int = 2                 # --hysteresis: overflows (since the last growth) before the scale is cut
    # the megatron backend's parallelism (--train-backend megatron); data parallel = the trainer's GPUs / (TP x PP x CP)
    tensor_model_parallel_size: int = 1    # --tensor-model-parallel-size
    pipeline_model_parallel_size: int = 1  # --pipeline-model-parallel-size
    first_pipeline_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers (None: an even split)
    last_pipeline_stage_layers: int | None = None   # --decoder-last-pipeline-num-layers
    context_parallel_size: int = 1         # --context-parallel-size
    expert_model_parallel_size: int = 1    # --expert-model-parallel-size: ranks a MoE layer's experts split over
    expert_tensor_parallel_size: int = 1   # --expert-tensor-parallel-size: 1 only (each expert whole on its rank)
    sequence_parallel: bool = False        # --sequence-parallel
    num_steps_per_rollout: int | None = None  # --num-steps-per-rollout: optimizer steps per rollout (sets the global batch)
    use_dynamic_global_batch_size: bool = False  # --use-dynamic-global-batch-size: one step of whatever a rollout gives
    save_debug_train_data: str | None = None  # --save-debug-train-data: each rollout's packed train batch to this path
    attn_implementation: str | None = None  # --attn-implementation: miles' FSDP attention kernel; no effect here
    megatron_to_hf_mode: str | None = None  # --megatron-to-hf-mode raw | bridge: accepted with megatron, no effect
    # LoRA (the torch trainer on one process: miles/training/torch/lora.py); rank 0: the whole model trains
    lora_rank: int = 0                  # --lora-rank: the adapters' rank r
    lora_alpha: float = 16.0            # --lora-alpha: the adapters' scale is alpha / r
    lora_dropout: float = 0.0           # --lora-dropout: dropout on the adapters' input in the training forwards
    target_modules: str | None = None   # --target-modules: comma list of module suffixes / attn / mlp (None: all-linear)
    exclude_modules: str | None = None  # --exclude-modules: comma list of module suffixes taken out of the targets
    lora_adapter_path: str | None = None  # --lora-adapter-path: a PEFT adapter folder to start from
    # mixture-of-experts (a Qwen3-MoE --hf-checkpoint on the torch trainer: miles/training/moe.py, docs/moe.md)
    use_rollout_routing_replay: bool = False  # --use-rollout-routing-replay (R3): the rollout's experts for its tokens
    use_routing_replay: bool = False    # --use-routing-replay: the old-logprob pass's experts in the train steps
    moe_aux_loss_coeff: float = 0.0     # --moe-aux-loss-coeff: the load-balancing loss's coefficient (0: off)
    moe_router_load_balancing_type: str = "aux_loss"  # --moe-router-load-balancing-type aux_loss | seq_aux_loss | none
    moe_z_loss_coeff: float | None = None  # --moe-z-loss-coeff: the router z-loss's coefficient (None: off)
    moe_router_dtype: str | None = None  # --moe-router-dtype fp32: the router's logits in float32 (None: the model's)

    @property
    def shadows(self) -> bool:
        """The decoder's Linear weights cast once a loop (--trainer-weight-shadows, or implied by
        --gradient-accumulation-fusion, whose matmuls need the shadows)."""
        return self.weight_shadows or self.grad_accum_fusion

    @property
    def warmup_steps(self) -> int:
        """The warmup's optimizer steps: --lr-warmup-iters, or with --lr-warmup-fraction F (Megatron-LM's)
        int(F x --lr-decay-iters)."""
        if self.lr_warmup_fraction is None or self.lr_decay_iters is None:
            return self.lr_warmup_iters
        return int(self.lr_warmup_fraction * self.lr_decay_iters)

    def global_batch(self, rollout_samples: int) -> int:
        """Samples per optimizer step for a rollout of `rollout_samples` samples."""
        if self.use_dynamic_global_batch_size:
            return rollout_samples
        if self.global_batch_size is not None:
            return self.global_batch_size
        return rollout_samples // self.num_steps_per_rollout if self.num_steps_per_rollout else rollout_samples


@dataclass(frozen=True, kw_only=True)
class SGLangConfig:
    """--rollout-engine sglang (docs/sglang.md)."""

    server_args: tuple[str, ...] = ()   # --sglang-<flag> [VALUE]: SGLang's own server flags, as SGLang spells them
    router_policy: str = "cache_aware"  # --sglang-router-policy
    router_request_timeout_s: float = 3600.0  # --sglang-router-request-timeout-secs
    startup_timeout_s: float = 600.0    # --sglang-server-startup-timeout: until /health_generate answers


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    save: str | None = None             # --save: checkpoint root
    load: str | None = None             # --load: checkpoint root to resume from (newest complete)
    save_interval: int | None = None    # --save-interval (rollouts)
    save_hf: bool = True                # --no-save-hf: skip the HF export at each save
    save_trigger_sentinel: str | None = None  # --save-trigger-sentinel: save when this file exists
    critic_load: str | None = None      # --critic-load: initial critic (HF folder, critic folder or checkpoint root)
    critic_save: str | None = None      # --critic-save: critic checkpoint root (None: inside --save's checkpoints)
    save_hf_path: str | None = None     # --save-hf: also export HF weights here at each save ({rollout_id} template)
    save_optimizer: bool = True         # --no-save-optim: checkpoints without optimizer state
    load_optimizer: bool = True         # --no-load-optim: a resume starts a fresh optimizer
    load_rng: bool = True               # --no-load-rng: a resume keeps this run's RNG states
    finetune: bool = False              # --finetune: --load's weights only, from rollout 0 and the data's start
    ckpt_step: int | None = None        # --ckpt-step: --load's checkpoint of this rollout, not the newest
    exit_on_missing: bool = False       # --exit-on-missing-checkpoint: an empty or missing --load stops the run
    keep_last: int | None = None        # --keep-last-checkpoints: prune all but the newest N checkpoints
    retain_interval: int | None = None  # --save-retain-interval: keep every Nth rollout's checkpoint and the newest
    allow_fresh_start: bool = False     # --allow-fresh-start: train from --hf-checkpoint when --load has nothing loadable
    save_retries: int = 0               # --save-retries: saves that may fail on a full disk before the run fails
    async_save: bool = False            # --async-save: a save snapshots the state; the files are written while training goes on

    @property
    def saves(self) -> bool:
        """Whether the run writes anything at a save: checkpoints, the critic's, or an HF export."""
        return bool(self.save or self.critic_save or self.save_hf_path)

    def load_parts(self) -> dict[str, bool]:
        """What a resume reads of the trainer's (and critic's) folder besides the weights (`Trainer.load`)."""
        if self.finetune:
            return {"optimizer": False, "rng": False, "step": False}
        return {"optimizer": self.load_optimizer, "rng": self.load_rng, "step": True}


@dataclass(frozen=True, kw_only=True)
class EvalDataset:
    """One eval dataset of --eval-config (miles' eval.datasets entry); None: the run's value."""

    name: str
    path: str
    n_samples_per_prompt: int | None = None   # n_samples_per_eval_prompt
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_response_len: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    input_key: str | None = None
    label_key: str | None = None
    metadata_key: str | None = None
    rm_type: str | None = None                # a built-in reward for this dataset (default: the run's reward)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    prompt_data: tuple[tuple[str, str], ...] = ()  # --eval-prompt-data NAME PATH [NAME PATH ...]
    interval: int | None = None         # --eval-interval (rollouts)
    skip_before_train: bool = False     # --skip-eval-before-train
    n_samples_per_prompt: int = 1       # --n-samples-per-eval-prompt
    temperature: float | None = None    # --eval-temperature (0: greedy; None: --rollout-temperature, as miles)
    top_p: float | None = None          # --eval-top-p (None: --rollout-top-p; 1 when greedy), as miles
    top_k: int | None = None            # --eval-top-k (None: --rollout-top-k; off when greedy), as miles
    max_response_len: int | None = None # --eval-max-response-len (None: the rollout's)
    max_prompt_len: int | None = None   # --eval-max-prompt-len: drop longer eval prompts (None: --max-prompt-len)
    max_context_len: int | None = None  # --eval-max-context-len: eval prompt + response cap (None: the rollout's)
    datasets: tuple[EvalDataset, ...] = ()  # --eval-config YAML: datasets with their own n, sampling, keys, reward
    log_passrate: bool = False          # --log-passrate: pass@k for every k <= n (rollouts and evals)
    min_new_tokens: int = 0             # --eval-min-new-tokens: EOS and stop tokens barred before this many
    log_function_path: str | None = None  # --custom-eval-rollout-log-function-path: fn(ctx, data, metrics)
    function_path: str | None = None    # --eval-function-path: async fn(ctx, rollout_id) -> {dataset: groups}

    def sets(self) -> tuple[EvalDataset, ...]:
        """Every eval dataset: --eval-prompt-data's pairs (run defaults), then --eval-config's."""
        return tuple(EvalDataset(name=n, path=p) for n, p in self.prompt_data) + self.datasets


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    ray_address: str | None = None      # --ray-address: attach to a running cluster (None: start a local one)
    num_cpus: int | None = None         # --ray-num-cpus for a local cluster
    namespace: str | None = None        # --ray-namespace (None: one per run)
    colocate: bool = False              # --colocate: engines on the trainer's GPUs (miles.cluster.placement)
    actor_num_nodes: int = 1            # --actor-num-nodes: nodes of the trainer
    actor_num_gpus_per_node: int = 1    # --actor-num-gpus-per-node: the trainer's GPUs on each of them
    rollout_num_gpus: int | None = None  # --rollout-num-gpus: the engines' GPUs (None: engines x GPUs per engine)
    rollout_num_gpus_per_engine: int = 1  # --rollout-num-gpus-per-engine (an SGLang server's tensor parallel size)
    num_gpus_per_node: int = 8          # --num-gpus-per-node: GPUs of a node (an engine may not span nodes)
    offload: bool = False               # --offload: both of the next two
    # None: as --offload (and, for the engines, --colocate) says; False: --no-offload-train / --no-offload-rollout
    offload_train: bool | None = None   # --offload-train: the trainer's optimizer state to host memory during rollouts
    offload_rollout: bool | None = None  # --offload-rollout: the engines' memory freed during training (SGLang: weights too)
    # attaching to a cluster (--ray-address; docs/running.md "Attaching to a cluster")
    ship_code: bool = True              # --ray-no-ship-code: miles and the user's files are on every node already
    shared_fs: bool | None = None       # --shared-fs / --no-shared-fs (None: shared iff every node is the driver's host)
    actor_resources: dict[str, float] | None = None  # --ray-actor-resources: Ray resources every actor asks for
    train_env_vars: dict[str, str] | None = None  # --train-env-vars: the trainer's processes' environment (JSON)

    @property
    def offloads_train(self) -> bool:
        return self.offload_train if self.offload_train is not None else self.offload

    @property
    def trainer_ranks(self) -> int:
        """The trainer's ranks: one per trainer GPU, or as many CPU processes on a CPU run."""
        return trainer_ranks(self.actor_num_nodes, self.actor_num_gpus_per_node)

    @property
    def offloads_rollout(self) -> bool:
        """--colocate frees the engines' cache during training too (miles: colocate turns it on)."""
        return self.offload_rollout if self.offload_rollout is not None else self.offload or self.colocate

    @property
    def shares_gpu_resident(self) -> bool:
        """--colocate --no-offload-rollout: engines and trainer on the same GPUs, the engines resident (their
        KV cache is never handed to the trainer); the engine's KV cache takes --rollout-mem-fraction of the
        GPU less its weights, the trainer the rest. The async machines take colocation only so (and without
        --offload-train: nothing is handed back and forth)."""
        return self.colocate and not self.offloads_rollout


@dataclass(frozen=True, kw_only=True)
class TraceConfig:
    run_dir: str | None = None          # --run-dir: trace.jsonl, metrics.jsonl, config.yaml (default runs/<run id>)
    console: str = "auto"               # --trace-console: auto | pretty | plain | off
    teardown_timeout_s: float = 60.0    # --teardown-timeout: per resource
    teardown_deadline_s: float = 300.0  # --teardown-deadline: whole unwind


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    progress: str = "auto"              # --progress: auto | rich | plain | off (the CLI's live display)
    use_tensorboard: bool = False       # --use-tensorboard (pip install miles[tensorboard])
    tensorboard_dir: str | None = None  # --tensorboard-dir (None: <run_dir>/tensorboard)
    use_wandb: bool = False             # --use-wandb (pip install miles[wandb])
    wandb_project: str = "miles"        # --wandb-project
    wandb_team: str | None = None       # --wandb-team: the W&B entity (None: your default)
    wandb_group: str | None = None      # --wandb-group
    wandb_mode: str | None = None       # --wandb-mode online | offline | disabled (None: $WANDB_MODE, else online)
    # --wandb-key: the W&B API key of this run's W&B run (None: wandb's own login); never written out
    wandb_key: str | None = field(default=None, repr=False, metadata=SECRET)
    wandb_dir: str | None = None        # --wandb-dir (None: <run_dir>/wandb)
    # --disable-wandb-random-suffix: miles' switch; the W&B run's name and id are the miles run id anyway
    disable_wandb_random_suffix: bool = False
    use_mlflow: bool = False            # --use-mlflow (pip install mlflow): $MLFLOW_TRACKING_URI, else <run_dir>/mlruns
    worker_log_level: str = "info"      # --worker-log-level: the actors' logs in <run_dir>/logs


# -- reliability: deadlines, stops, verified loads, the local cluster's exposure ----------------------

@dataclass(frozen=True, kw_only=True)
class ReliabilityConfig:
    """How a run bounds what can hang and guards what it reads and exposes (docs/reliability.md)."""

    phase_timeouts: tuple[str, ...] = ()  # --phase-timeout STATE=SECONDS ...: override the machine YAML's deadlines
    stop_timeout_s: float = 20.0        # --stop-timeout: first SIGINT/SIGTERM -> process exit, at most this long
    reward_timeout_s: float = 300.0     # --reward-timeout: per reward call; past it the sample scores 0 (0: no limit)
    verify_load: bool = True            # --no-verify-load: skip the sha256 check of a checkpoint on --load
    ray_node_ip: str = "127.0.0.1"      # --ray-node-ip: the local cluster's node address (auto: Ray's choice)
    ray_allow_no_auth: bool = False     # --ray-allow-no-auth: start a local cluster without token authentication

    @property
    def phase_timeout_overrides(self) -> dict[str, float]:
        """--phase-timeout's STATE=SECONDS pairs (validate checks their form)."""
        return {state: float(seconds) for state, _, seconds in (t.partition("=") for t in self.phase_timeouts)}

    def deadline_overrides(self, states: Collection[str]) -> dict[str, float]:
        """The deadlines --phase-timeout sets on a machine with these states: eval generates and scores
        as rollout does, so it takes rollout's deadline unless it is named itself."""
        named = self.phase_timeout_overrides
        if "rollout" in named and "eval" not in named and "eval" in states:
            return {**named, "eval": named["rollout"]}
        return named

    @property
    def reward_limit_s(self) -> float | None:
        """Seconds a reward call may take (None: no limit, --reward-timeout 0)."""
        return self.reward_timeout_s or None


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    num_rollout: int | None = None      # --num-rollout (None: derived from --num-epoch)
    num_epoch: int | None = None        # --num-epoch
    check_weight_update_equal: bool = False  # --check-weight-update-equal
    debug_skip_weight_update: bool = False  # --debug-skip-weight-update: no weight sync; engines keep the initial weights
    update_weight_buffer_size: int = 512 * 1024 ** 2  # --update-weight-buffer-size: bytes per weight bucket (CUDA IPC)
    update_weights_interval: int = 1    # --update-weights-interval: async pushes weights every N rollouts
    # fully async (--fully-async, machine fully_async: miles/rollout/producer.py, docs/fully-async.md)
    fully_async: bool = False           # --fully-async: a producer generates continuously into a buffer of groups
    max_weight_staleness: int | None = None   # --max-weight-staleness: a group older than this many versions is not trained
    async_max_concurrent_samples: int | None = None   # --async-max-concurrent-samples: samples in flight at most
    async_data_buffer_capacity_factor: float = 2.0   # --async-data-buffer-capacity-factor: buffer = this x batch groups
    async_unused_samples_handler: str = "drop"       # --async-unused-samples-handler: a stale group is dropped or retried
    async_tail_cut_share: float = 0.0                # --async-tail-cut-share: a producer call returns once this share of its samples still runs
    debug_exit_after_rollout: int | None = None  # --debug-exit-after-rollout
    save_debug_rollout_data: str | None = None  # --save-debug-rollout-data: each rollout's samples to this path
    dump_details: str | None = None     # --dump-details DIR: both debug dumps under DIR (debug_*_data_path)
    load_debug_rollout_data: str | None = None  # --load-debug-rollout-data: train on saved rollouts (machine train_only)
    debug_rollout_only: bool = False    # --debug-rollout-only: roll out without training (machine rollout_only)
    inject_faults: tuple[str, ...] = ()  # --inject-fault STATE:KIND[:VISIT] (miles/api/faults.py)
    start_rollout_id: int | None = None  # --start-rollout-id: the first rollout id (overrides the checkpoint's)
    debug_train_only: bool = False      # --debug-train-only: no engines; needs --load-debug-rollout-data
    ci_test: bool = False               # --ci-test: weight-sync, logprob and reference checks fail the run
    # miles' CI gates (miles/metrics/ci_gates.py); the metric and model-hash ones work under --ci-test, as in miles
    ci_metric_checker_key: str | None = None        # --ci-metric-checker-key: an eval metric some eval must reach...
    ci_metric_checker_threshold: float | None = None  # --ci-metric-checker-threshold: ...at least this value
    ci_save_grad_norm: str | None = None    # --ci-save-grad-norm: each optimizer step's gradient norm to this file
    ci_load_grad_norm: str | None = None    # --ci-load-grad-norm: each step's norm compared with this file's
    ci_save_model_hash: bool = False        # --ci-save-model-hash: each checkpoint holds its weights' hash
    ci_check_model_hash: bool = False       # --ci-check-model-hash: the weights loaded by --load match it

    @property
    def check_weights(self) -> bool:
        """Compare trainer and engine checksums after every weight sync (--ci-test turns it on)."""
        return self.check_weight_update_equal or self.ci_test

    @property
    def has_critic(self) -> bool:
        """The run makes PPO's critic (not when it only rolls out)."""
        return self.algorithm.needs_critic and not self.debug_rollout_only

    @property
    def trainer_gpus(self) -> int | None:
        """The trainer's GPUs where known before Ray starts (--device cuda: one per trainer rank), else
        None (a CPU run, or --device auto, whose placement plan answers at init)."""
        return self.cluster.trainer_ranks if self.model.on_gpus else None

    @property
    def user_function_paths(self) -> dict[str, str]:
        """Every function the run loads by path that is set, flag -> path as given (USER_FUNCTION_FLAGS)."""
        given = {flag: getattr(getattr(self, section), name) for flag, (section, name) in USER_FUNCTION_FLAGS.items()}
        return {flag: path for flag, path in given.items() if path}

    @property
    def debug_rollout_data_path(self) -> str | None:
        """Where each rollout's samples go: --save-debug-rollout-data, else --dump-details' DIR/rollout_data."""
        if self.save_debug_rollout_data or not self.dump_details:
            return self.save_debug_rollout_data
        return f"{self.dump_details}/rollout_data/{{rollout_id}}.pt"

    @property
    def debug_train_data_path(self) -> str | None:
        """Where each rollout's train batch goes: --save-debug-train-data, else --dump-details' DIR/train_data."""
        if self.train.save_debug_train_data or not self.dump_details:
            return self.train.save_debug_train_data
        return f"{self.dump_details}/train_data/{{rollout_id}}_{{rank}}.pt"

    @property
    def rollout_seed(self) -> int:
        """The seed of the prompt order and the engines' sampling: --rollout-seed, else --seed."""
        return self.train.seed if self.rollout.seed is None else self.rollout.seed


def as_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain-dict view (for config.yaml in the run dir and the trackers' run config); a SECRET
    field that is set reads "<redacted>"."""
    return {f.name: "<redacted>" if f.metadata.get("secret") and getattr(cfg, f.name) is not None
            else _plain(getattr(cfg, f.name)) for f in fields(cfg)}


def _plain(v: Any) -> Any:
    if hasattr(v, "__dataclass_fields__"):
        return as_dict(v)
    return [_plain(x) for x in v] if isinstance(v, (tuple, list)) else v


__all__ = [
    "AlgorithmConfig", "CheckpointConfig", "ClusterConfig", "ConfigError", "DataConfig", "EvalConfig", "EvalDataset",
    "GenerateConfig", "MULTI_TURN_GENERATE", "ModelConfig", "RolloutConfig", "RunConfig", "SGLangConfig",
    "TraceConfig", "TrackingConfig", "TrainConfig", "as_dict", "replace",
]
