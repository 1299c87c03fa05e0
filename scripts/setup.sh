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
# The dashboard test drives a real headless Chromium (Debian's `chromium`; no browser download).
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing chromium for the dashboard test (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
  else
    echo "setup: chromium not found and not root; the dashboard test will be skipped" >&2
  fi
fi
