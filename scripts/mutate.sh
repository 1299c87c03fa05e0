#!/usr/bin/env bash
# make mutate: mutation testing (mutmut) of the security and decision modules listed in
# scripts/mutate.toml, bounded by MUTATE_MINUTES (default 60) of wall time and MUTATE_CHILDREN
# (default 2) test processes. Runs in a staging tree (.cache/mutate: the three source roots
# merged into src/expertmesh, the tests, mutate.toml as its pyproject.toml). mutmut keeps each
# mutant's verdict there, so a second run goes on where the first stopped; the tree is made
# anew when the checkout changed. MUTATE_ONLY: mutant-name globs to run only those (e.g.
# 'expertmesh.controller.auth*'); MUTATE_STAGE: another staging tree. Writes $OUT/mutate-results.txt (every mutant: status),
# $OUT/mutate-survivors.txt (all but killed) and a table per module on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
venv=$repo/${VENV:-.venv}
out=${OUT:-out}
[[ $out == /* ]] || out=$repo/$out
minutes=${MUTATE_MINUTES:-60}
children=${MUTATE_CHILDREN:-2}
stage=${MUTATE_STAGE:-$repo/.cache/mutate}
[[ $stage == /* ]] || stage=$repo/$stage
"$venv/bin/python" -m pip install --quiet "mutmut==3.8.1"
mkdir -p "$out"

stamp=$( { git rev-parse HEAD; git status --porcelain -- controller workers proto tests scripts; } | sha256sum)
if [[ ! -f $stage/.stamp || $(cat "$stage/.stamp") != "$stamp" ]]; then
  rm -rf "$stage"
  mkdir -p "$stage/src/expertmesh"
  for root in controller workers proto; do
    cp -a "$root/expertmesh/." "$stage/src/expertmesh/"
  done
  cp -a tests deploy scripts examples dashboards "$stage/"
  cp scripts/mutate.toml "$stage/pyproject.toml"
  find "$stage" -name __pycache__ -prune -exec rm -rf {} +
  echo "$stamp" > "$stage/.stamp"
fi

cd "$stage"
export RAY_AUTH_MODE=disabled
read -r -a only <<< "${MUTATE_ONLY:-}"
start=$(date +%s)
status=0
timeout --signal=INT --kill-after=120 "${minutes}m" \
  "$venv/bin/mutmut" run --max-children "$children" "${only[@]}" || status=$?
echo "mutate: mutmut ran $(( ($(date +%s) - start) / 60 )) min, exit $status" \
  "(124: stopped at MUTATE_MINUTES=$minutes; run again to go on)"
"$venv/bin/mutmut" results --all true > "$out/mutate-results.txt"
grep -v ': killed$' "$out/mutate-results.txt" > "$out/mutate-survivors.txt" || true
"$venv/bin/python" - "$out/mutate-results.txt" <<'PY'
import collections
import sys

counts: collections.Counter[tuple[str, str]] = collections.Counter()
for line in open(sys.argv[1]):
    name, _, status = line.strip().rpartition(": ")
    if name:
        counts[(name.split(".x")[0], status)] += 1
statuses = sorted({s for _, s in counts})
print("module".ljust(34), *(s.rjust(12) for s in statuses))
for module in sorted({m for m, _ in counts}):
    print(module.ljust(34), *(str(counts[(module, s)]).rjust(12) for s in statuses))
PY
echo "mutate: every mutant in $out/mutate-results.txt, all but the killed in $out/mutate-survivors.txt"
