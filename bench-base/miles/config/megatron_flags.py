"""The fates of Megatron-LM's flags that miles launch scripts pass, as data.

miles' launch scripts hand Megatron-LM a model description (`scripts/models/*.py`: `--num-layers 36
--hidden-size 2560 ...`) and its kernel switches (`--transformer-impl`, `--attention-backend`, ...).
Here the model comes from `--hf-checkpoint`'s config.json and the kernels are the backend's, so
each such flag gets one of these fates:

- `CHECKED` (architecture): the value is compared with --hf-checkpoint's config.json before anything
  starts (`miles.config.megatron_arch`): equal is accepted, different is exit 2 naming both values;
- `REQUIRED`: accepted with the one value this build runs (dropout 0, one expert rank, Adam, full
  per-layer recomputation); another value is a problem naming the flag and what to use here;
- `ACCEPTED`: a switch that only tunes Megatron-LM's kernels or memory; accepted, with its note in
  `--help` (it changes nothing here);
- `FAMILIES`: model families this build does not train (MoE, MLA, DSA, FP8/FP4, MTP, LoRA, and the
  rest of Megatron-LM's families: `miles.config.megatron_lm`), refused with one line per family.

The rest of Megatron-LM's flags (not in miles' scripts) have their fates in `miles.config.megatron_lm`;
this module takes its accepted ones (`LM_ACCEPTED`), its aliases and its families from there.

Each table maps a flag name (without dashes) to `MegatronFlag`; argparse reads `takes` (None: a
switch, else the value's type name). Pure data: imports nothing of miles above config.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import megatron_lm


@dataclass(frozen=True)
class MegatronFlag:
    takes: str | None          # None: a switch; "int" | "float" | "str" | "value": one value; "list": several (nargs)
    note: str                  # what the flag is (for --help and the docs' table)
    hf: str = ""               # CHECKED: what of config.json it must equal (miles.config.megatron_arch reads it)
    required: object = None    # REQUIRED: the one value this build runs


def _check(takes: str | None, hf: str, note: str) -> MegatronFlag:
    return MegatronFlag(takes, note, hf=hf)


# Megatron architecture flag -> the config.json value it must equal (a switch: the condition that must hold)
CHECKED: dict[str, MegatronFlag] = {
    "num-layers": _check("int", "num_hidden_layers", "decoder layers"),
    "hidden-size": _check("int", "hidden_size", "hidden size"),
    "ffn-hidden-size": _check("int", "intermediate_size", "MLP hidden size"),
    "num-attention-heads": _check("int", "num_attention_heads", "attention heads"),
    "num-query-groups": _check("int", "num_key_value_heads", "key/value heads (GQA groups)"),
    "group-query-attention": _check(None, "num_key_value_heads < num_attention_heads", "grouped-query attention"),
    "kv-channels": _check("int", "head_dim", "channels per attention head"),
    "qk-layernorm": _check(None, "q_norm/k_norm (model_type qwen3)", "RMSNorm on queries and keys"),
    "rotary-base": _check("float", "rope_theta", "RoPE base"),
    "rotary-percent": _check("float", "partial_rotary_factor", "share of head channels that RoPE rotates"),
    "use-rotary-position-embeddings": _check(None, "rope_theta present", "RoPE position embeddings"),
    "position-embedding-type": _check("str", "position_embedding_type", "rope or learned_absolute"),
    "use-rope-scaling": _check(None, "rope_scaling present", "RoPE scaling (Llama 3)"),
    "rotary-scaling-factor": _check("float", "rope_scaling.factor", "RoPE scaling factor"),
    "rope-scaling-factor": _check("float", "rope_scaling.factor", "RoPE scaling factor"),
    "rope-type": _check("str", "rope_scaling.rope_type yarn, else rope", "rope or yarn RoPE"),
    "max-position-embeddings": _check("int", "max_position_embeddings", "positions the model was trained for"),
    "normalization": _check("str", "normalization", "RMSNorm (rms_norm_eps) or LayerNorm (layer_norm_eps)"),
    "norm-epsilon": _check("float", "rms_norm_eps", "the norms' epsilon"),
    "swiglu": _check(None, "hidden_act silu", "SwiGLU MLP"),
    "disable-bias-linear": _check(None, "no attention_bias and no mlp_bias", "linear layers without biases"),
    "add-qkv-bias": _check(None, "q/k/v biases (model_type qwen2, or attention_bias)", "biases on q, k and v"),
    "untie-embeddings-and-output-weights": _check(None, "tie_word_embeddings false", "an LM head of its own"),
    "vocab-size": _check("int", "vocab_size", "vocabulary size"),
    "padded-vocab-size": _check("int", "vocab_size", "padded vocabulary size"),
}

_KERNELS = "tunes Megatron-LM's kernels; here the backend picks its own: no effect"

# kernel and memory switches: accepted, no effect here
ACCEPTED: dict[str, MegatronFlag] = {
    **{name: MegatronFlag(None, _KERNELS) for name in (
        "overlap-grad-reduce", "overlap-param-gather", "no-gradient-accumulation-fusion", "use-flash-attn",
        "no-masked-softmax-fusion", "no-bias-swiglu-fusion", "no-bias-dropout-fusion", "no-bias-gelu-fusion",
        "no-rope-fusion", "tp-comm-overlap", "no-persist-layer-norm", "cross-entropy-loss-fusion",
        "use-mcore-models", "no-create-attention-mask-in-dataloader", "attention-softmax-in-fp32")},
    "transformer-impl": MegatronFlag("str", "Megatron-LM's layer implementation (transformer_engine | local); "
                                            "--train-backend megatron uses Transformer Engine when installed: no effect"),
    "attention-backend": MegatronFlag("str", "Megatron-LM's attention kernel (flash | fused | unfused | auto); "
                                             "the backend picks its own: no effect"),
    "cp-comm-type": MegatronFlag("list", "how context-parallel ranks exchange keys and values (p2p | a2a | allgather); "
                                        "here CP ranks all-gather them: no effect"),
    "bf16": MegatronFlag(None, "Megatron-LM's bf16 training; here --dtype auto trains bf16 on GPUs: no effect"),
    "accumulate-allreduce-grads-in-fp32": MegatronFlag(None, "fp32 gradient accumulation; here gradients are "
                                                             "accumulated in fp32 already: no effect"),
    "use-distributed-optimizer": MegatronFlag(None, "Megatron's distributed optimizer; --train-backend megatron "
                                                    "always uses it: no effect"),
    "distributed-backend": MegatronFlag("str", "torch.distributed backend; here nccl on GPUs, gloo on the CPU: no effect"),
    "distributed-timeout-minutes": MegatronFlag("int", "collective timeout; here phase deadlines bound a hang "
                                                       "(--phase-timeout): no effect"),
    "ckpt-format": MegatronFlag("str", "Megatron checkpoint format; here saves are torch_dist (megatron) or "
                                       "safetensors (torch): no effect"),
    "seq-length": MegatronFlag("int", "Megatron-LM's buffer length; here micro-batches are as long as their "
                                      "longest sample: no effect"),
    "make-vocab-size-divisible-by": MegatronFlag("int", "vocabulary padding; here the vocabulary is "
                                                        "--hf-checkpoint's: no effect"),
    "balance-data": MegatronFlag(None, "miles: balances tokens across data-parallel ranks; here samples are "
                                       "split in order: no effect on the loss"),
    "train-memory-margin-bytes": MegatronFlag("int", "miles: memory kept free for the trainer; here the trainer "
                                                     "takes what it needs: no effect"),
}

# accepted with exactly one value (another value is a problem naming what to use)
REQUIRED: dict[str, MegatronFlag] = {
    "attention-dropout": MegatronFlag("float", "attention dropout; dropout is off here (logprobs must match the "
                                               "engine's)", required=0.0),
    "hidden-dropout": MegatronFlag("float", "hidden dropout; dropout is off here (logprobs must match the engine's)",
                                   required=0.0),
    "expert-model-parallel-size": MegatronFlag("int", "expert parallelism; not built here (Qwen3-MoE trains on one rank: "
                                                                  "docs/moe.md)", required=1),
    "expert-tensor-parallel-size": MegatronFlag("int", "expert tensor parallelism; not built here (docs/moe.md)",
                                                required=1),
    "optimizer": MegatronFlag("str", "Megatron's optimizer; here always AdamW (Megatron's adam)", required="adam"),
    "tokenizer-type": MegatronFlag("str", "Megatron-LM's tokenizer kind; here the tokenizer is --hf-checkpoint's "
                                          "(AutoTokenizer)", required="HuggingFaceTokenizer"),
    # full recomputation of every layer is --recompute-activations (miles.config.megatron_arch sets it)
    "recompute-granularity": MegatronFlag("str", "activation recomputation; full = --recompute-activations",
                                          required="full"),
    "recompute-method": MegatronFlag("str", "which layers recompute; uniform (every layer) = --recompute-activations",
                                     required="uniform"),
    "recompute-num-layers": MegatronFlag("int", "layers per recomputed chunk; 1 = --recompute-activations",
                                         required=1),
}

# Megatron switches that set one of this build's values: flag -> (RunConfig flag dest, value)
SETS: dict[str, tuple[str, object]] = {
    "calculate-per-token-loss": ("loss_agg_mode", "token_mean"),     # miles: mean over the global batch's tokens
    "fp16": ("dtype", "float16"),   # with another --dtype or --bf16: a problem (megatron_arch.precision_problems)
}
SETS_NOTES = {"calculate-per-token-loss": "miles: the loss is the mean over the batch's tokens = --loss-agg-mode token_mean",
              "fp16": "Megatron-LM's fp16 training = --dtype float16: float16 compute, float32 master weights and "
                      "AdamW state, dynamic loss scaling (--initial-loss-scale, --min-loss-scale, --loss-scale-window, "
                      "--hysteresis; --loss-scale fixes it); the torch backend only (tested on the CPU)"}

@dataclass(frozen=True)
class Family:
    prefixes: tuple[str, ...]  # every flag starting with one of these
    names: tuple[str, ...]     # and these
    line: str                  # what the family is in miles; what to use here


# the model families and Megatron-LM features this build does not train or run (miles.config.megatron_lm)
FAMILIES: dict[str, Family] = {name: Family(g.prefixes, tuple(g.flags), g.line)
                               for name, g in megatron_lm.FAMILIES.items()}
# the rest of Megatron-LM's kernel, memory, logging and I/O switches: accepted, no effect
LM_ACCEPTED: dict[str, MegatronFlag] = {
    name: MegatronFlag(None if kind == "switch" else "list" if kind == "list" else "value", line)
    for name, (kind, line) in megatron_lm.accepted().items()}
# Megatron-LM's other names of this build's flags: name -> the RunConfig flag dest it sets
ALIASES: dict[str, str] = {name: dest for name, (_, dest) in megatron_lm.ALIASES.items()}


def family_of(name: str) -> str | None:
    """The refused family a flag belongs to (`name` without dashes), or None."""
    for family, f in FAMILIES.items():
        if name in f.names or name.startswith(f.prefixes):
            return family
    return None


def megatron_options() -> dict[str, MegatronFlag]:
    """Every Megatron flag argparse takes: the checked, the required-value and the accepted ones, and the aliases."""
    return {**LM_ACCEPTED, **CHECKED, **REQUIRED, **ACCEPTED, **{n: MegatronFlag(None, SETS_NOTES[n]) for n in SETS},
            **{n: MegatronFlag("str", f"Megatron-LM's name of --{d.replace('_', '-')}") for n, d in ALIASES.items()}}


def help_text(name: str) -> str:
    """The --help line of a Megatron flag argparse takes."""
    if name in CHECKED:
        return f"{CHECKED[name].note}: checked, must equal --hf-checkpoint's config.json ({CHECKED[name].hf})"
    if name in REQUIRED:
        return f"{REQUIRED[name].note}: accepted with {REQUIRED[name].required} only"
    if name in SETS:
        return SETS_NOTES[name]
    if name in ALIASES:
        return f"Megatron-LM's name of --{ALIASES[name].replace('_', '-')}: the same"
    return f"accepted: {(ACCEPTED.get(name) or LM_ACCEPTED[name]).note}"


DEST_PREFIX = "megatron__"     # their argparse dests; never a RunConfig field


def dest(name: str) -> str:
    return DEST_PREFIX + name.replace("-", "_")
