"""quota inside every DC over a cross-DC plan's holder sets: fast == reference, quota alone
per DC, no token crosses a DC to balance, the cost model's view, rehome."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.planner import ModelSpec, Placement, Topology, rank_tokens
from expertmesh.planner.domainquota import (
    at_home,
    dc_holds,
    domain_quota,
    domain_route,
    domain_traffic,
    rehome,
    remote_inflow,
)
from expertmesh.planner.hybrid import HybridSettings, plan_hybrid
from expertmesh.planner.quota import quota_balance
from expertmesh.planner.refs import domain_quota_ref
from expertmesh.planner.static import static_placement
from expertmesh.planner.traffic import traffic_from_route


def _case(seed: int, dcs: int = 3, ranks: int = 4, nodes: int = 2, gbps: float = 0.5):
    """A topology, a skewed load and hybrid's base for it (cross-DC copies, some DCs
    without some experts)."""
    topo = Topology.generate(dcs, ranks, nodes_per_dc=nodes, masters=2, spare=2, inter_dc_gbps=gbps)
    num_experts = 2 * topo.num_ranks - 2  # some ranks hold one master only
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(num_experts, 0.3))
    load = rng.multinomial(400, p, size=topo.num_ranks).astype(np.int64)
    load[rng.random(load.shape) < 0.2] = 0
    model = ModelSpec(num_experts=num_experts, top_k=2, hidden=512, ffn_hidden=16)
    masters = static_placement(topo.num_ranks, topo.slots_per_rank, num_experts, 2)
    plan = plan_hybrid(load.astype(float), masters, topo, model, HybridSettings(fill=[0.5]))
    return topo, load, plan


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), gbps=st.sampled_from([0.05, 1.0, 50.0]))
def test_fast_equals_reference(seed, gbps):
    topo, load, base = _case(seed, gbps=gbps)
    sol = domain_quota(load, base, topo)
    quotas, phy2log, route = domain_quota_ref(load, base, topo)
    assert sol.quota.tolist() == quotas
    assert np.array_equal(sol.placement.phy2log, phy2log)
    assert sorted(domain_route(load, sol, topo).tolist()) == sorted(route.tolist())


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_remote_inflow_equals_the_split_token_by_token(seed):
    topo, load, base = _case(seed, gbps=1.0)
    holds = dc_holds(base, topo)
    got = remote_inflow(load, holds, topo.rank_dc)
    held = sorted(zip(*np.nonzero(holds), strict=True), key=lambda de: (de[1], de[0]))
    want = {de: 0 for de in held}
    for r in range(topo.num_ranks):
        for e in range(load.shape[1]):
            if holds[topo.rank_dc[r], e]:
                continue
            holders = [d for d, x in held if x == e]
            for j, d in enumerate(holders):
                want[(d, e)] += int(
                    load[r, e] // len(holders)
                    + ((j - r) % len(holders) < load[r, e] % len(holders))
                )
    assert got.tolist() == [want[de] for de in held]


@pytest.mark.parametrize("gbps", [0.2, 50.0])
def test_every_dc_reaches_what_quota_alone_reaches_on_its_load(gbps):
    replicas = 0
    for seed in range(8):
        topo, load, base = _case(seed, gbps=gbps)
        sol = domain_quota(load, base, topo)
        replicas += sol.replicas[0].size
        route = domain_route(load, sol, topo)
        tokens = rank_tokens(route, topo.num_ranks)
        for d in range(topo.num_dcs):
            ranks = np.flatnonzero(topo.rank_dc == d)
            mine = sol.v_dc == d
            # quota alone on DC d: its ranks, its held experts mastered at their homes,
            # each expert's whole demand (own tokens and tokens sent in) on one source row
            sub_p2l = np.full((ranks.size, topo.slots_per_rank), -1, np.int64)
            local_v = np.flatnonzero(mine)
            master = np.zeros(local_v.size, np.int64)
            for i, v in enumerate(local_v):
                r = int(sol.home[v] - ranks[0])
                s = int(np.flatnonzero(sub_p2l[r] < 0)[0])
                sub_p2l[r, s] = i
                master[i] = r * topo.slots_per_rank + s
            sub_load = np.zeros((ranks.size, local_v.size), np.int64)
            sub_load[0] = sol.demand[local_v]
            alone = quota_balance(sub_load, Placement(sub_p2l, master))
            alone_tokens = rank_tokens(alone.route, ranks.size)
            assert alone.quota[0] == sol.quota[d]
            assert tokens[ranks].max() == alone_tokens.max()
            assert tokens[ranks].max() / tokens[ranks].mean() == pytest.approx(
                alone_tokens.max() / alone_tokens.mean()
            )
    assert replicas > 0  # the cases do balance


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), gbps=st.sampled_from([0.05, 1.0]))
def test_no_token_crosses_a_dc_to_balance(seed, gbps):
    topo, load, base = _case(seed, gbps=gbps)
    flows = []
    balanced = domain_quota(load, base, topo)
    plain = domain_quota(load, base, topo, replicate=False)
    assert np.array_equal(plain.quota, at_home(balanced, base, topo).quota)
    assert np.array_equal(plain.placement.phy2log, at_home(balanced, base, topo).placement.phy2log)
    for sol in (balanced, plain):
        route = domain_route(load, sol, topo)
        assert sol.placement.holds()[route[:, 2], route[:, 1]].all()
        routed = np.zeros_like(load)
        np.add.at(routed, (route[:, 0], route[:, 1]), route[:, 3])
        assert np.array_equal(routed, load)  # every token routed once
        src_dc, dst_dc = topo.rank_dc[route[:, 0]], topo.rank_dc[route[:, 2]]
        # a source whose DC holds the expert keeps its tokens in the DC
        assert (src_dc == dst_dc)[sol.holds[src_dc, route[:, 1]]].all()
        f = np.zeros((topo.num_dcs, topo.num_dcs, load.shape[1]), np.int64)
        np.add.at(f, (src_dc, dst_dc, route[:, 1]), route[:, 3])
        flows.append(f)
    assert np.array_equal(flows[0], flows[1])  # replicas change nothing across DCs


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), nodes=st.sampled_from([1, 2]))
def test_cost_model_view_equals_the_route(seed, nodes):
    topo, load, base = _case(seed, nodes=nodes)
    sol = domain_quota(load, base, topo)
    exact = traffic_from_route(domain_route(load, sol, topo), load, topo, 2)
    fast = domain_traffic(load, sol, topo, 2)
    assert np.array_equal(exact.rank_tokens, fast.rank_tokens)
    pairs = np.count_nonzero(load)  # rounding: at most a token per (source, expert)
    assert np.abs(exact.rank_out - fast.rank_out).sum() <= 2 * pairs
    assert np.abs(exact.rank_in - fast.rank_in).sum() <= 2 * pairs
    assert exact.pair_tokens.sum() == pytest.approx(fast.pair_tokens.sum(), abs=1e-6)
    np.testing.assert_allclose(fast.dc_tokens, exact.dc_tokens)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_rehome_keeps_one_copy_per_dc_and_moves_nothing(seed):
    topo, load, base = _case(seed)
    composed = domain_quota(load, base, topo).placement
    again = rehome(composed, load, topo)
    assert np.array_equal(again.master, composed.master)
    assert np.array_equal(dc_holds(again, topo), dc_holds(composed, topo))
    kept = again.phy2log >= 0
    assert np.array_equal(again.phy2log[kept], composed.phy2log[kept])  # same slots
    per_dc = np.zeros(dc_holds(again, topo).shape, np.int64)
    r, s = np.nonzero(kept)
    np.add.at(per_dc, (topo.rank_dc[r], again.phy2log[r, s]), 1)
    assert per_dc.max() == 1
    # a base again: composing it keeps the holders and routes every token
    sol = domain_quota(load, again, topo)
    assert np.array_equal(sol.holds, dc_holds(composed, topo))
    assert domain_route(load, sol, topo)[:, 3].sum() == load.sum()


def test_a_base_with_two_copies_in_a_dc_is_refused():
    topo = Topology.generate(1, 2, masters=1, spare=1)
    p = Placement(np.array([[0, 1], [1, -1]]), np.array([0, 2]))
    with pytest.raises(ValueError, match="more than once"):
        domain_quota(np.ones((2, 2), np.int64), p, topo)
