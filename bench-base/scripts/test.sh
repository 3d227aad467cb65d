#!/usr/bin/env bash
# Set up (scripts/setup.sh with the dev and tensorboard extras) and run the whole test suite on the CPU.
# Usage: bash scripts/test.sh [pytest args ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev tensorboard      # tensorboard: the --use-tensorboard tests run, not skip
PY=python; [ -z "${VIRTUAL_ENV:-}" ] && PY=.venv/bin/python
# the default run (CI) leaves out the tests marked extended (each repeats a path the others cover, at
# 1-2 min each on 2 cores); `bash scripts/test.sh -m extended` runs them, `-m ""` runs everything.
# Two pytest-xdist workers (the dev extra): one runs the end-to-end tests in order, the other the unit
# files beside it (the scheduler is tests/conftest.py's pytest_xdist_make_scheduler). An end-to-end run
# alone keeps the two cores ~81% busy, so two of them side by side only share the cores; the unit files
# fill the rest (docs/performance.md, "The test suite on 2 cores"). `-n 0` runs in this one process (for
# -s, --pdb or a single test).
exec "$PY" -m pytest -q -p no:cacheprovider --timeout=900 --durations=40 -m "not extended" -n 2 "$@"
