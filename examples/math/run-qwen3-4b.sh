#!/usr/bin/env bash
# GRPO on the math recipe's prompts with Qwen3-4B, miles' way: the chat template (Qwen3 thinks, then
# answers), --rm-type deepscaler (the box after </think> against the label, graded by math-verify),
# and an eval with pass@k (pass@1 .. pass@8 with --log-passrate).
#   bash examples/math/run-qwen3-4b.sh /path/to/Qwen3-4B [OUT_DIR]
# Needs one GPU and SGLang (docs/sglang.md); on more GPUs raise --actor-num-gpus-per-node and
# --rollout-num-gpus. Swap in DAPO-Math-17k or DeepScaleR's prompts with --prompt-data (their keys: --input-key
# prompt --label-key label as converted for miles) and AIME with --eval-prompt-data.
set -euo pipefail
MODEL=${1:?usage: run-qwen3-4b.sh /path/to/Qwen3-4B [OUT_DIR]}
OUT=${2:-runs/math-qwen3-4b}
HERE=$(cd "$(dirname "$0")" && pwd)

miles train \
  --hf-checkpoint "$MODEL" \
  --prompt-data "$HERE/data/train.jsonl" --input-key prompt --label-key label \
  --apply-chat-template --rollout-shuffle \
  --rm-type deepscaler \
  --num-rollout 100 --rollout-batch-size 32 --n-samples-per-prompt 8 \
  --rollout-max-response-len 4096 --rollout-temperature 1 \
  --global-batch-size 256 --micro-batch-size 4 \
  --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 \
  --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00 \
  --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 \
  --eval-prompt-data math-eval "$HERE/data/eval.jsonl" --n-samples-per-eval-prompt 8 \
  --eval-max-response-len 8192 --eval-interval 10 --log-passrate \
  --rollout-engine sglang --rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.6 \
  --actor-num-nodes 1 --actor-num-gpus-per-node 1 --colocate \
  --save "$OUT/checkpoints" --save-interval 20 --run-dir "$OUT"
