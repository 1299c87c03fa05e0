"""The committed generated code equals what `make proto` produces from the .proto file."""

import os
import shutil
import subprocess
import sys

import pytest


def test_generated_code_is_current(repo, tmp_path):
    pytest.importorskip("grpc_tools")
    if shutil.which("protoc-gen-mypy", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("mypy-protobuf is not installed")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHON": sys.executable}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    subprocess.run([str(repo / "scripts/gen_proto.sh"), str(out)], check=True, env=env, cwd=repo)
    generated = sorted(p.name for p in (out / "expertmesh/v1").iterdir())
    assert generated == ["expertmesh_pb2.py", "expertmesh_pb2.pyi", "expertmesh_pb2_grpc.py"]
    for name in generated:
        want = (out / "expertmesh/v1" / name).read_text()
        have = (repo / "proto/expertmesh/v1" / name).read_text()
        assert have == want, f"{name} is stale: run `make proto`"
