"""examples/torchrun_moe.py under torchrun (4 real processes, 2 DCs, gloo, no Ray) against a
real ``expertmesh serve`` on free loopback ports: every rank streams its counts, receives
the committed plans, and the world switches to them together with migration; the run's
own --json summary says the plans were applied, the loss fell and every rank ended on the
same plan."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from expertmesh.workers.client import ExpertMeshClient

pytestmark = pytest.mark.integration

TOPOLOGY = """\
dcs:
  - {name: east, nodes: 1, ranks_per_node: 2}
  - {name: west, nodes: 1, ranks_per_node: 2}
slots_per_rank: {masters: 2, spare: 2}
links:
  inter_dc: {gbps: 10, latency_ms: 20}
"""
STEPS, EXPERTS = 24, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_torchrun_trainer_follows_the_plans_of_serve(repo: Path, tmp_path: Path) -> None:
    topo = tmp_path / "topo.yaml"
    topo.write_text(TOPOLOGY)
    grpc_port, rest_port = _free_port(), _free_port()
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k != "EXPERTMESH_TOKEN"}
    env["OMP_NUM_THREADS"] = "1"
    serve = subprocess.Popen(
        [str(bin_dir / "expertmesh"), "serve", "--topology", str(topo), "--layers", "2",
         "--experts", str(EXPERTS), "--top-k", "2", "--hidden", "16", "--ffn-hidden", "32",
         "--policy", "eplb", "--policy-settings", '{"period": 1, "window": 4}',
         "--every", "4", "--rest-port", str(rest_port), "--grpc-port", str(grpc_port),
         "--no-planner-process", "--seconds", "170"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    out = tmp_path / "run.json"
    try:
        with ExpertMeshClient(f"127.0.0.1:{grpc_port}") as client:
            client.wait_ready(timeout=60)
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
             "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
             str(repo / "examples" / "torchrun_moe.py"), "--target", f"127.0.0.1:{grpc_port}",
             "--topology", str(topo), "--experts", str(EXPERTS), "--steps", str(STEPS),
             "--timeout-s", "60", "--json", str(out)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150, check=False,
            start_new_session=True,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        _stop(serve)
    res = json.loads(out.read_text())
    assert res["backend"] == "gloo" and res["world_size"] == 4 and res["rank_dc"] == [0, 0, 1, 1]
    # plans were committed by serve, received by every rank, and switched to together
    applied = res["applied"]
    assert applied, res
    assert [a["version"] for a in applied] == sorted({a["version"] for a in applied})
    assert res["final_versions"] == [applied[-1]["version"]] * 4
    assert sum(a["transfers"] for a in applied) > 0  # copies moved between ranks
    assert all(v >= applied[-1]["version"] for v in res["newest_received"])
    # every step's counts of every rank and layer reached the controller
    assert res["reports_accepted"] == [STEPS * 2] * 4 and res["reports_dropped"] == [0] * 4
    losses = res["losses"]
    assert len(losses) == STEPS
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses


def test_torchrun_trainer_refuses_a_world_that_does_not_fit(repo: Path, tmp_path: Path) -> None:
    topo = tmp_path / "topo.yaml"
    topo.write_text(TOPOLOGY)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}
    run = subprocess.run(
        [sys.executable, str(repo / "examples" / "torchrun_moe.py"), "--topology", str(topo)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "3 processes" in lines[0] and "4 ranks" in lines[0], lines
