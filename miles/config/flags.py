"""miles' flat flags → the typed `RunConfig`.

One table maps every flag (miles' names, so miles/slime launch scripts carry over) to its config
section and field. `--config run.yaml` loads a file whose keys are flag names (dashes or
underscores); flags given on the command line override it. Every problem is collected and raised as
one `ConfigError` before anything starts.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import difflib
import functools
import re
import json
import os
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from miles.algorithms.names import ADVANTAGE_ESTIMATOR_NAMES, KL_LOSS_TYPES, LOSS_AGG_MODES, LOSS_TYPES

from .eval_config import load_eval_config
from .megatron_arch import megatron_problems, pop_megatron_values, precision_problems
from .megatron_flags import ALIASES as MEGATRON_ALIASES, dest as megatron_dest, help_text as megatron_help, megatron_options
from .miles_flags import (PASSTHROUGH_PREFIX, VALUE_ALIASES, fate, miles_value_aliases, refusal_line, refusal_lines,
                          refused_in)
from .validate import validate
from .user_functions import signature
from .schema import (
    ATTN_IMPLEMENTATIONS, ENGINE_NAMES,
    MEGATRON_TO_HF_MODES, ROUTER_POLICIES, TRAIN_BACKEND_NAMES,
    OPD_TYPES, USER_FUNCTION_FLAGS, AlgorithmConfig, CheckpointConfig, ClusterConfig, ConfigError, DataConfig, EvalConfig,
    GenerateConfig, ModelConfig, ReliabilityConfig, RolloutConfig, RunConfig, SGLangConfig, TraceConfig,
    TrackingConfig, TrainConfig,
)

SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "rollout": RolloutConfig, "generate": GenerateConfig,
    "algorithm": AlgorithmConfig,
    "train": TrainConfig, "checkpoint": CheckpointConfig, "eval": EvalConfig, "cluster": ClusterConfig,
    "trace": TraceConfig, "tracking": TrackingConfig, "sglang": SGLangConfig, "run": RunConfig,
    "reliability": ReliabilityConfig,
}
GROUP_TITLES = {     # `miles train --help` groups flags by concern, under these titles
    "model": "model", "data": "data (prompts)", "rollout": "rollout (engines, sampling, rewards)",
    "generate": "generation beyond one engine call (custom and multi-turn rollouts, tools)",
    "algorithm": "algorithm (advantages, losses, KL)", "train": "train (optimizer, batches)",
    "checkpoint": "checkpoints", "eval": "evaluation", "cluster": "cluster (Ray)",
    "trace": "run directory and trace", "tracking": "tracking (metrics sinks, progress, worker logs)",
    "sglang": "SGLang (--rollout-engine sglang; docs/sglang.md). Any other --sglang-<flag> [VALUE] is passed to "
              "the SGLang server as --<flag> [VALUE]",
    "run": "the loop and debugging",
    "reliability": "reliability (deadlines, stops, verified loads, the local cluster's exposure)",
}


@dataclass(frozen=True)
class Flag:
    name: str                       # without the leading dashes
    section: str                    # key of SECTIONS
    field: str
    type: Callable[[str], Any] | None = None
    help: str = ""
    choices: Sequence[str] | None = None
    kind: str = "value"             # value | true | false | pairs | list | json | eval_config


def _f(name, section, field, type=None, help="", choices=None, kind="value") -> Flag:  # noqa: A002
    return Flag(name, section, field, type, help, choices, kind)


FLAGS: tuple[Flag, ...] = (
    # model
    _f("hf-checkpoint", "model", "hf_checkpoint", str, "HF-format folder with the model and its tokenizer"),
    _f("device", "model", "device", str, "where engines and trainers run", ("auto", "cpu", "cuda")),
    _f("dtype", "model", "dtype", str, "the compute dtype of trainers and engines (auto: fp32 on CPU, bf16 on GPU); "
       "the trainers keep float32 master weights and AdamW state either way. float16 (--fp16) scales the loss "
       "(--initial-loss-scale & co.; miles/training/torch/loss_scale.py) and skips the steps whose gradients overflow; the "
       "torch backend only, PPO's critic too. fp32, bf16, fp16 are taken for the long names",
       ("auto", "float32", "bfloat16", "float16")),
    # data
    _f("prompt-data", "data", "prompt_data", str, "training prompts: a .jsonl or .parquet file"),
    _f("input-key", "data", "input_key", str, "the prompt's key in each row"),
    _f("label-key", "data", "label_key", str, "the reference answer's key (for rule rewards)"),
    _f("metadata-key", "data", "metadata_key", str, "a per-row dict passed to the reward"),
    _f("apply-chat-template", "data", "apply_chat_template", kind="true", help="format prompts with the tokenizer's chat template"),
    _f("rollout-shuffle", "data", "rollout_shuffle", kind="true", help="shuffle prompts each epoch"),
    _f("no-rollout-shuffle", "data", "rollout_shuffle", kind="false",
       help="keep the file's prompt order (the default)"),
    _f("max-prompt-len", "data", "max_prompt_len", int, "drop prompts longer than this many tokens"),
    _f("response-key", "data", "response_key", str, "SFT (--loss-type sft_loss): the response's key in each row"),
    # rollout
    _f("rollout-batch-size", "rollout", "batch_size", int, "prompts per rollout"),
    _f("n-samples-per-prompt", "rollout", "n_samples_per_prompt", int, "responses per prompt (the GRPO group size)"),
    _f("rollout-max-response-len", "rollout", "max_response_len", int, "max new tokens per response (miles leaves it unset; this build needs a cap)"),
    _f("rollout-temperature", "rollout", "temperature", float, "sampling temperature"),
    _f("rollout-top-p", "rollout", "top_p", float, "nucleus sampling threshold"),
    _f("rollout-top-k", "rollout", "top_k", int, "top-k sampling (-1: off)"),
    _f("rollout-num-engines", "rollout", "num_engines", int, "engine actors serving rollouts (default: 2 on a "
       "CPU run with two or more cores and no --rollout-num-gpus, each decoding on a core of its own; else 1)"),
    _f("rollout-engine", "rollout", "engine", str, "inference engine", ENGINE_NAMES),
    _f("rm-type", "rollout", "rm_type", str, "built-in reward: math, deepscaler, dapo, gemma_math (graded by "
       "math-verify), gpqa, exact_match, f1, random, deterministic_random, remote_rm; boxed_TYPE scores the last "
       "\\boxed{...}; miles' ifbench gets a line saying what to use"),
    _f("custom-rm-path", "rollout", "custom_rm_path", str, "reward function by import path, module:function (sync or async)"),
    _f("rollout-seed", "rollout", "seed", int, "sampling seed (default: --seed)"),
    _f("engine-max-restarts", "rollout", "engine_max_restarts", int, "restarts of dead engines allowed per window"),
    _f("engine-restart-window", "rollout", "engine_restart_window_s", float, "the restart budget's window, seconds"),
    _f("dynamic-sampling-filter-path", "rollout", "dynamic_sampling_filter_path", str,
       "DAPO dynamic sampling: keep a group iff this filter(group) is true, sample more prompts until the batch "
       "is full (built-in: miles.rollout.filters:check_reward_nonzero_std); with --fully-async the producer "
       "drops the groups it rejects before the buffer"),
    _f("over-sampling-batch-size", "rollout", "over_sampling_batch_size", int,
       "dynamic sampling: prompts per sampling round (default: --rollout-batch-size); refused with --fully-async, "
       "whose producer has no rounds"),
    _f("dynamic-sampling-max-rounds", "rollout", "dynamic_sampling_max_rounds", int,
       "dynamic sampling: sampling rounds per rollout before filling up with filtered-out groups (--fully-async: "
       "rejected groups fill once this x --rollout-batch-size were rejected in a step)"),
    _f("partial-rollout", "rollout", "partial_rollout", kind="true",
       help="dynamic sampling: once the batch is full the engine calls still running are aborted, and their "
            "groups (responses so far, with their logprobs) are continued by the next rollout before fresh prompts "
            "(miles.rollout.partial)"),
    _f("mask-offpolicy-in-partial-rollout", "rollout", "mask_offpolicy_in_partial_rollout", kind="true",
       help="--partial-rollout: train a continued sample only on the tokens of its last engine call (loss mask 0 "
            "on what earlier weights generated)"),
    _f("buffer-filter-path", "rollout", "buffer_filter_path", str,
       "--partial-rollout: fn(ctx, rollout_id, buffer, num_groups) -> groups, which buffered groups a rollout "
       "continues; it removes them from the buffer (default: the oldest first), by import path"),
    _f("rollout-sample-filter-path", "rollout", "sample_filter_path", str,
       "fn(ctx, groups) on each rollout's groups: set sample.remove_sample = True to leave a sample out of "
       "training (it still counts in its group's statistics), by import path (miles.rollout.hooks)"),
    _f("rollout-all-samples-process-path", "rollout", "all_samples_process_path", str,
       "fn(ctx, all_groups) on every group a rollout generated, those dynamic sampling dropped included, by "
       "import path (miles.rollout.hooks)"),
    _f("custom-reward-post-process-path", "rollout", "reward_post_process_path", str,
       "fn(ctx, samples) -> (raw_rewards, rewards): the rewards are the advantages, in place of the group "
       "baseline (grpo, gspo, rloo, reinforce_plus_plus_baseline); by import path (miles.rollout.hooks)"),
    _f("custom-config-path", "rollout", "custom_config_path", str,
       "a YAML file (or base64:PAYLOAD, miles' pseudo file) of extra arguments, as in miles: a key naming a flag "
       "here (rollout_batch_size) sets it, over the command line; any other key is for custom functions and "
       "hooks, which read it as ctx.KEY where miles reads args.KEY (miles.user_code.custom_args().KEY where no "
       "ctx is passed)"),
    _f("custom-rollout-log-function-path", "rollout", "log_function_path", str,
       "fn(ctx, samples, metrics, rollout_time_s) after each rollout: it may add entries to `metrics` (the "
       "rollout's row); returning True replaces the default metrics by its own (those the loop reads stay), by "
       "import path (miles.rollout.hooks)"),
    _f("log-reward-category", "rollout", "log_reward_category", str,
       "KEY: log the share of samples per category, a sample's metadata[KEY] (rollout/error_cat/CAT, "
       "eval/NAME/error_cat/CAT)"),
    _f("overlong-buffer-len", "rollout", "overlong_buffer_len", int,
       "DAPO overlong penalty: penalize responses within this many tokens of --rollout-max-response-len"),
    _f("overlong-penalty-factor", "rollout", "overlong_penalty_factor", float, "DAPO overlong penalty at the max length"),
    # rollout: the engine's limits and switches (FastEngine: --rollout-engine fast, or embedded on CUDA)
    _f("rollout-max-batch-size", "rollout", "max_batch_size", int,
       "sequences one engine decodes at once; the rest of a call's requests wait their turn (default: "
       "{engines[fast][max_batch_size]} for FastEngine, {engines[embedded][max_batch_size]} for EmbeddedEngine)"),
    _f("rollout-mem-fraction", "rollout", "mem_fraction", float,
       "FastEngine's KV cache: this share, in (0, 1), of the GPU memory free once its weights are loaded "
       "(default: {engines[fast][mem_fraction]}); beside a resident trainer (--colocate --no-offload-rollout), "
       "of the GPU's memory less the engine's weights"),
    _f("disable-cuda-graph", "rollout", "cuda_graph", kind="false",
       help="FastEngine: run decode steps eagerly, not as captured CUDA graphs (debugging)"),
    _f("disable-torch-compile", "rollout", "torch_compile", kind="false",
       help="FastEngine: run the layers eagerly, not torch.compile'd (debugging; faster start)"),
    _f("disable-attention-kernel", "rollout", "attention_kernel", kind="false",
       help="FastEngine: decode attention by the stock SDPA call, not the length-aware Triton kernel"),
    _f("rollout-chunked-prefill-size", "rollout", "chunked_prefill_size", int,
       f"FastEngine: a prompt longer than this is prefilled in pieces of this many tokens, one piece per decode "
       "step of the running sequences (SGLang's --chunked-prefill-size; default: {engines[fast][chunked_prefill_size]})"),
    _f("rollout-page-size", "rollout", "page_size", int,
       "FastEngine: a paged KV cache of pages this many positions long (16 or more; 64 suits the decode kernel): "
       "--rollout-max-batch-size sequences start at once while their K/V fits, each holding pages for the "
       "positions it has reached, and the newest is preempted and prefilled again later when the pages run out "
       "(SGLang's --page-size). Unset: each slot holds the longest prompt + response from its start, and long "
       "answers run in waves of as many slots as fit"),
    _f("rollout-quantization", "rollout", "quantization", str,
       "the engines' weights: fp8 = the decoder's Linear weights in float8 e4m3 with 128x128 block scales (FP8 GEMMs "
       "on Hopper, emulated elsewhere; docs/fp8.md), synced from the bf16/fp32 trainer as FP8; none = --dtype "
       "(default: as --hf-checkpoint is stored: an FP8 checkpoint stays FP8). Also spelled --sglang-quantization fp8. "
       "Add --use-tis: it corrects for the train/rollout gap FP8 widens", ("none", "fp8")),
    _f("kv-cache-dtype", "rollout", "kv_cache_dtype", str,
       "FastEngine's KV cache: auto (the compute dtype) or fp8_e4m3 (scale 1, half the bytes: more sequences and "
       "faster long answers; docs/fp8.md); SGLang's flag, also spelled --sglang-kv-cache-dtype. Add --use-tis",
       ("auto", "fp8_e4m3")),
    # -- custom and multi-turn rollouts, tools, remote rewards, engine health ------------------------
    _f("custom-generate-function-path", "generate", "custom_generate_function_path", str,
       "generate each sample with async fn(ctx, sample, sampling_params) -> Sample (module:fn or file.py:fn); "
       "ctx.generate calls the engines, token ids in and out"),
    _f("rollout-function-path", "generate", "rollout_function_path", str,
       "replace the whole rollout with async fn(ctx, rollout_id) -> list of groups of Samples"),
    _f("sglang-server-concurrency", "generate", "server_concurrency", int,
       "requests in flight per engine: an SGLang server's open requests, and the samples a custom generation "
       "keeps in flight per engine (miles' name; every engine)"),
    _f("rollout-sample-timeout", "generate", "sample_timeout_s", float,
       "custom generation: seconds one sample may take; past it the sample is aborted (default: none)"),
    _f("rollout-timeout", "generate", "rollout_timeout_s", float,
       "custom generation: seconds a rollout's samples may take; the unfinished ones are aborted (default: none)"),
    _f("generate-max-turns", "generate", "max_turns", int, "multi-turn: model turns per sample"),
    _f("generate-tool-specs-path", "generate", "tool_specs_path", str,
       "multi-turn: OpenAI-style tool specs, a .json file or module:attr (given to the chat template)"),
    _f("generate-execute-tool-function-path", "generate", "execute_tool_function_path", str,
       "multi-turn: async fn(name, arguments) -> str runs one tool call; setting it makes multi-turn the "
       "generate function unless --custom-generate-function-path says otherwise"),
    _f("generate-tool-call-parser", "generate", "tool_call_parser", str,
       "multi-turn: how tool calls are read from the model's text", ("qwen25", "json")),
    _f("generate-tool-timeout", "generate", "tool_timeout_s", float,
       "multi-turn: seconds a tool call may take; past it the sample fails"),
    _f("rm-url", "rollout", "rm_url", str, "--rm-type remote_rm: the reward service to POST responses to"),
    _f("rm-timeout", "rollout", "rm_timeout_s", float, "remote reward: seconds per request"),
    _f("rm-max-retries", "rollout", "rm_max_retries", int,
       "remote reward: retries of a request that failed transiently (no connection, timeout, 429, 5xx)"),
    _f("rm-retry-backoff", "rollout", "rm_retry_backoff_s", float, "remote reward: seconds before the first retry (doubling)"),
    _f("group-rm", "rollout", "group_rm", kind="true",
       help="the --custom-rm-path function scores all responses to a prompt at once: fn(prompt, responses, label)"),
    _f("reward-key", "rollout", "reward_key", str, "the entry of a dict-valued reward to train on"),
    _f("engine-generate-timeout", "rollout", "engine_generate_timeout_s", float,
       "seconds one engine call may take; past it the engine counts as hung and is restarted"),
    _f("rollout-health-check-interval", "rollout", "health_check_interval_s", float,
       "seconds between health probes of every engine (0: no probes)"),
    _f("rollout-health-check-timeout", "rollout", "health_check_timeout_s", float,
       "an engine that does not answer a probe, or makes no progress, within this many seconds is killed "
       "and restarted"),
    _f("rollout-health-check-first-wait", "rollout", "health_check_first_wait_s", float,
       "seconds before the first health probe"),
    # algorithm
    _f("advantage-estimator", "algorithm", "advantage_estimator", str, "advantage estimator", ADVANTAGE_ESTIMATOR_NAMES),
    _f("disable-grpo-std-normalization", "algorithm", "disable_grpo_std_normalization", kind="true",
       help="GRPO: center rewards per group without dividing by their std (Dr. GRPO)"),
    _f("disable-rewards-normalization", "algorithm", "disable_rewards_normalization", kind="true",
       help="grpo, gspo, reinforce_plus_plus_baseline: no per-group normalization at all, the raw rewards are "
            "the advantages (++-baseline still whitens them over the batch); the other estimators: no effect"),
    _f("loss-type", "algorithm", "loss_type", str, "training loss (custom_loss: --custom-loss-function-path)",
       LOSS_TYPES),
    _f("eps-clip", "algorithm", "eps_clip", float, "PPO clip range (low side, and high unless --eps-clip-high)"),
    _f("eps-clip-high", "algorithm", "eps_clip_high", float, "PPO clip range, high side (DAPO clip-higher)"),
    _f("eps-clip-c", "algorithm", "eps_clip_c", float, "dual-clip constant (> 1)"),
    _f("use-kl-loss", "algorithm", "use_kl_loss", kind="true", help="add a KL-to-reference term to the loss"),
    _f("kl-loss-coef", "algorithm", "kl_loss_coef", float, "weight of the KL loss"),
    _f("kl-loss-type", "algorithm", "kl_loss_type", str, "KL estimator", KL_LOSS_TYPES),
    _f("entropy-coef", "algorithm", "entropy_coef", float, "entropy bonus weight"),
    _f("normalize-advantages", "algorithm", "normalize_advantages", kind="true",
       help="whiten advantages over the rollout's response tokens"),
    _f("loss-agg-mode", "algorithm", "loss_agg_mode", str,
       "loss reduction: token_mean (DAPO; miles' --calculate-per-token-loss), seq_mean_token_mean (GRPO; miles' "
       "default), seq_mean_token_sum_norm (Dr. GRPO)",
       LOSS_AGG_MODES),
    _f("kl-coef", "algorithm", "kl_coef", float, "KL penalty in the token rewards (ppo, reinforce_plus_plus)"),
    _f("ref-load", "algorithm", "ref_load", str, "HF folder of the KL reference model (default: the initial policy)"),
    _f("ref-update-interval", "algorithm", "ref_update_interval", int, "copy the policy into the reference every N rollouts"),
    _f("gamma", "algorithm", "gamma", float, "discount factor (ppo, reinforce_plus_plus)"),
    _f("lambd", "algorithm", "lambd", float, "GAE lambda (ppo)"),
    _f("value-clip", "algorithm", "value_clip", float, "PPO value clipping range (0: off)"),
    _f("num-critic-only-steps", "algorithm", "num_critic_only_steps", int, "first N rollouts train only the critic (ppo)"),
    _f("use-rollout-logprobs", "algorithm", "use_rollout_logprobs", kind="true",
       help="use the engine's logprobs as the old policy in the PPO ratio"),
    _f("skip-actor-forward-only", "algorithm", "skip_actor_forward_only", kind="true",
       help="no no-grad forward for the old logprobs: the PPO ratio's old policy is the engine's with "
            "--use-rollout-logprobs, else the one optimizer step's own logprobs, detached (refused with several steps "
            "per rollout, --use-tis, --kl-coef, a loss other than policy_loss, or --train-backend megatron); the "
            "train/rollout mismatch metrics come from the step"),
    _f("use-tis", "algorithm", "use_tis", kind="true",
       help="truncated importance sampling: weight each token's loss by exp(train - rollout logprob), clipped"),
    _f("tis-clip", "algorithm", "tis_clip", float, "upper bound of the TIS weight"),
    _f("tis-clip-low", "algorithm", "tis_clip_low", float, "lower bound of the TIS weight"),
    _f("use-opd", "algorithm", "use_opd", kind="true",
       help="on-policy distillation: each response token's advantage -= --opd-kl-coef x (student - teacher "
            "logprob of the sampled token); needs --opd-type (docs/algorithms.md, OPD)"),
    _f("opd-type", "algorithm", "opd_type", str, "where the OPD teacher scores the samples: megatron = in the "
       "trainer (--opd-teacher-load; the torch trainer here), sglang = teacher servers (--opd-teacher-urls)",
       OPD_TYPES),
    _f("opd-kl-coef", "algorithm", "opd_kl_coef", float, "weight of the OPD reverse KL in the advantages"),
    _f("opd-teacher-load", "algorithm", "opd_teacher_load", str,
       "--opd-type megatron: HF folder of the teacher (the policy's tokenizer)"),
    _f("opd-teacher-urls", "algorithm", "opd_teacher_urls", str,
       "--opd-type sglang: teacher servers, NAME=URL each (a sample goes to the one its metadata[--opd-teacher-key] "
       "names, else to 'default'); a bare URL is 'default'", kind="list"),
    _f("opd-teacher-key", "algorithm", "opd_teacher_key", str,
       "--opd-teacher-urls: the sample metadata key that names its teacher"),
    # train
    _f("lr", "train", "lr", float, "AdamW learning rate"),
    _f("weight-decay", "train", "weight_decay", float, "AdamW weight decay"),
    _f("adam-beta1", "train", "adam_beta1", float, "AdamW beta1"),
    _f("adam-beta2", "train", "adam_beta2", float, "AdamW beta2"),
    _f("adam-eps", "train", "adam_eps", float, "AdamW epsilon (added to the second moment's square root)"),
    _f("clip-grad", "train", "clip_grad", float, "max gradient norm (0: off)"),
    _f("global-batch-size", "train", "global_batch_size", int, "samples per optimizer step (default: the whole rollout)"),
    _f("micro-batch-size", "train", "micro_batch_size", int, "samples per forward/backward"),
    _f("seed", "train", "seed", int, "seed of everything (data order, init, sampling)"),
    _f("train-backend", "train", "backend", str, "training backend (policy trainer and critic; miles' fsdp is "
       "torch here)", TRAIN_BACKEND_NAMES),
    _f("critic-lr", "train", "critic_lr", float, "the critic's learning rate (default: --lr)"),
    _f("lr-decay-style", "train", "lr_decay_style", str, "learning-rate schedule after warmup (Megatron-LM's)",
       ("constant", "linear", "cosine", "inverse-square-root", "WSD")),
    _f("lr-warmup-iters", "train", "lr_warmup_iters", int, "optimizer steps of linear learning-rate warmup"),
    _f("lr-warmup-fraction", "train", "lr_warmup_fraction", float,
       "warmup as a share of --lr-decay-iters (Megatron-LM's): sets --lr-warmup-iters to int(F x decay iters)"),
    _f("lr-warmup-init", "train", "lr_warmup_init", float, "the learning rate warmup starts from"),
    _f("lr-decay-iters", "train", "lr_decay_iters", int,
       "optimizer step where the decay reaches --min-lr (linear, cosine, WSD; inverse-square-root: optional); "
       "default with --num-rollout: the run's optimizer steps (--num-rollout x steps a rollout), as Megatron-LM's "
       "--train-iters"),
    _f("lr-wsd-decay-iters", "train", "lr_wsd_decay_iters", int,
       "WSD: optimizer steps of the decay phase, which ends at --lr-decay-iters (the rate is --lr before it)"),
    _f("lr-wsd-decay-style", "train", "lr_wsd_decay_style", str, "WSD: the decay phase's shape",
       ("exponential", "linear", "cosine", "minus_sqrt")),
    _f("min-lr", "train", "min_lr", float, "the learning rate at the end of the decay"),
    _f("decoupled-lr", "train", "decoupled_lr", float,
       "the input embedding's and output layer's learning rate (Megatron-LM's; tied: one parameter), on --lr's "
       "warmup and decay down to --decoupled-min-lr; the one-process torch trainer's policy"),
    _f("decoupled-min-lr", "train", "decoupled_min_lr", float,
       "with --decoupled-lr: the embedding and output layer's rate at the end of the decay (default: --min-lr)"),
    _f("weight-decay-incr-style", "train", "weight_decay_incr_style", str,
       "weight-decay schedule (Megatron-LM's): constant (--weight-decay throughout), or linear / cosine from "
       "--start-weight-decay to --end-weight-decay over --lr-decay-iters optimizer steps (--weight-decay unused)",
       ("constant", "linear", "cosine")),
    _f("start-weight-decay", "train", "start_weight_decay", float,
       "--weight-decay-incr-style linear/cosine: the weight decay of the first optimizer step"),
    _f("end-weight-decay", "train", "end_weight_decay", float,
       "--weight-decay-incr-style linear/cosine: the weight decay from --lr-decay-iters on (>= the start)"),
    _f("log-probs-max-tokens-per-gpu", "train", "log_probs_max_tokens_per_gpu", int,
       "with --use-dynamic-batch-size: the token budget of the forwards without a backward (old and reference "
       "logprobs, PPO's critic values), which keep no activations; default: --max-tokens-per-gpu's (or, on CUDA, "
       "the memory plan's)"),
    _f("use-dynamic-batch-size", "train", "use_dynamic_batch_size", kind="true",
       help="micro-batches by token budget (--max-tokens-per-gpu) instead of --micro-batch-size samples (the "
            "policy's and PPO's critic's)"),
    _f("max-tokens-per-gpu", "train", "max_tokens_per_gpu", int,
       "token budget of a micro-batch with --use-dynamic-batch-size: its real tokens, packed end to end into one "
       "row with per-sample attention (rows x longest row with --no-pack-sequences; rows whose padding adds at "
       "most 3% run unpacked). Not given, on CUDA: "
       "micro-batches are capped at floor(0.8 x (free memory - gradients, optimizer state, weight copies, logprob "
       "chunks) / activation bytes per token) padded tokens (miles/training/torch/memory_plan.py states the rule)"),
    _f("no-pack-sequences", "train", "pack_sequences", kind="false",
       help="with --use-dynamic-batch-size: right-padded rows per micro-batch instead of one packed row"),
    _f("recompute-activations", "train", "recompute_activations", kind="true",
       help="activation checkpointing: recompute each layer's activations in the backward (less memory)"),
    _f("trainer-compile", "train", "compile_layers", kind="true",
       help="torch trainer on CUDA: torch.compile each decoder layer (default there for dense models: the train "
            "phase runs ~1.5x faster on an H200 after a one-time compile in the first rollout; docs/performance.md; "
            "a Qwen3-MoE model's layers run eagerly unless this flag is given: docs/moe.md)"),
    _f("no-trainer-compile", "train", "compile_layers", kind="false",
       help="torch trainer on CUDA: run the decoder layers eagerly (no compile warm-up, slower steps)"),
    _f("trainer-weight-shadows", "train", "weight_shadows", kind="true",
       help="torch trainer with a compute dtype below float32 (bf16 on CUDA): cast the decoder's Linear weights "
            "once per optimizer step instead of once per micro-batch, and add their gradients into the float32 "
            "ones as each backward makes them (the same numbers as autocast; miles/training/torch/shadows.py). Opt-in: "
            "0.6-0.9%% of a step on the GPU (docs/performance.md); FSDP ranks (several trainer GPUs) gather bf16 "
            "weights once a step already and ignore it"),
    _f("gradient-accumulation-fusion", "train", "grad_accum_fusion", kind="true",
       help="torch trainer with a compute dtype below float32: --trainer-weight-shadows, and each shadowed "
            "Linear's weight gradient is added into its float32 gradient by the weight-gradient matmul itself "
            "(cuBLAS with a float32 output on CUDA), not rounded to bf16 and added by a kernel of its own "
            "(Megatron-LM's gradient-accumulation fusion; more exact than autocast's sums, so not its numbers "
            "to the bit; miles/training/torch/shadows.py). Opt-in: 3.6%% off a 1.7B step on an H100, the colocated "
            "Qwen3-4B x 4k-token step at MFU 0.457 on an H200 against 0.430 without it (docs/performance.md); FSDP ranks ignore it, as they do the shadows; Megatron-LM's "
            "--no-gradient-accumulation-fusion leaves it off"),
    _f("optimizer-cpu-offload", "train", "optimizer_cpu_offload", kind="true",
       help="keep the optimizer state (AdamW's two float32 moments, 8 bytes a parameter) in pinned host memory "
            "for the whole run: each step streams it through the trainer's device 1 GiB of parameters at a time, "
            "the copies beside the updates, so the GPU never holds it whole (Megatron-LM's flag; here the update "
            "runs on the GPU, not on the CPU; the same numbers as without it). --offload-train does the same from "
            "the first rollout on and also frees the gradients while the engine rolls out"),
    _f("offload-optimizer-states", "train", "optimizer_cpu_offload", kind="true",
       help="miles' FSDP backend's name of --optimizer-cpu-offload: the same"),
    # train: float16 loss scaling (--fp16; Megatron-LM's flags and defaults)
    _f("loss-scale", "train", "loss_scale", float,
       "--fp16: a fixed loss scale instead of the dynamic one; a step whose gradients overflow is still skipped "
       "(Megatron-LM's; default: none, dynamic)"),
    _f("initial-loss-scale", "train", "initial_loss_scale", float,
       "--fp16: the dynamic loss scale's start (default 65536, torch's GradScaler's; Megatron-LM's 2^32 makes the "
       "first ~18 steps overflow and be skipped while it falls to float16's range: in RL, a rollout's update each)"),
    _f("min-loss-scale", "train", "min_loss_scale", float, "--fp16: the dynamic loss scale's floor"),
    _f("loss-scale-window", "train", "loss_scale_window", int,
       "--fp16: steps without an overflow after which the dynamic loss scale doubles"),
    _f("hysteresis", "train", "hysteresis", int,
       "--fp16: overflow steps (since the scale last grew) before the dynamic loss scale is halved; every overflow "
       "step is skipped"),
    # train: the megatron backend's parallelism (--train-backend megatron)
    _f("tensor-model-parallel-size", "train", "tensor_model_parallel_size", int,
       "megatron: tensor-parallel ranks per model replica (must divide the attention and key/value heads)"),
    _f("pipeline-model-parallel-size", "train", "pipeline_model_parallel_size", int,
       "megatron: pipeline stages (must divide the layers, or the layers the first and last stages leave)"),
    _f("decoder-first-pipeline-num-layers", "train", "first_pipeline_stage_layers", int,
       "megatron: the first pipeline stage's layers (the others split the rest evenly)"),
    _f("decoder-last-pipeline-num-layers", "train", "last_pipeline_stage_layers", int,
       "megatron: the last pipeline stage's layers (the others split the rest evenly)"),
    _f("context-parallel-size", "train", "context_parallel_size", int,
       "megatron: context-parallel ranks; each takes 2 of the 2N chunks of every sequence (padded to a multiple of 2N)"),
    _f("expert-model-parallel-size", "train", "expert_model_parallel_size", int,
       "megatron: ranks each MoE layer's experts are split over (must divide the experts and the data x context "
       "parallel ranks)"),
    _f("expert-tensor-parallel-size", "train", "expert_tensor_parallel_size", int,
       "megatron: tensor-parallel ranks per expert; 1 (each expert whole on its expert-parallel rank) is built"),
    _f("sequence-parallel", "train", "sequence_parallel", kind="true",
       help="megatron: split norms' and dropouts' activations along the sequence over the TP ranks"),
    # checkpoint
    _f("save", "checkpoint", "save", str, "checkpoint root directory"),
    _f("load", "checkpoint", "load", str, "resume from the newest complete checkpoint under this root"),
    _f("save-interval", "checkpoint", "save_interval", int, "save every N rollouts (and after the last)"),
    _f("no-save-hf", "checkpoint", "save_hf", kind="false", help="skip the HF-format export at each save"),
    _f("save-trigger-sentinel", "checkpoint", "save_trigger_sentinel", str, "save after the rollout during which this file appears, then delete it"),
    _f("critic-load", "checkpoint", "critic_load", str,
       "initial critic (ppo): an HF folder (new value head), a critic folder, or a checkpoint root (newest)"),
    _f("critic-save", "checkpoint", "critic_save", str, "critic checkpoint root (default: inside --save's checkpoints)"),
    # eval
    _f("eval-prompt-data", "eval", "prompt_data", kind="pairs", help="eval datasets: NAME PATH [NAME PATH ...]"),
    _f("eval-interval", "eval", "interval", int, "evaluate every N rollouts (and before training, and after the last)"),
    _f("skip-eval-before-train", "eval", "skip_before_train", kind="true", help="no eval before the first rollout"),
    _f("n-samples-per-eval-prompt", "eval", "n_samples_per_prompt", int, "responses per eval prompt (pass@k uses them)"),
    _f("eval-temperature", "eval", "temperature", float, "eval sampling temperature (0: greedy; default: --rollout-temperature)"),
    _f("eval-max-response-len", "eval", "max_response_len", int, "max new tokens in eval (default: the rollout's)"),
    _f("eval-min-new-tokens", "eval", "min_new_tokens", int,
       "eval responses get at least this many tokens: EOS and stop tokens are barred before (SGLang's "
       "min_new_tokens; stop strings still end a response)"),
    _f("eval-function-path", "eval", "function_path", str,
       "async fn(ctx, rollout_id) -> {dataset: groups of scored Samples}, or ({dataset: groups}, metrics), in place "
       "of the built-in eval (miles calls its eval function like the rollout function, evaluation=True): ctx has "
       "the eval datasets (ctx.datasets[name].prompts, .n_samples_per_prompt, .sampling_params), generate, "
       "generate_samples and score; the eval row gets each returned dataset's reward_mean, pass@k and ratios as the "
       "built-in eval's, and the metrics under eval/, by import path (miles.rollout.evals)"),
    _f("custom-eval-rollout-log-function-path", "eval", "log_function_path", str,
       "fn(ctx, data, metrics) after each eval, data {dataset: samples}: it may add entries to `metrics`; "
       "returning True replaces the default eval metrics by its own, by import path (miles.rollout.hooks)"),
    _f("eval-max-prompt-len", "eval", "max_prompt_len", int,
       "drop eval prompts longer than this many tokens (default: --max-prompt-len)"),
    _f("eval-max-context-len", "eval", "max_context_len", int,
       "eval prompt + response tokens at most (default: --rollout-max-context-len)"),
    # cluster
    _f("ray-address", "cluster", "ray_address", str, "attach to this Ray cluster (default: start a local one)"),
    _f("ray-num-cpus", "cluster", "num_cpus", int, "CPUs of the local Ray cluster"),
    _f("ray-namespace", "cluster", "namespace", str, "Ray namespace of the run's actors (default: one per run)"),
    _f("colocate", "cluster", "colocate", kind="true",
       help="engines on the trainer's GPUs, weights synced by CUDA IPC, the engines' cache freed while training "
            "(sync machine); with --no-offload-rollout both stay resident, the engine's KV cache taking "
            "--rollout-mem-fraction of the GPU less its weights: the one-GPU layout of the async machines "
            "(--fully-async too)"),
    _f("actor-num-nodes", "cluster", "actor_num_nodes", int, "nodes of the trainer"),
    _f("actor-num-gpus-per-node", "cluster", "actor_num_gpus_per_node", int, "the trainer's GPUs on each node"),
    _f("rollout-num-gpus", "cluster", "rollout_num_gpus", int,
       "the engines' GPUs in all (default: --rollout-num-engines x --rollout-num-gpus-per-engine)"),
    _f("rollout-num-gpus-per-engine", "cluster", "rollout_num_gpus_per_engine", int,
       "GPUs of one engine: an SGLang server's tensor parallel size (the embedded and fast engines: 1)"),
    _f("num-gpus-per-node", "cluster", "num_gpus_per_node", int, "GPUs of each node"),
    _f("offload", "cluster", "offload", kind="true", help="--offload-train and --offload-rollout"),
    _f("offload-train", "cluster", "offload_train", kind="true",
       help="the trainer's optimizer state goes to pinned host memory at the first rollout and stays there: "
            "each step streams it through the GPU 1 GiB of parameters at a time, so the GPU never holds it whole"),
    _f("offload-rollout", "cluster", "offload_rollout", kind="true",
       help="the engines free their GPU memory while the trainer trains: KV cache and CUDA graphs, SGLang's "
            "weights too (on with --colocate; sync machine)"),
    _f("no-offload-train", "cluster", "offload_train", kind="false",
       help="miles' explicit off: the trainer keeps its optimizer state on the GPU, --offload notwithstanding"),
    _f("no-offload-rollout", "cluster", "offload_rollout", kind="false",
       help="miles' explicit off: the engines keep their memory while the trainer trains, --colocate and --offload "
            "notwithstanding (with --colocate: the GPU shared, both resident; what the async machines take)"),
    _f("offload-train-disk-chunk-mb", "train", "offload_chunk_mb", int,
       "MiB of float32 parameters each streamed optimizer step moves through the GPU at a time under --offload-train "
       "and --optimizer-cpu-offload (default 1024; the step holds 4x this of AdamW moments on the GPU). miles: the "
       "staging buffer of its disk offload, which this build does not have"),
    _f("ray-no-ship-code", "cluster", "ship_code", kind="false",
       help="with --ray-address: do not send miles and the files of --custom-rm-path & co. to the cluster through "
            "Ray's runtime_env; they are installed at the same paths on every node"),
    _f("shared-fs", "cluster", "shared_fs", kind="true",
       help="the trainer's checkpoint folders are visible to the driver at the same path (default: when every "
            "node of the cluster is the driver's machine)"),
    _f("no-shared-fs", "cluster", "shared_fs", kind="false",
       help="no filesystem shared with the driver: checkpoints travel between the trainer's node and the driver's "
            "--save/--load folders through Ray (default on a cluster with nodes on other machines)"),
    _f("ray-actor-resources", "cluster", "actor_resources", kind="json",
       help="Ray resources every actor of the run asks for, as JSON ('{\"miles_worker\": 1}'): puts the actors on "
            "the nodes that have them"),
    _f("train-env-vars", "cluster", "train_env_vars", kind="json",
       help="environment variables the trainer's processes start with, as a JSON object of strings "
            "('{\"PYTORCH_CUDA_ALLOC_CONF\": \"expandable_segments:True\"}'): the trainer, PPO's critic and "
            "their FSDP or Megatron ranks, through their Ray runtime_env, as in miles"),
    # trace
    _f("run-dir", "trace", "run_dir", str, "where trace.jsonl, metrics.jsonl and config.yaml go"),
    _f("trace-console", "trace", "console", str, "trace events on the terminal", ("auto", "pretty", "plain", "off")),
    _f("teardown-timeout", "trace", "teardown_timeout_s", float, "seconds each resource gets to tear down before it is forced"),
    _f("teardown-deadline", "trace", "teardown_deadline_s", float, "seconds the whole teardown may take"),
    # tracking
    _f("progress", "tracking", "progress", str,
       "live progress on stderr: rich on a terminal, plain lines otherwise (auto), or off", ("auto", "rich", "plain", "off")),
    _f("use-tensorboard", "tracking", "use_tensorboard", kind="true",
       help="also write metrics as TensorBoard scalars (pip install miles[tensorboard])"),
    _f("tensorboard-dir", "tracking", "tensorboard_dir", str, "TensorBoard event folder (default: <run-dir>/tensorboard)"),
    _f("use-wandb", "tracking", "use_wandb", kind="true", help="also log metrics to Weights & Biases (pip install miles[wandb])"),
    _f("wandb-project", "tracking", "wandb_project", str, "W&B project"),
    _f("wandb-team", "tracking", "wandb_team", str, "W&B entity (team or user; default: your W&B default)"),
    _f("wandb-group", "tracking", "wandb_group", str, "W&B group of runs"),
    _f("wandb-mode", "tracking", "wandb_mode", str,
       "W&B mode; offline needs no network (`wandb sync` later) (default: $WANDB_MODE, else online)",
       ("online", "offline", "disabled")),
    _f("wandb-dir", "tracking", "wandb_dir", str, "W&B's local files (default: <run-dir>/wandb)"),
    _f("worker-log-level", "tracking", "worker_log_level", str,
       "lowest level the actors write to <run-dir>/logs/<role>-<rank>.jsonl", ("debug", "info", "warning", "error")),
    # sglang
    _f("sglang-router-policy", "sglang", "router_policy", str, "how the sglang-router spreads requests over the "
       "servers (with more than one engine)", ROUTER_POLICIES),
    _f("sglang-router-request-timeout-secs", "sglang", "router_request_timeout_s", float,
       "seconds a request may take, through the router and to a server"),
    _f("sglang-server-startup-timeout", "sglang", "startup_timeout_s", float,
       "seconds an SGLang server may take to load and answer /health_generate"),
    # the loop
    _f("num-rollout", "run", "num_rollout", int, "rollouts to run (default: from --num-epoch)"),
    _f("num-epoch", "run", "num_epoch", int, "passes over the prompt data"),
    _f("check-weight-update-equal", "run", "check_weight_update_equal", kind="true",
       help="after each weight sync, compare trainer and engine checksums; fail on a mismatch (with --fully-async: "
            "the checksums each engine records at the token boundary of its in-flight swap)"),
    _f("debug-skip-weight-update", "run", "debug_skip_weight_update", kind="true",
       help="debugging: skip every weight sync (a weights_sync_skipped trace event says so); the engines keep the "
            "initial weights and the trainer trains on; evals keep their --eval-interval schedule. Refused with --check-weight-update-equal and --ci-test, "
            "which compare the two, and with SGLang engines that release their weights (--offload*, --colocate)"),
    _f("update-weight-buffer-size", "run", "update_weight_buffer_size", int,
       "bytes of one weight bucket when weights travel by CUDA IPC (--colocate on GPUs)"),
    _f("update-weights-interval", "run", "update_weights_interval", int,
       "async machine: push the trainer's weights to the engines every N rollouts (staleness up to N)"),
    _f("fully-async", "run", "fully_async", kind="true",
       help="a rollout producer generates groups continuously into a bounded buffer; the trainer takes the next "
            "--rollout-batch-size groups; weight pushes pause the requests in flight at a token boundary instead "
            "of waiting for them (picks --machine fully_async; docs/fully-async.md)"),
    _f("max-weight-staleness", "run", "max_weight_staleness", int,
       "fully async: a group whose oldest token is more than this many weight versions behind the step that "
       "would train it goes to --async-unused-samples-handler (default: no bound)"),
    _f("async-max-concurrent-samples", "run", "async_max_concurrent_samples", int,
       "fully async: samples being generated at most, over all engines (default: one rollout batch)"),
    _f("async-data-buffer-capacity-factor", "run", "async_data_buffer_capacity_factor", float,
       "fully async: the buffer holds at most this x --rollout-batch-size groups, finished or in flight (2.0)"),
    _f("async-unused-samples-handler", "run", "async_unused_samples_handler", str,
       "fully async: what happens to a group past --max-weight-staleness: drop it, or retry (generate its "
       "prompt again); either is counted", ("drop", "retry")),
    _f("async-tail-cut-share", "run", "async_tail_cut_share", float,
       "fully async: a producer's engine call returns once at most this share of its samples still run "
       "(their groups go on in a next call, from prompt + response so far), so the long answers do not keep "
       "the engine's batch nearly empty; 0 (default): a call waits for its longest answer"),
    _f("debug-exit-after-rollout", "run", "debug_exit_after_rollout", int, "stop after this many rollouts of this invocation"),
    _f("save-debug-rollout-data", "run", "save_debug_rollout_data", str,
       "write each rollout's samples and metrics to PATH, a template with {rollout_id} (else a folder: "
       "PATH/rollout_{rollout_id}.pt)"),
    _f("load-debug-rollout-data", "run", "load_debug_rollout_data", str,
       "train on rollouts saved by --save-debug-rollout-data (same PATH) instead of generating: no engines, "
       "no weight sync, no eval (picks --machine train_only)"),
    _f("debug-rollout-only", "run", "debug_rollout_only", kind="true",
       help="generate and score rollouts without a trainer; weights stay the initial ones (picks --machine rollout_only)"),
    _f("inject-fault", "run", "inject_faults", kind="list",
       help="rehearse a failure: STATE:KIND[:VISIT] (the kinds: miles/api/faults.py; a wrong one lists them)"),
)

# -- miles flags a single-node user reaches for; the ones refused are in miles_flags.py -------------
MILES_COMPAT_FLAGS: tuple[Flag, ...] = (
    _f("chat-template-path", "data", "chat_template_path", str,
       "a Jinja chat template file used instead of the tokenizer's (with --apply-chat-template)"),
    _f("apply-chat-template-kwargs", "data", "apply_chat_template_kwargs", kind="json",
       help='a JSON object of extra chat-template variables, e.g. \'{"enable_thinking": false}\''),
    _f("rollout-stop", "rollout", "stop", str, "stop strings: a response ends once its text contains one",
       kind="list"),
    _f("rollout-stop-token-ids", "rollout", "stop_token_ids", int, "token ids that end a response, besides EOS",
       kind="list"),
    _f("rollout-max-context-len", "rollout", "max_context_len", int,
       "prompt + response tokens at most: each response gets this minus its prompt's length"),
    _f("use-unbiased-kl", "algorithm", "use_unbiased_kl", kind="true",
       help="weight the KL loss per token by the importance ratio exp(logp - old logp) (DeepSeek-V3.2)"),
    _f("use-opsm", "algorithm", "use_opsm", kind="true",
       help="off-policy sequence masking (DeepSeek-V3.2): drop from the policy loss the negative-advantage tokens "
            "of each sequence whose mean old - current logprob over its response tokens exceeds --opsm-delta"),
    _f("opsm-delta", "algorithm", "opsm_delta", float,
       "--use-opsm's threshold on a sequence's mean old - current logprob (a KL estimate); default 1e-4"),
    _f("custom-loss-function-path", "algorithm", "custom_loss_function_path", str,
       f"--loss-type custom_loss: {signature('--custom-loss-function-path')}, by import path"),
    _f("custom-tis-function-path", "algorithm", "custom_tis_function_path", str,
       f"--use-tis: {signature('--custom-tis-function-path')}, by import path"),
    _f("custom-pg-loss-reducer-function-path", "algorithm", "pg_loss_reducer_path", str,
       "miles' get_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer(x): "
       "reduces the policy loss only (KL, entropy keep --loss-agg-mode's), then divided by the global batch's "
       "normalizer; by import path (miles.training.pg_reducer)"),
    _f("num-steps-per-rollout", "train", "num_steps_per_rollout", int,
       "optimizer steps per rollout: the global batch is the rollout's samples / N"),
    _f("use-dynamic-global-batch-size", "train", "use_dynamic_global_batch_size", kind="true",
       help="the global batch is every sample the rollout gives, however many (one optimizer step per rollout); "
            "--global-batch-size is then ignored for the steps. Needs --use-dynamic-batch-size"),
    _f("save-debug-train-data", "train", "save_debug_train_data", str,
       "write each rollout's packed train batch to PATH, a template with {rollout_id} and {rank} (else a "
       "folder: PATH/train_{rollout_id}.pt)"),
    _f("save-hf", "checkpoint", "save_hf_path", str,
       "also export the model in HF format to PATH at each save ({rollout_id} in PATH is filled in)"),
    _f("no-load-optim", "checkpoint", "load_optimizer", kind="false",
       help="resume without the checkpoint's optimizer state: a fresh AdamW (the step count and schedule continue)"),
    _f("no-load-rng", "checkpoint", "load_rng", kind="false",
       help="resume without the checkpoint's RNG states (this run's seeds go on)"),
    _f("finetune", "checkpoint", "finetune", kind="true",
       help="take only the weights of --load's checkpoint: a fresh optimizer and RNG, step 0, from rollout 0 and "
            "the start of the data (Megatron-LM's --finetune)"),
    _f("ckpt-step", "checkpoint", "ckpt_step", int,
       "resume from --load's checkpoint of this rollout (iter_N) instead of the newest (Megatron-LM's)"),
    _f("exit-on-missing-checkpoint", "checkpoint", "exit_on_missing", kind="true",
       help="a --load folder that is missing or empty stops the run instead of starting from --hf-checkpoint"),
    _f("no-save-optim", "checkpoint", "save_optimizer", kind="false",
       help="checkpoints without optimizer state (resuming one starts a fresh optimizer)"),
    _f("keep-last-checkpoints", "checkpoint", "keep_last", int,
       "keep only the newest N checkpoints under --save (default: all; miles has no such flag)"),
    _f("save-retain-interval", "checkpoint", "retain_interval", int,
       "as miles: keep the checkpoint after every N rollouts and the newest; delete the others (default: keep all)"),
    _f("log-probs-chunk-size", "train", "log_probs_chunk_size", int,
       "rows per chunk of the chunked logprob computation (the trainer's CUDA path; default: 2048)"),
    _f("gradient-checkpointing", "train", "recompute_activations", kind="true",
       help="miles' FSDP name of --recompute-activations"),
    _f("allow-fresh-start", "checkpoint", "allow_fresh_start", kind="true",
       help="when --load holds files but nothing loadable (every checkpoint corrupt), train from --hf-checkpoint "
            "instead of refusing (default: refuse, exit 2; an empty or missing --load folder starts fresh anyway)"),
    _f("save-retries", "checkpoint", "save_retries", int,
       "saves that may fail for a full disk (the partial one removed, the run goes on) before the run fails"),
    _f("async-save", "checkpoint", "async_save", kind="true",
       help="a save under --save takes a CPU snapshot of the trainer's (and critic's) state and returns; the files "
            "are written while the run goes on, and the checkpoint is committed when they are all written (before "
            "the next save, and at the run's end). Torch trainer on one GPU or the CPU; other trainers save "
            "synchronously (a warning says so). --critic-save elsewhere and --save-hf PATH stay synchronous"),
    _f("eval-config", "eval", "datasets", kind="eval_config",
       help="eval datasets in miles' YAML: eval.defaults and eval.datasets (name, path, n_samples_per_eval_prompt, "
            "temperature, top_p, max_response_len, input_key, label_key, rm_type, ...)"),
    _f("mfu-peak-tflops", "train", "mfu_peak_tflops", float,
       "a trainer GPU's peak TFLOP/s for the `mfu` train metric (`tflops`: 6 x params x real tokens a second of "
       "the optimizer steps; default peak: the dense bf16 one of an H100, H200 or A100 training in bf16, else no "
       "`mfu`)"),
    _f("log-passrate", "eval", "log_passrate", kind="true",
       help="log pass@k for every k up to n, for rollouts and evals (unbiased estimator)"),
    _f("use-mlflow", "tracking", "use_mlflow", kind="true",
       help="also log metrics to MLflow (pip install mlflow; tracking URI: $MLFLOW_TRACKING_URI, else <run-dir>/mlruns)"),
    _f("start-rollout-id", "run", "start_rollout_id", int,
       "the first rollout id of this invocation (default: 0, or the one after --load's checkpoint)"),
    _f("debug-train-only", "run", "debug_train_only", kind="true",
       help="train without engines on rollouts saved by --save-debug-rollout-data (needs "
            "--load-debug-rollout-data; picks --machine train_only)"),
    _f("rollout-max-prompt-len", "data", "max_prompt_len", int,
       "miles' name of --max-prompt-len: drop prompts longer than this many tokens"),
    _f("ci-test", "run", "ci_test", kind="true",
       help="CI checks that fail the run: weights equal after each sync, engine and trainer logprobs agree, "
            "the reference equals the policy at the start"),
    _f("ci-metric-checker-key", "run", "ci_metric_checker_key", str,
       "with --ci-test: the eval metric the run must reach (eval/<set>/<metric>, or miles' eval/<set>: its "
       "reward_mean); missing from an eval, or never reaching the threshold by the run's end, fails the run"),
    _f("ci-metric-checker-threshold", "run", "ci_metric_checker_threshold", float,
       "with --ci-metric-checker-key: the value at least one eval must reach (>=)"),
    _f("ci-save-grad-norm", "run", "ci_save_grad_norm", str,
       "write each optimizer step's gradient norm to this JSON file (miles' {role}, {rollout_id}, {step_id} may "
       "split it into several) for a later --ci-load-grad-norm"),
    _f("ci-load-grad-norm", "run", "ci_load_grad_norm", str,
       "compare each optimizer step's gradient norm with the one --ci-save-grad-norm recorded there (rel and abs "
       "tolerance 0.01); a mismatch or an unrecorded step fails the run"),
    _f("ci-save-model-hash", "run", "ci_save_model_hash", kind="true",
       help="with --ci-test and --save: each checkpoint also holds a sha256 of the trainer's float32 weights"),
    _f("ci-check-model-hash", "run", "ci_check_model_hash", kind="true",
       help="with --ci-test and --load: the weights loaded must match the hash --ci-save-model-hash wrote into "
            "the checkpoint, else the run fails"),
    # -- flags miles' own launch scripts pass (scripts/run_qwen3_*.py) -------------------------------
    _f("eval-top-p", "eval", "top_p", float,
       "the eval datasets' top-p (an --eval-config dataset's own top_p wins; default: --rollout-top-p, 1 with a "
       "greedy --eval-temperature 0)"),
    _f("eval-top-k", "eval", "top_k", int,
       "the eval datasets' top-k, -1: off (an --eval-config dataset's own top_k wins; default: --rollout-top-k, "
       "off with a greedy --eval-temperature 0)"),
    _f("dump-details", "run", "dump_details", str,
       "DIR: as miles, each rollout's samples go to DIR/rollout_data/{rollout_id}.pt (--load-debug-rollout-data "
       "reads them back), its train batch to DIR/train_data/{rollout_id}_{rank}.pt and the tokenizer to "
       "DIR/tokenizer. A --save-debug-rollout-data or --save-debug-train-data given beside it wins for its kind "
       "(miles' --dump-details overrides them) (default: none)"),
    _f("use-fault-tolerance", "rollout", "use_fault_tolerance", kind="true",
       help="miles' switch for engine health checks and restarts of dead or hung engines, which this build does by "
            "default (--engine-max-restarts, --rollout-health-check-*, --engine-generate-timeout); given, the flags "
            "that turn them off are refused. miles' train-cell fault tolerance (--ft-components train) is not here"),
    _f("attn-implementation", "train", "attn_implementation", str,
       "miles' FSDP backend's HF attention kernel; a kernel switch, accepted with no effect: the torch trainer runs "
       "its own attention (SDPA; packed micro-batches through torch's varlen flash kernel on CUDA, "
       "miles/training/packing.py), megatron-core its own (default: none)", ATTN_IMPLEMENTATIONS),
    _f("disable-compute-advantages-and-returns", "algorithm", "compute_advantages_and_returns", kind="false",
       help="miles: train without advantages or returns; here with --loss-type sft_loss, which computes none "
            "already; refused with the policy and custom losses, which read the advantages"),
    _f("wandb-key", "tracking", "wandb_key", str,
       "the W&B API key of the run's W&B run (miles logs in with it); written to no config.yaml, trace, log or "
       "tracker config. On a command line other users of the machine can read it (ps): WANDB_API_KEY is safer "
       "(default: W&B's own login, WANDB_API_KEY or `wandb login`)"),
    _f("disable-wandb-random-suffix", "tracking", "disable_wandb_random_suffix", kind="true",
       help="miles: name the W&B run without a random suffix; here the W&B run's name and id are always the miles "
            "run id, with no suffix: accepted, it is what happens"),
    _f("megatron-to-hf-mode", "train", "megatron_to_hf_mode", str,
       "--train-backend megatron: how miles maps Megatron weights to HF names for the engines (raw: its own table, "
       "bridge: Megatron-Bridge); here the backend's own bit-exact conversion (miles/training/megatron/"
       "conversion.py) serves both, accepted with no effect (default: none)", MEGATRON_TO_HF_MODES),
    # LoRA: the torch trainer on one process (docs/algorithms.md "LoRA")
    _f("lora-rank", "train", "lora_rank", int,
       "train LoRA adapters of rank R on the decoder's Linear layers, the base model frozen (0: off, the whole "
       "model trains); the engines get the merged weights W + (alpha/R) B A at each sync. Torch trainer, one "
       "process (default: 0)"),
    _f("lora-alpha", "train", "lora_alpha", float, "LoRA's alpha: the adapters' output is scaled by alpha / "
       "--lora-rank (default: 16, miles')"),
    _f("lora-dropout", "train", "lora_dropout", float,
       "dropout on the LoRA adapters' input in the training forwards (not in the logprob passes; default: 0)"),
    _f("target-modules", "train", "target_modules", str,
       "the Linear modules LoRA adapts, a comma list: all-linear (every Linear of the decoder layers, not the LM "
       "head), miles' groups attn and mlp, module-name suffixes (q_proj,v_proj or self_attn.o_proj) or patterns "
       "with * (default: all-linear)"),
    _f("exclude-modules", "train", "exclude_modules", str,
       "module-name suffixes or * patterns (comma list) taken out of --target-modules' selection"),
    _f("lora-adapter-path", "train", "lora_adapter_path", str,
       "start the LoRA adapters from this PEFT adapter folder (adapter_model.safetensors, adapter_config.json; "
       "its r and lora_alpha must equal --lora-rank and --lora-alpha) instead of B = 0"),
    # mixture-of-experts: a Qwen3-MoE --hf-checkpoint on the torch trainer (docs/moe.md)
    _f("use-rollout-routing-replay", "train", "use_rollout_routing_replay", kind="true",
       help="R3: the trainer's MoE layers route each response token to the experts the rollout engine used "
            "(the gate weights stay the trainer's router softmax at those experts, so the router trains)"),
    _f("use-routing-replay", "train", "use_routing_replay", kind="true",
       help="the train steps' MoE layers route as the old-logprob pass did (with R3: the rollout's experts where "
            "it has them)"),
    _f("moe-aux-loss-coeff", "train", "moe_aux_loss_coeff", float,
       "coefficient of Megatron's load-balancing loss, summed over the MoE layers (0: off)"),
    _f("moe-router-load-balancing-type", "train", "moe_router_load_balancing_type", str,
       "aux_loss: over a micro-batch's tokens; seq_aux_loss: per sequence, averaged; none: no load-balancing loss",
       ("aux_loss", "seq_aux_loss", "none")),
    _f("moe-z-loss-coeff", "train", "moe_z_loss_coeff", float,
       "coefficient of the router z-loss (mean logsumexp(router logits)^2), summed over the MoE layers"),
    _f("moe-router-dtype", "train", "moe_router_dtype", str, "the routers' logits and gate weights in float32",
       ("fp32",)),
)
FLAGS += MILES_COMPAT_FLAGS
# reliability: kept in a block of their own
RELIABILITY_FLAGS: tuple[Flag, ...] = (
    _f("phase-timeout", "reliability", "phase_timeouts", kind="list",
       help="STATE=SECONDS ...: a state's phase deadline, overriding the machine YAML's timeout (past it the "
            "phase is cancelled and the run drains); eval takes rollout's unless named"),
    _f("stop-timeout", "reliability", "stop_timeout_s", float,
       "seconds from the first SIGINT/SIGTERM to the process's exit, whatever the phase is doing "
       "(stays under a cluster's ~30 s preemption grace)"),
    _f("reward-timeout", "reliability", "reward_timeout_s", float,
       "seconds one reward call may take; past it the sample scores 0 and the run goes on; 0: no limit. The "
       "default, 300, is above remote_rm's worst case (4 tries of --rm-timeout 30 s with backoff: 124 s) and a "
       "judge model's or a sandboxed test's call; a reward still running after 5 minutes is hung"),
    _f("no-verify-load", "reliability", "verify_load", kind="false",
       help="do not check a checkpoint's sha256 values on --load (huge models; a corrupt file then fails the load)"),
    _f("ray-node-ip", "reliability", "ray_node_ip", str,
       "address of the local cluster's node: 127.0.0.1 keeps every Ray port on loopback; another address "
       "(or auto: Ray's choice) makes Ray listen on every interface"),
    _f("ray-allow-no-auth", "reliability", "ray_allow_no_auth", kind="true",
       help="start a local cluster even when Ray's token authentication is off (RAY_AUTH_MODE=disabled)"),
)
FLAGS = FLAGS + RELIABILITY_FLAGS
# --sglang-<flag> [VALUE] pass-through: collected by parse_flags / load_config_file, never an argparse option
PASSTHROUGH = Flag("sglang-*", "sglang", "server_args", kind="list", help="SGLang server flags")
BY_DEST = {f.name.replace("-", "_"): f for f in FLAGS} | {"sglang_server_args": PASSTHROUGH}
REQUIRED = ("hf-checkpoint", "prompt-data", "rollout-batch-size")


NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")   # argparse's own misses -1e-4


def build_parser(prog: str = "miles train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Train a language model with RL (GRPO, PPO and kin).",
                                usage=f"{prog} [--config FILE] [--machine NAME] --hf-checkpoint DIR --prompt-data FILE "
                                      "--rollout-batch-size N [flags ...]",
                                argument_default=argparse.SUPPRESS, allow_abbrev=False)
    p._negative_number_matcher = NEGATIVE_NUMBER     # "--lr -1e-4" is a value, which validation then refuses
    p.add_argument("--config", help="YAML file of flag: value pairs; flags given here override it (default: none)")
    p.add_argument("--machine", help="lifecycle machine: a built-in name (sync, async, eval_only) or a .yaml path "
                                     "(default: sync)")
    groups = {s: p.add_argument_group(GROUP_TITLES[s]) for s in SECTIONS}
    _add_megatron_options(p)
    for f in FLAGS:
        g, opt, help_ = groups[f.section], f"--{f.name}", help_line(f)
        if f.kind in ("true", "false"):
            g.add_argument(opt, action="store_true", help=help_)
        elif f.kind == "pairs":
            g.add_argument(opt, nargs="+", metavar="NAME PATH", help=help_)
        elif f.kind == "list":
            g.add_argument(opt, nargs="+", type=f.type or str, metavar="VALUE", help=help_)
        elif f.kind in ("json", "eval_config"):
            g.add_argument(opt, metavar="JSON" if f.kind == "json" else "FILE", help=help_)
        else:
            metavar = "{" + ",".join(f.choices) + "}" if f.choices else {int: "N", float: "X"}.get(f.type, "VALUE")
            choices = (*f.choices, *VALUE_ALIASES.get(opt[2:].replace("-", "_"), {})) if f.choices else None
            g.add_argument(opt, type=f.type, choices=choices, help=help_, metavar=metavar)
    return p


def _add_megatron_options(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's architecture and kernel flags of miles' launch scripts (miles.config.megatron_flags)."""
    g = p.add_argument_group("Megatron-LM flags: architecture flags must equal --hf-checkpoint's config.json; "
                             "kernel, memory, logging and I/O switches are accepted and change nothing here")
    for name, f in megatron_options().items():     # values stay as given: the checks compare them as numbers
        if name in MEGATRON_ALIASES:                # Megatron-LM's other name of a flag here: the same option
            target = BY_DEST[MEGATRON_ALIASES[name]]
            g.add_argument(f"--{name}", dest=MEGATRON_ALIASES[name], type=target.type, help=megatron_help(name),
                           metavar={int: "N", float: "X"}.get(target.type, "VALUE"))
        elif f.takes is None:
            g.add_argument(f"--{name}", dest=megatron_dest(name), action="store_true", help=megatron_help(name))
        elif f.takes == "list":
            g.add_argument(f"--{name}", dest=megatron_dest(name), nargs="*", help=megatron_help(name), metavar="VALUE")
        else:
            g.add_argument(f"--{name}", dest=megatron_dest(name), help=megatron_help(name), metavar=f.takes.upper())


@functools.lru_cache(maxsize=4)
def _parser(prog: str) -> argparse.ArgumentParser:
    """The parser parse_flags reads with: built once (Megatron-LM's ~600 flags make building it cost more
    than a parse), never changed after."""
    return build_parser(prog)


def engine_defaults() -> dict[str, Any]:
    """{engine name: its spec's `defaults`}, which the help of the engines' flags quotes as
    `{engines[fast][max_batch_size]}`. The defaults live on the engines' specs; the registry is imported
    here by name, when help is shown (as `checks.run_checks` imports its contributors), so config
    imports nothing above it."""
    import importlib

    registry = importlib.import_module("miles.rollout.engines.registry")
    return {name: spec.defaults for name, spec in registry.ENGINES.items()}


def help_text(f: Flag) -> str:
    """The flag's help as written, an engine's default it quotes filled in from the engine's spec."""
    return f.help.format_map({"engines": engine_defaults()}) if "{engines[" in f.help else f.help


def help_line(f: Flag) -> str:
    """The flag's help with its default; a help that states its default itself keeps its wording."""
    f = replace(f, help=help_text(f))
    if f.name in REQUIRED:
        return f"{f.help} (required)"
    if "default" in f.help:
        return f.help
    if f.kind in ("true", "false"):
        return f"{f.help} (default: off)"
    default = _default(f)
    shown = "none" if default in (None, ()) else default
    return f"{f.help} (default: {shown})"


def _default(f: Flag) -> Any:
    fld = next(x for x in fields(SECTIONS[f.section]) if x.name == f.field)
    return None if fld.default is MISSING else fld.default


def parse_flags(argv: Sequence[str] | None = None, *, prog: str = "miles train") -> tuple[RunConfig, str | None]:
    """Parse the command line (and --config file) into a validated RunConfig and the machine name."""
    parser = _parser(prog)
    known, rest = parser.parse_known_args(argv)
    passthrough, rest = split_passthrough(rest)
    ns = vars(known)
    config_path, machine = ns.pop("config", None), ns.pop("machine", None)
    values: dict[str, Any] = {}
    refused = _leftovers(parser, rest)
    problems: list[str] = []
    if config_path:
        file_values, machine_from_file = load_config_file(config_path, problems)
        values.update(file_values)
        machine = machine or machine_from_file
    values.update(ns)
    custom_args = apply_custom_config(values, problems)    # miles: the YAML's keys over the command line
    values.update(miles_value_aliases(values))
    megatron = pop_megatron_values(values)      # checked against --hf-checkpoint's config.json below
    refused += megatron_problems(megatron, values.get("hf_checkpoint"))    # reported with the refused flags
    refused += precision_problems(megatron, values.get("dtype"))
    if passthrough:     # the command line's SGLang flags override the file's, flag by flag
        values["sglang_server_args"] = _merge_passthrough(values.get("sglang_server_args", ()), passthrough)
    try:                      # the refused flags first, then everything else wrong with the command line
        cfg = build_config(values, problems, custom_args=custom_args)
    except ConfigError as exc:
        raise ConfigError(refused + exc.problems) from None
    if refused:
        raise ConfigError(refused)
    return cfg, machine


def _leftovers(parser: argparse.ArgumentParser, rest: list[str]) -> list[str]:
    """miles flags this build refuses become problems (one line each); anything else unrecognized is
    argparse's error (exit 2), with the closest flag names."""
    refused, unknown = refused_in(rest)
    if unknown:
        names = [f"--{f.name}" for f in FLAGS]
        hints = [u + (f" (did you mean {close[0]}?)" if (close := difflib.get_close_matches(u, names, 1)) else "")
                 for u in unknown]
        parser.error(f"unrecognized arguments: {', '.join(hints)}")
    return refusal_lines(refused)


def split_passthrough(args: Sequence[str]) -> tuple[tuple[str, ...], list[str]]:
    """argparse's leftovers → (SGLang argv from every --sglang-<flag> [VALUE ...], anything else). A
    miles flag of that form that is not SGLang's (--sglang-router-ip: miles_flags.REFUSED) is left to
    the refusals."""
    out: list[str] = []
    stray: list[str] = []
    taking = False          # the values after a pass-through flag belong to it
    for a in args:
        if a.startswith("--" + PASSTHROUGH_PREFIX) and fate(a[2:].partition("=")[0]) is None:
            name, eq, value = a[2 + len(PASSTHROUGH_PREFIX):].partition("=")
            out += [f"--{name}", value] if eq else [f"--{name}"]
            taking = True
        elif taking and not a.startswith("--"):
            out.append(a)
        else:
            stray.append(a)
            taking = False
    return tuple(out), stray


def passthrough_from_file(name: str, value: Any) -> tuple[str, ...]:
    """A config file's `sglang-<flag>: value` → SGLang argv (true: the flag alone; false/null: nothing)."""
    if value is True:
        return (f"--{name}",)
    if value is False or value is None:
        return ()
    return (f"--{name}", *(map(str, value) if isinstance(value, (list, tuple)) else [str(value)]))


def _merge_passthrough(base: Sequence[str], override: Sequence[str]) -> tuple[str, ...]:
    def groups(argv: Sequence[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for a in argv:
            if a.startswith("--"):
                key = a
                out[key] = [a]
            else:
                out[key].append(a)
        return out

    merged = groups(base) | groups(override)
    return tuple(a for g in merged.values() for a in g)


def load_config_file(path: str, problems: list[str]) -> tuple[dict[str, Any], str | None]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    values, machine = {}, raw.pop("machine", None)
    base = p.parent
    for key, value in raw.items():
        dest = str(key).lstrip("-").replace("-", "_")
        flag_name = str(key).lstrip("-").replace("_", "-")
        if dest not in BY_DEST and flag_name.startswith(PASSTHROUGH_PREFIX) and fate(flag_name) is None:
            extra = passthrough_from_file(flag_name[len(PASSTHROUGH_PREFIX):], value)
            values["sglang_server_args"] = (*values.get("sglang_server_args", ()), *extra)
            continue
        if flag_name in megatron_options():
            values[megatron_dest(flag_name)] = value
            continue
        if dest not in BY_DEST:
            refused, _ = refused_in([f"--{dest.replace('_', '-')}"])
            problems.append(f"--config {path}: " + (refusal_line(refused[0]) if refused else
                            f"unknown key {key!r} (keys are flag names, e.g. rollout-batch-size)"))
            continue
        values[dest] = _relative_paths(dest, value, base)
    return values, machine


_FUNCTION_PATHS = tuple(flag[2:].replace("-", "_") for flag in USER_FUNCTION_FLAGS)   # their dest names


def _relative_paths(dest: str, value: Any, base: Path) -> Any:
    """Paths in a config file are relative to the file, so a recipe runs from any directory."""
    def fix(v: Any) -> Any:
        return str(base / v) if isinstance(v, str) and not os.path.isabs(v) and (base / v).exists() else v
    if dest in ("hf_checkpoint", "prompt_data", "eval_config", "chat_template_path", "generate_tool_specs_path",
                "custom_config_path"):
        return fix(value)
    if dest in _FUNCTION_PATHS and isinstance(value, str) and ".py:" in value:
        file, _, name = value.rpartition(":")      # a file.py:function path, relative to the file too
        return f"{fix(file)}:{name}"
    if dest == "eval_prompt_data":
        items = list(value.items()) if isinstance(value, dict) else value
        flat = [x for pair in items for x in (pair if isinstance(pair, (list, tuple)) else [pair])]
        return [fix(x) if i % 2 else x for i, x in enumerate(flat)]
    return value


def build_config(values: dict[str, Any], problems: list[str] | None = None, *,
                 custom_args: dict[str, Any] | None = None) -> RunConfig:
    """Flag values (dest names) → RunConfig; every problem is raised together as one ConfigError.
    `custom_args`: --custom-config-path's keys that name no flag (`apply_custom_config`)."""
    problems = list(problems or [])
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    if custom_args:
        sections["rollout"]["custom_args"] = dict(custom_args)
    for dest, value in values.items():
        flag = BY_DEST[dest]
        if flag.kind == "false":
            if value:
                sections[flag.section][flag.field] = False
            continue
        if flag.kind == "true" and not value:
            continue
        if flag.kind == "pairs":
            value = _pairs(value, problems)
        elif flag.kind == "list":
            value = tuple((flag.type or str)(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
        elif flag.kind == "json":
            value = _json_object(flag.name, value, problems)
        elif flag.kind == "eval_config":
            value = load_eval_config(str(value), problems)
        sections[flag.section][flag.field] = value
    _own_engine_precision(sections, problems)
    for name in REQUIRED:
        flag = next(f for f in FLAGS if f.name == name)
        if flag.field not in sections[flag.section]:
            problems.append(f"--{name} is required")
    if problems:
        raise ConfigError(problems)
    built = {s: SECTIONS[s](**kw) for s, kw in sections.items() if s != "run"}
    cfg = _schedule_defaults(RunConfig(**built, **sections["run"]))
    validate(cfg)
    return cfg


# SGLang's spellings of the rollout precision (miles' launch scripts pass --sglang-quantization fp8): for the
# embedded and fast engines they are --rollout-quantization / --kv-cache-dtype; SGLang servers keep them as they are
_SGLANG_PRECISION = {"--quantization": ("quantization", ("fp8",), "--rollout-quantization"),
                     "--kv-cache-dtype": ("kv_cache_dtype", ("auto", "fp8_e4m3"), "--kv-cache-dtype")}


def _own_engine_precision(sections: dict[str, dict[str, Any]], problems: list[str]) -> None:
    import importlib

    rollout, sglang = sections["rollout"], sections["sglang"]
    if not sglang.get("server_args"):
        return
    engines = importlib.import_module("miles.rollout.engines.registry").ENGINES   # by name: config imports nothing above
    engine = engines.get(rollout.get("engine", "embedded"))
    if engine is None or engine.quantizes_own_weights:      # an unknown name: the flag's choices say so
        return
    args, kept = list(sglang["server_args"]), []
    while args:
        flag = args.pop(0)
        if flag not in _SGLANG_PRECISION:
            kept.append(flag)
            continue
        field, values, own = _SGLANG_PRECISION[flag]
        value = args.pop(0) if args and not args[0].startswith("--") else None
        if value not in values:
            problems.append(f"--sglang{flag[1:]} {value}: the {rollout.get('engine', 'embedded')} engine takes "
                            f"{' or '.join(values)} there (its own flag: {own}); other values need --rollout-engine "
                            f"sglang")
        elif rollout.get(field, value) != value:
            problems.append(f"--sglang{flag[1:]} {value} contradicts {own} {rollout[field]}; give one of them")
        else:
            rollout[field] = value
    sglang["server_args"] = tuple(kept)


CUSTOM_CONFIG_FLAG = "--custom-config-path"
PSEUDO_FILE_PREFIX = "base64:"      # miles' pseudo file: the YAML itself, base64-encoded, in place of a path
# what the contexts custom functions get (HookContext, GenerateContext, RolloutContext, EvalContext) are
# themselves: a custom key of one of these names would be hidden behind ctx's own (tests check the list)
CONTEXT_NAMES = frozenset({
    "rollout_id", "rollout", "algorithm", "tokenizer", "config", "tools", "evaluation", "engine_calls",
    "weight_version", "generate", "prompts", "n_samples_per_prompt", "sampling_params", "generate_samples", "score",
    "new_sample", "datasets", "eval"})


def _shown(value: str) -> str:
    """The flag's value as errors show it: a base64 payload cut short."""
    return f"{value[:len(PSEUDO_FILE_PREFIX) + 8]}..." if value.startswith(PSEUDO_FILE_PREFIX) else value


def read_custom_config(value: str) -> dict[str, Any]:
    """--custom-config-path's YAML (a file, or miles' `base64:PAYLOAD`) as a mapping; ConfigError otherwise."""
    shown = _shown(value)
    if value.startswith(PSEUDO_FILE_PREFIX):
        try:
            text = base64.b64decode(value[len(PSEUDO_FILE_PREFIX):], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise ConfigError(f"{CUSTOM_CONFIG_FLAG} {shown}: not base64-encoded UTF-8 text ({exc}); pass a YAML "
                              "file's path or base64: and the file's text base64-encoded") from None
    else:
        if not Path(value).is_file():
            raise ConfigError(f"{CUSTOM_CONFIG_FLAG} {value}: no such file; pass a YAML file of name: value lines")
        text = Path(value).read_text()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{CUSTOM_CONFIG_FLAG} {shown}: not valid YAML: {exc}") from None
    if raw is None:
        return {}       # an empty file, as miles reads it
    if not isinstance(raw, dict):
        raise ConfigError(f"{CUSTOM_CONFIG_FLAG} {shown}: expected a mapping of names to values (name: value lines), "
                          f"got a {type(raw).__name__}")
    bad = [k for k in raw if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise ConfigError(f"{CUSTOM_CONFIG_FLAG} {shown}: key {bad[0]!r} is not a Python name; custom functions "
                          "read each key as an attribute (ctx.my_key), so keys are names like my_key")
    return raw


def apply_custom_config(values: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """--custom-config-path, as miles reads it (it sets each key on `args`, over the command line): a key
    that is a flag's name with underscores (rollout_batch_size, use_tis, a Megatron-LM flag) sets that
    flag in `values`; one naming a miles flag this build refuses is a problem; every other key is returned,
    for the custom functions (RolloutConfig.custom_args)."""
    path = values.get("custom_config_path")
    if not path:
        return {}
    custom: dict[str, Any] = {}
    shown = _shown(str(path))
    for key, value in read_custom_config(str(path)).items():
        name = key.replace("_", "-")
        if key in BY_DEST and key != "sglang_server_args":
            values[key] = value
        elif name in megatron_options():
            values[megatron_dest(name)] = value
        elif fate(name) is not None:
            problems.append(f"{CUSTOM_CONFIG_FLAG} {shown}: key {key!r} sets miles' --{name}, which this build does "
                            f"not take: {fate(name)}")
        elif key in CONTEXT_NAMES:
            problems.append(f"{CUSTOM_CONFIG_FLAG} {shown}: key {key!r} would be hidden by ctx.{key}, which the "
                            "contexts of custom functions have themselves; rename the key")
        else:
            custom[key] = value
    return custom


def _schedule_defaults(cfg: RunConfig) -> RunConfig:
    """Megatron-LM's default --lr-decay-iters: when a schedule needs it (a decay style,
    --lr-warmup-fraction, a share of it, or a weight-decay schedule) and it is not given, the run's optimizer steps (--train-iters
    there; here --num-rollout x the steps of a rollout)."""
    t = cfg.train
    if t.lr_decay_iters is not None or not cfg.num_rollout or (t.lr_decay_style not in ("linear", "cosine", "WSD")
                                                                 and t.lr_warmup_fraction is None
                                                                 and t.weight_decay_incr_style == "constant"):
        return cfg
    samples = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    decay = cfg.num_rollout * -(-samples // max(t.global_batch(samples), 1))
    return replace(cfg, train=replace(t, lr_decay_iters=decay))


def _json_object(name: str, value: Any, problems: list[str]) -> dict[str, Any] | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            problems.append(f"--{name} {value!r}: not valid JSON ({exc.msg}); pass an object like '{{\"key\": 1}}'")
            return None
    if not isinstance(value, dict):
        problems.append(f"--{name} {value!r}: must be a JSON object (a mapping of names to values)")
        return None
    return value


def _pairs(value: Any, problems: list[str]) -> tuple[tuple[str, str], ...]:
    items = list(value)
    if len(items) % 2:
        problems.append(f"--eval-prompt-data takes NAME PATH pairs; got {len(items)} values: {' '.join(items)}")
        return ()
    return tuple((str(items[i]), str(items[i + 1])) for i in range(0, len(items), 2))


def config_from_yaml(path: str, *flags: str) -> RunConfig:
    """A RunConfig from a YAML file of flag: value pairs, with optional flags overriding it."""
    cfg, _ = parse_flags(["--config", str(path), *flags])
    return cfg


def config_from_flags(argv: Sequence[str]) -> RunConfig:
    """A RunConfig from miles command-line flags, as `miles train` would build it."""
    cfg, _ = parse_flags(list(argv))
    return cfg


if __name__ == "__main__":      # the "coming from miles" table of docs/coming-from-miles.md
    from .miles_flags import markdown

    print(markdown({f.name: help_text(f) for f in FLAGS}), end="")
