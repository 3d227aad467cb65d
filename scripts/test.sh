#!/usr/bin/env bash
# Set up (scripts/setup.sh with the dev and tensorboard extras) and run the whole test suite on the CPU.
# Usage: bash scripts/test.sh [pytest args ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev tensorboard      # tensorboard: the --use-tensorboard tests run, not skip
PY=python; [ -z "${VIRTUAL_ENV:-}" ] && PY=.venv/bin/python
# the default run (CI) leaves out the tests marked extended (each repeats a path the others cover, at
# 1-2 min each on 2 cores); `bash scripts/test.sh -m extended` runs them, `-m ""` runs everything.
# Two pytest-xdist workers (MILES_TEST_WORKERS; `-n 0` runs in this process), each taking whole files
# in the order they are collected (the end-to-end folders first, then the many short unit files that
# even out the end), each with its own local Ray cluster: run alone, an end-to-end file keeps the two
# cores 82% busy (tests/faults/test_bad_input.py) and the unit folder 57%; beside each other they fill them.
exec "$PY" -m pytest -q -p no:cacheprovider --timeout=900 --durations=40 -m "not extended" \
    -n "${MILES_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
