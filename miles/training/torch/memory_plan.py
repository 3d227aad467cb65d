"""The token budget of a CUDA micro-batch when `--max-tokens-per-gpu` is not given: planned from the
free memory, so a micro-batch that TRL trains at the same size does not run out of memory here.

The rule (pure functions, unit-tested; the inputs come from `torch.cuda.mem_get_info` and the model's
config at the start of each train call, after a colocated engine has released its KV cache):

    budget_tokens = floor(HEADROOM * (free - reserve) / bytes_per_token)

- free: the device's free memory plus what this process's allocator holds cached but unused.
- reserve: what the step will still allocate whatever the micro-batch: the float32 gradients
  (4 B/param) and AdamW's two moments (8 B/param) when they do not exist yet on the device (the
  first step; never with --offload-train, whose step streams them a chunk at a time once the
  activations are gone), autocast's half-precision weight copies (2 B/param under a
  bf16/fp16 compute dtype; with --trainer-weight-shadows the shadows, made after the plan), and the
  chunked logprob pass's temporaries (chunk rows x vocab x 16 B: the chunk's logits and three
  float32 passes over them).
- bytes_per_token (`activation_bytes_per_token`): what autograd keeps per token for the backward.
  Per decoder layer 32 h + 4 e I + 5 e (q_dim + kv_dim) + 512 bytes (h hidden size, I the MLP's
  intermediate size, q_dim = heads x head_dim, kv_dim = KV heads x head_dim, e the compute dtype's
  bytes; the residual stream and the norms stay float32 under autocast); plus 8 h for the final norm
  and the chunked LM head, or 12 V more when the logits are materialised (the CPU path). With
  --recompute-activations a layer keeps only its float32 input (8 h, rounded up), and one layer's
  activations exist at a time during its recompute. The coefficients are an upper bound of the
  bytes autograd saved in eager Qwen3 layers (measured on the CPU by `saved_tensors_hooks`;
  tests/unit/test_memory_plan.py checks the bound). Compiled layers (the CUDA trainer's default)
  keep less: Inductor's partitioner recomputes the cheap elementwise work (SiLU, the norms' float32
  passes, rotary) in the backward instead of saving its outputs, so a compiled layer is planned at
  COMPILED_LAYER_SHARE (0.75) of the eager bound: on the GPU a compiled layer of Qwen3's 0.6B-8B
  shapes kept 0.52-0.54 of it (tests/gpu/test_memory_plan_gpu.py: the slope of the step's peak memory
  in the tokens, Dec 4 2026), and the rest is a margin, as for the eager bound (0.91-0.93 measured).
- HEADROOM = 0.8: a margin for the allocator's fragmentation, kernel workspaces and the backward's
  transient gradient buffers, which the saved-tensor count does not see. A policy, not a measurement:
  the trainer reports `gpu_mem_peak_gib` per train call to check it against.

The budget caps micro-batches by their padded size (rows x longest; `plan_micro_batches`'
`memory_tokens`); it never merges rows, so the gradient is the same as without it. A budget below
one row's length cannot be split further: where even the longest row does not fit,
`plan_token_budget` says so, naming the flags that make room, and the trainer logs that as a
`memory_plan_tight` warning and trains one row per micro-batch (the coefficients are not yet
checked against GPU peaks, so the per-step plan warns rather than refuses).

What is refused is a run whose step cannot fit at all: `startup_problems`, the torch backend's
check, adds up what a step needs on a trainer GPU (weights, gradients, optimizer state, a colocated
engine's weights, one longest sample's activations; see its comment) when the placement is known,
before any actor starts, and names the flags that make room.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from miles.rollout.engines.registry import ENGINES, engine_to_run

if TYPE_CHECKING:
    from miles.config import RunConfig

HEADROOM = 0.8
COMPILED_LAYER_SHARE = 0.75
LOGPROB_CHUNK_BYTES_PER_VOCAB = 16


def _dims(cfg) -> tuple[int, int, int, int, int, int]:
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    inter = getattr(cfg, "intermediate_size", None) or 4 * h
    return h, inter, heads * head_dim, kv_heads * head_dim, cfg.num_hidden_layers, cfg.vocab_size


def activation_bytes_per_token(cfg, *, compute_bytes: int, recompute: bool, logits: bool,
                               compiled: bool = False) -> int:
    """Bytes autograd keeps per token of a micro-batch (see the module docstring); `compiled`: the
    decoder layers run torch.compiled."""
    h, inter, q_dim, kv_dim, layers, vocab = _dims(cfg)
    layer = 32 * h + 4 * compute_bytes * inter + 5 * compute_bytes * (q_dim + kv_dim) + 512
    if compiled:
        layer = math.ceil(COMPILED_LAYER_SHARE * layer)
    head = 8 * h + (12 * vocab if logits else 0)
    return (layers * 8 * h + layer if recompute else layers * layer) + head


def reserve_bytes(*, params: int, grads_allocated: bool, optimizer_allocated: bool, compute_bytes: int,
                  chunk_rows: int, vocab: int, trained: int | None = None) -> int:
    """Bytes the step allocates besides the activations (see the module docstring). `trained`: the
    parameters with gradients and optimizer state (LoRA: the adapters; None: all `params`)."""
    trained = params if trained is None else trained
    return ((0 if grads_allocated else 4 * trained) + (0 if optimizer_allocated else 8 * trained)
            + (2 * params if compute_bytes < 4 else 0) + chunk_rows * vocab * LOGPROB_CHUNK_BYTES_PER_VOCAB)


def plan_token_budget(free_bytes: int, reserve: int, bytes_per_token: int, *, min_tokens: int = 1) -> int:
    """floor(HEADROOM * (free - reserve) / bytes_per_token); a ValueError when fewer than `min_tokens` fit."""
    budget = math.floor(HEADROOM * (free_bytes - reserve) / bytes_per_token) if free_bytes > reserve else 0
    if budget < min_tokens:
        gib = 2 ** 30
        raise ValueError(
            f"training needs {min_tokens} tokens per micro-batch but only {max(budget, 0)} fit: "
            f"{free_bytes / gib:.1f} GiB free, {reserve / gib:.1f} GiB reserved for gradients, optimizer state and "
            f"logprob chunks, {bytes_per_token} B of activations per token; make room with --recompute-activations, "
            f"--offload-train, a smaller --rollout-mem-fraction or shorter --rollout-max-response-len")
    return budget


def cuda_token_budget(model, optimizer, *, device, compute_bytes: int, recompute: bool, logits: bool,
                      chunk_rows: int, min_tokens: int, streamed: bool = False, compiled: bool = False) -> int:
    """`plan_token_budget` for `model` on the CUDA `device` now (see the module docstring). `streamed`:
    the optimizer state lives on the host and each step streams it (--offload-train), so the step
    never allocates it here beside the activations; `compiled`: its decoder layers run compiled."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    reserve = reserve_bytes(params=sum(p.numel() for p in params),
                            trained=sum(p.numel() for p in params if p.requires_grad),
                            grads_allocated=any(p.grad is not None for p in params),
                            optimizer_allocated=streamed or (bool(state) and all(v.is_cuda for v in state)),
                            compute_bytes=compute_bytes, chunk_rows=chunk_rows, vocab=model.config.vocab_size)
    per_token = activation_bytes_per_token(model.config, compute_bytes=compute_bytes, recompute=recompute,
                                           logits=logits, compiled=compiled)
    try:
        return plan_token_budget(free, reserve, per_token, min_tokens=min_tokens)
    except ValueError as exc:
        # the coefficients are an eager-layer bound, not yet checked against GPU peaks: say it, and
        # train one row per micro-batch rather than refuse a step that may still fit
        import structlog

        structlog.get_logger().warning("memory_plan_tight", problem=str(exc), budget=min_tokens)
        return min_tokens


# --- the start-up check ------------------------------------------------------------------------------
# What a run's plan needs on each trainer GPU during a step, checked once the placement is known
# (validate with --device cuda, init again with the plan), before any actor takes memory: a plan that
# cannot fit is refused then, naming the flags that make room, rather than running out of memory in
# its first train call minutes later. The parts, per trainer GPU (P parameters, N trainer ranks):
#   float32 weights 4P/N, gradients 4P/N, AdamW's moments 8P/N (none with --offload-train or
#   --optimizer-cpu-offload: the step streams them), autocast's half-precision weight copies 2P/N, the
#   frozen KL reference 4P/N (float32, sharded like the policy on N ranks), PPO's critic 16P/N (weights,
#   gradients, moments: 8P/N with --optimizer-cpu-offload; on N ranks, one per trainer GPU, sharded like
#   the policy), a colocated
#   engine's weights (2P in bf16: the fast engine keeps them while the trainer trains; SGLang releases
#   them; a resident engine, --colocate --no-offload-rollout, keeps them and its spec's `shared_gpu_bytes`:
#   the fast engine's KV cache, --rollout-mem-fraction of the GPU less its weights, and workspace), one
#   micro-batch of the longest sample's activations / HEADROOM (a micro-batch holds at least
#   one sample), the OPD teacher of --opd-type megatron 4T (float32, T its parameters: the one-process
#   trainer holds it whole), and a CUDA context per process on the GPU. Under LoRA (--lora-rank)
#   gradients and moments are the adapters' (counted as none) and the initial-policy reference is the
#   policy itself.
CONTEXT_BYTES = 1 << 30


def parameter_count(config) -> int:
    """The parameters of the HF model of `config` (tied ones once), built on the meta device: nothing
    is allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def step_need(*, params: int, ranks: int, optimizer_on_gpu: bool, compute_bytes: int, reference: bool,
              critic: bool, engine_weight_bytes: int, activation_bytes: int, processes: int,
              critic_optimizer_on_gpu: bool = True, trained: int | None = None,
              teacher_params: int = 0, engine_cache_bytes: int = 0) -> dict[str, int]:
    """Bytes a training step needs on each trainer GPU, by part (see the comment above). `trained`: the
    parameters with gradients and moments (LoRA: its adapters; None: all `params`); `teacher_params`:
    the OPD teacher's, held whole in the trainer (--opd-type megatron; 0: none)."""
    trained = params if trained is None else trained
    return {
        "weights": 4 * params // ranks,
        "gradients": 4 * trained // ranks,
        "optimizer": 8 * trained // ranks if optimizer_on_gpu else 0,
        "compute_copies": 2 * params // ranks if compute_bytes < 4 else 0,
        "reference": 4 * params // ranks if reference else 0,
        "critic": (16 if critic_optimizer_on_gpu else 8) * params // ranks if critic else 0,
        "teacher": 4 * teacher_params,
        "engine_weights": engine_weight_bytes,
        "engine_cache": engine_cache_bytes,
        "activations": math.ceil(activation_bytes / HEADROOM),
        "cuda_contexts": processes * CONTEXT_BYTES,
    }


def gpu_memory_bytes() -> int | None:
    """The smallest total memory of this machine's GPUs (nvidia-smi: no CUDA context is made), None
    when there is no nvidia-smi to ask (a driver without GPUs: the check is left to the trainer's plan)."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        return min(int(line) for line in out.split()) * 2 ** 20
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def check(cfg: RunConfig, problems: list[str]) -> None:
    """The torch backend's `check` (`TrainBackendSpec.check`): `startup_problems` on the trainer's GPUs."""
    problems += startup_problems(cfg, cfg.trainer_gpus)


def host_memory_bytes() -> int:
    """This machine's memory (psutil: what the OS reports, a container's limit not subtracted)."""
    import psutil

    return psutil.virtual_memory().total


# the share of the host's memory AdamW's moments may take when they live there: beside them stay the trainer's
# own process (torch, CUDA, pinned staging), the engines', Ray's, and the page cache; Ray's memory monitor ends
# workers at 95% of the node's memory
HOST_MOMENTS_SHARE = 0.8


def startup_problems(cfg, trainer_gpus: int | None = None, *, gpu_bytes: int | None = None,
                     host_bytes: int | None = None) -> list[str]:
    """The torch trainer's check of a GPU run's memory plan (the backend spec's `check`): one problem
    naming the flags to change when a step cannot fit on a trainer GPU, else none. Runs only where the
    trainer's GPUs are known and their memory can be read (`gpu_bytes`, else `gpu_memory_bytes()`).
    Where the optimizer's moments live in host memory (--offload-train, --optimizer-cpu-offload) on a
    cluster this run starts here, also whether this machine (`host_bytes`, else `host_memory_bytes()`)
    can hold them: a run that cannot would be ended by the OOM killer in its first train step."""
    if not trainer_gpus or cfg.model.on_gpus is False:
        return []
    total = gpu_bytes if gpu_bytes is not None else gpu_memory_bytes()
    if not total:
        return []
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(cfg.model.hf_checkpoint)
    except (OSError, ValueError):       # validate reports an unreadable model folder itself
        return []
    params = parameter_count(hf_config)
    t, c, r, a = cfg.train, cfg.cluster, cfg.rollout, cfg.algorithm
    teacher = 0
    if a.opd_in_trainer and a.opd_teacher_load:
        try:
            teacher = parameter_count(AutoConfig.from_pretrained(a.opd_teacher_load))
        except (OSError, ValueError):   # validate reports an unreadable teacher folder itself
            pass
    compute_bytes = 4 if cfg.model.dtype == "float32" else 2
    prompt = cfg.data.max_prompt_len
    longest = r.max_context_len or (prompt or 0) + r.max_response_len
    per_token = activation_bytes_per_token(hf_config, compute_bytes=compute_bytes, recompute=t.recompute_activations,
                                           logits=False)
    # --offload-train streams the policy's moments (not with PPO's critic, as in miles); --optimizer-cpu-offload
    # every optimizer's, the critic's too
    streamed = (c.offloads_train and not a.needs_critic) or t.optimizer_cpu_offload
    # the engine that runs (a GPU run's `embedded` is FastEngine for the models it implements), as init picks it
    engine = ENGINES[engine_to_run(cfg, on_gpus=True)[0]]
    # a resident engine (--colocate --no-offload-rollout) keeps everything: its weights, and what its spec
    # says it holds beside them on a shared GPU (the fast engine: its KV cache and workspace)
    resident = c.shares_gpu_resident
    engine_keeps = c.colocate and (resident or engine.weights_on_release == "kept")
    engine_cache = engine.shared_gpu_bytes(cfg, total, 2 * params) if resident and engine.shared_gpu_bytes else 0
    need = step_need(params=params, ranks=trainer_gpus, optimizer_on_gpu=not streamed, compute_bytes=compute_bytes,
                     # LoRA: gradients and moments of the adapters alone (~0), the initial-policy reference the
                     # policy itself with its adapters off
                     trained=0 if t.lora_rank else None,
                     reference=(a.use_kl_loss or a.kl_coef > 0)
                     and not (t.lora_rank and a.ref_load is None and not a.ref_update_interval),
                     critic=a.needs_critic,
                     critic_optimizer_on_gpu=not t.optimizer_cpu_offload,
                     engine_weight_bytes=2 * params if engine_keeps else 0, activation_bytes=longest * per_token,
                     processes=2 if c.colocate else 1, teacher_params=teacher, engine_cache_bytes=engine_cache)
    problems = _host_problems(cfg, params, streamed, host_bytes)
    if sum(need.values()) <= total:
        return problems
    gib = 2 ** 30
    room = [f for f, missing in (
        ("--offload-train or --optimizer-cpu-offload (AdamW's moments, 8 B/param, stay in host memory)",
         not streamed and not a.needs_critic and not t.lora_rank and not resident),
        ("--optimizer-cpu-offload (AdamW's moments, 8 B/param, stay in host memory)",
         not streamed and not a.needs_critic and not t.lora_rank and resident),
        ("a smaller --rollout-mem-fraction (the resident engine's KV cache: that share of the GPU less its "
         "weights) or --rollout-max-batch-size", engine_cache > 0),
        ("--optimizer-cpu-offload (the policy's and the critic's AdamW moments, 8 B/param each, in host memory)",
         a.needs_critic and not t.optimizer_cpu_offload),
        ("--recompute-activations", not t.recompute_activations),
        ("a shorter --rollout-max-response-len" + ("" if prompt is None else " or --max-prompt-len"), True),
        (f"--rollout-engine {' / '.join(n for n, e in ENGINES.items() if e.weights_on_release == 'dropped')} (it "
         "releases its weights while the trainer trains)", engine_keeps and not resident),
        ("--opd-type sglang --opd-teacher-urls (the teacher scores on its own servers, not in the trainer)",
         teacher > 0),
        ("more trainer GPUs (--actor-num-gpus-per-node N shards the model)", True)) if missing]
    parts = ", ".join(f"{k.replace('_', ' ')} {v / gib:.1f}" for k, v in need.items() if v)
    return [f"the torch trainer's step needs about {sum(need.values()) / gib:.1f} GiB on each of its GPUs "
            f"({parts} GiB; a {params / 1e9:.2f}B-parameter model, samples up to {longest} tokens) but a GPU here "
            f"has {total / gib:.1f} GiB; make room with " + "; ".join(room)] + problems


def _host_problems(cfg, params: int, streamed: bool, host_bytes: int | None) -> list[str]:
    """AdamW's moments in host memory (8 B/param: the policy's, and the critic's under
    --optimizer-cpu-offload) against `HOST_MOMENTS_SHARE` of this machine's memory; only for a cluster
    started here (with --ray-address the trainer's hosts are elsewhere) and a full-parameter run (LoRA's
    moments are the adapters')."""
    t, a = cfg.train, cfg.algorithm
    if not streamed or t.lora_rank or cfg.cluster.ray_address:
        return []
    moments = 8 * params * (2 if a.needs_critic and t.optimizer_cpu_offload else 1)
    host = host_bytes if host_bytes is not None else host_memory_bytes()
    if moments <= HOST_MOMENTS_SHARE * host:
        return []
    gib = 2 ** 30
    flag = "--optimizer-cpu-offload" if t.optimizer_cpu_offload else "--offload-train"
    return [f"{flag} keeps AdamW's moments in host memory: about {moments / gib:.1f} GiB (8 B/param, a "
            f"{params / 1e9:.2f}B-parameter model{', policy and critic' if moments > 8 * params else ''}) but this "
            f"machine has {host / gib:.1f} GiB, and the trainer, the engines and Ray need room beside them (the "
            f"moments may take {HOST_MOMENTS_SHARE:.0%}); run on a machine with more memory, train LoRA adapters "
            f"(--lora-rank), or spread the trainer over nodes of a cluster (--ray-address, --actor-num-nodes)"]
