"""Typed run configuration: one frozen dataclass per concern, built from flags, YAML or code.

Every component receives its own slice (`RolloutConfig`, `TrainConfig`, ...), never the whole
`RunConfig`. Flag names are miles' (`--rollout-batch-size` is `RolloutConfig.batch_size`); the
mapping lives in `miles/config/flags.py`. Validation collects every problem and raises one `ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from miles.algorithms.names import AdvantageEstimator, KlLossType, LossAggMode, LossType


class ConfigError(ValueError):
    """Bad configuration or input. `problems` lists each one; the CLI exits with code 2."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(f"  - {p}" for p in self.problems) if len(self.problems) > 1 else self.problems[0])


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    hf_checkpoint: str                  # --hf-checkpoint: HF-format folder (model + tokenizer)
    device: str = "auto"                # --device: auto | cpu | cuda
    dtype: str = "auto"                 # --dtype: auto (fp32 on CPU, bf16 on GPU) | float32 | bfloat16


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    prompt_data: str                    # --prompt-data: .jsonl or .parquet
    input_key: str = "input"            # --input-key
    label_key: str | None = None        # --label-key
    metadata_key: str | None = None     # --metadata-key
    apply_chat_template: bool = False   # --apply-chat-template
    rollout_shuffle: bool = True        # --rollout-shuffle / --no-rollout-shuffle
    max_prompt_len: int | None = None   # --max-prompt-len: drop longer prompts (tokens)
    response_key: str = "response"      # --response-key: the response's key in SFT data (--loss-type sft_loss)


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    batch_size: int                     # --rollout-batch-size: prompts per rollout
    n_samples_per_prompt: int = 8       # --n-samples-per-prompt
    max_response_len: int = 64          # --rollout-max-response-len
    temperature: float = 1.0            # --rollout-temperature
    top_p: float = 1.0                  # --rollout-top-p
    top_k: int = -1                     # --rollout-top-k
    num_engines: int = 1                # --rollout-num-engines
    engine: str = "embedded"            # --rollout-engine: a name in miles.rollout.protocol.ENGINES
    rm_type: str = "math"               # --rm-type
    custom_rm_path: str | None = None   # --custom-rm-path module:function
    seed: int | None = None             # --rollout-seed (None: --seed; read it as RunConfig.rollout_seed)
    engine_max_restarts: int = 3        # --engine-max-restarts: restarts of dead engines allowed ...
    engine_restart_window_s: float = 600.0  # --engine-restart-window: ... within any window of this many seconds
    dynamic_sampling_filter_path: str | None = None  # --dynamic-sampling-filter-path: keep a group iff filter(group)
    over_sampling_batch_size: int | None = None  # --over-sampling-batch-size: prompts per sampling round (None: batch_size)
    dynamic_sampling_max_rounds: int = 8  # --dynamic-sampling-max-rounds: then fill up with filtered-out groups
    overlong_buffer_len: int | None = None  # --overlong-buffer-len: DAPO overlong penalty over the last N tokens
    overlong_penalty_factor: float = 1.0  # --overlong-penalty-factor: the penalty at max_response_len
    # rewards beyond --rm-type / --custom-rm-path (issue 17)
    rm_url: str | None = None           # --rm-url: the reward service --rm-type remote_rm posts to
    rm_timeout_s: float = 30.0          # --rm-timeout: seconds per remote reward request
    rm_max_retries: int = 3             # --rm-max-retries: retries of a remote reward request that failed transiently
    rm_retry_backoff_s: float = 0.5     # --rm-retry-backoff: seconds before the first retry, doubling after each
    group_rm: bool = False              # --group-rm: the --custom-rm-path function scores a prompt's responses at once
    reward_key: str | None = None       # --reward-key: the entry of a dict-valued reward to train on
    # engine health (issue 17)
    engine_generate_timeout_s: float = 600.0  # --engine-generate-timeout: one engine call past it counts as hung
    health_check_interval_s: float = 30.0     # --rollout-health-check-interval: probe every engine this often (0: off)
    health_check_timeout_s: float = 30.0      # --rollout-health-check-timeout: an engine that does not answer (or
    #                                           makes no progress) within it is killed and restarted
    health_check_first_wait_s: float = 0.0    # --rollout-health-check-first-wait: before the first probe

    @property
    def num_samples(self) -> int:
        return self.batch_size * self.n_samples_per_prompt


MULTI_TURN_GENERATE = "miles.rollout.multi_turn:generate"   # the generate function of multi-turn tool use


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """How one sample (or the whole rollout) is generated when it takes more than one engine call:
    a custom generate function, multi-turn with tools, or a custom rollout function (issue 17)."""

    custom_generate_function_path: str | None = None  # --custom-generate-function-path: async fn(ctx, sample, params)
    rollout_function_path: str | None = None  # --rollout-function-path: async fn(ctx, rollout_id) -> groups
    server_concurrency: int = 512       # --sglang-server-concurrency: samples in flight per engine
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
    loss_type: LossType = "policy_loss"  # --loss-type policy_loss | sft_loss
    eps_clip: float = 0.2               # --eps-clip
    eps_clip_high: float | None = None  # --eps-clip-high (DAPO clip-higher); None: same as eps_clip
    eps_clip_c: float | None = None     # --eps-clip-c (dual clip)
    use_kl_loss: bool = False           # --use-kl-loss
    kl_loss_coef: float = 0.0           # --kl-loss-coef
    kl_loss_type: KlLossType = "k3"     # --kl-loss-type k1 | k2 | k3 | low_var_kl
    entropy_coef: float = 0.0           # --entropy-coef
    normalize_advantages: bool = False  # --normalize-advantages: whiten over the rollout's response tokens
    loss_agg_mode: LossAggMode = "token_mean"  # --loss-agg-mode token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
    kl_coef: float = 0.0                # --kl-coef: KL penalty in the token rewards (ppo, reinforce_plus_plus)
    ref_load: str | None = None         # --ref-load: HF folder of the reference model (None: the initial policy)
    ref_update_interval: int | None = None  # --ref-update-interval: reference := policy every N rollouts
    gamma: float = 1.0                  # --gamma: discount (ppo, reinforce_plus_plus)
    lambd: float = 1.0                  # --lambd: GAE lambda (ppo)
    value_clip: float = 0.2             # --value-clip: PPO value clipping (ppo); 0 disables
    num_critic_only_steps: int = 0      # --num-critic-only-steps: rollouts that train only the critic (ppo)
    use_rollout_logprobs: bool = False  # --use-rollout-logprobs: the engine's logprobs are the PPO ratio's old logprobs
    use_tis: bool = False               # --use-tis: truncated importance sampling, exp(old - rollout) per token
    tis_clip: float = 2.0               # --tis-clip: upper bound of the TIS weight
    tis_clip_low: float = 0.0           # --tis-clip-low: lower bound of the TIS weight


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    lr: float = 1e-6                    # --lr
    weight_decay: float = 0.0           # --weight-decay
    adam_beta1: float = 0.9             # --adam-beta1
    adam_beta2: float = 0.999           # --adam-beta2
    clip_grad: float = 1.0              # --clip-grad (max grad norm; 0 disables)
    global_batch_size: int | None = None  # --global-batch-size: samples per optimizer step (None: whole rollout)
    micro_batch_size: int = 1           # --micro-batch-size: samples per forward/backward
    seed: int = 0                       # --seed
    backend: str = "torch"              # --train-backend: a name in miles.training.protocol.TRAIN_BACKENDS
    critic_lr: float | None = None      # --critic-lr: the critic's learning rate (None: --lr)
    lr_decay_style: str = "constant"    # --lr-decay-style constant | linear | cosine
    lr_warmup_iters: int = 0            # --lr-warmup-iters: optimizer steps of linear warmup
    lr_decay_iters: int | None = None   # --lr-decay-iters: the step where linear/cosine decay reaches --min-lr
    min_lr: float = 0.0                 # --min-lr


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    save: str | None = None             # --save: checkpoint root
    load: str | None = None             # --load: checkpoint root to resume from (newest complete)
    save_interval: int | None = None    # --save-interval (rollouts)
    save_hf: bool = True                # --no-save-hf: skip the HF export at each save
    save_trigger_sentinel: str | None = None  # --save-trigger-sentinel: save when this file exists
    critic_load: str | None = None      # --critic-load: initial critic (HF folder, critic folder or checkpoint root)
    critic_save: str | None = None      # --critic-save: critic checkpoint root (None: inside --save's checkpoints)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    prompt_data: tuple[tuple[str, str], ...] = ()  # --eval-prompt-data NAME PATH [NAME PATH ...]
    interval: int | None = None         # --eval-interval (rollouts)
    skip_before_train: bool = False     # --skip-eval-before-train
    n_samples_per_prompt: int = 1       # --n-samples-per-eval-prompt
    temperature: float = 0.0            # --eval-temperature (0: greedy)
    max_response_len: int | None = None # --eval-max-response-len (None: the rollout's)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    ray_address: str | None = None      # --ray-address: attach to a running cluster (None: start a local one)
    num_cpus: int | None = None         # --ray-num-cpus for a local cluster
    namespace: str | None = None        # --ray-namespace (None: one per run)
    colocate: bool = False              # --colocate: engines and trainer share devices (not supported yet)


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
    wandb_dir: str | None = None        # --wandb-dir (None: <run_dir>/wandb)
    worker_log_level: str = "info"      # --worker-log-level: the actors' logs in <run_dir>/logs


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
    num_rollout: int | None = None      # --num-rollout (None: derived from --num-epoch)
    num_epoch: int | None = None        # --num-epoch
    check_weight_update_equal: bool = False  # --check-weight-update-equal
    update_weights_interval: int = 1    # --update-weights-interval: async pushes weights every N rollouts
    debug_exit_after_rollout: int | None = None  # --debug-exit-after-rollout
    save_debug_rollout_data: str | None = None  # --save-debug-rollout-data: each rollout's samples to this path
    load_debug_rollout_data: str | None = None  # --load-debug-rollout-data: train on saved rollouts (machine train_only)
    debug_rollout_only: bool = False    # --debug-rollout-only: roll out without training (machine rollout_only)
    inject_faults: tuple[str, ...] = ()  # --inject-fault STATE:KIND[:VISIT] (miles/phases/faults.py)

    @property
    def rollout_seed(self) -> int:
        """The seed of the prompt order and the engines' sampling: --rollout-seed, else --seed."""
        return self.train.seed if self.rollout.seed is None else self.rollout.seed


def as_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain-dict view (for config.yaml in the run dir)."""
    out: dict[str, Any] = {}
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = as_dict(v) if hasattr(v, "__dataclass_fields__") else (list(v) if isinstance(v, tuple) else v)
    return out


__all__ = [
    "AlgorithmConfig", "CheckpointConfig", "ClusterConfig", "ConfigError", "DataConfig", "EvalConfig",
    "GenerateConfig", "MULTI_TURN_GENERATE", "ModelConfig", "RolloutConfig", "RunConfig", "TraceConfig", "TrackingConfig", "TrainConfig", "as_dict", "replace",
]
