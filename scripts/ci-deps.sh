#!/usr/bin/env bash
# System tools the tests use beyond the venv, from Debian's packages (root, apt-get):
#   promtool (package prometheus): validates deploy/prometheus.yml and the Grafana queries
#   ip, tc (package iproute2): the one-machine multi-DC emulation (deploy/emulate/)
#   sshd, ssh, rsync (openssh-server, openssh-client, rsync): `ray up` onto the emulated hosts
#     (deploy/emulate/rayup.py); the install starts no sshd (no init system here; where one runs,
#     the service the package started is stopped again, as for prometheus)
# Idempotent and quick when they are there; without root or apt-get it says what is missing
# and the tests that need a tool skip with the reason.
set -euo pipefail
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
{ command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; } || missing+=(iproute2)
[[ -x /usr/sbin/sshd ]] || missing+=(openssh-server)
command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
command -v rsync >/dev/null 2>&1 || missing+=(rsync)
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
  # Likewise an sshd on the host's own addresses: the emulation runs its own, per namespace.
  if [[ " ${missing[*]} " == *" openssh-server "* ]] && command -v systemctl >/dev/null 2>&1 \
    && systemctl is-active --quiet ssh 2>/dev/null; then
    systemctl disable --now ssh >/dev/null 2>&1 || true
  fi
else
  echo "ci-deps: ${missing[*]} missing and not root with apt-get; the tests that need them skip" >&2
fi
