"""A real network cut between two DCs of the one-machine emulation (``netemu cut``),
which the runtime is not told about, on the SPMD data plane (shaper off).

Three DC namespaces with Ray (emulate.yaml). The driver (emulated_cut_spmd.py, in the
head's namespace) trains, cuts eu-west <-> ap-south (not the head's DC, so Ray's GCS
keeps every node alive), trains on, heals, trains on. The step that meets the cut waits
in a gloo collective until the process groups' timeout (8 s here), fails on every rank,
and the runtime probes the links: ap-south is paused, the step runs again on us-east and
eu-west, plans place no copy and route no token across the cut; after the heal the next
probe sees the link back and ap-south rejoins. Skipped, with the reason, only where
network namespaces cannot be created."""

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
DRIVER = Path(__file__).resolve().with_name("emulated_cut_spmd.py")

netemu = load_netemu()
WHY_NOT = netemu.check_host()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}"),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    name = f"cs{os.getpid() % 100000}"
    em = netemu.plan_emulation(yaml.safe_load(TOPOLOGY.read_text()), name=name)
    netemu.up(em, ray=True, cpus=1.0)
    try:
        out = tmp_path_factory.mktemp("cut") / "run.json"
        argv = [sys.executable, str(DRIVER), em.name, str(out)]
        done = subprocess.run(
            ["ip", "netns", "exec", em.head.netns, *argv],
            env=netemu.env_for_namespace(em),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert netemu.cuts(em) == []  # the driver healed what it cut
        report = os.environ.get("EXPERTMESH_MEMBERS_REPORT")
        if report:
            Path(report).with_suffix(".emulate.json").write_text(out.read_text())
        yield json.loads(out.read_text())
    finally:
        pids = list(em.pids)
        netemu.down(name)
        assert not netemu._our_namespaces(name)
        assert not [p for p in pids if netemu.alive(p)], "Ray processes survived down"


def test_a_real_cut_pauses_the_dc_and_training_goes_on(run: dict[str, Any]) -> None:
    dc = np.asarray(run["rank_dc"])
    far = np.flatnonzero(dc == 2)  # ap-south: not linked to every DC kept before it
    first, second = run["during"]
    status = run["status_cut"]
    assert status["retried_steps"] == [first["step"]]  # the step that met the cut ran again
    assert status["paused_ranks"] == far.tolist() and status["dead_ranks"] == []
    (rec,) = status["recoveries"]
    assert rec["reason"] == "cut" and rec["failed_step"] == first["step"]
    assert rec["paused"] == far.tolist()
    assert rec["links_up"][1][2] == 0 and rec["links_up"][0][2] == 1
    for s in (first, second):
        assert s["error"] is None and np.isfinite(s["loss"])
        assert all(s["tokens_per_rank"][r] == 0 for r in far)
        assert all(s["tokens_per_rank"][r] > 0 for r in np.flatnonzero(dc != 2))
        # nothing crosses towards the cut DC: the failed attempt is not a recorded step,
        # and the retried one runs without it
        pairs = np.asarray(s["bytes_by_pair"])  # [kinds, D, D]
        assert pairs[:, :, 2].sum() == 0 and pairs[:, 2, :].sum() == 0
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
    assert run["status"]["paused_ranks"] == []
    assert run["status"]["retried_steps"] == [run["during"][0]["step"]]
    for s in run["after"]:
        assert s["error"] is None and np.isfinite(s["loss"])
        assert all(t > 0 for t in s["tokens_per_rank"])
    assert any((np.asarray(layer["phy2log"])[far] >= 0).any() for layer in run["plan_after"])
    assert all(run["dense_equal"])  # every rank's dense weights, bit for bit
