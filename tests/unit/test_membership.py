"""Planning without dead ranks or DCs cut off (expertmesh.planner.membership)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.planner.membership import connected_dcs
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.policy import PolicyContext, make_policy
from expertmesh.planner.runner import plan_layer
from expertmesh.planner.topology import Topology

TOPO = Topology.from_dict(
    {
        "dcs": [
            {"name": "a", "nodes": 2, "ranks_per_node": 2},
            {"name": "b", "nodes": 1, "ranks_per_node": 2},
            {"name": "c", "nodes": 1, "ranks_per_node": 2},
        ],
        "slots_per_rank": {"masters": 2, "spare": 2},
    }
)
E = 12


def _model() -> ModelSpec:
    return ModelSpec(num_layers=1, num_experts=E, hidden=32, ffn_hidden=64)


def _ctx(load: np.ndarray, dead: tuple[int, ...], previous=None) -> PolicyContext:
    return PolicyContext(
        topology=TOPO, model=_model(), step=1, layer=0, load=load,
        history=load[None], previous=previous, dead_ranks=dead,
    )  # fmt: skip


def _check(lp, dead: tuple[int, ...], load: np.ndarray) -> None:
    r = TOPO.num_ranks
    live = np.ones(r, bool)
    live[list(dead)] = False
    p = lp.placement
    assert p.phy2log.shape == (r, TOPO.slots_per_rank)
    assert (p.phy2log[~live] < 0).all()  # no copy on a dead rank
    mr = p.master_rank()
    assert live[mr].all()  # every master on a survivor
    holds = p.holds()
    assert holds[mr, np.arange(E)].all()  # the master slot holds its expert: one master each
    route = lp.route
    assert live[route[:, 2]].all()  # no token goes to a dead rank
    assert holds[route[:, 2], route[:, 1]].all()
    # every surviving rank's tokens are routed, all of them
    for src in np.flatnonzero(live):
        got = np.bincount(route[route[:, 0] == src, 1], route[route[:, 0] == src, 3], E)
        assert np.array_equal(got.astype(np.int64), load[src])


@pytest.mark.parametrize("policy", ["static", "eplb", "quota", "hybrid", "fastermoe"])
@given(
    dead=st.sets(st.integers(0, TOPO.num_ranks - 1), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=15, deadline=None)
def test_plans_put_nothing_on_dead_ranks(policy: str, dead: set[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    load = rng.integers(0, 50, size=(TOPO.num_ranks, E)).astype(np.int64)
    d = tuple(sorted(dead))
    load[list(d)] = 0  # dead ranks send nothing
    pol = make_policy(policy)
    lp = plan_layer(pol, _ctx(load, d))
    _check(lp, d, load)
    # the next plan starts from this one (its previous has nothing on dead ranks)
    lp2 = plan_layer(pol, _ctx(load, d, previous=lp))
    _check(lp2, d, load)
    for t in lp2.migration.transfers:
        assert t.src_rank not in d and t.dst_rank not in d


def test_no_dead_ranks_is_the_plain_plan() -> None:
    load = np.arange(TOPO.num_ranks * E, dtype=np.int64).reshape(TOPO.num_ranks, E)
    pol = make_policy("eplb")
    a, b = plan_layer(pol, _ctx(load, ())), plan_layer(pol, _ctx(load, ()))
    assert np.array_equal(a.phy2log, b.phy2log)


def test_bad_dead_ranks_raise() -> None:
    load = np.zeros((TOPO.num_ranks, E), np.int64)
    with pytest.raises(ValueError, match="dead_ranks"):
        _ctx(load, (TOPO.num_ranks,))
    with pytest.raises(ValueError, match="dead_ranks"):
        _ctx(load, tuple(range(TOPO.num_ranks)))


def test_too_few_survivors_raise() -> None:
    load = np.zeros((TOPO.num_ranks, E), np.int64)
    # 2 survivors x 4 slots cannot hold 12 experts
    with pytest.raises(ValueError, match="cannot hold"):
        plan_layer(make_policy("static"), _ctx(load, (0, 1, 2, 3, 4, 5)))


@pytest.mark.parametrize("policy", ["static", "eplb", "quota", "hybrid", "fastermoe"])
def test_cut_dc_gets_no_copies_or_routes(policy: str) -> None:
    """A cut between DCs a and c: c pauses (connected_dcs), its ranks are planned out, so
    no copy and no route crosses the cut."""
    up = np.ones((3, 3), bool)
    up[0, 2] = up[2, 0] = False
    keep = connected_dcs(up, home=0)
    assert keep.tolist() == [True, True, False]
    dead = tuple(np.flatnonzero(~keep[TOPO.rank_dc]).tolist())
    rng = np.random.default_rng(3)
    load = rng.integers(0, 40, size=(TOPO.num_ranks, E)).astype(np.int64)
    load[list(dead)] = 0
    lp = plan_layer(make_policy(policy), _ctx(load, dead))
    _check(lp, dead, load)
    dc = TOPO.rank_dc
    route = lp.route[lp.route[:, 3] > 0]
    crossing = ~up[dc[route[:, 0]], dc[route[:, 2]]]
    assert not crossing.any()
    assert not lp.placement.holds()[dc == 2].any()


def test_connected_dcs() -> None:
    up = np.ones((4, 4), bool)
    assert connected_dcs(up).all()
    up[1, 2] = up[2, 1] = False  # 1 and 2 cannot both stay: the lower index wins
    assert connected_dcs(up).tolist() == [True, True, False, True]
    up[:] = False
    np.fill_diagonal(up, True)
    assert connected_dcs(up, home=2).tolist() == [False, False, True, False]
    with pytest.raises(ValueError, match="symmetric"):
        connected_dcs(np.triu(np.ones((3, 3), bool)))
    with pytest.raises(ValueError, match="home"):
        connected_dcs(np.ones((2, 2), bool), home=2)
