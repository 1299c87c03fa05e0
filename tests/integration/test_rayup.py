"""`ray up` of deploy/cluster.yaml onto the emulated DC hosts over real SSH (deploy/emulate/rayup.py).

The real commands, from the operator's workstation (a namespace on the emulation's bridge):
`ray up -y`, `ray exec` of `expertmesh demo --address auto --exit --steps N` on the head,
the dashboard, REST and /metrics read from the head's address, `ray down -y`; then nothing
may be left. Skipped, with the reason, only where the machine cannot make the hosts (not
root, no `ip netns`/htb, no sshd, rsync or overlay: scripts/ci-deps.sh installs them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from .netemu_module import load_rayup

REPO = Path(__file__).resolve().parents[2]
TOPOLOGY = REPO / "deploy/topologies/emulate.yaml"

rayup = load_rayup()
WHY_NOT = rayup.check_host()
pytestmark = [
    pytest.mark.skipif(WHY_NOT is not None, reason=f"no emulated SSH hosts: {WHY_NOT}"),
    pytest.mark.timeout(1500),  # every step below has its own, shorter bound
]


@pytest.fixture
def other_ray(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process named `raylet` outside the hosts: what a `ray stop` that escaped its host
    (the cluster file's start commands, `ray down`) would kill, as it would kill the other
    engineers' Ray on this machine."""
    fake = tmp_path / "raylet"
    shutil.copy("/bin/sleep", fake)
    proc = subprocess.Popen([str(fake), "1200"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _plan(prefix: str) -> object:
    return rayup.plan_rayup(
        yaml.safe_load(TOPOLOGY.read_text()), name=f"{prefix}{os.getpid() % 100000}"
    )


def test_ray_up_trains_and_ray_down_leaves_nothing(other_ray: subprocess.Popen[bytes]) -> None:
    ru = _plan("ru")
    # rehearse raises at the first step that fails: ray up, a host that does not join with
    # its DC label, serve, the demo, its surfaces, stop-serve/stop-workers, ray down, or a
    # process left on a host afterwards (it tears the emulation down either way).
    rep = rayup.rehearse(ru, steps=20, log=lambda _: None)
    assert rep["serve"] == {"/api/v1/health": 200, "/": 200, "/metrics": 200}
    assert rep["demo_step_seen"] >= 1
    assert set(rep["demo_surfaces"].values()) == {200}
    assert rep["left_after_ray_down"] == {}
    assert rep["sshd_alive_after_down"] == []
    assert rep["namespaces_after_down"] == []
    assert not Path(ru.em.temp_dir).exists()
    assert other_ray.poll() is None, "a `ray stop` on a host killed a Ray process outside it"


def test_a_head_that_cannot_find_its_dc_fails_ray_up_with_the_reason() -> None:
    ru = _plan("rd")
    rayup.hosts_up(ru, no_dc_file=frozenset({ru.head.dc}))
    base = {dc: set(pids) for dc, pids in rayup.host_pids(ru).items()}  # init + sshd
    try:
        up = rayup.ops(
            ru, ["ray", "up", "-y", "--disable-usage-stats", ru.cluster_file], timeout=600
        )
        out = up.stdout + up.stderr
        assert up.returncode != 0, out[-3000:]
        assert (
            f"no DC for {ru.head.ip} in /home/root/expertmesh/deploy/dc-map.yaml; add a line "
            "or write the DC name to /etc/expertmesh/dc" in out
        ), out[-3000:]
        assert "start-node.sh: cannot find this node's DC" in out
        assert rayup.leftovers(ru, base) == {}  # no Ray started anywhere
    finally:
        rayup.down(ru.em.name)
    assert rayup.netemu._our_namespaces(ru.em.name) == []
