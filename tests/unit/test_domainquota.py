"""quota inside every DC over a cross-DC plan's holder sets: fast == reference, quota alone
per DC, no token crosses a DC to balance, the cost model's view, rehome."""

from __future__ import annotations

import dataclasses

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
    remote_holder,
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
def test_remote_inflow_equals_the_rotation_token_by_token(seed):
    topo, load, base = _case(seed, gbps=1.0)
    holds = dc_holds(base, topo)
    got = remote_inflow(load, holds, topo.rank_dc)
    held = sorted(zip(*np.nonzero(holds), strict=True), key=lambda de: (de[1], de[0]))
    want = {de: 0 for de in held}
    for e in range(load.shape[1]):
        holders = [d for d, x in held if x == e]
        k = 0
        for r in range(topo.num_ranks):
            if not holds[topo.rank_dc[r], e]:
                want[(holders[(k + e) % len(holders)], e)] += int(load[r, e])
                k += 1
    assert got.tolist() == [want[de] for de in held]


def _spread_case(seed: int):
    """16 DCs of 2 ranks, 12 experts each held by 1-5 DCs: many sources per holder."""
    topo = Topology.generate(16, 2, masters=1, spare=3)
    rng = np.random.default_rng(seed)
    num_experts = 12
    p2l = np.full((topo.num_ranks, topo.slots_per_rank), -1, np.int64)
    master = np.zeros(num_experts, np.int64)
    for e in range(num_experts):  # master of e on rank e (slot 0), copies on other DCs
        p2l[e, 0] = e
        master[e] = e * topo.slots_per_rank
        mdc = int(topo.rank_dc[e])
        others = rng.choice([d for d in range(topo.num_dcs) if d != mdc], int(rng.integers(0, 5)),
                            replace=False)  # fmt: skip
        for d in others:
            r = int(2 * d + rng.integers(0, 2))
            free = np.flatnonzero(p2l[r] < 0)
            if free.size:
                p2l[r, free[0]] = e
    load = rng.integers(0, 50, size=(topo.num_ranks, num_experts)).astype(np.int64)
    return topo, load, Placement(p2l, master)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_the_rotation_routes_every_token_whole_to_one_holder_and_balances_sources(seed):
    topo, load, base = _spread_case(seed)
    holds = dc_holds(base, topo)
    sol = domain_quota(load, base, topo, replicate=False)
    route = domain_route(load, sol, topo)
    routed = np.zeros_like(load)
    np.add.at(routed, (route[:, 0], route[:, 1]), route[:, 3])
    assert np.array_equal(routed, load)  # every token routed, once
    assert holds[topo.rank_dc[route[:, 2]], route[:, 1]].all()  # only to holders
    # each (source, expert) whole to one DC: one row, since no replicas
    assert len({(s, e) for s, e, _, _ in route.tolist()}) == len(route)
    target = remote_holder(holds, topo.rank_dc)  # [R, E]
    for e in range(load.shape[1]):
        away = ~holds[topo.rank_dc, e]
        h = int(holds[:, e].sum())
        first = int(holds[:, :e].sum())  # virtual experts are by expert, then DC
        got = np.bincount(target[away, e] - first, minlength=h)
        if away.any() and h > 1:
            # every holder serves floor or ceil of the sources without e
            assert got.size == h and got.max() - got.min() <= 1
            assert got.sum() == away.sum()
    assert (target[holds[topo.rank_dc]] == -1).all()


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


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_fast_equals_reference_with_many_holders(seed):
    topo, load, base = _spread_case(seed)
    sol = domain_quota(load, base, topo)
    quotas, phy2log, route = domain_quota_ref(load, base, topo)
    assert sol.quota.tolist() == quotas
    assert np.array_equal(sol.placement.phy2log, phy2log)
    assert sorted(domain_route(load, sol, topo).tolist()) == sorted(route.tolist())


def test_routing_in_blocks_of_dcs_gives_the_same_rows(monkeypatch):
    import expertmesh.planner.domainquota as dq

    for seed in range(6):
        topo, load, base = _case(seed, gbps=50.0)
        sol = domain_quota(load, base, topo)
        whole = sorted(domain_route(load, sol, topo).tolist())
        monkeypatch.setattr(dq, "_ROUTE_CELLS", 1)  # one DC per block
        assert sorted(domain_route(load, sol, topo).tolist()) == whole
        monkeypatch.undo()


def test_rehome_with_a_reserve_keeps_a_free_slot_on_every_rank_it_can():
    """DC 0: rank 0 holds two cold masters and a copy of expert 5, rank 1 one master and
    another copy of 5. By work alone rank 0 (least loaded) keeps 5 and is full; with
    ``reserve=1`` rank 1 keeps it, so both ranks keep a free slot for the fast loop."""
    topo = Topology.generate(2, 2, masters=2, spare=1)  # 2 DCs x 2 ranks x 3 slots
    p2l = np.array([[0, 1, 5], [2, 5, -1], [3, 4, -1], [5, 6, 7]], np.int32)
    master = np.array([0, 1, 3, 6, 7, 9, 10, 11])
    p = Placement(p2l, master)
    load = np.ones((4, 8), np.int64)
    load[:2, 2] = 500  # rank 1's master is hot
    plain = rehome(p, load, topo)
    kept = rehome(p, load, topo, 1)
    assert plain.phy2log[0].tolist() == [0, 1, 5] and plain.phy2log[1].tolist() == [2, -1, -1]
    assert kept.phy2log[0].tolist() == [0, 1, -1] and kept.phy2log[1].tolist() == [2, 5, -1]
    assert np.array_equal(dc_holds(kept, topo), dc_holds(plain, topo))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), dcs=st.integers(1, 5), size=st.integers(1, 4))
def test_row_sums_by_dc_take_the_integer_path_and_give_the_same_floats(seed, dcs, size):
    from expertmesh.planner.domainquota import sum_rows

    rng = np.random.default_rng(seed)
    group = np.repeat(np.arange(dcs), size)  # a topology's DCs: in order, equal sizes
    shuffled = rng.permutation(group)  # the bincount path
    for x in (rng.integers(0, 10**6, size=(group.size, 7)), rng.random((group.size, 7)) < 0.5):
        for g in (group, shuffled):
            want = np.zeros((dcs, 7))
            np.add.at(want, g, x.astype(np.float64))
            got = sum_rows(x, g, dcs)
            assert got.dtype == np.float64 and np.array_equal(got, want)


def test_memos_by_identity_serve_only_what_cannot_change(monkeypatch):
    # rehome of a plan of masters only (each DC's copies its masters') is one read-only
    # base per masters, whatever the replicas: the same object, whose parts domain_quota
    # finds by identity; holder sets that can still change are never served by identity
    from expertmesh.planner import domainquota
    from expertmesh.planner.domainquota import holder_routing

    topo = Topology.generate(2, 4, masters=2, spare=2)
    num_experts = 2 * topo.num_ranks
    masters = static_placement(topo.num_ranks, topo.slots_per_rank, num_experts, 2)
    rng = np.random.default_rng(5)
    load = rng.integers(0, 50, size=(topo.num_ranks, num_experts))
    p2l = masters.phy2log.copy()
    p2l[0, 2] = p2l[1, 0]  # a replica of rank 1's first master on rank 0 (same DC)
    with_replica = Placement(p2l, masters.master.copy())
    a, b = rehome(masters, load, topo), rehome(with_replica, load, topo)
    assert a is b and not a.phy2log.flags.writeable and not a.master.flags.writeable
    want = np.full_like(masters.phy2log, -1)
    want.reshape(-1)[masters.master] = np.arange(num_experts)
    assert np.array_equal(a.phy2log, want) and np.array_equal(a.master, masters.master)
    # served by identity (the read-only base of the last call) vs built afresh (a writable
    # copy, no by-value memo to hit): the same solution, field by field
    domain_quota(load, a, topo)
    last = domainquota._LAST_BASE[0]
    assert last is not None and last[0] is a  # a frozen base: kept by identity
    with monkeypatch.context() as m:
        # no by-value entries: b's parts can come only from the identity slot, and the
        # reference's base parts and holder routing are computed from scratch
        m.setattr(domainquota, "_BASES", {})
        m.setattr(domainquota, "_BASES_KEPT", 0)
        m.setattr(domainquota, "_ROUTINGS", {})
        m.setattr(domainquota, "_ROUTINGS_KEPT", 0)
        sol = domain_quota(load, b, topo)
        assert domainquota._LAST_BASE[0] is last and sol.holds is last[2][0]  # by identity
        by_value = domain_quota(load, Placement(a.phy2log.copy(), a.master.copy()), topo)
        assert domainquota._LAST_BASE[0] is last  # a writable base is never kept
        assert by_value.holds is not sol.holds and not domainquota._BASES
    for f in dataclasses.fields(sol):
        x, y = getattr(sol, f.name), getattr(by_value, f.name)
        if isinstance(x, Placement):
            x, y = (x.phy2log, x.master), (y.phy2log, y.master)
        elif not isinstance(x, tuple):
            x, y = (x,), (y,)
        assert len(x) == len(y), f.name
        for u, v in zip(map(np.asarray, x), map(np.asarray, y), strict=True):
            assert u.dtype == v.dtype and np.array_equal(u, v), f.name
    holds = dc_holds(masters, topo)  # writable: looked up by value every time
    first = holder_routing(holds, topo.rank_dc)
    holds[1, 0] = True  # DC 1 now holds expert 0 too
    second = holder_routing(holds, topo.rank_dc)
    assert second.v_dc.size == first.v_dc.size + 1
    assert np.array_equal(second.v_dc, holder_routing(holds.copy(), topo.rank_dc).v_dc)
