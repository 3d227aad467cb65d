#!/usr/bin/env bash
# Set up a machine for miles: a virtual environment (the active one, else ./.venv) with miles and
# its dependencies installed. Idempotent: a second run installs nothing new.
# Usage: bash scripts/setup.sh [extra ...]      e.g.  bash scripts/setup.sh dev
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  PY=.venv/bin/python
else
  PY=python
fi
extras=$(IFS=,; echo "${*:-}")
# A CPU build of torch when none is installed: `torch==2.13.0` is the CPU wheel kept on this
# project's CI machines; elsewhere pip fetches it from PyPI. An existing torch (a GPU build) is kept.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q --disable-pip-version-check "${MILES_TORCH_SPEC:-torch==2.13.0}"
fi
"$PY" -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
echo "miles installed in $("$PY" -c 'import sys; print(sys.prefix)')"
