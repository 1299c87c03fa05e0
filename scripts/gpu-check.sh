#!/usr/bin/env bash
# The device check (docs/benchmarks.md, "On a GPU"): on a machine with a CUDA device and a
# CUDA build of torch, run the `gpu` tests and bench/bench_gpu.py, logs and JSON under $OUT
# (default out/gpu). Needs no install of the project: the source roots go on PYTHONPATH.
# Wheels in .whl/ (a machine without PyPI: pydantic and what it needs) are installed to
# /tmp/site first.
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}controller:workers:proto:. PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
  "nccl", torch.cuda.nccl.version(), "devices", torch.cuda.device_count())'
rc=0
timeout "${GPU_TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/integration/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" || rc=1
timeout "${GPU_BENCH_TIMEOUT:-200}" python3 bench/bench_gpu.py --json "$OUT/bench-gpu.json" \
  2>&1 | tee "$OUT/bench-gpu.log" || rc=1
exit $rc
