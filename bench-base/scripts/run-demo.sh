#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: GRPO on the arithmetic demo, on the CPU with a
# local Ray cluster, from the tiny base model in examples/arithmetic/base_model. Prints greedy eval
# accuracy before and after. Extra flags are passed to the trainer (e.g. --num-rollout 10).
# Usage: bash scripts/run-demo.sh [flags ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=python; [ -z "${VIRTUAL_ENV:-}" ] && PY=.venv/bin/python
run_dir=${MILES_DEMO_RUN_DIR:-runs/demo}
rm -rf "$run_dir"
"$PY" -m miles.cli train --config examples/arithmetic/grpo.yaml --run-dir "$run_dir" \
  --save "$run_dir/checkpoints" --save-interval 20 "$@"
"$PY" examples/arithmetic/summarize.py "$run_dir"
