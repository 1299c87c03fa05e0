"""The one-machine multi-DC emulation's plan (deploy/emulate/netemu.py), without touching the host."""

from __future__ import annotations

import importlib.util
import ipaddress
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import yaml

from expertmesh.planner import Topology

REPO = Path(__file__).resolve().parents[2]


def _load_netemu() -> ModuleType:
    spec = importlib.util.spec_from_file_location("netemu", REPO / "deploy/emulate/netemu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["netemu"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


netemu = _load_netemu()
TOPO = yaml.safe_load((REPO / "deploy/topologies/emulate.yaml").read_text())


def test_one_namespace_and_address_per_dc_inside_the_subnet() -> None:
    em = netemu.plan_emulation(TOPO, name="t1", subnet="10.99.7.0/24")
    names = [d["name"] for d in TOPO["dcs"]]
    assert [n.dc for n in em.nodes] == names
    assert len({n.netns for n in em.nodes} | {em.bridge_netns}) == len(names) + 1
    net = ipaddress.ip_network("10.99.7.0/24")
    ips = [ipaddress.ip_address(n.ip) for n in em.nodes]
    assert len(set(ips)) == len(ips) and all(ip in net and ip != net.network_address for ip in ips)
    assert em.address == f"{em.nodes[0].ip}:{netemu.RAY_PORT}"


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_every_ordered_pair_is_shaped_at_the_topology_bandwidth(scale: float) -> None:
    topo = Topology.from_dict(TOPO)
    em = netemu.plan_emulation(TOPO, scale=scale)
    d = topo.num_dcs
    assert {(s.src, s.dst) for s in em.shapes} == {
        (a, b) for a in range(d) for b in range(d) if a != b
    }
    for s in em.shapes:
        assert s.mbit == pytest.approx(topo.dc_gbps[s.src, s.dst] * 1000 * scale)
    # the pair override of the YAML (us-east <-> ap-south at 0.1 Gbit/s) is honoured both ways
    assert em.shape(0, 2).mbit == em.shape(2, 0).mbit == pytest.approx(100 * scale)
    assert len({s.classid for s in em.shapes if s.src == 0}) == d - 1


def test_commands_only_touch_our_namespaces() -> None:
    """Every ip/tc command names one of the emulation's namespaces: the host stays untouched."""
    em = netemu.plan_emulation(TOPO, name="safe")
    ours = set(em.namespaces)
    cmds = em.network_commands()
    assert cmds
    for argv in cmds:
        assert argv[0] in ("ip", "tc")
        if argv[:3] == ["ip", "netns", "add"]:
            assert argv[3] in ours
        else:
            assert argv[1] == "-n" and argv[2] in ours, argv
        if "peer" in argv:  # the other end of a veth goes into a DC namespace
            assert argv[argv.index("netns") + 1] in ours
    for argv in cmds:  # Linux interface names are at most 15 bytes
        for key in ("add", "name"):
            if argv[1:2] == ["-n"] and key in argv and argv[3] == "link":
                assert len(argv[argv.index(key) + 1]) <= 15
    shaped = [a for a in cmds if a[0] == "tc" and a[3] == "class"]
    assert len(shaped) == len(em.shapes)


def test_filters_send_each_destination_to_its_class() -> None:
    em = netemu.plan_emulation(TOPO)
    filters = [a for a in em.network_commands() if a[0] == "tc" and a[3] == "filter"]
    got = {(a[2], a[a.index("dst") + 1], a[a.index("flowid") + 1]) for a in filters}
    want = {(em.nodes[s.src].netns, f"{em.nodes[s.dst].ip}/32", s.classid) for s in em.shapes}
    assert got == want


def test_ray_start_head_first_then_workers_join_with_dc_labels() -> None:
    em = netemu.plan_emulation(TOPO)
    cmds = em.ray_start_commands("/venv/bin/ray", 1.5)
    assert [ns for ns, _ in cmds] == [n.netns for n in em.nodes]
    head = cmds[0][1]
    assert "--head" in head and f"--port={em.ray_port}" in head
    for (_, argv), n in zip(cmds, em.nodes, strict=True):
        assert argv[:2] == ["/venv/bin/ray", "start"]
        assert f"--labels=dc={n.dc}" in argv and f"--node-ip-address={n.ip}" in argv
        assert "--num-cpus=1.5" in argv and f"--temp-dir={em.temp_dir}/ray" in argv
        assert "stop" not in argv
    for _, argv in cmds[1:]:
        assert f"--address={em.address}" in argv and "--head" not in argv


def test_state_round_trips_through_json() -> None:
    em = netemu.plan_emulation(TOPO, name="rt")
    em.pids.extend([3, 5])
    back = netemu.Emulation.from_json(em.to_json())
    assert back == em and back.pids == [3, 5]


def test_node_lookup_by_name_or_index() -> None:
    em = netemu.plan_emulation(TOPO)
    assert em.node("eu-west").index == 1 and em.node("2").dc == "ap-south"
    with pytest.raises(ValueError, match="no DC"):
        em.node("mars")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "bad name"}, "--name"),
        ({"name": "x" * 17}, "--name"),
        ({"scale": 0.0}, "--scale"),
        ({"scale": float("nan")}, "--scale"),
        ({"subnet": "8.8.8.0/24"}, "private"),
        ({"subnet": "10.0.0.1/24"}, "host bits"),
        ({"subnet": "10.0.0.0/31"}, "no room"),
    ],
)
def test_bad_arguments_are_value_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        netemu.plan_emulation(TOPO, **kwargs)


def test_bandwidth_matrix_matches_the_planner() -> None:
    topo = Topology.generate(4, 1, masters=1, spare=0).with_inter_dc(0.3, 5.0)
    em = netemu.plan_emulation(topo.to_dict(), scale=2.0)
    m = np.zeros((4, 4))
    for s in em.shapes:
        m[s.src, s.dst] = s.mbit
    np.fill_diagonal(m, topo.dc_gbps.diagonal() * 2000)
    assert np.allclose(m, topo.dc_gbps * 2000)


def test_cut_drops_the_pair_both_ways_and_heal_undoes_exactly_that() -> None:
    em = netemu.plan_emulation(TOPO)
    a, b = em.nodes[1], em.nodes[2]
    cut = em.cut_commands(a.dc, "2")
    heal = em.cut_commands("1", b.dc, heal=True)
    want = {(a.netns, em.shape(1, 2).classid), (b.netns, em.shape(2, 1).classid)}
    for cmds, verb in ((cut, "replace"), (heal, "del")):
        assert {(c[2], c[c.index("parent") + 1]) for c in cmds} == want
        assert all(c[:2] == ["tc", "-n"] and c[3:6] == ["qdisc", verb, "dev"] for c in cmds)
    assert all(c[-3:] == ["pfifo", "limit", "0"] for c in cut)  # a queue that takes nothing
    # the other DCs' classes (and the head's) are not touched
    assert em.head.netns not in {c[2] for c in cut + heal}
    with pytest.raises(ValueError, match="two different"):
        em.cut_commands("1", a.dc)
    with pytest.raises(ValueError, match="no DC"):
        em.cut_commands("1", "mars")


def test_max_inline_bytes_is_set_once_for_the_whole_cluster() -> None:
    em = netemu.plan_emulation(TOPO)
    cmds = em.ray_start_commands("/venv/bin/ray", 1.0, max_inline_bytes=1024)
    conf = [a for _, argv in cmds for a in argv if a.startswith("--system-config=")]
    assert conf == ['--system-config={"max_direct_call_object_size": 1024}']
    assert "--head" in cmds[0][1] and conf[0] in cmds[0][1]
    with pytest.raises(ValueError, match="max-inline-bytes"):
        em.ray_start_commands("/venv/bin/ray", 1.0, max_inline_bytes=-1)


def test_tls_gives_every_dc_a_certificate_for_its_address(tmp_path):
    from cryptography import x509

    plain = netemu.plan_emulation(TOPO, name="notls")
    assert plain.tls_env(0) == {} and "RAY_USE_TLS" not in netemu.env_for_namespace(plain)
    em = netemu.plan_emulation(TOPO, name="tls", tls=True)
    em = netemu.Emulation.from_json(em.to_json())  # the state file keeps it
    em = netemu.Emulation(**{**em.__dict__, "tls_dir": str(tmp_path)})
    netemu.make_tls(em)
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    for n in em.nodes:
        env = netemu.env_for_namespace(em, n.index)
        assert env["RAY_USE_TLS"] == "1" and env["RAY_TLS_CA_CERT"] == str(tmp_path / "ca.pem")
        cert = x509.load_pem_x509_certificate(Path(env["RAY_TLS_SERVER_CERT"]).read_bytes())
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert ipaddress.ip_address(n.ip) in san.get_values_for_type(x509.IPAddress)
        assert Path(env["RAY_TLS_SERVER_KEY"]).is_file()
