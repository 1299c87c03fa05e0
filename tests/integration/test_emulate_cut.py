"""A real network cut between two DCs of the one-machine emulation (deploy/emulate/netemu.py
``cut``/``heal``), which the runtime is not told about (issue 7, "a DC cut off").

Three DC namespaces with Ray (emulate.yaml; packets over 1 KiB travel node to node, as
real-size packets do). The driver (tests/integration/emulated_cut.py, run in the head's
namespace) trains, cuts eu-west <-> ap-south (not the head's DC, so Ray's GCS keeps every
node alive), trains on, heals, trains on. The step that hits the cut misses its deadline;
the runtime probes the links, pauses ap-south, retries the step; plans stop placing copies
or routing tokens across the cut; after the heal the DC rejoins. Skipped, with the reason,
only where network namespaces cannot be created.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from .netemu_module import load_netemu

REPO = Path(__file__).resolve().parents[2]
TOPOLOGY = REPO / "deploy/topologies/emulate.yaml"
DRIVER = Path(__file__).resolve().with_name("emulated_cut.py")


netemu = load_netemu()
WHY_NOT = netemu.check_host()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")

CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], 9), timeout=1).close()\n"
    "except ConnectionRefusedError:\n"
    "    sys.exit(0)\n"  # the peer's kernel answered: the link works
    "except OSError:\n"
    "    sys.exit(1)\n"
)


def _reaches(em: Any, src: int, dst: int) -> bool:
    argv = [sys.executable, "-c", CONNECT, em.nodes[dst].ip]
    netns = em.nodes[src].netns
    run = subprocess.run(["ip", "netns", "exec", netns, *argv], check=False, timeout=30)
    return run.returncode == 0


@pytest.fixture(scope="module")
def emulation() -> Iterator[Any]:
    name = f"ct{os.getpid() % 100000}"
    em = netemu.plan_emulation(yaml.safe_load(TOPOLOGY.read_text()), name=name)
    netemu.up(em, ray=True, cpus=1.0, max_inline_bytes=1024)
    try:
        yield em
    finally:
        pids = list(em.pids)
        netemu.down(name)
        left = netemu._our_namespaces(name) + [p for p in [em.temp_dir] if Path(p).exists()]
        assert not left, left
        assert not [p for p in pids if netemu.alive(p)], "Ray processes survived down"


def test_cut_drops_only_the_pair_and_heal_restores_it(emulation: Any) -> None:
    em = emulation
    pairs = [(a, b) for a in range(3) for b in range(3) if a != b]
    assert all(_reaches(em, a, b) for a, b in pairs)
    netemu.cut(em, "eu-west", "ap-south")
    try:
        assert netemu.cuts(em) == [("eu-west", "ap-south")]
        for a, b in pairs:
            assert _reaches(em, a, b) == ({a, b} != {1, 2}), (a, b)
    finally:
        netemu.heal(em, "ap-south", "eu-west")
    assert netemu.cuts(em) == []
    assert all(_reaches(em, a, b) for a, b in [(1, 2), (2, 1)])
    netemu.heal(em, "eu-west", "ap-south")  # healing a pair that is not cut: a no-op


@pytest.fixture(scope="module")
def run(emulation: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("cut") / "run.json"
    env = netemu.env_for_namespace(emulation)
    argv = [sys.executable, str(DRIVER), emulation.name, str(out)]
    done = subprocess.run(
        ["ip", "netns", "exec", emulation.head.netns, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert netemu.cuts(emulation) == []  # the driver healed what it cut
    res: dict[str, Any] = json.loads(out.read_text())
    return res


def test_a_real_cut_pauses_the_dc_and_training_goes_on(run: dict[str, Any]) -> None:
    dc = np.asarray(run["rank_dc"])
    far = np.flatnonzero(dc == 2)  # ap-south: not linked to every DC kept before it
    first, second = run["during"]
    status = run["status_cut"]
    assert status["retried_steps"] == [first["step"]]  # the step that met the cut ran again
    assert status["paused_ranks"] == far.tolist()
    rec = [r for r in status["recoveries"] if r["reason"] == "step stalled"]
    assert len(rec) == 1 and rec[0]["paused"] == far.tolist()
    assert rec[0]["links_up"][1][2] == 0 and rec[0]["links_up"][0][2] == 1
    for s in (first, second):
        assert s["error"] is None and np.isfinite(s["loss"])
        assert all(s["tokens_per_rank"][r] == 0 for r in far)
        assert all(s["tokens_per_rank"][r] > 0 for r in np.flatnonzero(dc != 2))
    # the retried step's first attempt may have sent packets towards the cut before it was
    # found; a step run wholly under the pause sends nothing across it
    pair = [second["bytes_by_pair"][k][a][b] for k in range(3) for a, b in [(1, 2), (2, 1)]]
    assert pair == [0] * 6
    for layer in run["plan_during"]:  # no copy on the cut DC, no token to or from it
        phy2log, route = np.asarray(layer["phy2log"]), np.asarray(layer["route"])
        assert (phy2log[far] < 0).all()
        assert not np.isin(route, far).any()


def test_the_dc_rejoins_when_the_link_heals(run: dict[str, Any]) -> None:
    dc = np.asarray(run["rank_dc"])
    far = np.flatnonzero(dc == 2)
    steps = [s["step"] for k in ("before", "during", "after") for s in run[k]]
    assert steps == list(range(len(steps)))  # no step dropped
    heal = [r for r in run["status"]["recoveries"] if r["reason"] == "heal"]
    assert len(heal) == 1 and heal[0]["rejoined"] == far.tolist() and heal[0]["paused"] == []
    assert run["status"]["paused_ranks"] == [] and run["status"]["retried_steps"] == [
        run["during"][0]["step"]
    ]
    for s in run["after"]:
        assert s["error"] is None and np.isfinite(s["loss"])
        assert all(t > 0 for t in s["tokens_per_rank"])
    assert any((np.asarray(layer["phy2log"])[far] >= 0).any() for layer in run["plan_after"])
