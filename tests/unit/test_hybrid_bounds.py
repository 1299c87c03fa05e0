"""hybrid's bounds, exact where it skips work: the guard bound's DC pairs are the route's,
and a domain larger than a DC is scored without its plan without replicas only where
that plan is a DC's (every expert in one DC)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import expertmesh.planner.domainquota as domainquota
import expertmesh.planner.hybrid as hybrid
import expertmesh.planner.hybridguard as hybridguard
from expertmesh.planner import ModelSpec, Topology
from expertmesh.planner.costmodel import CostSettings, modeled_step
from expertmesh.planner.hybrid import HybridSettings, choose_domain
from expertmesh.planner.static import static_placement
from expertmesh.planner.traffic import traffic_from_route


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), dcs=st.sampled_from([2, 3, 5]), shuffled=st.booleans())
def test_the_guard_bounds_dc_pairs_are_the_routes_cells_summed(seed, dcs, shuffled):
    """guard_bound's DC pairs (experts with one holder from the DC sums, the others rank by
    rank) are the floats of summing every (rank, expert) cell by the route's DC pair;
    with ranks of a DC not consecutive too (the route's ordinals then go by cumsum)."""
    topo = Topology.generate(dcs, 4, masters=2, spare=2)
    rng = np.random.default_rng(seed)
    rank_dc = rng.permutation(topo.rank_dc) if shuffled else topo.rank_dc
    num_experts = 12
    load = rng.multinomial(999, rng.dirichlet(np.full(num_experts, 0.3)), size=topo.num_ranks)
    holds = rng.random((dcs, num_experts)) < rng.choice([0.1, 0.5, 0.9])
    holds[rng.integers(0, dcs, num_experts), np.arange(num_experts)] = True
    fixed = hybridguard._Fixed(
        load=load.astype(np.float64), local=domainquota.sum_rows(load, rank_dc, dcs),
        used=load.any(axis=0), dc_tokens=np.zeros(dcs), mean=0.0, previous=None,
        sizes=None if shuffled else np.bincount(rank_dc, minlength=dcs),
        place=None if shuffled else np.arange(rank_dc.size) - np.searchsorted(rank_dc, rank_dc),
    )  # fmt: skip
    got = hybridguard._dc_pairs(fixed, holds, rank_dc)
    to_v = domainquota.remote_holder(holds, rank_dc)  # -1 where the source's DC holds e
    away = to_v >= 0
    v_dc = np.nonzero(holds.T)[1]  # the holder DC of every virtual expert
    key = rank_dc[:, None] * dcs + v_dc[np.maximum(to_v, 0)]
    want = np.bincount(key[away], weights=load[away].astype(float), minlength=dcs * dcs)
    assert np.array_equal(got, want.reshape(dcs, dcs))
    holds[:, int(np.argmax(load.sum(axis=0)))] = False  # an expert with load and no copy
    assert hybridguard._dc_pairs(fixed, holds, rank_dc) is None


def _domains_case(seed, gbps, dcs, copies):
    topo = Topology.generate(dcs, 4, masters=1, spare=2, inter_dc_gbps=gbps, inter_dc_latency_ms=1)
    rng = np.random.default_rng(seed)
    num_experts = topo.num_ranks
    load = rng.multinomial(4096, rng.dirichlet(np.full(num_experts, 0.3)), size=topo.num_ranks)
    load[: topo.num_ranks // dcs] *= 5  # DC 0 busier: a larger domain can spread it
    base = static_placement(topo.num_ranks, topo.slots_per_rank, num_experts, 1)
    if copies:  # DC 0's experts held in DC 1 too (the shortcut must not apply): a domain
        # of both holds each once, syncs less, and its plan without replicas can win
        phy2log = base.phy2log.copy()
        phy2log[4:8, 1] = np.arange(4)
        base = type(base)(phy2log, base.master)
    model = ModelSpec(num_experts=num_experts, top_k=2, hidden=512, ffn_hidden=8192)
    cfg = HybridSettings(cost=CostSettings(flops_per_second=1e13))
    return topo, load, base, model, cfg


_DOMAIN_CASES = dict(
    seed=st.integers(0, 10_000),
    gbps=st.sampled_from([1.0, 10.0, 100.0, 400.0, 3200.0]),
    dcs=st.sampled_from([2, 4]),
    copies=st.booleans(),
)


@settings(max_examples=30, deadline=None)
@given(**_DOMAIN_CASES)
def test_the_plan_without_replicas_of_any_domain_is_a_dcs_with_one_holder_each(
    seed, gbps, dcs, copies
):
    """The fact choose_domain's shortcut rests on: with every expert in one DC, the plan
    without replicas of a domain of k DCs routes as a DC's and costs the same floats."""
    topo, load, base, model, cfg = _domains_case(seed, gbps, dcs, False)
    costs = []
    for k in domainquota.domain_sizes(topo):
        dom = domainquota.merge_dcs(topo, k)
        kbase = domainquota.rehome(base, load, dom)
        sol = domainquota.domain_quota(load, kbase, dom, replicate=False)
        if k == 1:
            traffic = domainquota.domain_traffic(load, sol, topo, model.top_k)
        else:
            route = domainquota.domain_route(load, sol, dom)
            traffic = traffic_from_route(route, load, topo, model.top_k)
        step = modeled_step(topo, model, traffic, sol.placement, settings=cfg.cost)
        costs.append(step.seconds)
    assert len(costs) > 1 and all(c == costs[0] for c in costs), costs


@settings(max_examples=30, deadline=None)
@given(**_DOMAIN_CASES, again=st.booleans())
def test_choose_domain_is_choose_domain_scoring_both_plans_of_every_domain(
    monkeypatch_module, seed, gbps, dcs, copies, again
):
    topo, load, base, model, cfg = _domains_case(seed, gbps, dcs, copies)
    before = base.holds() if again else None
    got = choose_domain(load, base, topo, model, cfg, before=before)
    compose = hybrid.compose
    with monkeypatch_module.context() as m:
        m.setattr(hybrid, "compose", lambda *a, **kw: compose(*a, **{**kw, "plain": True}))
        want = choose_domain(load, base, topo, model, cfg, before=before)
    assert got == want


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m
