#!/usr/bin/env bash
# GRPO on Qwen2.5-0.5B-Instruct with SGLang rollouts, on a GPU machine with SGLang installed.
#
# Needs: one or more NVIDIA GPUs; SGLang 0.5.23 built for your CUDA (`pip install "sglang[all]==0.5.23"`,
# see docs/sglang.md); miles with the sglang extra (`pip install -e ".[sglang]"`, which brings
# sglang-router and aiohttp). The model is a local HF folder or a hub id SGLang and transformers can fetch.
# Data: the arithmetic demo's prompts (examples/arithmetic/data), scored by the math rule reward.
#
# Usage: bash scripts/run-qwen2.5-0.5b-sglang.sh [extra miles flags ...]
#   MODEL=/models/Qwen2.5-0.5B-Instruct  ENGINES=2  RUN_DIR=runs/qwen-sglang  bash scripts/run-qwen2.5-0.5b-sglang.sh
# Every SGLang server flag can be passed as --sglang-<flag> (e.g. --sglang-mem-fraction-static 0.5).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
ENGINES=${ENGINES:-1}
RUN_DIR=${RUN_DIR:-runs/qwen2.5-0.5b-sglang}

"$PY" -c "import sglang, sglang_router, aiohttp; print('sglang', sglang.__version__)" || {
  echo "needs SGLang, sglang-router and aiohttp: pip install 'sglang[all]==0.5.23' && pip install -e '.[sglang]'" >&2
  exit 2
}
nvidia-smi -L >/dev/null || { echo "needs an NVIDIA GPU (SGLang serves on CUDA)" >&2; exit 2; }

# One GPU holds the SGLang server(s) and the trainer: the servers take a fixed share of its memory
# (--sglang-mem-fraction-static), the trainer the rest. With several GPUs, raise ENGINES.
exec "$PY" -m miles.cli train \
  --hf-checkpoint "$MODEL" --device cuda --dtype bfloat16 \
  --prompt-data examples/arithmetic/data/train.jsonl --input-key input --label-key label \
  --apply-chat-template --rm-type math --rollout-shuffle --loss-agg-mode token_mean \
  --eval-prompt-data arith examples/arithmetic/data/eval.jsonl --eval-interval 10 --eval-temperature 0 \
  --rollout-engine sglang --rollout-num-engines "$ENGINES" --rollout-num-gpus-per-engine 1 \
  --sglang-mem-fraction-static 0.35 --sglang-router-policy cache_aware \
  --rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 64 --rollout-temperature 1.0 \
  --num-rollout 50 --global-batch-size 256 --micro-batch-size 32 --lr 1e-6 \
  --advantage-estimator grpo --eps-clip 0.2 --seed 0 \
  --check-weight-update-equal \
  --run-dir "$RUN_DIR" "$@"
