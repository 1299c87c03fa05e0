#!/usr/bin/env bash
# Creates .venv with the pinned CPU torch first, then the project and its dev tools.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
if [[ ! -x $venv/bin/python ]]; then
  python3 -m venv "$venv"
fi
py=$venv/bin/python
stamp=$venv/.expertmesh-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  "$py" -m pip install --quiet --upgrade pip
  # The pinned CPU build must come first: an unpinned torch pulls several GB of CUDA wheels.
  "$py" -m pip install --quiet "torch==2.13.0"
  "$py" -m pip install --quiet -e ".[dev]"
  touch "$stamp"
fi
