#!/usr/bin/env bash
# System tools the tests use beyond the venv, from Debian's packages (root, apt-get):
#   promtool (package prometheus): validates deploy/prometheus.yml and the Grafana queries
#   ip, tc (package iproute2): the one-machine multi-DC emulation (deploy/emulate/)
# Idempotent and quick when they are there; without root or apt-get it says what is missing
# and the tests that need a tool skip with the reason.
set -euo pipefail
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
{ command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; } || missing+=(iproute2)
((${#missing[@]})) || exit 0
if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
  echo "ci-deps: installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # Debian's package would start a Prometheus server where an init system runs; the tests only
  # need promtool, so stop a service the install started (never any other Prometheus).
  if [[ " ${missing[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null 2>&1 \
    && systemctl is-active --quiet prometheus 2>/dev/null; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
else
  echo "ci-deps: ${missing[*]} missing and not root with apt-get; the tests that need them skip" >&2
fi
