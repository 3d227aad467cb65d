"""Config's own checks of a RunConfig (pure: they read the config and the files it names), and
`validate`, which runs them with every backend's and concern's (the registry of `miles.config.checks`).
Every problem is collected; one ConfigError names them all."""

from __future__ import annotations

import ipaddress
import json
import math
import string
from pathlib import Path
from typing import Any

from miles.algorithms.names import (ADVANTAGE_ESTIMATOR_NAMES, KL_LOSS_TYPES, LOSS_AGG_MODES, LOSS_TYPES,
                                    TOKEN_LEVEL_ESTIMATORS)
from miles.runtime.machine import STATES, MachineDef
from miles.runtime.procs import CPU_THREADS_ENV
from miles.types import sampling_problems

from .checks import check, run_checks
from .packages import missing_package
from .user_functions import signature

from .schema import (ATTN_IMPLEMENTATIONS, DTYPES, ENGINE_NAMES, MEGATRON_TO_HF_MODES, OPD_TYPES, TRAIN_BACKEND_NAMES,
                     USER_FUNCTION_FLAGS, ConfigError, RunConfig, TrainConfig, parse_opd_teachers)


def validate(cfg: RunConfig, **facts: Any) -> None:
    """Every registered check (config's below, then the contributors' of `miles.config.checks`) that needs
    exactly `facts`: none at parse time; `machine=MachineDef` once the machine is picked (prepare_run),
    `num_engines=N` once the placement counts the engines (init)."""
    problems = run_checks(cfg, **facts)
    if problems:
        raise ConfigError(problems)


@check
def _names(cfg: RunConfig, problems: list[str]) -> None:
    """Names a config may give (a config built in code skips the flags' `choices`)."""
    if cfg.rollout.engine not in ENGINE_NAMES:
        problems.append(f"--rollout-engine {cfg.rollout.engine}: no such engine; use one of {', '.join(ENGINE_NAMES)}")
    if cfg.train.backend not in TRAIN_BACKEND_NAMES:
        problems.append(f"--train-backend {cfg.train.backend}: no such backend; use one of "
                        f"{', '.join(TRAIN_BACKEND_NAMES)}")


@check
def _precision(cfg: RunConfig, problems: list[str]) -> None:
    """--dtype's names (a config built in code skips the flag's choices) and the loss scaling's ranges."""
    if cfg.model.dtype != "auto" and cfg.model.dtype not in DTYPES:
        problems.append(f"--dtype {cfg.model.dtype}: no such dtype; use auto, {', '.join(DTYPES)}")
    t = cfg.train
    if t.loss_scale is not None and t.loss_scale <= 0:
        problems.append(f"--loss-scale {t.loss_scale}: must be > 0 (leave it out for the dynamic scale)")
    if not 0 < t.min_loss_scale <= t.initial_loss_scale:
        problems.append(f"--min-loss-scale {t.min_loss_scale} / --initial-loss-scale {t.initial_loss_scale}: need "
                        "0 < min <= initial")
    for flag, value in (("--loss-scale-window", t.loss_scale_window), ("--hysteresis", t.hysteresis)):
        if value < 1:
            problems.append(f"{flag} {value}: must be a positive integer")


@check
def _positive_ints(cfg: RunConfig, problems: list[str]) -> None:
    for flag, value in (
        ("--rollout-batch-size", cfg.rollout.batch_size), ("--n-samples-per-prompt", cfg.rollout.n_samples_per_prompt),
        ("--rollout-max-response-len", cfg.rollout.max_response_len), ("--rollout-num-engines", cfg.rollout.num_engines),
        ("--micro-batch-size", cfg.train.micro_batch_size), ("--global-batch-size", cfg.train.global_batch_size),
        ("--num-rollout", cfg.num_rollout), ("--num-epoch", cfg.num_epoch), ("--save-interval", cfg.checkpoint.save_interval),
        ("--eval-interval", cfg.eval.interval), ("--n-samples-per-eval-prompt", cfg.eval.n_samples_per_prompt),
        ("--debug-exit-after-rollout", cfg.debug_exit_after_rollout), ("--eval-max-response-len", cfg.eval.max_response_len),
        ("--update-weights-interval", cfg.update_weights_interval),
        ("--rollout-max-batch-size", cfg.rollout.max_batch_size),
        ("--rollout-chunked-prefill-size", cfg.rollout.chunked_prefill_size),
        ("--rollout-page-size", cfg.rollout.page_size),
        ("--rollout-num-gpus-per-engine", cfg.cluster.rollout_num_gpus_per_engine),
        ("--offload-train-disk-chunk-mb", cfg.train.offload_chunk_mb),
    ):
        if value is not None and value < (0 if flag == "--num-rollout" else 1):
            problems.append(f"{flag} {value}: must be {'>= 0' if flag == '--num-rollout' else 'a positive integer'}")


@check
def _ranges(cfg: RunConfig, problems: list[str]) -> None:
    r = cfg.rollout
    trains_greedy = r.temperature <= 0 and not cfg.debug_rollout_only    # the trainer divides by it (miles.algorithms)
    if trains_greedy:
        problems.append(f"--rollout-temperature {r.temperature}: must be > 0 to train on the rollouts (greedy ones "
                        "cannot be; >= 0 with --debug-rollout-only)")
    problems += sampling_problems(temperature=None if trains_greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
                                  names=("--rollout-temperature", "--rollout-top-p", "--rollout-top-k"))
    if r.mem_fraction is not None and not 0 < r.mem_fraction < 1:
        problems.append(f"--rollout-mem-fraction {r.mem_fraction}: must be in (0, 1), the share of the GPU memory "
                        "free after the weights that the KV cache takes")
    if cfg.eval.min_new_tokens < 0:
        problems.append(f"--eval-min-new-tokens {cfg.eval.min_new_tokens}: must be >= 0 (0: responses may stop at once)")
    if cfg.train.lr <= 0:
        problems.append(f"--lr {cfg.train.lr}: must be > 0")
    if cfg.train.clip_grad < 0:
        problems.append(f"--clip-grad {cfg.train.clip_grad}: must be >= 0 (0 disables clipping)")
    a = cfg.algorithm
    if a.eps_clip <= 0 or (a.eps_clip_high is not None and a.eps_clip_high <= 0):
        problems.append(f"--eps-clip {a.eps_clip} / --eps-clip-high {a.eps_clip_high}: clip ranges must be > 0")
    if a.eps_clip_c is not None and a.eps_clip_c <= 1:
        problems.append(f"--eps-clip-c {a.eps_clip_c}: the dual-clip constant must be > 1")


@check
def _batches(cfg: RunConfig, problems: list[str]) -> None:
    t, n = cfg.train, cfg.rollout.num_samples
    gbs = t.global_batch(n)
    if t.use_dynamic_global_batch_size:
        _dynamic_global_batch(t, problems)
    elif t.global_batch_size is not None and n % t.global_batch_size:
        problems.append(f"--global-batch-size {t.global_batch_size} does not divide the {n} samples of a rollout "
                        f"(--rollout-batch-size {cfg.rollout.batch_size} x --n-samples-per-prompt "
                        f"{cfg.rollout.n_samples_per_prompt})")
    if t.num_steps_per_rollout is not None and t.global_batch_size is not None:
        problems.append(f"--num-steps-per-rollout {t.num_steps_per_rollout} and --global-batch-size "
                        f"{t.global_batch_size} both set the global batch: give one of them")
    elif t.num_steps_per_rollout is not None and (t.num_steps_per_rollout < 1 or n % t.num_steps_per_rollout):
        problems.append(f"--num-steps-per-rollout {t.num_steps_per_rollout} must be a positive divisor of the {n} "
                        f"samples of a rollout (--rollout-batch-size {cfg.rollout.batch_size} x "
                        f"--n-samples-per-prompt {cfg.rollout.n_samples_per_prompt})")
    elif t.micro_batch_size >= 1 and gbs % t.micro_batch_size:      # < 1: _positive_ints says so
        problems.append(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {t.micro_batch_size}")
    if cfg.algorithm.advantage_estimator in ("grpo", "gspo") and cfg.rollout.n_samples_per_prompt < 2 \
            and not cfg.algorithm.disable_grpo_std_normalization and not cfg.algorithm.disable_rewards_normalization \
            and cfg.algorithm.loss_type == "policy_loss":
        problems.append("--n-samples-per-prompt 1 gives GRPO groups of one, which learn nothing (1 is miles' "
                        "default): pass --n-samples-per-prompt N with N >= 2")


def _dynamic_global_batch(t: TrainConfig, problems: list[str]) -> None:
    """--use-dynamic-global-batch-size: one optimizer step of every sample a rollout gives, however many."""
    if t.num_steps_per_rollout is not None:
        problems.append(f"--use-dynamic-global-batch-size makes one optimizer step per rollout: drop "
                        f"--num-steps-per-rollout {t.num_steps_per_rollout}")
    if not t.use_dynamic_batch_size:
        problems.append("--use-dynamic-global-batch-size needs --use-dynamic-batch-size (and --max-tokens-per-gpu): "
                        "a rollout's sample count varies, so micro-batches go by tokens, not --micro-batch-size")


@check
def _algorithm(cfg: RunConfig, problems: list[str]) -> None:
    a = cfg.algorithm
    for flag, value, names in (("--advantage-estimator", a.advantage_estimator, ADVANTAGE_ESTIMATOR_NAMES),
                               ("--loss-type", a.loss_type, LOSS_TYPES), ("--loss-agg-mode", a.loss_agg_mode, LOSS_AGG_MODES),
                               ("--kl-loss-type", a.kl_loss_type, KL_LOSS_TYPES)):
        if value not in names:             # a config built in code skips the flags' choices
            problems.append(f"{flag} {value}: not one of {', '.join(names)}")
    if a.use_kl_loss and a.kl_loss_coef < 0:
        problems.append(f"--kl-loss-coef {a.kl_loss_coef}: must be >= 0")
    if not a.use_kl_loss and a.kl_loss_coef:
        problems.append(f"--kl-loss-coef {a.kl_loss_coef} has no effect without --use-kl-loss")


@check
def _loop(cfg: RunConfig, problems: list[str]) -> None:
    if cfg.num_rollout is None and cfg.num_epoch is None:
        problems.append("set --num-rollout N or --num-epoch N: how long to train")
    if cfg.num_rollout is not None and cfg.num_epoch is not None:
        problems.append(f"--num-rollout {cfg.num_rollout} and --num-epoch {cfg.num_epoch}: give one of them")


@check
def _paths(cfg: RunConfig, problems: list[str]) -> None:
    ckpt = Path(cfg.model.hf_checkpoint)
    if not (ckpt / "config.json").is_file():
        problems.append(f"--hf-checkpoint {cfg.model.hf_checkpoint}: no config.json there; pass an HF-format "
                        "model folder (what save_pretrained writes)")
    else:
        problems += [f"--hf-checkpoint {cfg.model.hf_checkpoint}: {p}" for p in model_json_problems(ckpt)]
    for flag, path in [("--prompt-data", cfg.data.prompt_data)] + [
            (f"--eval-prompt-data {name}", p) for name, p in cfg.eval.prompt_data] + [
            (f"--eval-config dataset {d.name!r}: path", d.path) for d in cfg.eval.datasets]:
        if not Path(path).is_file():
            problems.append(f"{flag} {path}: no such file")
        elif Path(path).suffix not in (".jsonl", ".parquet"):
            problems.append(f"{flag} {path}: expected a .jsonl or .parquet file")


@check
def _checkpoint_and_eval(cfg: RunConfig, problems: list[str]) -> None:
    c = cfg.checkpoint
    if (c.save_interval is not None or c.save_trigger_sentinel) and not c.saves:
        problems.append("--save-interval / --save-trigger-sentinel need --save DIR (or --save-hf PATH)")
    if c.load and not Path(c.load).is_dir() and not _same_path(c.load, c.save):
        problems.append(f"--load {c.load}: no such directory (to start fresh and resume later from the same "
                        "place, pass that folder as --save too)")
    if cfg.eval.interval is not None and not cfg.eval.sets():
        problems.append(f"--eval-interval {cfg.eval.interval} needs --eval-prompt-data NAME PATH or --eval-config FILE")
    if cfg.eval.function_path and not cfg.eval.sets():
        problems.append(f"--eval-function-path {cfg.eval.function_path} runs where an eval is due, and evals run with "
                        "eval datasets, as in miles: add --eval-prompt-data NAME PATH or --eval-config FILE")
    for flag, given in (("--ckpt-step", c.ckpt_step is not None), ("--exit-on-missing-checkpoint", c.exit_on_missing),
                        ("--finetune", c.finetune), ("--no-load-optim", not c.load_optimizer),
                        ("--no-load-rng", not c.load_rng)):
        if given and not c.load:
            problems.append(f"{flag} has no effect without --load DIR (the checkpoints to resume from)")
    if c.ckpt_step is not None and c.ckpt_step < 0:
        problems.append(f"--ckpt-step {c.ckpt_step}: a rollout id, >= 0")


MODEL_JSON_FILES = ("config.json", "tokenizer_config.json", "generation_config.json",   # small, read at start
                    "model.safetensors.index.json")


def model_json_problems(folder: Path) -> list[str]:
    """What is wrong with a model folder's small JSON files, each named with where it breaks: a broken
    one otherwise surfaces as "cannot load its tokenizer" or a transformers traceback."""
    problems = []
    for name in MODEL_JSON_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            problems.append(f"the {name} at {path} is not UTF-8 text (byte {e.start}); restore it from the "
                            "model's source")
            continue
        except json.JSONDecodeError as e:
            problems.append(f"the {name} at {path} is not valid JSON (line {e.lineno}, column {e.colno}: "
                            f"{e.msg}); restore it from the model's source")
            continue
        if not isinstance(data, dict):
            problems.append(f"the {name} at {path} holds a JSON {type(data).__name__}, not an object")
    return problems


def _same_path(a: str, b: str | None) -> bool:
    """--load X --save X with X not there yet: the auto-resume launch script; it starts fresh."""
    return b is not None and Path(a).resolve() == Path(b).resolve()


@check
def _restarts(cfg: RunConfig, problems: list[str]) -> None:
    if cfg.rollout.engine_max_restarts < 0 or cfg.rollout.engine_restart_window_s <= 0:
        problems.append(f"--engine-max-restarts {cfg.rollout.engine_max_restarts} / --engine-restart-window "
                        f"{cfg.rollout.engine_restart_window_s}: need >= 0 restarts and a window > 0 s")


@check
def _reliability(cfg: RunConfig, problems: list[str]) -> None:
    """Deadlines are positive seconds of known states; the node address is an IP (or auto)."""
    r = cfg.reliability
    for text in r.phase_timeouts:
        state, sep, seconds = text.partition("=")
        try:
            ok = bool(sep) and state in STATES and state != "shutdown" and float(seconds) > 0
        except ValueError:
            ok = False
        if not ok:
            problems.append(f"--phase-timeout {text}: expected STATE=SECONDS with STATE one of "
                            f"{', '.join(s for s in STATES if s != 'shutdown')} and SECONDS > 0")
    if r.stop_timeout_s < 1:
        problems.append(f"--stop-timeout {r.stop_timeout_s}: must be at least 1 s (the draining and the "
                        "teardown share it)")
    if r.reward_timeout_s is not None and not r.reward_timeout_s >= 0:
        problems.append(f"--reward-timeout {r.reward_timeout_s:g}: must be >= 0 seconds (0: no limit)")
    if r.ray_node_ip != "auto":
        try:
            ipaddress.ip_address(r.ray_node_ip)
        except ValueError:
            problems.append(f"--ray-node-ip {r.ray_node_ip}: not an IP address; use 127.0.0.1 (loopback only), "
                            "this machine's address, or auto")

RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")   # asked for by the placement, not by name


@check
def _train_env_vars(cfg: RunConfig, problems: list[str]) -> None:
    """--train-env-vars: a JSON object of names to string values (what a process environment holds)."""
    env = cfg.cluster.train_env_vars
    if env is None:
        return
    if not isinstance(env, dict):
        problems.append(f"--train-env-vars {env!r}: must be a JSON object of names to strings")
        return
    for name, value in env.items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            problems.append(f"--train-env-vars: {name!r} is not an environment variable name")
        elif not isinstance(value, str):
            problems.append(f"--train-env-vars {name}: {json.dumps(value)} is not a string; values are "
                            f"strings, as in a process environment: write \"{name}\": {json.dumps(str(value))}")
        elif name == CPU_THREADS_ENV and not (value.strip().isdigit() and int(value) > 0):
            problems.append(f"--train-env-vars {name}: {json.dumps(value)} is not a thread count; it overrides the "
                            "CPU trainer's torch threads (miles.cluster.placement.cpu_thread_budget): give a whole "
                            f"number >= 1, e.g. \"{name}\": \"1\", or drop it")


@check
def _attached(cfg: RunConfig, problems: list[str]) -> None:
    """The flags of a run on a cluster it attaches to (docs/running.md "Attaching to a cluster")."""
    c = cfg.cluster
    if not c.ship_code and not c.ray_address:
        problems.append("--ray-no-ship-code needs --ray-address: a run that starts its own cluster ships nothing")
    for name, amount in (c.actor_resources or {}).items():
        if not isinstance(name, str) or not name or name in RAY_BUILTIN_RESOURCES or name.startswith("node:"):
            problems.append(f"--ray-actor-resources: {name!r} is not a custom resource name; CPUs and GPUs come from "
                            "the placement flags (--actor-num-gpus-per-node, ...), name the resource your nodes "
                            "were started with (ray start --resources '{\"miles_worker\": 8}')")
        elif isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount <= 0 \
                or (amount > 1 and amount != int(amount)):
            problems.append(f"--ray-actor-resources {name}: {amount!r} must be a number > 0, a whole number above "
                            "1 (Ray's rule for resource amounts)")


# -- algorithm recipes (docs/algorithms.md) ---------------------------------------------------------

@check
def _kl_and_reference(cfg: RunConfig, problems: list[str]) -> None:
    a = cfg.algorithm
    if a.kl_coef < 0:
        problems.append(f"--kl-coef {a.kl_coef}: must be >= 0")
    if a.kl_coef and a.use_kl_loss:
        problems.append(f"--kl-coef {a.kl_coef} (KL in the reward) and --use-kl-loss (KL in the loss) are mutually "
                        "exclusive: penalize the KL once; drop one of them")
    elif a.kl_coef and a.advantage_estimator not in TOKEN_LEVEL_ESTIMATORS:
        problems.append(f"--kl-coef {a.kl_coef} puts a per-token KL penalty into the token rewards, which only "
                        f"{' and '.join(TOKEN_LEVEL_ESTIMATORS)} use; with --advantage-estimator {a.advantage_estimator} use "
                        "--use-kl-loss --kl-loss-coef X instead")
    uses_ref = a.use_kl_loss or a.kl_coef > 0
    if a.ref_update_interval is not None and a.ref_update_interval < 1:
        problems.append(f"--ref-update-interval {a.ref_update_interval}: must be a positive integer")
    for flag, value in (("--ref-load", a.ref_load), ("--ref-update-interval", a.ref_update_interval)):
        if value is not None and not uses_ref:
            problems.append(f"{flag} {value} has no effect without a reference: add --use-kl-loss or --kl-coef")


@check
def _critic(cfg: RunConfig, problems: list[str]) -> None:
    a, c = cfg.algorithm, cfg.checkpoint
    if not (0 <= a.gamma <= 1 and 0 <= a.lambd <= 1):
        problems.append(f"--gamma {a.gamma} / --lambd {a.lambd}: both must be in [0, 1]")
    if a.value_clip < 0:
        problems.append(f"--value-clip {a.value_clip}: must be >= 0 (0 turns value clipping off)")
    if a.num_critic_only_steps < 0:
        problems.append(f"--num-critic-only-steps {a.num_critic_only_steps}: must be >= 0")
    if cfg.train.critic_lr is not None and cfg.train.critic_lr <= 0:
        problems.append(f"--critic-lr {cfg.train.critic_lr}: must be > 0")
    extra = [(flag, v) for flag, v in (("--num-critic-only-steps", a.num_critic_only_steps or None),
                                       ("--critic-lr", cfg.train.critic_lr), ("--critic-load", c.critic_load),
                                       ("--critic-save", c.critic_save)) if v is not None]
    if extra and not a.needs_critic:
        problems.append(f"{', '.join(f'{k} {v}' for k, v in extra)}: only PPO has a critic; add "
                        "--advantage-estimator ppo or drop them")
    if c.critic_load and not Path(c.critic_load).exists():
        problems.append(f"--critic-load {c.critic_load}: no such file or directory")


@check
def _off_policy(cfg: RunConfig, problems: list[str]) -> None:
    a = cfg.algorithm
    if a.use_tis and a.use_rollout_logprobs:
        problems.append("--use-tis and --use-rollout-logprobs are two corrections for the same mismatch: with "
                        "--use-rollout-logprobs the ratio already divides by the engine's probabilities; keep one")
    if not 0 <= a.tis_clip_low <= a.tis_clip or a.tis_clip <= 0:
        problems.append(f"--tis-clip-low {a.tis_clip_low} / --tis-clip {a.tis_clip}: need 0 <= low <= clip and clip > 0")
    if a.use_opsm and a.loss_type != "policy_loss":
        problems.append(f"--use-opsm masks sequences out of the policy loss: --loss-type {a.loss_type} has none; "
                        "drop --use-opsm or use --loss-type policy_loss")
    if a.use_opsm and not (math.isfinite(a.opsm_delta) and a.opsm_delta >= 0):
        problems.append(f"--opsm-delta {a.opsm_delta}: must be a finite threshold >= 0 on a sequence's mean "
                        "old - current logprob")


@check
def _skipped_old_pass(cfg: RunConfig, problems: list[str]) -> None:
    """--skip-actor-forward-only: the old logprobs are the engine's (--use-rollout-logprobs) or, with one
    optimizer step per rollout, the step's own; nothing else may need the pre-step pass."""
    a, t, n = cfg.algorithm, cfg.train, cfg.rollout.num_samples
    if not a.skip_actor_forward_only:
        return
    flag = "--skip-actor-forward-only"
    if a.loss_type != "policy_loss":
        problems.append(f"{flag} skips the policy loss's old-logprob pass: --loss-type {a.loss_type} has none "
                        "(SFT rollouts carry no engine logprobs); drop it or use --loss-type policy_loss")
    needs_pass = [f for f, on in (("--use-tis", a.use_tis), (f"--kl-coef {a.kl_coef}", a.kl_coef > 0)) if on]
    if needs_pass:
        problems.append(f"{flag}: {', '.join(needs_pass)} read(s) the trainer's logprobs before the first step "
                        "(TIS weights, the reward's KL); drop one of them")
    steps = -(-n // max(t.global_batch(n), 1))
    if not a.use_rollout_logprobs and steps > 1:
        problems.append(f"{flag} without --use-rollout-logprobs takes the old logprobs from the step itself, "
                        f"right only for one optimizer step per rollout, not {steps} (global batch "
                        f"{t.global_batch(n)} of {n} samples): add --use-rollout-logprobs, or drop "
                        "--global-batch-size / --num-steps-per-rollout")


@check
def _skipped_weight_sync(cfg: RunConfig, problems: list[str]) -> None:
    """--debug-skip-weight-update: the engines keep the initial weights, so nothing may compare them with the
    trainer's (no engine may drop its weights either: the engines' registry checks that)."""
    if not cfg.debug_skip_weight_update:
        return
    checks = [f for f, on in (("--check-weight-update-equal", cfg.check_weight_update_equal),
                              ("--ci-test", cfg.ci_test)) if on]
    if checks:
        problems.append(f"--debug-skip-weight-update keeps the engines on the initial weights, which "
                        f"{' and '.join(checks)} compare(s) with the trainer's (checksums, logprobs) and would fail "
                        "after the first step: drop one of them")


@check
def _sampling(cfg: RunConfig, problems: list[str]) -> None:
    r = cfg.rollout
    if r.over_sampling_batch_size is not None and not r.dynamic_sampling_filter_path:
        problems.append(f"--over-sampling-batch-size {r.over_sampling_batch_size} has no effect without "
                        "--dynamic-sampling-filter-path (e.g. miles.rollout.filters:check_reward_nonzero_std)")
    if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < 1:
        problems.append(f"--over-sampling-batch-size {r.over_sampling_batch_size}: must be a positive integer")
    if r.dynamic_sampling_max_rounds < 1:
        problems.append(f"--dynamic-sampling-max-rounds {r.dynamic_sampling_max_rounds}: must be a positive integer")
    per_round = r.over_sampling_batch_size or r.batch_size
    if r.dynamic_sampling_filter_path and per_round * r.dynamic_sampling_max_rounds < r.batch_size:
        problems.append(f"--over-sampling-batch-size {per_round} x --dynamic-sampling-max-rounds "
                        f"{r.dynamic_sampling_max_rounds} prompts cannot fill --rollout-batch-size {r.batch_size}")
    _partial_rollout(cfg, problems)
    if r.overlong_buffer_len is not None and not 0 < r.overlong_buffer_len <= r.max_response_len:
        problems.append(f"--overlong-buffer-len {r.overlong_buffer_len}: must be in [1, --rollout-max-response-len "
                        f"{r.max_response_len}]")
    if r.overlong_penalty_factor < 0:
        problems.append(f"--overlong-penalty-factor {r.overlong_penalty_factor}: must be >= 0")


def _partial_rollout(cfg: RunConfig, problems: list[str]) -> None:
    r = cfg.rollout
    needs = [flag for flag, on in (("--mask-offpolicy-in-partial-rollout", r.mask_offpolicy_in_partial_rollout),
                                   ("--buffer-filter-path", r.buffer_filter_path)) if on]
    if needs and not r.partial_rollout:
        problems.append(f"{', '.join(needs)} only act with --partial-rollout: add it, or drop them")
    if r.partial_rollout and not r.dynamic_sampling_filter_path:
        problems.append("--partial-rollout continues the groups dynamic sampling aborts once the batch is full: add "
                        "--dynamic-sampling-filter-path (e.g. miles.rollout.filters:check_reward_nonzero_std) and "
                        "--over-sampling-batch-size")
    a = cfg.algorithm
    if (r.partial_rollout and not r.mask_offpolicy_in_partial_rollout and a.loss_type == "policy_loss"
            and not (a.use_tis or a.use_rollout_logprobs)):
        problems.append("--partial-rollout trains a continued sample's earlier tokens, which older weights generated "
                        "(as the async machine does): add an off-policy correction, --use-tis or "
                        "--use-rollout-logprobs, or leave those tokens out with --mask-offpolicy-in-partial-rollout")
    if r.partial_rollout and cfg.ci_test and not r.mask_offpolicy_in_partial_rollout:
        problems.append("--ci-test checks that engine and trainer logprobs agree, and with --partial-rollout a "
                        "continued sample's earlier tokens come from older weights: add "
                        "--mask-offpolicy-in-partial-rollout (they are then left out of training and of the check)")
    if r.partial_rollout and cfg.generate.generate_function_path:
        problems.append("--partial-rollout continues single-turn samples (one engine call each): not supported yet "
                        "with --custom-generate-function-path or --generate-execute-tool-function-path; drop one")


@check
def _lr_schedule(cfg: RunConfig, problems: list[str]) -> None:
    t = cfg.train
    fraction = t.lr_warmup_fraction
    if fraction is not None:
        if t.lr_warmup_iters:
            problems.append(f"--lr-warmup-fraction {fraction} and --lr-warmup-iters {t.lr_warmup_iters}: give one of them")
        elif not 0.0 <= fraction <= 1.0:
            problems.append(f"--lr-warmup-fraction {fraction}: must be in [0, 1] (a share of --lr-decay-iters)")
        elif t.lr_decay_iters is None:
            problems.append(f"--lr-warmup-fraction {fraction} needs --lr-decay-iters N, or --num-rollout (which sets "
                            "it to the run's optimizer steps)")
    warmup = t.warmup_steps
    # a bad --lr (or --critic-lr) is its own problem: the rates bounded by it are checked against a good one only
    lr_ok = t.lr > 0 and (t.critic_lr is None or t.critic_lr > 0)
    if warmup < 0 or t.min_lr < 0 or (lr_ok and t.min_lr > t.lr):
        problems.append(f"--lr-warmup-iters {warmup} / --min-lr {t.min_lr}: need warmup >= 0 and "
                        f"0 <= min-lr <= --lr {t.lr}")
    if t.lr_decay_style in ("linear", "cosine", "WSD") and (t.lr_decay_iters is None or t.lr_decay_iters <= warmup):
        problems.append(f"--lr-decay-style {t.lr_decay_style} needs --lr-decay-iters N (optimizer steps) greater "
                        f"than --lr-warmup-iters {warmup}; got {t.lr_decay_iters}")
    if t.lr_decay_style == "WSD" and (t.lr_wsd_decay_iters is None or t.lr_wsd_decay_iters <= 0
                                      or t.lr_decay_iters is not None and t.lr_wsd_decay_iters > t.lr_decay_iters):
        problems.append(f"--lr-decay-style WSD needs --lr-wsd-decay-iters N: the decay phase's optimizer steps, "
                        f"1..--lr-decay-iters {t.lr_decay_iters}; got {t.lr_wsd_decay_iters}")
    _wd_schedule(t, problems)
    _decoupled_lr(cfg, problems)
    top = min(t.lr, t.critic_lr or t.lr)      # the critic warms up from it too
    if t.lr_warmup_init < 0 or (lr_ok and t.lr_warmup_init > top):
        problems.append(f"--lr-warmup-init {t.lr_warmup_init}: need 0 <= warmup-init <= --lr {t.lr}"
                        + (f" and --critic-lr {t.critic_lr}" if t.critic_lr else ""))


def _decoupled_lr(cfg: RunConfig, problems: list[str]) -> None:
    """--decoupled-lr / --decoupled-min-lr (Megatron-LM's): the policy's only (the backends that refuse it
    say so on their spec: `TrainBackendSpec.refuses`)."""
    t = cfg.train
    if t.decoupled_lr is None:
        if t.decoupled_min_lr is not None:
            problems.append(f"--decoupled-min-lr {t.decoupled_min_lr} has no effect without --decoupled-lr: add it "
                            "or drop --decoupled-min-lr")
        return
    bottom = t.min_lr if t.decoupled_min_lr is None else t.decoupled_min_lr
    if not 0 <= bottom <= t.decoupled_lr or t.lr_warmup_init > t.decoupled_lr:
        problems.append(f"--decoupled-lr {t.decoupled_lr} / --decoupled-min-lr {bottom}: need 0 <= decoupled-min-lr "
                        f"<= decoupled-lr and --lr-warmup-init {t.lr_warmup_init} <= decoupled-lr")
    if cfg.algorithm.needs_critic:
        problems.append("--decoupled-lr: the critic (--advantage-estimator ppo) takes one rate, --critic-lr, for "
                        "all its parameters here; drop --decoupled-lr or use another estimator")


@check
def _lora(cfg: RunConfig, problems: list[str]) -> None:
    """LoRA (--lora-rank R, miles/training/torch/lora.py): what it cannot take (the backends that refuse it say so
    on their spec: `TrainBackendSpec.refuses`)."""
    t, a = cfg.train, cfg.algorithm
    if t.lora_rank < 0:
        problems.append(f"--lora-rank {t.lora_rank}: must be >= 0 (0 trains the whole model)")
    if not t.lora_rank:
        extra = [f"{flag} {v}" for flag, v in (("--lora-dropout", t.lora_dropout or None),
                                               ("--target-modules", t.target_modules),
                                               ("--exclude-modules", t.exclude_modules),
                                               ("--lora-adapter-path", t.lora_adapter_path)) if v is not None]
        if extra:
            problems.append(f"{', '.join(extra)}: LoRA is off without --lora-rank R; add it (the adapter's r for "
                            "--lora-adapter-path) or drop them")
        return
    if not t.lora_alpha > 0:
        problems.append(f"--lora-alpha {t.lora_alpha}: must be > 0 (the adapters' scale is alpha / --lora-rank)")
    if not 0 <= t.lora_dropout < 1:
        problems.append(f"--lora-dropout {t.lora_dropout}: must be in [0, 1)")
    targets = [s.strip() for s in (t.target_modules or "").split(",") if s.strip()]
    if t.target_modules is not None and not targets:
        problems.append(f"--target-modules {t.target_modules!r}: name modules (q_proj,v_proj), attn, mlp or all-linear")
    if "unembed" in targets:
        problems.append("--target-modules unembed: the LM head is not adapted here (tied to the embedding in many "
                        "models); drop it")
    if len(targets) > 1 and {"all-linear", "all_linear", "all"} & set(targets):
        problems.append(f"--target-modules {t.target_modules}: all-linear takes every decoder Linear; give it alone")
    refused = [(t.weight_shadows, "--trainer-weight-shadows", "the adapted Linear layers run their own matmuls; drop it"),
               (t.grad_accum_fusion, "--gradient-accumulation-fusion", "the adapted Linear layers run their own "
                "matmuls; drop it"),
               (a.needs_critic, "--advantage-estimator ppo", "PPO's critic is not set up for LoRA yet; use grpo, "
                "gspo, rloo or reinforce_plus_plus"),
               (t.decoupled_lr is not None, "--decoupled-lr", "the embedding and output layer are frozen under LoRA; "
                "drop it")]
    for bad, flag, fix in refused:
        if bad:
            problems.append(f"--lora-rank {t.lora_rank} with {flag}: {fix}")
    _lora_adapter(t, problems)


def _lora_adapter(t: TrainConfig, problems: list[str]) -> None:
    """--lora-adapter-path: a PEFT folder whose r and lora_alpha are the flags'."""
    if t.lora_adapter_path is None:
        return
    folder = Path(t.lora_adapter_path)
    missing = [f for f in ("adapter_config.json", "adapter_model.safetensors") if not (folder / f).is_file()]
    if missing:
        problems.append(f"--lora-adapter-path {folder}: lacks {', '.join(missing)}; pass a PEFT LoRA adapter folder")
        return
    try:
        saved = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        problems.append(f"--lora-adapter-path {folder}: adapter_config.json is unreadable ({exc})")
        return
    for flag, key, mine in (("--lora-rank", "r", t.lora_rank), ("--lora-alpha", "lora_alpha", t.lora_alpha)):
        if saved.get(key) is not None and float(saved[key]) != float(mine):
            problems.append(f"--lora-adapter-path {folder}: its {key} is {saved[key]}, {flag} is {mine}; pass "
                            f"{flag} {saved[key]}")


def _wd_schedule(t: TrainConfig, problems: list[str]) -> None:
    """Megatron-LM's rules: constant takes --weight-decay alone; linear/cosine take a start and an end,
    0 <= start <= end, over --lr-decay-iters steps (Megatron-LM's --train-iters, its default)."""
    style, start, end = t.weight_decay_incr_style, t.start_weight_decay, t.end_weight_decay
    if style == "constant":
        given = [f for f, v in (("--start-weight-decay", start), ("--end-weight-decay", end)) if v is not None]
        if given:
            problems.append(f"{', '.join(given)} need --weight-decay-incr-style linear or cosine; with constant "
                            "(the default) the weight decay is --weight-decay")
        return
    if start is None or end is None:
        problems.append(f"--weight-decay-incr-style {style} needs --start-weight-decay and --end-weight-decay")
    elif not 0 <= start <= end:
        problems.append(f"--start-weight-decay {start} / --end-weight-decay {end}: need 0 <= start <= end "
                        "(Megatron-LM's schedule increases the weight decay)")
    if t.lr_decay_iters is None or t.lr_decay_iters <= 0:
        problems.append(f"--weight-decay-incr-style {style} runs over --lr-decay-iters optimizer steps: give "
                        f"--lr-decay-iters N or --num-rollout (which sets it to the run's optimizer steps); got "
                        f"{t.lr_decay_iters}")


@check
def _sft(cfg: RunConfig, problems: list[str]) -> None:
    if cfg.algorithm.loss_type != "sft_loss":
        return
    r, a = cfg.rollout, cfg.algorithm
    if r.n_samples_per_prompt != 1:
        problems.append(f"--n-samples-per-prompt {r.n_samples_per_prompt}: SFT reads one response per prompt "
                        "from the data; use 1")
    ignored = [flag for flag, on in (("--dynamic-sampling-filter-path", r.dynamic_sampling_filter_path),
                                     ("--rollout-sample-filter-path", r.sample_filter_path),
                                     ("--rollout-all-samples-process-path", r.all_samples_process_path),
                                     ("--custom-reward-post-process-path", r.reward_post_process_path),
                                     ("--overlong-buffer-len", r.overlong_buffer_len),
                                     ("--use-kl-loss", a.use_kl_loss), ("--kl-coef", a.kl_coef),
                                     ("--use-tis", a.use_tis), ("--use-rollout-logprobs", a.use_rollout_logprobs),
                                     ("--advantage-estimator ppo", a.needs_critic)) if on]
    if ignored:
        problems.append(f"--loss-type sft_loss trains on the data's responses: {', '.join(ignored)} do not apply; "
                        "drop them")


# -- custom and multi-turn generation, rewards, engine health ------------------------------------------

@check
def _user_paths(cfg: RunConfig, problems: list[str]) -> None:
    """Each function given by path looks like one (whether it imports, init checks on the driver)."""
    for flag, path in cfg.user_function_paths.items():
        if ":" not in path and "." not in path:
            problems.append(f"{flag} {path}: expected module:function (or path/to/file.py:function)")


@check
def _generation(cfg: RunConfig, problems: list[str]) -> None:
    g = cfg.generate
    for flag, value in (("--sglang-server-concurrency", g.server_concurrency), ("--generate-max-turns", g.max_turns)):
        if value < 1:
            problems.append(f"{flag} {value}: must be a positive integer")
    for flag, value in (("--rollout-sample-timeout", g.sample_timeout_s), ("--rollout-timeout", g.rollout_timeout_s),
                        ("--generate-tool-timeout", g.tool_timeout_s)):
        if value is not None and value <= 0:
            problems.append(f"{flag} {value}: must be > 0 seconds")
    if g.generate_function_path is None:
        idle = [f"{flag} {v}" for flag, v in (("--rollout-sample-timeout", g.sample_timeout_s),
                                               ("--rollout-timeout", g.rollout_timeout_s),
                                               ("--generate-tool-specs-path", g.tool_specs_path)) if v is not None]
        if idle:
            problems.append(f"{', '.join(idle)}: only custom generation reads them; add "
                            "--custom-generate-function-path module:fn or --generate-execute-tool-function-path")
    if g.tool_specs_path and g.tool_specs_path.endswith(".json") and not Path(g.tool_specs_path).is_file():
        problems.append(f"--generate-tool-specs-path {g.tool_specs_path}: no such file")
    custom = [flag for flag in cfg.user_function_paths if USER_FUNCTION_FLAGS[flag][0] == "generate"]
    if custom and cfg.algorithm.loss_type == "sft_loss":
        problems.append(f"--loss-type sft_loss trains on the data's responses: {', '.join(custom)} do not apply")
    if g.rollout_function_path and cfg.rollout.dynamic_sampling_filter_path:
        problems.append("--rollout-function-path replaces the whole rollout, dynamic sampling included: drop "
                        "--dynamic-sampling-filter-path (or filter inside the rollout function)")


@check
def _rollout_hooks(cfg: RunConfig, problems: list[str]) -> None:
    """miles' rollout hooks (miles.rollout.hooks) where they would not run as in miles (SFT: `_sft`)."""
    r, a = cfg.rollout, cfg.algorithm
    hooks = [flag for flag, on in (("--rollout-sample-filter-path", r.sample_filter_path),
                                   ("--rollout-all-samples-process-path", r.all_samples_process_path)) if on]
    if cfg.generate.rollout_function_path and hooks:
        problems.append(f"--rollout-function-path replaces the whole rollout, and miles calls {' and '.join(hooks)} "
                        "only inside its own rollout function: call yours from the rollout function, or drop them")
    replayed = hooks + (["--custom-reward-post-process-path"] if r.reward_post_process_path else [])
    if cfg.load_debug_rollout_data and replayed:
        problems.append(f"--load-debug-rollout-data trains on the saved rollouts as they were, advantages included: "
                        f"{', '.join(replayed)} would not run; drop them (a run that saved rollouts with them "
                        "ran them before saving)")
    if r.reward_post_process_path and a.advantage_estimator in TOKEN_LEVEL_ESTIMATORS:
        problems.append(f"--custom-reward-post-process-path with --advantage-estimator {a.advantage_estimator}: not "
                        "supported yet (the trainer computes token-level advantages from the rewards); shape the "
                        "rewards in --custom-rm-path, or use a sequence-level estimator (grpo, gspo, rloo, "
                        "reinforce_plus_plus_baseline)")


@check
def _opd(cfg: RunConfig, problems: list[str]) -> None:
    """On-policy distillation (miles' checks, and what this build needs): one teacher source per --opd-type,
    a teacher that shares the policy's tokenizer, and the pre-step logprobs the adjustment reads."""
    a = cfg.algorithm
    given = [f"{flag} {v}" for flag, v in (("--opd-type", a.opd_type), ("--opd-teacher-load", a.opd_teacher_load),
                                           ("--opd-teacher-urls", " ".join(a.opd_teacher_urls) or None)) if v]
    if not a.use_opd:
        if given:
            problems.append(f"{', '.join(given)}: no effect without --use-opd; add --use-opd or drop them")
        return
    if a.opd_type not in OPD_TYPES:
        problems.append(f"--use-opd needs --opd-type {' or '.join(OPD_TYPES)} (where the teacher scores the samples), "
                        f"got {a.opd_type}")
    if not math.isfinite(a.opd_kl_coef) or a.opd_kl_coef < 0:
        problems.append(f"--opd-kl-coef {a.opd_kl_coef}: must be a finite number >= 0")
    if a.loss_type == "sft_loss":
        problems.append("--use-opd adjusts the advantages, which --loss-type sft_loss does not read; drop one of them")
    if a.skip_actor_forward_only and not a.use_rollout_logprobs:
        problems.append("--skip-actor-forward-only with --use-opd: the OPD reverse KL reads the student's logprobs "
                        "before the first step; add --use-rollout-logprobs (the engine's stand in) or drop it")
    if a.opd_type == "megatron":
        _opd_teacher_folder(cfg, problems)
        if a.opd_teacher_urls:
            problems.append("--opd-teacher-urls is for --opd-type sglang; --opd-type megatron runs the teacher of "
                            "--opd-teacher-load in the trainer: drop one of them")
    elif a.opd_type == "sglang":
        if missing := missing_package("--opd-type sglang", "aiohttp", "aiohttp", "remote"):
            problems.append(missing)
        if a.opd_teacher_load:
            problems.append(f"--opd-teacher-load {a.opd_teacher_load} is for --opd-type megatron; with --opd-type "
                            "sglang the teacher servers of --opd-teacher-urls score the samples: drop it")
        if not a.opd_teacher_urls:
            problems.append("--opd-type sglang needs --opd-teacher-urls NAME=URL ... (or one URL): the teacher "
                            "servers' /generate endpoints (miles' fallback to --rm-url is not taken here)")
        try:
            parse_opd_teachers(a.opd_teacher_urls)
        except ValueError as exc:
            problems.append(str(exc))


def _opd_teacher_folder(cfg: RunConfig, problems: list[str]) -> None:
    """--opd-teacher-load: an HF folder whose tokenizer is the policy's (OPD compares the logprobs of the same
    token ids; a teacher with another vocabulary would score other tokens)."""
    path = cfg.algorithm.opd_teacher_load
    if not path:
        problems.append("--opd-type megatron needs --opd-teacher-load: the teacher's HF folder")
        return
    if not (Path(path) / "config.json").is_file():
        problems.append(f"--opd-teacher-load {path}: no config.json there; pass an HF-format model folder")
        return
    if not (Path(cfg.model.hf_checkpoint) / "config.json").is_file():
        return      # _paths says so
    from transformers import AutoTokenizer     # only OPD runs pay for it

    try:
        policy, teacher = (AutoTokenizer.from_pretrained(p).get_vocab() for p in (cfg.model.hf_checkpoint, path))
    except (OSError, ValueError) as exc:
        problems.append(f"--opd-teacher-load {path}: its tokenizer does not load ({exc}); the teacher needs the "
                        "policy's tokenizer files")
        return
    if policy != teacher:
        diff = sorted(set(policy.items()) ^ set(teacher.items()), key=lambda kv: kv[1])[:1]
        where = f" (first difference: {diff[0][0]!r} id {diff[0][1]})" if diff else ""
        problems.append(f"--opd-teacher-load {path}: its tokenizer's vocabulary ({len(teacher)} tokens) is not "
                        f"--hf-checkpoint's ({len(policy)} tokens){where}; OPD compares the teacher's and the "
                        "student's logprobs of the same token ids, so the teacher must share the policy's tokenizer")


@check
def _rewards(cfg: RunConfig, problems: list[str]) -> None:
    r = cfg.rollout
    if r.rm_type == "remote_rm" and not r.custom_rm_path and not r.rm_url:
        problems.append("--rm-type remote_rm needs --rm-url URL: the reward service to post responses to")
    if r.rm_url and not r.rm_url.startswith(("http://", "https://")):
        problems.append(f"--rm-url {r.rm_url}: expected an http:// or https:// URL")
    if r.rm_url and not r.custom_rm_path and (missing := missing_package("--rm-url", "aiohttp", "aiohttp", "remote")):
        problems.append(missing)
    if r.rm_url and r.custom_rm_path:
        problems.append(f"--rm-url {r.rm_url} has no effect with --custom-rm-path (the custom reward scores "
                        "every sample); drop one of them")
    if r.group_rm and not r.custom_rm_path:
        problems.append("--group-rm makes the --custom-rm-path function score a prompt's responses at once; "
                        "add --custom-rm-path module:fn or drop --group-rm")
    if r.rm_timeout_s <= 0 or r.rm_max_retries < 0 or r.rm_retry_backoff_s < 0:
        problems.append(f"--rm-timeout {r.rm_timeout_s} / --rm-max-retries {r.rm_max_retries} / --rm-retry-backoff "
                        f"{r.rm_retry_backoff_s}: need a timeout > 0, retries >= 0 and a backoff >= 0")


@check
def _engine_health(cfg: RunConfig, problems: list[str]) -> None:
    r = cfg.rollout
    if r.engine_generate_timeout_s <= 0:
        problems.append(f"--engine-generate-timeout {r.engine_generate_timeout_s}: must be > 0 seconds")
    if r.health_check_interval_s < 0 or r.health_check_timeout_s <= 0 or r.health_check_first_wait_s < 0:
        problems.append(f"--rollout-health-check-interval {r.health_check_interval_s} / -timeout "
                        f"{r.health_check_timeout_s} / -first-wait {r.health_check_first_wait_s}: need an interval "
                        ">= 0 (0: off), a timeout > 0 and a first wait >= 0")


# -- checks that depend on the lifecycle machine ----------------------------------------------------

PREFETCHING_PHASES = ("miles.phases.async_loop:rollout",)   # rollout r+1 generates while r trains
PRODUCER_PHASES = ("miles.phases.fully_async:rollout",)     # a producer generates continuously (--fully-async)
FULLY_ASYNC_FLAGS = (("--max-weight-staleness", "max_weight_staleness", None),
                     ("--async-max-concurrent-samples", "async_max_concurrent_samples", None),
                     ("--async-data-buffer-capacity-factor", "async_data_buffer_capacity_factor", 2.0),
                     ("--async-unused-samples-handler", "async_unused_samples_handler", "drop"),
                     ("--async-tail-cut-share", "async_tail_cut_share", 0.0))


@check
def _machine(cfg: RunConfig, problems: list[str], *, machine: MachineDef) -> None:
    """What the chosen machine adds: the async machine trains one step off-policy, the fully-async one up
    to --max-weight-staleness steps; --phase-timeout names its states."""
    rollout = machine.states.get("rollout")
    off_policy = rollout is not None and rollout.phase in PREFETCHING_PHASES
    producer = rollout is not None and rollout.phase in PRODUCER_PHASES
    if producer:
        problems += _async_problems(cfg) + _fully_async_problems(cfg)
    elif cfg.fully_async:
        problems.append(f"--fully-async needs the fully_async machine (it picks it); machine {machine.name} has no "
                        "rollout producer: drop --machine or --fully-async")
    else:
        problems += _async_problems(cfg) if off_policy else _on_policy_problems(cfg, machine.name)
        problems += [f"{flag} {getattr(cfg, name)}: only --fully-async reads it; add --fully-async or drop it"
                     for flag, name, default in FULLY_ASYNC_FLAGS if getattr(cfg, name) != default]
    problems += [f"--phase-timeout {state}=...: machine {machine.name} has no state {state!r} "
                 f"(its states: {', '.join(s for s, d in machine.states.items() if not d.final)})"
                 for state in cfg.reliability.phase_timeout_overrides
                 if state not in machine.states or machine.states[state].final]


# the half runs for debugging (miles.phases.debug): the flag -> (the machine it runs on, the flag's name)
DEBUG_MACHINES = {"load_debug_rollout_data": ("train_only", "--load-debug-rollout-data"),
                  "debug_rollout_only": ("rollout_only", "--debug-rollout-only")}


@check
def _debug_flags(cfg: RunConfig, problems: list[str], *, machine: MachineDef) -> None:
    """A debug flag needs its machine, and its machine needs the flag."""
    name = machine.name
    given = [(machine_for, flag) for field, (machine_for, flag) in DEBUG_MACHINES.items() if getattr(cfg, field)]
    if len(given) > 1:
        problems.append("--load-debug-rollout-data and --debug-rollout-only exclude each other: "
                        "one trains without engines, the other rolls out without a trainer")
    for machine_for, flag in given:
        if name != machine_for:
            problems.append(f"{flag} runs on --machine {machine_for}, not {name!r} (miles train picks it "
                            "when --machine is not given)")
    for field, (machine_for, flag) in DEBUG_MACHINES.items():
        if name == machine_for and not getattr(cfg, field):
            problems.append(f"--machine {machine_for} needs {flag}")
    if cfg.debug_rollout_data_path and name == "async":     # its rollouts come from the prefetcher
        flag = "--save-debug-rollout-data" if cfg.save_debug_rollout_data else "--dump-details"
        problems.append(f"{flag} is not supported by --machine async yet; use sync")
    if cfg.debug_rollout_only and (cfg.checkpoint.load or cfg.checkpoint.save):
        problems.append("--debug-rollout-only has no trainer to --save or --load; drop those flags")


@check
def _partial_rollout_engines(cfg: RunConfig, problems: list[str], *, num_engines: int) -> None:
    """Once the placement knows the engine count: an engine answers a call's requests together, so what
    an abort can cut short (--partial-rollout, miles.rollout.partial) is a whole engine call, one per
    engine and round."""
    if cfg.rollout.partial_rollout and num_engines < 2:
        problems.append(f"--partial-rollout cuts short the engine calls still running once the batch is full, "
                        f"and this run has {num_engines} engine: a round is one call, never cut short. Give "
                        "--rollout-num-engines 2 or more (on GPUs: --rollout-num-gpus), or drop --partial-rollout")


def _async_problems(cfg: RunConfig) -> list[str]:
    problems, a, n = [], cfg.algorithm, cfg.update_weights_interval
    if cfg.cluster.colocate and not cfg.cluster.shares_gpu_resident:
        problems.append("--colocate cannot be used with the async machines as it is (miles: colocation is not "
                        "supported for async training): it hands the GPU back and forth between the engines and "
                        "the trainer, and here they run at the same time. Add --no-offload-rollout to share the "
                        "GPU with both resident (the engine's KV cache takes --rollout-mem-fraction of the GPU "
                        "less its weights, the trainer the rest; docs/fully-async.md), drop --colocate (devices "
                        "of their own), or use the sync machine")
    offloads = [f for f, on in (("--offload", cfg.cluster.offload), ("--offload-train", cfg.cluster.offload_train),
                                ("--offload-rollout", cfg.cluster.offload_rollout)) if on]
    if offloads:
        problems.append(f"{', '.join(offloads)} cannot be used with the async machine: the engines generate while "
                        "the trainer trains, so neither can hand its memory to the other; drop them or use the "
                        "sync machine")
    if a.loss_type == "policy_loss" and not (a.use_tis or a.use_rollout_logprobs):
        problems.append(f"the async machine trains on rollouts generated by weights up to {n} update(s) old; "
                        "the policy loss needs an off-policy correction: add --use-tis (truncated importance "
                        "sampling, --tis-clip / --tis-clip-low bound the ratio) or --use-rollout-logprobs "
                        "(the engine's logprobs as the old policy)")
    if cfg.eval.interval is not None and cfg.eval.interval % n:
        problems.append(f"--eval-interval {cfg.eval.interval} is not a multiple of --update-weights-interval {n}: "
                        "an eval reads the engines' weights, which change only every "
                        f"{n} rollouts; use an --eval-interval that is a multiple of {n}")
    return problems


def _fully_async_problems(cfg: RunConfig) -> list[str]:
    """The fully-async machine's own rules (docs/fully-async.md): the producer generates single-turn groups
    of fresh prompts; the bounds must let it make progress."""
    problems, r, a, n = [], cfg.rollout, cfg.algorithm, cfg.update_weights_interval
    if not cfg.fully_async:
        problems.append("the fully_async machine runs with --fully-async (which picks it): add --fully-async")
    refused = [(flag, why) for flag, on, why in (
        ("--partial-rollout", r.partial_rollout, "the producer never aborts a request: it pauses it for a weight "
                                                 "swap and continues it"),
        # --dynamic-sampling-filter-path is taken: the producer drops the groups it rejects before they reach
        # the buffer, and --dynamic-sampling-max-rounds bounds the rejects per step (miles.rollout.producer)
        ("--over-sampling-batch-size", r.over_sampling_batch_size is not None,
         "the producer has no sampling rounds: it draws the prompts of each engine call (--async-max-concurrent-"
         "samples over the engines) and keeps generating until a step's groups passed the filter; drop it "
         "(--dynamic-sampling-max-rounds x --rollout-batch-size rejects in a step let the rejected groups fill it)"),
        ("--rollout-function-path", cfg.generate.rollout_function_path, "the producer generates the groups itself"),
        ("--custom-generate-function-path", cfg.generate.generate_function_path,
         "the producer pauses single-turn engine calls; multi-turn generation is not paused at token boundaries "
         "yet"),
        # --check-weight-update-equal / --ci-test are taken: each engine records its checksums at the token
        # boundary of its swap (miles.rollout.engines.guard), compared with the trainer's by the push
        ("--debug-skip-weight-update", cfg.debug_skip_weight_update, "the staleness bound counts weight versions"),
        ("--loss-type sft_loss", a.loss_type == "sft_loss", "SFT generates nothing")) if on]
    problems += [f"{flag} cannot be used with --fully-async: {why}" for flag, why in refused]
    bound = cfg.max_weight_staleness
    if bound is not None and bound < n:
        problems.append(f"--max-weight-staleness {bound} is below --update-weights-interval {n}: between two pushes "
                        f"the engines' weights are up to {n - 1} version(s) behind the step, and a group that was "
                        f"in flight at a push is one interval older; give --max-weight-staleness {n} or more")
    cap = cfg.async_max_concurrent_samples
    if cap is not None and cap < r.n_samples_per_prompt:
        problems.append(f"--async-max-concurrent-samples {cap} is below --n-samples-per-prompt "
                        f"{r.n_samples_per_prompt}: a group's samples are generated together; give at least "
                        f"{r.n_samples_per_prompt}")
    if not cfg.async_data_buffer_capacity_factor >= 1.0:
        problems.append(f"--async-data-buffer-capacity-factor {cfg.async_data_buffer_capacity_factor}: the buffer "
                        "must hold at least one --rollout-batch-size of groups; give 1.0 or more (miles: 2.0)")
    if not 0.0 <= cfg.async_tail_cut_share < 1.0:
        problems.append(f"--async-tail-cut-share {cfg.async_tail_cut_share}: the share of an engine call's samples "
                        "still running when it returns; give a value in [0, 1) (0: off; e.g. 0.25)")
    return problems


def _on_policy_problems(cfg: RunConfig, name: str) -> list[str]:
    problems = []
    if cfg.update_weights_interval != 1:
        problems.append(f"--update-weights-interval {cfg.update_weights_interval}: only the async machine reads it "
                        f"(machine {name} pushes weights after every rollout); drop it or use --machine async")
    return problems


@check
def _gpu_memory(cfg: RunConfig, problems: list[str]) -> None:
    t = cfg.train
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu is None and cfg.model.on_gpus is False:
        problems.append("--use-dynamic-batch-size needs --max-tokens-per-gpu N on the CPU: the token budget of a "
                        "micro-batch (on CUDA it is planned from the free memory)")
    if t.max_tokens_per_gpu is not None and not t.use_dynamic_batch_size:
        problems.append(f"--max-tokens-per-gpu {t.max_tokens_per_gpu} has no effect without --use-dynamic-batch-size")
    if t.max_tokens_per_gpu is not None and t.max_tokens_per_gpu < 1:
        problems.append(f"--max-tokens-per-gpu {t.max_tokens_per_gpu}: must be a positive integer")
    lp = t.log_probs_max_tokens_per_gpu
    if lp is not None and (lp < 1 or not t.use_dynamic_batch_size):
        problems.append(f"--log-probs-max-tokens-per-gpu {lp}: a positive token budget of micro-batches by tokens; "
                        "it needs --use-dynamic-batch-size")
    if t.mfu_peak_tflops is not None and not t.mfu_peak_tflops > 0:
        problems.append(f"--mfu-peak-tflops {t.mfu_peak_tflops}: must be a positive number of TFLOP/s")
    if cfg.update_weight_buffer_size < 1:
        problems.append(f"--update-weight-buffer-size {cfg.update_weight_buffer_size}: must be a positive number of bytes")


@check
def _placement(cfg: RunConfig, problems: list[str]) -> None:
    """The GPU flags among themselves; what the trainer and the engines can take is their specs' check,
    the plan itself `miles.cluster.placement`'s."""
    c = cfg.cluster
    if c.rollout_num_gpus_per_engine > 1 and c.colocate:
        problems.append(f"--rollout-num-gpus-per-engine {c.rollout_num_gpus_per_engine} with --colocate: a colocated "
                        "engine shares one trainer GPU; use 1 (or drop --colocate for tensor-parallel SGLang servers)")
    if c.rollout_num_gpus is not None and cfg.rollout.num_engines is not None \
            and c.rollout_num_gpus != cfg.rollout.num_engines * c.rollout_num_gpus_per_engine:
        problems.append(f"--rollout-num-gpus {c.rollout_num_gpus} and --rollout-num-engines {cfg.rollout.num_engines} "
                        f"disagree (x --rollout-num-gpus-per-engine {c.rollout_num_gpus_per_engine}); give one of them")


# -- miles flags that need another flag, or a file -----------------------------------------------------

@check
def _miles_compat(cfg: RunConfig, problems: list[str]) -> None:
    d, r, a, c = cfg.data, cfg.rollout, cfg.algorithm, cfg.checkpoint
    needs = [
        (d.chat_template_path is not None and not d.apply_chat_template, "--chat-template-path", "--apply-chat-template"),
        (d.apply_chat_template_kwargs is not None and not d.apply_chat_template, "--apply-chat-template-kwargs",
         "--apply-chat-template"),
        (a.use_unbiased_kl and not a.use_kl_loss, "--use-unbiased-kl", "--use-kl-loss"),
        (a.custom_tis_function_path is not None and not a.use_tis, "--custom-tis-function-path", "--use-tis"),
        (c.keep_last is not None and not c.save, "--keep-last-checkpoints", "--save DIR"),
        (c.retain_interval is not None and not c.save, "--save-retain-interval", "--save DIR"),
        (c.save_retries > 0 and not c.save, "--save-retries", "--save DIR"),
        (c.async_save and not c.save, "--async-save", "--save DIR"),
        (cfg.debug_train_only and not cfg.load_debug_rollout_data, "--debug-train-only",
         "--load-debug-rollout-data PATH (rollouts written by --save-debug-rollout-data)"),
    ]
    problems += [f"{flag} has no effect without {need}: add it or drop {flag}" for bad, flag, need in needs if bad]
    if a.pg_loss_reducer_path and a.loss_type != "policy_loss":
        problems.append(f"--custom-pg-loss-reducer-function-path reduces the policy loss: --loss-type {a.loss_type} "
                        "has none (a custom loss reduces with its `reduce` argument); drop it")
    if (a.loss_type == "custom_loss") != (a.custom_loss_function_path is not None):
        problems.append("--loss-type custom_loss and --custom-loss-function-path go together: the loss function "
                        f"is {signature('--custom-loss-function-path')}, by import path")
    if d.chat_template_path and not Path(d.chat_template_path).is_file():
        problems.append(f"--chat-template-path {d.chat_template_path}: no such file")
    for flag, value in (("--keep-last-checkpoints", c.keep_last), ("--rollout-max-context-len", r.max_context_len),
                        ("--save-retain-interval", c.retain_interval),
                        ("--log-probs-chunk-size", cfg.train.log_probs_chunk_size),
                        ("--eval-max-context-len", cfg.eval.max_context_len),
                        ("--eval-max-prompt-len", cfg.eval.max_prompt_len)):
        if value is not None and value < 1:
            problems.append(f"{flag} {value}: must be a positive integer")
    if c.retain_interval and c.save_interval and c.retain_interval % c.save_interval:
        problems.append(f"--save-retain-interval {c.retain_interval} is not a multiple of --save-interval "
                        f"{c.save_interval}: no checkpoint would fall on it (as in miles); make it a multiple")
    if c.save_retries < 0:
        problems.append(f"--save-retries {c.save_retries}: must be >= 0")
    if cfg.start_rollout_id is not None and (cfg.start_rollout_id < 0 or (
            cfg.num_rollout is not None and cfg.start_rollout_id >= cfg.num_rollout)):
        problems.append(f"--start-rollout-id {cfg.start_rollout_id}: must be in [0, --num-rollout {cfg.num_rollout})")
    if any(not s for s in r.stop) or any(t < 0 for t in r.stop_token_ids):
        problems.append(f"--rollout-stop {list(r.stop)} / --rollout-stop-token-ids {list(r.stop_token_ids)}: stop "
                        "strings must be non-empty and token ids >= 0")


@check
def _eval_sets(cfg: RunConfig, problems: list[str]) -> None:
    e = cfg.eval
    if e.prompt_data and e.datasets:
        problems.append("--eval-prompt-data and --eval-config both name eval datasets: give one of them")
    for d in e.datasets:
        where = f"--eval-config dataset {d.name!r}"
        if d.n_samples_per_prompt is not None and d.n_samples_per_prompt < 1:
            problems.append(f"{where}: n_samples_per_eval_prompt {d.n_samples_per_prompt} must be >= 1")
        problems += [f"{where}: {p}" for p in sampling_problems(temperature=d.temperature, top_p=d.top_p,
                                                                  top_k=d.top_k)]
    problems += sampling_problems(temperature=e.temperature, top_p=e.top_p, top_k=e.top_k,
                                  names=("--eval-temperature", "--eval-top-p", "--eval-top-k"))


@check
def _launch_script_switches(cfg: RunConfig, problems: list[str]) -> None:
    """miles' launch-script flags that hold only with what this build does (names: a config built in
    code skips the flags' choices)."""
    r, a, t = cfg.rollout, cfg.algorithm, cfg.train
    off = [flag for flag, is_off in (("--engine-max-restarts 0", r.engine_max_restarts == 0),
                                     ("--rollout-health-check-interval 0", r.health_check_interval_s == 0)) if is_off]
    if r.use_fault_tolerance and off:
        problems.append(f"--use-fault-tolerance asks for engine health checks and restarts of dead engines, which "
                        f"{' and '.join(off)} turn off: drop one side (both are on by default here)")
    if not a.compute_advantages_and_returns and a.loss_type != "sft_loss":
        problems.append(f"--disable-compute-advantages-and-returns with --loss-type {a.loss_type}: that loss reads "
                        "the advantages; miles' SFT recipe passes it, and here --loss-type sft_loss computes none "
                        "already: drop the flag, or train with --loss-type sft_loss")
    if t.attn_implementation is not None and t.attn_implementation not in ATTN_IMPLEMENTATIONS:
        problems.append(f"--attn-implementation {t.attn_implementation}: not an attention implementation miles' "
                        f"FSDP backend takes; use one of {', '.join(ATTN_IMPLEMENTATIONS)} (or drop it: no effect "
                        "here)")
    if t.megatron_to_hf_mode is not None and t.megatron_to_hf_mode not in MEGATRON_TO_HF_MODES:
        problems.append(f"--megatron-to-hf-mode {t.megatron_to_hf_mode}: use raw or bridge")


GRAD_NORM_FIELDS = ("role", "rollout_id", "step_id")     # what miles' --ci-save/load-grad-norm paths may hold


@check
def _ci_gates(cfg: RunConfig, problems: list[str]) -> None:
    """miles' CI gates (miles/metrics/ci_gates.py): the metric and model-hash ones work under --ci-test, as in miles."""
    key, threshold = cfg.ci_metric_checker_key, cfg.ci_metric_checker_threshold
    if (key is None) != (threshold is None):
        problems.append("--ci-metric-checker-key and --ci-metric-checker-threshold go together: give both")
    needs_ci = [flag for flag, given in (("--ci-metric-checker-key", key is not None),
                                         ("--ci-save-model-hash", cfg.ci_save_model_hash),
                                         ("--ci-check-model-hash", cfg.ci_check_model_hash)) if given]
    if needs_ci and not cfg.ci_test:
        problems.append(f"{' / '.join(needs_ci)} work under --ci-test (as in miles): add --ci-test")
    names = [d.name for d in cfg.eval.sets()]
    if key is not None and not any(key == f"eval/{n}" or key.startswith(f"eval/{n}/") for n in names):
        problems.append(f"--ci-metric-checker-key {key}: not an eval metric of this run; use eval/<set>/<metric> "
                        f"(or eval/<set>: its reward_mean) with <set> one of --eval-prompt-data / --eval-config's "
                        f"datasets ({', '.join(names) or 'none given'})")
    if cfg.ci_save_grad_norm and cfg.ci_load_grad_norm:
        problems.append("--ci-save-grad-norm and --ci-load-grad-norm: a run records the norms or checks them; give one")
    for flag, path in (("--ci-save-grad-norm", cfg.ci_save_grad_norm), ("--ci-load-grad-norm", cfg.ci_load_grad_norm)):
        fields = _template_fields(path) if path else set()
        if fields is None or not fields <= set(GRAD_NORM_FIELDS):
            problems.append(f"{flag} {path}: a path whose {{...}} fields are among {', '.join(GRAD_NORM_FIELDS)}")
    if cfg.ci_save_model_hash and not cfg.checkpoint.save:
        problems.append("--ci-save-model-hash writes the hash into each checkpoint: add --save DIR")
    if cfg.ci_check_model_hash and not cfg.checkpoint.load:
        problems.append("--ci-check-model-hash checks the weights --load reads: add --load DIR")


def _template_fields(path: str) -> set[str] | None:
    """The {field} names of a str.format template (None: not a valid template)."""
    try:
        return {name for _, name, _, _ in string.Formatter().parse(path) if name is not None}
    except ValueError:
        return None
