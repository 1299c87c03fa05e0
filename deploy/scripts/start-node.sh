#!/usr/bin/env bash
# Start this machine's Ray node labeled dc=<its DC>; on the head, also `expertmesh serve`.
#
#   start-node.sh head                 # Ray head (GCS on :6379) + expertmesh serve
#   start-node.sh worker HEAD_IP       # Ray worker joining HEAD_IP:6379
#   start-node.sh stop-serve           # stop the `expertmesh serve` this script started
#   start-node.sh stop-workers         # on the head: `ray stop` on each worker, over SSH
#   start-node.sh which-dc             # print the DC this machine resolves to
#   eval "$(start-node.sh tls-env)"    # Ray's TLS variables for a driver on this machine
#
# The DC comes from, first match wins:
#   1. $EXPERTMESH_DC
#   2. the `dc` key of $RAY_OVERRIDE_LABELS (what `ray up` sets from a cloud node type's `labels`)
#   3. a per-host file, $EXPERTMESH_DC_FILE (default /etc/expertmesh/dc): one line, the DC name
#   4. the IP-to-DC map $EXPERTMESH_DC_MAP (default <repo>/deploy/dc-map.yaml):
#      lines `<IP or CIDR>: <DC>`, matched against this node's IP
# This node's IP: $EXPERTMESH_NODE_IP, else the first address of `hostname -I`.
# Other knobs (environment): EXPERTMESH_HOME (the checkout, default: this script's repo),
# EXPERTMESH_VENV (default ~/expertmesh-venv), EXPERTMESH_TOPOLOGY (default
# deploy/topologies/onprem-3dc.yaml), EXPERTMESH_STATE (default ~/.expertmesh: serve's pid, log,
# SQLite plan store and bearer token), EXPERTMESH_SERVE_HOST (default this node's IP),
# EXPERTMESH_TOKEN (bearer token for serve's writes; default: made once into
# $EXPERTMESH_STATE/token), RAY_METRICS_PORT (default 8080).
# stop-workers is for tearing down: `ray down` with Ray's local provider runs `ray stop` on the
# head only and marks the workers terminated; their raylets exit once the head is gone, but each
# worker's log_monitor runs on. It reads the worker IPs, SSH user and key that `ray up` left on the
# head (~/ray_bootstrap_config.yaml, ~/ray_bootstrap_key.pem) and runs `ray stop` on each.
# TLS: when $EXPERTMESH_TLS_DIR (default <repo>/deploy/tls) holds ca.pem and <DC>.pem/.key
# (`expertmesh certs --out deploy/tls --topology T.yaml --hosts <DC>=<its node IPs>`), Ray
# runs with its own TLS (RAY_USE_TLS=1, RAY_TLS_SERVER_CERT/_KEY = the DC's certificate,
# RAY_TLS_CA_CERT = ca.pem) and serve speaks only TLS with the same certificate;
# EXPERTMESH_TLS_MUTUAL=1 also makes serve require client certificates signed by ca.pem.
# EXPERTMESH_DRY_RUN=FILE appends the commands to FILE instead of running them (tests).
set -euo pipefail

home=${EXPERTMESH_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
venv=${EXPERTMESH_VENV:-$HOME/expertmesh-venv}
state=${EXPERTMESH_STATE:-$HOME/.expertmesh}
topology=${EXPERTMESH_TOPOLOGY:-$home/deploy/topologies/onprem-3dc.yaml}
dc_file=${EXPERTMESH_DC_FILE:-/etc/expertmesh/dc}
dc_map=${EXPERTMESH_DC_MAP:-$home/deploy/dc-map.yaml}
metrics_port=${RAY_METRICS_PORT:-8080}
tls=${EXPERTMESH_TLS_DIR:-$home/deploy/tls}
py=$venv/bin/python
[[ -x $py ]] || py=python3

die() { echo "start-node.sh: $*" >&2; exit 2; }

run() {
  if [[ -n ${EXPERTMESH_DRY_RUN:-} ]]; then
    if [[ -n ${RAY_USE_TLS:-} ]]; then  # log the TLS variables the command runs with
      printf '%q ' env "RAY_USE_TLS=$RAY_USE_TLS" "RAY_TLS_SERVER_CERT=$RAY_TLS_SERVER_CERT" \
        "RAY_TLS_SERVER_KEY=$RAY_TLS_SERVER_KEY" "RAY_TLS_CA_CERT=$RAY_TLS_CA_CERT" \
        >>"$EXPERTMESH_DRY_RUN"
    fi
    printf '%q ' "$@" >>"$EXPERTMESH_DRY_RUN"
    echo >>"$EXPERTMESH_DRY_RUN"
  else
    "$@"
  fi
}

node_ip() {
  if [[ -n ${EXPERTMESH_NODE_IP:-} ]]; then
    echo "$EXPERTMESH_NODE_IP"
  else
    hostname -I | awk '{print $1}'
  fi
}

which_dc() {
  local ip=$1
  if [[ -n ${EXPERTMESH_DC:-} ]]; then
    echo "$EXPERTMESH_DC"
    return
  fi
  # RAY_OVERRIDE_LABELS, the per-host file and the map, in that order (python: JSON and CIDRs).
  "$py" - "$ip" "$dc_file" "$dc_map" <<'EOF'
import ipaddress, json, os, sys
ip, dc_file, dc_map = sys.argv[1:4]
labels = os.environ.get("RAY_OVERRIDE_LABELS")
if labels:
    try:
        dc = json.loads(labels).get("dc")
    except (ValueError, AttributeError):
        dc = None
    if dc:
        sys.exit(print(dc))
if os.path.isfile(dc_file):
    dc = open(dc_file).read().strip()
    if dc:
        sys.exit(print(dc))
if not os.path.isfile(dc_map):
    sys.exit(f"no DC for {ip}: no $EXPERTMESH_DC, {dc_file} or map {dc_map}")
addr = ipaddress.ip_address(ip)
for n, line in enumerate(open(dc_map), 1):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    key, sep, dc = line.rpartition(":")
    if not sep or not key.strip() or not dc.strip():
        sys.exit(f"{dc_map}:{n}: expected `<IP or CIDR>: <DC>`, got {line!r}")
    if addr in ipaddress.ip_network(key.strip().strip("'\""), strict=False):
        sys.exit(print(dc.strip().strip("'\"")))
sys.exit(f"no DC for {ip} in {dc_map}; add a line or write the DC name to {dc_file}")
EOF
}

# Ray's TLS variables for DC $1, exported (nothing without the files). Every Ray process and
# driver of a TLS cluster needs them; the certificate must name this node's address.
tls_env() {
  local dc=$1
  [[ -f $tls/ca.pem ]] || return 0
  [[ -f $tls/$dc.pem && -f $tls/$dc.key ]] \
    || die "$tls has ca.pem but no $dc.pem/$dc.key: run expertmesh certs for DC $dc"
  export RAY_USE_TLS=1 RAY_TLS_SERVER_CERT=$tls/$dc.pem RAY_TLS_SERVER_KEY=$tls/$dc.key
  export RAY_TLS_CA_CERT=$tls/ca.pem
}

serve_pid() {
  local pid
  [[ -f $state/serve.pid ]] || return 1
  pid=$(<"$state/serve.pid")
  # only a process that still is the serve we started (PIDs get reused)
  [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "expertmesh serve" \
    && echo "$pid"
}

stop_serve() {
  local pid
  if pid=$(serve_pid); then
    run kill "$pid"
  fi
  run rm -f "$state/serve.pid"
}

role=${1:-}
case $role in
  which-dc)
    which_dc "$(node_ip)"
    ;;
  head)
    ip=$(node_ip)
    dc=$(which_dc "$ip") || die "cannot find this node's DC"
    args=(--head --port=6379 --node-ip-address="$ip" --labels="dc=$dc"
      --metrics-export-port="$metrics_port" --dashboard-host=0.0.0.0 --disable-usage-stats)
    [[ -f $HOME/ray_bootstrap_config.yaml ]] \
      && args+=(--autoscaling-config="$HOME/ray_bootstrap_config.yaml")
    tls_env "$dc"
    run "$venv/bin/ray" start "${args[@]}"
    run mkdir -p "$state"
    stop_serve
    serve=("$venv/bin/expertmesh" serve --topology "$topology"
      --host "${EXPERTMESH_SERVE_HOST:-$ip}" --db "$state/plans.sqlite")
    if [[ -n ${RAY_USE_TLS:-} ]]; then
      serve+=(--tls-cert "$tls/$dc.pem" --tls-key "$tls/$dc.key")
      [[ ${EXPERTMESH_TLS_MUTUAL:-0} == 1 ]] && serve+=(--tls-client-ca "$tls/ca.pem")
    fi
    # serve refuses a non-loopback address without a bearer token for writes: keep one in
    # $state/token (made once, mode 600) unless EXPERTMESH_TOKEN is given.
    if [[ -z ${EXPERTMESH_TOKEN:-} && -z ${EXPERTMESH_DRY_RUN:-} ]]; then
      if [[ ! -s $state/token ]]; then
        (umask 077 && "$py" -c 'import secrets; print(secrets.token_urlsafe(32))' >"$state/token")
      fi
      EXPERTMESH_TOKEN=$(<"$state/token")
    fi
    if [[ -n ${EXPERTMESH_DRY_RUN:-} ]]; then
      run "${serve[@]}"
    else
      EXPERTMESH_TOKEN=$EXPERTMESH_TOKEN nohup "${serve[@]}" >>"$state/serve.log" 2>&1 </dev/null &
      echo $! >"$state/serve.pid"
      echo "start-node.sh: expertmesh serve pid $! (log $state/serve.log)"
    fi
    ;;
  worker)
    head=${2:-${RAY_HEAD_IP:-}}
    [[ -n $head ]] || die "usage: start-node.sh worker HEAD_IP"
    ip=$(node_ip)
    dc=$(which_dc "$ip") || die "cannot find this node's DC"
    tls_env "$dc"
    run "$venv/bin/ray" start --address="$head:6379" --node-ip-address="$ip" --labels="dc=$dc" \
      --metrics-export-port="$metrics_port"
    ;;
  stop-serve)
    stop_serve
    ;;
  stop-workers)
    config=${RAY_BOOTSTRAP_CONFIG:-$HOME/ray_bootstrap_config.yaml}
    [[ -f $config ]] || die "no $config: run stop-workers on the head of a \`ray up\` cluster"
    mapfile -t targets < <("$py" - "$config" <<'EOF'
import sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
user = cfg.get("auth", {}).get("ssh_user", "")
for ip in cfg.get("provider", {}).get("worker_ips", []):
    print(f"{user}@{ip}" if user else ip)
EOF
    )
    failed=0
    for target in "${targets[@]}"; do
      echo "start-node.sh: ray stop on $target"
      run ssh -i "$HOME/ray_bootstrap_key.pem" -o BatchMode=yes -o IdentitiesOnly=yes \
        -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o ConnectTimeout=10 \
        -o LogLevel=ERROR "$target" "~/$(basename "$venv")/bin/ray stop" \
        || { echo "start-node.sh: ray stop on $target failed" >&2; failed=1; }
    done
    exit $failed
    ;;
  tls-env)
    dc=$(which_dc "$(node_ip)") || die "cannot find this node's DC"
    tls_env "$dc"
    [[ -n ${RAY_USE_TLS:-} ]] && printf 'export %s=%q\n' RAY_USE_TLS 1 \
      RAY_TLS_SERVER_CERT "$RAY_TLS_SERVER_CERT" RAY_TLS_SERVER_KEY "$RAY_TLS_SERVER_KEY" \
      RAY_TLS_CA_CERT "$RAY_TLS_CA_CERT"
    ;;
  *)
    die "usage: start-node.sh head | worker HEAD_IP | stop-serve | stop-workers | which-dc | tls-env"
    ;;
esac
