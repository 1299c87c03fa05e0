"""TLS across the emulated DCs (real namespaces, one address per DC): start-node.sh, as
`ray up deploy/cluster.yaml` runs it, brings Ray up with its own TLS on every node and
`expertmesh serve` over HTTPS, with per-DC certificates from `expertmesh certs`; a driver
without the TLS variables cannot join, serve refuses plain HTTP, and a client with the CA
reaches it from another DC.

Skipped, with the reason, only where network namespaces cannot be created.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from expertmesh.controller.certs import make_certs

from .netemu_module import load_netemu, start_nodes

REPO = Path(__file__).resolve().parents[2]
TOPOLOGY = REPO / "deploy/topologies/emulate.yaml"

netemu = load_netemu()
WHY_NOT = netemu.check_host()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")

PROBE = """
import httpx, ssl, sys, time
url, ca = sys.argv[1], sys.argv[2]
for _ in range(120):
    try:
        r = httpx.get(url + "/api/v1/health", timeout=2, verify=ssl.create_default_context(cafile=ca))
        break
    except httpx.TransportError:
        time.sleep(0.5)
else:
    sys.exit(2)
try:
    httpx.get(url.replace("https://", "http://") + "/api/v1/health", timeout=5)
    sys.exit(3)  # plain HTTP must get no answer
except httpx.TransportError:
    pass
sys.exit(0 if r.status_code == 200 else 1)
"""

JOIN = """
import ray, sys
ray.init(address=sys.argv[1], log_to_driver=False)
print(sorted(n["Labels"]["dc"] for n in ray.nodes() if n["Alive"]))
"""


def test_start_node_brings_up_ray_over_tls_and_serve_over_https(tmp_path: Path) -> None:
    name = f"tl{os.getpid() % 100000}"
    em = netemu.plan_emulation(yaml.safe_load(TOPOLOGY.read_text()), name=name)
    tls = tmp_path / "tls"
    # per-DC certificates naming each DC's address (what the operator makes before `ray up`);
    # the same files under the emulation's own names for netemu's driver helpers
    names = {n.dc: [n.ip] for n in em.nodes} | {f"dc{n.index}": [n.ip] for n in em.nodes}
    make_certs(tls, names)
    em = netemu.Emulation(**{**em.__dict__, "tls_dir": str(tls)})
    netemu.up(em, ray=False)
    try:
        env = start_nodes(em, tmp_path, TOPOLOGY, EXPERTMESH_TLS_DIR=str(tls))
        netemu.wait_nodes(em, timeout=90)  # a driver with DC 0's TLS variables joins
        # a driver without them cannot (the GCS speaks only TLS): bounded by a timeout
        plain = {k: v for k, v in env.items() if not k.startswith("RAY_TLS")}
        plain.pop("RAY_USE_TLS", None)
        try:
            joined = subprocess.run(
                ["ip", "netns", "exec", em.nodes[1].netns, sys.executable, "-c", JOIN,
                 em.address],
                env=plain, capture_output=True, text=True, timeout=45, check=False,
            )  # fmt: skip
            assert joined.returncode != 0, joined.stdout
        except subprocess.TimeoutExpired:
            pass  # it hung trying: refused just the same
        url = f"https://{em.head.ip}:8700"
        for n in (em.nodes[0], em.nodes[2]):  # from the head and from another DC
            got = subprocess.run(
                ["ip", "netns", "exec", n.netns, sys.executable, "-c", PROBE, url,
                 str(tls / "ca.pem")],
                env=env, timeout=120, check=False,
            )  # fmt: skip
            assert got.returncode == 0, f"serve not healthy over TLS at {url} from {n.dc}"
    finally:
        netemu.down(name)
