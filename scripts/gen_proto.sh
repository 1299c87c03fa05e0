#!/usr/bin/env bash
# Regenerates proto/expertmesh/v1/*_pb2*.py(i) from proto/expertmesh/v1/*.proto with grpcio-tools
# (and mypy-protobuf stubs). `make proto` runs it; tests/unit/test_proto_current.py checks that
# the committed files equal what it produces.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
out=${1:-proto}
"$py" -m grpc_tools.protoc -Iproto --python_out="$out" --grpc_python_out="$out" \
  --mypy_out="$out" proto/expertmesh/v1/expertmesh.proto
