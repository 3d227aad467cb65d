"""The command lines miles' own launch scripts build (radixark/miles @ 31f1ca96: `scripts/models/*.py`
for the model, `scripts/run_*.py` for the run) go through the parser: not one flag is unrecognized;
the Megatron architecture flags are checked against --hf-checkpoint's config.json (equal: accepted;
different: exit 2 naming both values); the kernel switches are accepted; what this build does not do
is refused with one line each (what stays refused of the Qwen3 scripts: --use-miles-dashboard, and with
W&B on --disable-wandb-random-suffix).

The flags and values below are copied from those scripts (the normal mode of each, paths made local),
and the config.json values from the HF models they describe.
"""

from __future__ import annotations

import json
import shlex

import pytest

from miles.config import ConfigError
from miles.config.flags import parse_flags
from miles.config.megatron_arch import hf_value
from miles.config.megatron_flags import CHECKED

# scripts/models/qwen3-4B.py: model_args()
QWEN3_4B_MODEL = ("--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32 "
                  "--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings "
                  "--disable-bias-linear --normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 "
                  "--vocab-size 151936 --kv-channels 128 --qk-layernorm")
# scripts/models/llama3.1-8B-Instruct.py: model_args()
LLAMA31_8B_MODEL = ("--swiglu --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
                    "--group-query-attention --num-query-groups 8 --max-position-embeddings 131072 "
                    "--use-rotary-position-embeddings --disable-bias-linear --normalization RMSNorm "
                    "--norm-epsilon 1e-5 --rotary-base 500000 --vocab-size 128256 --kv-channels 128 "
                    "--use-rope-scaling --rotary-scaling-factor 8.0 --untie-embeddings-and-output-weights")
# Qwen/Qwen3-4B and meta-llama/Llama-3.1-8B-Instruct config.json (the architecture's keys)
QWEN3_4B_CONFIG = {"model_type": "qwen3", "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 9728,
                   "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
                   "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": True, "vocab_size": 151936}
LLAMA31_8B_CONFIG = {"model_type": "llama", "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                     "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                     "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "vocab_size": 128256}

# scripts/run_qwen3_4b.py, execute() with the defaults (megatron, normal mode, eval on, KL loss on)
RUN_QWEN3_4B = (
    "--hf-checkpoint {model} --save {out}/checkpoints --save-interval 20 --load {model}_torch_dist "
    "--ref-load {model}_torch_dist --save-retain-interval 20 "
    "--prompt-data {data} --input-key prompt --label-key label --apply-chat-template --rollout-shuffle "
    "--rm-type math --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8 "
    "--rollout-max-response-len 8192 --rollout-temperature 1 --global-batch-size 256 --balance-data "
    "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 "
    "--advantage-estimator grpo --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28 "
    "--use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl "
    "--use-dynamic-batch-size --max-tokens-per-gpu 9216 "
    "--eval-interval 20 --eval-prompt-data aime {data} --n-samples-per-eval-prompt 16 "
    "--eval-max-response-len 16384 --eval-top-p 1 "
    "--rollout-num-gpus-per-engine 1 --sglang-chunked-prefill-size 4096 "
    "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 "
    "--context-parallel-size 4 --cp-comm-type a2a --expert-model-parallel-size 1 --expert-tensor-parallel-size 1 "
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 "
    "--attention-softmax-in-fp32 --attention-backend flash --train-memory-margin-bytes 3221225472 "
    "--sglang-mem-fraction-static 0.7 --actor-num-nodes 1 --actor-num-gpus-per-node 8 --num-gpus-per-node 8 "
    "--colocate --use-fault-tolerance --dump-details {out}/dump_details")
# run_qwen3_4b.py with --train-fp8: what it adds
FP8 = "--transformer-impl transformer_engine --bf16 --fp8-format e4m3 --fp8-recipe blockwise --fp8-param-gather"
# scripts/run_qwen3_dense.py (Qwen3-32B: optimizer offload and pinned CUDA graph sizes)
RUN_QWEN3_DENSE = (
    "--hf-checkpoint {model} --ref-load {model}_torch_dist --load {out}/checkpoints --save {out}/checkpoints "
    "--save-interval 20 --prompt-data {data} --input-key prompt --label-key label --apply-chat-template "
    "--rollout-shuffle --rm-type deepscaler --num-rollout 5 --rollout-batch-size 32 --n-samples-per-prompt 8 "
    "--rollout-max-response-len 8192 --rollout-temperature 1 --global-batch-size 256 --balance-data "
    "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 "
    "--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer "
    "--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00 "
    "--eps-clip 0.2 --eps-clip-high 0.28 "
    "--tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1 "
    "--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 --recompute-granularity full "
    "--recompute-method uniform --recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 20480 "
    "--eval-interval 20 --eval-prompt-data aime {data} --n-samples-per-eval-prompt 16 --eval-max-response-len 16384 "
    "--eval-top-p 1 --rollout-num-gpus-per-engine 8 --sglang-mem-fraction-static 0.7 "
    "--sglang-cuda-graph-bs 1 2 4 8 16 24 32 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 "
    "--attention-backend flash --colocate --actor-num-nodes 1 --actor-num-gpus-per-node 8 --num-gpus-per-node 8 "
    "--use-miles-dashboard --dump-details {out}/dump_details")
# scripts/run_qwen3_0_6b_fsdp.py: the FSDP backend's flags
RUN_FSDP = (
    "--hf-checkpoint {model} --ref-load {model} --prompt-data {data} --input-key prompt --label-key label "
    "--apply-chat-template --rollout-shuffle --balance-data --rm-type deepscaler --num-rollout 3000 "
    "--rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 4096 --rollout-temperature 1 "
    "--global-batch-size 256 --use-kl-loss --advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl "
    "--kl-coef 0.00 --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28 --optimizer adam --lr 1e-6 "
    "--lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 "
    "--rollout-num-gpus-per-engine 1 --sglang-decode-log-interval 1000 --sglang-mem-fraction-static 0.75 "
    "--sglang-attention-backend fa3 --sglang-chunked-prefill-size 4096 --train-backend fsdp "
    "--update-weight-buffer-size 536870912 --gradient-checkpointing --attn-implementation flash_attention_3 "
    "--use-dynamic-batch-size --max-tokens-per-gpu 9216 --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate "
    "--use-fault-tolerance")
# scripts/run_qwen3_sft.py (Qwen3-4B-Base): SFT without engines, on a Megatron checkpoint
RUN_SFT = (
    "--hf-checkpoint {model} --ref-load {model}_torch_dist --load {out}/checkpoints --save {out}/checkpoints "
    "--save-interval 1000 --prompt-data {data} --input-key messages --rollout-shuffle --num-epoch 3 "
    "--rollout-batch-size 128 --global-batch-size 128 --loss-type sft_loss --calculate-per-token-loss "
    "--disable-compute-advantages-and-returns --debug-train-only "
    "--tensor-model-parallel-size 1 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1 "
    "--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 --recompute-granularity full "
    "--recompute-method uniform --recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 9216 "
    "--optimizer adam --lr 1e-5 --lr-decay-style cosine --min-lr 1e-6 --lr-warmup-fraction 0.1 --weight-decay 0.1 "
    "--adam-beta1 0.9 --adam-beta2 0.95 --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 --attention-backend flash "
    "--actor-num-nodes 1 --actor-num-gpus-per-node 8 --num-gpus-per-node 8")
# miles/utils/external_utils/command_utils.py get_default_wandb_args(): what every run script adds when
# WANDB_API_KEY is set
WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"
WANDB = (f"--use-wandb --wandb-project miles-run_qwen3_4b --wandb-group 250101-000000 --wandb-key '{WANDB_KEY}' "
         "--disable-wandb-random-suffix")


def command(tmp_path, model_args: str, run: str, config: dict, extra: str = "") -> list[str]:
    model = tmp_path / "Qwen3-4B"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    (tmp_path / "dapo.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n' * 32)
    line = f"{model_args} {run} {extra}".format(model=model, out=tmp_path / "out", data=tmp_path / "dapo.jsonl")
    return shlex.split(line)


def problems_of(argv: list[str]) -> list[str]:
    """The exit-2 problems; a bare argparse error (SystemExit) fails the test."""
    with pytest.raises(ConfigError) as info:
        parse_flags(argv)
    return info.value.problems


def refused_flags(problems: list[str]) -> list[str]:
    return [p.split(" is a miles flag")[0].split(" are miles flags")[0] for p in problems
            if "miles flag" in p and "this build does not take" in p]


@pytest.mark.parametrize("run,refused", [
    (RUN_QWEN3_4B, []),
    (RUN_QWEN3_DENSE, ["--use-miles-dashboard"]),
])
def test_the_qwen3_scripts_command_lines_parse_with_their_model_checked(tmp_path, run, refused):
    problems = problems_of(command(tmp_path, QWEN3_4B_MODEL, run, QWEN3_4B_CONFIG))
    assert sorted(refused_flags(problems)) == sorted(refused)
    # the rest is this build's own checks of the values (GPUs, the megatron backend): no architecture mismatch
    assert not [p for p in problems if "differs from --hf-checkpoint" in p], problems


def test_the_llama_model_file_is_checked_equal_and_every_kernel_switch_accepted(tmp_path):
    argv = command(tmp_path, LLAMA31_8B_MODEL, "", LLAMA31_8B_CONFIG,
                   "--hf-checkpoint {model} --prompt-data {data} --rollout-batch-size 2 --num-rollout 1 --n-samples-per-prompt 8 "
                   "--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 "
                   "--attention-softmax-in-fp32 --attention-backend flash --transformer-impl transformer_engine "
                   "--bf16 --overlap-grad-reduce --no-gradient-accumulation-fusion --use-flash-attn "
                   "--optimizer adam --recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    cfg, _ = parse_flags(argv)
    assert cfg.train.recompute_activations          # Megatron's full per-layer recomputation is ours
    # every architecture flag of the model file was compared with config.json, not skipped
    given = {a[2:] for a in shlex.split(LLAMA31_8B_MODEL) if a.startswith("--")}
    assert given <= set(CHECKED)


def test_the_fsdp_scripts_flags_have_their_fates(tmp_path):
    problems = problems_of(command(tmp_path, "", RUN_FSDP, QWEN3_4B_CONFIG))
    # miles' fsdp backend is --train-backend torch; --gradient-checkpointing is --recompute-activations
    assert refused_flags(problems) == []
    # --rm-type deepscaler is graded here (miles.rollout.math_grading): no problem with it
    assert not [p for p in problems if "--rm-type" in p], problems
    cfg, _ = parse_flags(command(tmp_path, "", "--hf-checkpoint {model} --prompt-data {data} --rollout-batch-size 2 --num-rollout 1 --n-samples-per-prompt 8 "
                                 "--gradient-checkpointing --log-probs-chunk-size 512", QWEN3_4B_CONFIG))
    assert cfg.train.recompute_activations and cfg.train.log_probs_chunk_size == 512


def test_the_fsdp_scripts_run_flags_are_taken_with_miles_meaning(tmp_path):
    cfg, _ = parse_flags(command(tmp_path, "", "--hf-checkpoint {model} --prompt-data {data} --rollout-batch-size 2 "
                                 "--num-rollout 1 --n-samples-per-prompt 8 --eval-prompt-data aime {data} "
                                 "--eval-top-p 1 --use-fault-tolerance --attn-implementation flash_attention_3 "
                                 "--dump-details {out}/dump_details", QWEN3_4B_CONFIG))
    assert (cfg.eval.top_p, cfg.rollout.use_fault_tolerance, cfg.train.attn_implementation) == \
        (1.0, True, "flash_attention_3")
    assert cfg.debug_rollout_data_path == f"{tmp_path}/out/dump_details/rollout_data/{{rollout_id}}.pt"
    assert cfg.debug_train_data_path == f"{tmp_path}/out/dump_details/train_data/{{rollout_id}}_{{rank}}.pt"


def test_the_sft_scripts_flags_have_their_fates(tmp_path):
    problems = problems_of(command(tmp_path, QWEN3_4B_MODEL, RUN_SFT, QWEN3_4B_CONFIG))
    assert refused_flags(problems) == []
    # --disable-compute-advantages-and-returns with sft_loss is what SFT does here; what stays is the rest:
    # miles' SFT replays no saved rollouts (--debug-train-only needs --load-debug-rollout-data here)
    assert not [p for p in problems if "--disable-compute-advantages-and-returns" in p], problems
    assert [p for p in problems if p.startswith("--debug-train-only")], problems


def test_the_scripts_wandb_flags_take_the_key_and_never_echo_it(tmp_path):
    problems = problems_of(command(tmp_path, QWEN3_4B_MODEL, RUN_QWEN3_4B, QWEN3_4B_CONFIG, WANDB))
    assert refused_flags(problems) == []
    assert WANDB_KEY not in "\n".join(problems)


def test_a_megatron_run_takes_megatron_to_hf_mode_and_names_what_it_cannot_dump(tmp_path):
    problems = problems_of(command(tmp_path, QWEN3_4B_MODEL, RUN_QWEN3_4B, QWEN3_4B_CONFIG,
                                   "--train-backend megatron --megatron-to-hf-mode bridge"))
    assert refused_flags(problems) == []
    assert not [p for p in problems if "--megatron-to-hf-mode" in p], problems
    # its ranks do not write train batches: --dump-details says so (the rollouts alone: --save-debug-rollout-data)
    assert [p for p in problems if p.startswith("--dump-details: not supported by --train-backend megatron yet")]


@pytest.mark.parametrize("flag,value,hf", [("--num-layers", "40", "num_hidden_layers: 36"),
                                           ("--rotary-base", "10000", "rope_theta: 1000000"),
                                           ("--kv-channels", "64", "head_dim: 128")])
def test_a_wrong_architecture_flag_exits_2_naming_both_values(tmp_path, flag, value, hf):
    model_args = QWEN3_4B_MODEL.replace(f"{flag} {hf.split(': ')[1]}", f"{flag} {value}")
    assert model_args != QWEN3_4B_MODEL
    argv = command(tmp_path, model_args, "--hf-checkpoint {model} --prompt-data {data} --rollout-batch-size 2 --num-rollout 1 --n-samples-per-prompt 8",
                   QWEN3_4B_CONFIG)
    problems = problems_of(argv)
    assert [p for p in problems if p.startswith(f"{flag} {value} differs from --hf-checkpoint's config.json ({hf})")]
    assert len(problems) == 1, problems


def test_a_switch_the_hf_model_contradicts_is_named(tmp_path):
    # Qwen3-4B ties its embeddings: a script saying otherwise describes another model
    argv = command(tmp_path, QWEN3_4B_MODEL + " --untie-embeddings-and-output-weights",
                   "--hf-checkpoint {model} --prompt-data {data} --rollout-batch-size 2 --num-rollout 1 --n-samples-per-prompt 8", QWEN3_4B_CONFIG)
    assert problems_of(argv) == [
        "--untie-embeddings-and-output-weights given differs from --hf-checkpoint's config.json (tie_word_embeddings "
        f"false: no): the model is built from {tmp_path / 'Qwen3-4B' / 'config.json'}; fix the flag, or point "
        "--hf-checkpoint at the model the script describes"]


def test_the_architecture_keys_of_a_config_file_are_checked_too(tmp_path):
    argv = command(tmp_path, "", "--hf-checkpoint {model} --prompt-data {data} --rollout-batch-size 2 --num-rollout 1 --n-samples-per-prompt 8", QWEN3_4B_CONFIG)
    (tmp_path / "run.yaml").write_text("num-layers: 36\nhidden_size: 2560\nqk-layernorm: true\n")
    parse_flags(argv + ["--config", str(tmp_path / "run.yaml")])
    (tmp_path / "run.yaml").write_text("num-layers: 28\n")
    assert problems_of(argv + ["--config", str(tmp_path / "run.yaml")])[0].startswith("--num-layers 28 differs")


def test_hf_values_read_transformers_5_rope_parameters():
    cfg = {**LLAMA31_8B_CONFIG, "rope_parameters": {"rope_theta": 500000.0, **LLAMA31_8B_CONFIG["rope_scaling"]}}
    del cfg["rope_theta"], cfg["rope_scaling"]
    assert (hf_value("rotary-base", cfg), hf_value("rotary-scaling-factor", cfg), hf_value("use-rope-scaling", cfg)) \
        == (500000.0, 8.0, True)


def test_log_probs_chunk_size_is_the_chunked_logprob_paths_rows(tmp_path):
    from contextlib import nullcontext

    import torch
    from transformers import AutoModelForCausalLM

    from miles.algorithms.fused_logprobs import DEFAULT_CHUNK_ROWS
    from miles.training.torch.forward import pick_forward
    from tests.tiny_model import make_tiny_model

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m"))
    pick = dict(temperature=1.0, autocast=nullcontext, compute_dtype=torch.float32, hidden=True)
    chunked, name = pick_forward(model, chunk_rows=512, **pick)
    assert name == "hidden" and chunked.args[3] == 512
    assert pick_forward(model, **pick)[0].args[3] == DEFAULT_CHUNK_ROWS     # miles' unset: the default


# Flags of later miles scripts (Gemma-4, DeepSeek-V3.2/V4, GLM-4/4.5/5, Kimi-K2.5, Qwen3.5; issue 56) that ended in
# a bare "unrecognized arguments": each now has a fate. Values as those scripts pass them.
LATER_SCRIPTS_REFUSED = (
    "--allgather-cp --data-pad-size-multiplier 128 --experts-shared-outer-loras "
    "--extra-high-precision-layers-hf .kv_b_proj. --extra-high-precision-layers-megatron .linear_kv_up_proj. "
    "--use-distributed-post --use-rollout-indexer-replay")
LATER_MODEL_FLAGS = (   # Megatron-LM forks' architecture flags (scripts/models/deepseek-v4-flash.py, glm4-32B.py, ...)
    "--attention-output-gate --beta-fast 32 --beta-slow 1 --experimental-attention-variant dsv4 --dsv4-hc-mult 4 "
    "--dsv4-hc-sinkhorn-iters 20 --dsv4-compress-ratios 0,4,128 --dsv4-compress-rope-theta 160000 --dsv4-o-groups 8 "
    "--dsv4-o-lora-rank 1024 --dsv4-n-hash-layers 3 --dsv4-window-size 128 --freeze-e-score-correction-bias "
    "--no-activation-func-clamp-shared-expert --original-max-position-embeddings 65536 --post-mlp-layernorm "
    "--post-self-attn-layernorm --te-precision-config-file precision.yaml")


def test_the_later_scripts_flags_are_refused_each_with_what_to_use(tmp_path):
    base = "--hf-checkpoint {model} --prompt-data {data} --rollout-batch-size 2 --num-rollout 1 --n-samples-per-prompt 8 "
    problems = problems_of(command(tmp_path, "", base + LATER_SCRIPTS_REFUSED, QWEN3_4B_CONFIG))
    assert sorted(refused_flags(problems)) == sorted(a for a in LATER_SCRIPTS_REFUSED.split() if a.startswith("--"))
    assert all("drop it" in p for p in problems), problems
    problems = problems_of(command(tmp_path, "", base + LATER_MODEL_FLAGS, QWEN3_4B_CONFIG))
    text = "\n".join(problems)
    by_family = {"DeepSeek-V4": ["--experimental-attention-variant", "--dsv4-hc-mult", "--dsv4-window-size",
                                 "--no-activation-func-clamp-shared-expert"],
                 "architecture variants": ["--attention-output-gate", "--beta-fast", "--beta-slow",
                                           "--original-max-position-embeddings", "--post-mlp-layernorm",
                                           "--post-self-attn-layernorm"],
                 "MoE": ["--freeze-e-score-correction-bias"], "FP8/FP4": ["--te-precision-config-file"]}
    for family, flags in by_family.items():
        line = next(p for p in problems if f"take: {family}:" in p)
        assert all(f in line.split(" are miles flags")[0].split(" is a miles flag")[0] for f in flags), (family, line)
    assert len(problems) == len(by_family), problems      # one line per family; no value read as a flag
    assert "unrecognized" not in text


def test_the_no_offload_forms_and_the_chunk_size_are_miles(tmp_path):
    base = ("--hf-checkpoint {model} --prompt-data {data} --rollout-batch-size 2 --num-rollout 1 "
            "--n-samples-per-prompt 8 ")
    c = parse_flags(command(tmp_path, "", base, QWEN3_4B_CONFIG))[0].cluster
    assert (c.offloads_train, c.offloads_rollout) == (False, False)
    c = parse_flags(command(tmp_path, "", base + "--colocate", QWEN3_4B_CONFIG))[0].cluster
    assert c.offloads_rollout                                       # --colocate frees the engines' memory
    c = parse_flags(command(tmp_path, "", base + "--colocate --no-offload-rollout", QWEN3_4B_CONFIG))[0].cluster
    assert not c.offloads_rollout                                   # the explicit off wins (miles')
    c = parse_flags(command(tmp_path, "", base + "--offload --no-offload-train", QWEN3_4B_CONFIG))[0].cluster
    assert (c.offloads_train, c.offloads_rollout) == (False, True)
    cfg, _ = parse_flags(command(tmp_path, "", base + "--offload-train --offload-train-disk-chunk-mb 256",
                                 QWEN3_4B_CONFIG))
    assert cfg.train.offload_chunk_mb == 256 and cfg.cluster.offloads_train
    problems = problems_of(command(tmp_path, "", base + "--offload-train-disk-chunk-mb 0", QWEN3_4B_CONFIG))
    assert problems == ["--offload-train-disk-chunk-mb 0: must be a positive integer"]


# --- mixture of experts: miles' Qwen3-30B-A3B scripts (radixark/miles scripts/models/qwen3-30B-A3B.sh, with
# MODEL_ARGS_ROTARY_BASE=1000000, the model's rope_theta; and scripts/run-qwen3-30B-A3B.sh) ---------------
QWEN3_30B_A3B_MODEL = (
    "--disable-bias-linear --qk-layernorm --group-query-attention --num-attention-heads 32 --num-query-groups 4 "
    "--kv-channels 128 --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --normalization RMSNorm "
    "--position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 1.0 --swiglu "
    "--untie-embeddings-and-output-weights --vocab-size 151936 --rotary-base 1000000 "
    "--moe-ffn-hidden-size 768 --moe-router-score-function softmax --moe-token-dispatcher-type alltoall "
    "--moe-router-topk 8 --moe-layer-freq [" + ",".join(["1"] * 48) + "] --num-experts 128 --moe-grouped-gemm "
    "--moe-token-drop-policy probs --moe-router-dtype fp32 --moe-permute-fusion --moe-aux-loss-coeff 0")
RUN_QWEN3_30B_A3B = (
    "--hf-checkpoint {model} --ref-load {model}_torch_dist --load {out}/ckpt --save {out}/ckpt --save-interval 20 "
    "--prompt-data {data} --input-key prompt --label-key label --apply-chat-template "
    "--apply-chat-template-kwargs '{{\"enable_thinking\":false}}' --rollout-shuffle --rm-type math --num-rollout 3000 "
    "--rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 8192 --rollout-temperature 0.8 "
    "--global-batch-size 256 --balance-data "
    "--eval-interval 20 --eval-prompt-data aime {data} --n-samples-per-eval-prompt 16 --eval-max-response-len 16384 "
    "--eval-top-p 0.7 "
    "--tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1 "
    "--expert-model-parallel-size 8 --expert-tensor-parallel-size 1 --recompute-granularity full "
    "--recompute-method uniform --recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 20480 "
    "--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00 "
    "--eps-clip 0.2 --eps-clip-high 0.28 "
    "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 "
    "--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer "
    "--rollout-num-gpus-per-engine 8 --sglang-mem-fraction-static 0.7 --sglang-cuda-graph-bs 1 2 4 8 "
    + " ".join(str(n) for n in range(16, 257, 8)) + " "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 "
    "--attention-backend flash --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate")
# Qwen/Qwen3-30B-A3B config.json (the architecture's keys)
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False, "vocab_size": 151936,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": []}


def test_the_qwen3_30b_a3b_scripts_parse_with_the_moe_architecture_checked(tmp_path):
    problems = problems_of(command(tmp_path, QWEN3_30B_A3B_MODEL, RUN_QWEN3_30B_A3B + " --train-backend megatron",
                                   QWEN3_30B_A3B_CONFIG))
    assert refused_flags(problems) == []                   # every flag of both scripts has its fate here
    assert not [p for p in problems if "differs from --hf-checkpoint" in p], problems
    # what stays is this build's own checks of the values, each naming its flag: the engines (SGLang's flags
    # without --rollout-engine sglang, 8 GPUs per engine), the missing checkpoint folder, and what
    # --train-backend megatron does not do yet (token-budget micro-batches, optimizer offload, sequence parallelism)
    named = {p.split(" ", 1)[0].rstrip(":,") for p in problems}
    assert named == {"--rollout-num-gpus-per-engine", "--sglang-<flag>", "--ref-load", "--use-dynamic-batch-size",
                     "--max-tokens-per-gpu", "--optimizer-cpu-offload", "--sequence-parallel"}, problems
    cfg_argv = command(tmp_path, QWEN3_30B_A3B_MODEL, "", QWEN3_30B_A3B_CONFIG,
                       "--hf-checkpoint {model} --prompt-data {data} --rollout-batch-size 2 --num-rollout 1 "
                       "--n-samples-per-prompt 8 --train-backend megatron --expert-model-parallel-size 8")
    cfg, _ = parse_flags(cfg_argv)
    assert (cfg.train.moe_router_dtype, cfg.train.moe_aux_loss_coeff, cfg.train.expert_model_parallel_size) == \
        ("fp32", 0.0, 8)


@pytest.mark.parametrize("flag,value,hf", [
    ("--num-experts", "64", "num_experts: 128"), ("--moe-router-topk", "4", "num_experts_per_tok: 8"),
    ("--moe-ffn-hidden-size", "1536", "moe_intermediate_size: 768"),
    ("--moe-layer-freq", "2", "[1, 0, 1, 0"),                        # every 2nd layer; the model's are all MoE
    ("--moe-layer-freq", "([0]+[1]*3)*12", "[1, 1, 1, 1"),           # list arithmetic, as Megatron-LM evaluates it
    ("--moe-router-pre-softmax", None, "norm_topk_prob false: no"),  # the model renormalises its top-k
])
def test_a_wrong_moe_architecture_flag_exits_2_naming_both_values(tmp_path, flag, value, hf):
    extra = f"{flag} {value}" if value else flag
    argv = command(tmp_path, "", "", QWEN3_30B_A3B_CONFIG,
                   "--hf-checkpoint {model} --prompt-data {data} --rollout-batch-size 2 --num-rollout 1 "
                   "--n-samples-per-prompt 8 " + extra)
    problems = [p for p in problems_of(argv) if "differs from --hf-checkpoint" in p]
    assert len(problems) == 1 and problems[0].startswith(flag) and hf in problems[0], problems


def test_moe_flags_against_a_dense_model_and_a_sigmoid_router_are_named(tmp_path):
    argv = command(tmp_path, "", "", QWEN3_4B_CONFIG,
                   "--hf-checkpoint {model} --prompt-data {data} --rollout-batch-size 2 --num-rollout 1 "
                   "--n-samples-per-prompt 8 --num-experts 8 --moe-router-score-function sigmoid")
    problems = problems_of(argv)
    assert any(p.startswith("--num-experts 8 differs") and "num_experts: not set" in p for p in problems), problems
    assert any(p.startswith("--moe-router-score-function sigmoid") and "only softmax" in p for p in problems), problems
