#!/usr/bin/env bash
# Set up (scripts/setup.sh with the dev and tensorboard extras) and run the whole test suite on the CPU.
# Usage: bash scripts/test.sh [pytest args ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev tensorboard      # tensorboard: the --use-tensorboard tests run, not skip
PY=python; [ -z "${VIRTUAL_ENV:-}" ] && PY=.venv/bin/python
# the default run (CI) leaves out the tests marked extended (each repeats a path the others cover, at
# 1-2 min each on 2 cores); `bash scripts/test.sh -m extended` runs them, `-m ""` runs everything.
# One process: the end-to-end runs are CPU-bound (run alone they keep the two cores 81% busy), and two
# xdist workers running them side by side were no faster (docs/performance.md, "The test suite on 2 cores");
# `-n 2` (pytest-xdist, in the dev extra) speeds up a unit-only run (`-n 2 tests/unit`: 585 s -> 355 s).
exec "$PY" -m pytest -q -p no:cacheprovider --timeout=900 --durations=40 -m "not extended" "$@"
