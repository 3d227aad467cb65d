#!/usr/bin/env bash
# Makes docs/img/reward-curve-tiny.png with the project's own commands: a GRPO run of the tests'
# tiny random model (tests/tiny_model.py) on the addition prompts, rewarded for writing 7s
# (docs/img/reward_seven.py, a reward such a model can learn in a few dozen rollouts), then
# `miles plot`. Eval pass@1 there: greedy answers with at least one 7. About a minute on a 2-core
# CPU. Usage: bash docs/img/make-reward-curve.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=python; [ -z "${VIRTUAL_ENV:-}" ] && PY=.venv/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -c "
import sys; sys.path.insert(0, '.')
from pathlib import Path
from tests.tiny_model import make_tiny_model
from tests.conftest import write_addition_task
make_tiny_model('$work/model'); write_addition_task(Path('$work'))"
"$PY" -m miles.cli train --hf-checkpoint "$work/model" --prompt-data "$work/train.jsonl" --label-key label \
  --rollout-batch-size 8 --n-samples-per-prompt 8 --rollout-max-response-len 6 --num-rollout 30 --lr 1e-3 \
  --use-kl-loss --kl-loss-coef 0.01 --kl-loss-type k3 --rollout-shuffle --loss-agg-mode token_mean --custom-rm-path docs/img/reward_seven.py:seven \
  --eval-prompt-data add "$work/eval.jsonl" --eval-interval 5 --run-dir "$work/run" --progress plain --ray-num-cpus 2
"$PY" -m miles.cli plot "$work/run" -o docs/img/reward-curve-tiny.png \
  --title "GRPO, tiny random model, reward: share of 7s in the answer (docs/img/make-reward-curve.sh)"
