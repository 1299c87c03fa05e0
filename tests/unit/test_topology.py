import numpy as np
import pytest
import yaml

from expertmesh.planner import LinkClass, Topology
from expertmesh.planner.topology import DC, Link


def _two_dc(repo):
    return Topology.from_dict(yaml.safe_load((repo / "deploy/topologies/two-dc.yaml").read_text()))


def test_brief_example_loads(repo):
    t = _two_dc(repo)
    assert t.num_ranks == 128 and t.slots_per_rank == 6 and t.num_nodes == 16
    assert t.rank_dc[63] == 0 and t.rank_dc[64] == 1
    assert t.rank_node[7] == 0 and t.rank_node[8] == 1 and t.rank_node[64] == 8
    assert t.dc_gbps[0, 1] == 5 and t.dc_latency_ms[1, 0] == 80


def test_link_class_and_bandwidth(repo):
    t = _two_dc(repo)
    src = np.array([0, 0, 0, 0])
    dst = np.array([0, 1, 9, 70])
    assert t.link_class(src, dst).tolist() == [
        LinkClass.SAME_RANK,
        LinkClass.INTRA_NODE,
        LinkClass.INTRA_DC,
        LinkClass.INTER_DC,
    ]
    bw = t.bandwidth_Bps(src, dst)
    assert np.isinf(bw[0]) and bw[1] == 3200e9 / 8 and bw[2] == 400e9 / 8 and bw[3] == 5e9 / 8
    assert t.latency_s(src, dst).tolist() == [0.0, 0.005e-3, 0.01e-3, 0.08]


def test_round_trip(repo):
    t = _two_dc(repo)
    u = Topology.from_dict(t.to_dict())
    assert u.to_dict() == t.to_dict()


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"dcs": []}, "dcs"),
        ({"dcs": [{"name": "a", "nodes": 0, "ranks_per_node": 1}]}, "nodes"),
        ({"dcs": [{"name": "a", "nodes": 1, "ranks_per_node": 1}] * 2}, "duplicate"),
        ({"slots_per_rank": {"masters": 0, "spare": 1}}, "masters"),
        ({"links": {"inter_dc": {"gbps": -1, "latency_ms": 1}}}, "gbps"),
        ({"links": {"pairs": [{"a": "us-east", "b": "mars", "gbps": 1, "latency_ms": 1}]}}, "mars"),
        ({"color": "blue"}, "color"),
    ],
)
def test_bad_topologies_raise_value_error(repo, patch, message):
    data = yaml.safe_load((repo / "deploy/topologies/two-dc.yaml").read_text())
    data.update(patch)
    with pytest.raises(ValueError, match=message):
        Topology.from_dict(data)


def test_generate_large_is_cheap():
    t = Topology.generate(dcs=1000, ranks_per_dc=8)
    assert t.num_ranks == 8000 and t.dc_gbps.shape == (1000, 1000)
    assert t.link_class(np.array([0]), np.array([7999]))[0] == LinkClass.INTER_DC


def test_links_are_latency_and_bandwidth_of_each_pair():
    # links works the link class out once for both; the same floats as each alone
    topo = Topology(
        (DC("a", 2, 2), DC("b", 1, 3)), 2, 2,
        intra_node=Link(900, 0.01), intra_dc=Link(200, 0.2), inter_dc=Link(5, 30.0),
    )  # fmt: skip
    src, dst = np.meshgrid(np.arange(topo.num_ranks), np.arange(topo.num_ranks))
    src, dst = src.ravel(), dst.ravel()
    lat, bw = topo.links(src, dst)
    cls = topo.link_class(src, dst)
    want_ms = np.select([cls == 0, cls == 1, cls == 2], [0.0, 0.01, 0.2], topo.dc_latency_ms[0, 1])
    want_gbps = np.select([cls == 0, cls == 1, cls == 2], [np.inf, 900, 200], 5)
    assert np.array_equal(lat, want_ms / 1e3) and np.array_equal(bw, want_gbps * 1e9 / 8.0)
    assert np.array_equal(topo.latency_s(src, dst), lat)
    assert np.array_equal(topo.bandwidth_Bps(src, dst), bw)
