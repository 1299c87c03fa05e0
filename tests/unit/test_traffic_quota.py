"""quota_traffic's whole-token path (planner/traffic.py: _quota_whole) gives the same floats,
bit for bit, as the general path (weighted_traffic over level_sums) it replaces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.planner import Topology
from expertmesh.planner import traffic as tr
from expertmesh.planner.quota import quota_balance
from expertmesh.planner.static import static_placement

FIELDS = ("rank_tokens", "rank_out", "rank_in", "pair_src", "pair_dst", "pair_tokens", "dc_tokens")


def _bits(t: tr.TokenTraffic) -> list[tuple[str, tuple[int, ...], bytes]]:
    return [(np.asarray(getattr(t, f)).dtype.str, np.shape(getattr(t, f)),
             np.ascontiguousarray(getattr(t, f)).tobytes()) for f in FIELDS]  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), nodes=st.sampled_from([1, 2]),
       domain=st.sampled_from(["dc", "node", "global"]))  # fmt: skip
def test_whole_path_equals_general_path(seed, nodes, domain):
    topo = Topology.generate(3, 4, nodes_per_dc=nodes, masters=2, spare=2)
    assert tr._whole_runs(topo) == ((4, 0) if nodes == 1 else (2, 2))
    rng = np.random.default_rng(seed)
    load = rng.integers(0, 50, size=(12, 16)) * (rng.random(16) < 0.8)
    load[:, int(rng.integers(16))] += 400  # a hot expert to replicate
    dom = {"dc": topo.rank_dc, "node": topo.rank_node, "global": None}[domain]
    sol = quota_balance(load, static_placement(12, 4, 16, 2), dom)
    fast = tr.quota_traffic(load, sol, topo, 2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tr, "_whole_runs", lambda topology: None)
        general = tr.quota_traffic(load, sol, topo, 2)
    assert _bits(fast) == _bits(general)


def test_float_load_takes_the_general_path(monkeypatch):
    # a float load never reaches _quota_whole (it raises here), and gives the general
    # path's floats, every field bit for bit, as the same load in whole tokens does
    topo = Topology.generate(2, 4, masters=2, spare=2)
    rng = np.random.default_rng(1)
    load = rng.integers(0, 50, size=(8, 8))
    load[:, 3] += 300
    sol = quota_balance(load, static_placement(8, 4, 8, 2), topo.rank_dc)
    whole = tr.quota_traffic(load, sol, topo, 2)  # the whole-token path

    def no_whole(*args, **kwargs):
        raise AssertionError("_quota_whole ran on a float load")

    monkeypatch.setattr(tr, "_quota_whole", no_whole)
    floats = tr.quota_traffic(load.astype(np.float64), sol, topo, 2)
    monkeypatch.setattr(tr, "_whole_runs", lambda topology: None)
    general = tr.quota_traffic(load, sol, topo, 2)
    assert _bits(floats) == _bits(general) == _bits(whole)
