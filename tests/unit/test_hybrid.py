"""hybrid and fastermoe: valid plans, the two degenerate cases, the guard, shadowing."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.planner import ModelSpec, Topology, check_layer_plan, make_policy, plan_trace
from expertmesh.planner.costmodel import CostSettings, placement_cost
from expertmesh.planner.domainquota import dc_holds
from expertmesh.planner.fastermoe import shadow, shadow_traffic
from expertmesh.planner.hybrid import HybridSettings, compose, plan_hybrid
from expertmesh.planner.policy import PolicyContext
from expertmesh.planner.quota import quota_balance
from expertmesh.planner.runner import plan_layer
from expertmesh.planner.static import static_placement
from expertmesh.planner.topology import Link
from expertmesh.planner.traffic import even_traffic, traffic_from_route


def _topo(gbps: float, latency_ms: float = 20.0) -> Topology:
    return Topology.generate(
        2, 4, masters=2, spare=2, inter_dc_gbps=gbps, inter_dc_latency_ms=latency_ms
    )


def _load(topo: Topology, num_experts: int, tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(num_experts))
    return rng.multinomial(tokens * 2, p, size=topo.num_ranks)  # top-2


def _hybrid(topo, model, load, **cfg):
    base = static_placement(topo.num_ranks, topo.slots_per_rank, model.num_experts, 2)
    return base, plan_hybrid(load.astype(float), base, topo, model, HybridSettings(**cfg))


def test_fast_links_and_expensive_copies_give_static():
    topo = _topo(gbps=3200, latency_ms=0.0)
    model = ModelSpec(num_experts=8, top_k=2, hidden=256, ffn_hidden=65536)
    load = np.full((topo.num_ranks, 8), 64)  # balanced: copies could only cost
    base, plan = _hybrid(topo, model, load)
    assert np.array_equal(plan.phy2log, base.phy2log)
    assert np.array_equal(plan.master, base.master)


def test_slow_links_and_cheap_copies_replicate_every_used_expert_in_every_dc():
    topo = _topo(gbps=0.01)
    model = ModelSpec(num_experts=8, top_k=2, hidden=1024, ffn_hidden=1)
    load = _load(topo, 8, 4096)
    _, plan = _hybrid(topo, model, load, move_masters=False)
    held = np.zeros((2, 8), bool)
    r, s = np.nonzero(plan.phy2log >= 0)
    held[topo.rank_dc[r], plan.phy2log[r, s]] = True
    used = np.zeros((2, 8))
    np.add.at(used, topo.rank_dc, load)
    assert held[used > 0].all()
    # and no token crosses a DC any more
    c = placement_cost(topo, model, load, plan, domain="dc", remote="spread")
    assert c.cross_dc_token_bytes == 0


def test_masters_move_to_the_dc_that_uses_them():
    topo = _topo(gbps=1.0)
    model = ModelSpec(num_experts=8, top_k=1, hidden=1024, ffn_hidden=4)
    load = np.zeros((8, 8), np.int64)
    load[4:, :] = 1000  # only DC 1 sends tokens
    _, plan = _hybrid(topo, model, load, period=100)
    assert (topo.rank_dc[plan.master_rank()] == 1).all()


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 1000),
    gbps=st.sampled_from([0.05, 1.0, 10.0, 400.0]),
    ffn=st.sampled_from([1, 64, 4096]),
    training=st.booleans(),
    inside=st.sampled_from(["quota", "split"]),
)
def test_guard_never_picks_a_plan_slower_than_masters_only(seed, gbps, ffn, training, inside):
    topo = _topo(gbps)
    model = ModelSpec(num_experts=8, top_k=2, hidden=512, ffn_hidden=ffn, training=training)
    load = _load(topo, 8, 2048, seed)
    base, plan = _hybrid(topo, model, load, move_masters=False, inside=inside)
    static = placement_cost(topo, model, load, base, domain="dc", remote="spread").seconds
    if inside == "split":
        cost = placement_cost(topo, model, load, plan, domain="dc", remote="spread").seconds
    else:  # what runs: quota inside the DCs of the plan, when the model says it pays
        cost = compose(load, plan, topo, model, HybridSettings())[2]
    assert cost <= static * (1 + 1e-9)


@pytest.mark.parametrize("name", ["hybrid", "fastermoe"])
def test_plans_are_valid_over_a_trace(name):
    topo = _topo(gbps=1.0)
    model = ModelSpec(num_experts=8, top_k=2, hidden=512, ffn_hidden=16)
    rng = np.random.default_rng(5)
    load = rng.integers(0, 300, size=(5, 2, topo.num_ranks, 8))
    settings_ = {"period": 2, "window": 2} if name == "hybrid" else None
    plan = plan_trace(load, topo, model, make_policy(name, settings_))
    for t in range(5):
        for layer in range(2):
            check_layer_plan(plan.layers[t][layer], load[t, layer], topo.slots_per_rank)


@pytest.mark.parametrize("inside", ["quota", "split"])
def test_hybrid_keeps_its_plan_between_periods(inside):
    topo = _topo(gbps=0.1)
    model = ModelSpec(num_experts=8, top_k=2, hidden=512, ffn_hidden=16)
    load = np.random.default_rng(2).integers(0, 300, size=(5, 1, topo.num_ranks, 8))
    pol = make_policy("hybrid", {"period": 3, "window": 1, "inside": inside})
    plan = plan_trace(load, topo, model, pol)
    p = [plan.layers[t][0].placement for t in range(5)]
    held = [dc_holds(x, topo) for x in p]
    assert held[0].sum() > 8  # uniform prior at step 0: already replicated
    assert p[1] is not p[0]  # step 1 re-plans on the first history
    for a, b in ((1, 2), (3, 4)):  # between re-plans: the same holders and masters
        assert np.array_equal(held[a], held[b]) and np.array_equal(p[a].master, p[b].master)
        if inside == "split":
            assert np.array_equal(p[a].phy2log, p[b].phy2log)


def test_hybrid_at_step_zero_uses_only_the_token_count():
    topo = _topo(gbps=0.1)
    model = ModelSpec(num_experts=8, top_k=2, hidden=512, ffn_hidden=16)
    pol = make_policy("hybrid")
    a = np.zeros((1, 1, topo.num_ranks, 8), np.int64)
    a[..., 0] = 100  # every token wants expert 0
    b = np.full((1, 1, topo.num_ranks, 8), 100 // 8)
    b[..., :4] += 1  # same totals, spread
    pa = plan_trace(a, topo, model, pol).layers[0][0].placement
    pb = plan_trace(b, topo, model, pol).layers[0][0].placement
    # the slow loop's holders: the same; inside the DCs quota works on each exact load
    assert np.array_equal(dc_holds(pa, topo), dc_holds(pb, topo))
    assert np.array_equal(pa.master, pb.master)


def test_capacity_shares_slots_across_pairs():
    # three DCs of one rank with no spare slot beyond two: DC 0 cannot copy everything
    topo = Topology.generate(3, 1, masters=2, spare=1, inter_dc_gbps=0.01)
    model = ModelSpec(num_experts=6, top_k=1, hidden=1024, ffn_hidden=1)
    load = np.array([[0, 0, 500, 400, 300, 200], [0] * 6, [0] * 6])
    _, plan = _hybrid(topo, model, load, move_masters=False)
    assert (plan.phy2log[0] >= 0).sum() == 3  # its two masters and one copy
    assert 2 in plan.phy2log[0]  # the heaviest remote expert


@pytest.mark.parametrize("inside", ["quota", "split"])
def test_hybrid_route_matches_what_the_simulator_charges(inside):
    topo = _topo(gbps=1.0)
    model = ModelSpec(num_experts=8, top_k=2, hidden=512, ffn_hidden=1)
    load = _load(topo, 8, 1024, 3)
    pol = make_policy("hybrid", {"inside": inside})
    ctx = PolicyContext(topo, model, 0, 0, load, np.zeros((0, *load.shape), np.int64))
    plan = plan_layer(pol, ctx)
    check_layer_plan(plan, load, topo.slots_per_rank)
    exact = traffic_from_route(plan.route, load, topo, 2)
    fast = pol.route_traffic(ctx, plan.placement)
    if inside == "split":
        assert fast is None
        domain, remote = pol.even_split
        fast = even_traffic(load, plan.placement, topo, 2, domain=domain, remote=remote)
    assert np.abs(exact.rank_tokens - fast.rank_tokens).max() < np.count_nonzero(load)
    assert exact.pair_tokens.sum() == pytest.approx(fast.pair_tokens.sum(), abs=64)


def test_hybrid_balances_inside_dcs_with_quota():
    # fast links, cheap copies, one hot expert per DC: quota splits it inside its DC
    topo = Topology.generate(2, 4, masters=2, spare=2, inter_dc_gbps=400)
    model = ModelSpec(num_experts=8, top_k=1, hidden=64, ffn_hidden=4096)
    load = np.full((1, 1, 8, 8), 10, np.int64)
    load[0, 0, :4, 0] = 2000  # DC 0 hammers expert 0
    load[0, 0, 4:, 4] = 2000  # DC 1 hammers expert 4
    plans = {
        inside: plan_trace(load, topo, model, make_policy("hybrid", {"inside": inside}))
        for inside in ("quota", "split")
    }
    tokens = {k: v.layers[0][0].rank_tokens() for k, v in plans.items()}
    imb = {k: t.max() / t.mean() for k, t in tokens.items()}
    assert imb["quota"] < 1.01 < imb["split"]


def test_fast_links_and_expensive_copies_give_static_every_microbatch():
    # the policy, not just its slow loop: quota's replicas would not pay either (a copy
    # moves 100 MB over a 400 Gbit/s port to save the compute of a few hundred tokens)
    topo = _topo(gbps=3200, latency_ms=0.0)
    model = ModelSpec(num_experts=8, top_k=2, hidden=256, ffn_hidden=65536)
    load = np.random.default_rng(1).integers(0, 10, size=(4, 1, topo.num_ranks, 8))
    load[:, :, :, 0] *= 5  # skewed: quota alone replicates expert 0
    assert quota_balance(load[0, 0], static_placement(8, 4, 8, 2)).placement.holds().sum() > 8
    plan = plan_trace(load, topo, model, make_policy("hybrid", {"period": 2, "window": 1}))
    static = static_placement(topo.num_ranks, topo.slots_per_rank, 8, 2)
    for t in range(4):
        assert np.array_equal(plan.layers[t][0].placement.holds(), static.holds())


def test_shadow_puts_experts_on_every_rank():
    base = static_placement(4, 3, 4, 1)
    p = shadow(base, np.array([2, 0]))
    holds = p.holds()
    assert holds[:, 2].all() and holds[:, 0].all()
    assert np.array_equal(p.master, base.master)
    with pytest.raises(ValueError, match="free slots"):
        shadow(base, np.array([0, 1, 2]))


def test_fastermoe_shadows_hot_experts_when_links_are_slow_and_not_when_fast():
    model = ModelSpec(num_experts=8, top_k=2, hidden=1024, ffn_hidden=1)
    slow = _topo(gbps=0.01)
    load = np.zeros((1, 1, 8, 8), np.int64)
    load[0, 0, :, 0] = 5000  # everyone wants expert 0 (on rank 0)
    pol = make_policy("fastermoe")
    p = plan_trace(load, slow, model, pol).layers[0][0].placement
    assert p.holds()[:, 0].all()
    big = ModelSpec(num_experts=8, top_k=2, hidden=64, ffn_hidden=1 << 20)
    fast = Topology.generate(2, 4, masters=2, spare=2, inter_dc_gbps=3200,
                             intra_dc=Link(3200, 0.0))  # fmt: skip
    light = np.ones((1, 1, 8, 8), np.int64)
    p = plan_trace(light, fast, big, pol).layers[0][0].placement
    assert p.holds().sum() == 8


def test_hybrid_settings_are_validated():
    with pytest.raises(ValueError, match="period"):
        make_policy("hybrid", {"period": 0})
    with pytest.raises(ValueError, match="flops_per_second"):
        make_policy("hybrid", {"cost": {"flops_per_second": -1}})
    assert make_policy("hybrid", {"cost": CostSettings().model_dump()}).name == "hybrid"


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), j=st.integers(1, 3))
def test_shadow_traffic_equals_the_full_computation(seed, j):
    topo = Topology.generate(3, 2, nodes_per_dc=2, masters=2, spare=3)
    base = static_placement(topo.num_ranks, topo.slots_per_rank, 8, 2)
    load = np.random.default_rng(seed).integers(0, 100, size=(topo.num_ranks, 8))
    hot = np.argsort(-load.sum(axis=0), kind="stable")[:j]
    t = even_traffic(load, base, topo, 2, domain="rank")
    for e in hot:
        t = shadow_traffic(t, load, base, topo, int(e))
    ref = even_traffic(load, shadow(base, hot), topo, 2, domain="rank")
    np.testing.assert_allclose(t.rank_tokens, ref.rank_tokens, atol=1e-9)
    np.testing.assert_allclose(t.rank_out, ref.rank_out, atol=1e-9)
    np.testing.assert_allclose(t.rank_in, ref.rank_in, atol=1e-9)
    got = {(a, b): v for a, b, v in zip(t.pair_src, t.pair_dst, t.pair_tokens, strict=True)}
    want = {(a, b): v for a, b, v in zip(ref.pair_src, ref.pair_dst, ref.pair_tokens, strict=True)}
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(v) for k, v in want.items())


# ---- the domain quota copies experts inside: a decision of the cost model ----

_DOM_MODEL = ModelSpec(num_experts=16, top_k=2, ffn_hidden=16384)
_DOM_COST = CostSettings(flops_per_second=1e14)


def _dom_load() -> np.ndarray:
    """Tokens stay in their DC's experts; DC 0's are 10x as busy, expert 0 hotter still:
    only a domain larger than a DC can spread DC 0's work, over the WAN."""
    load = np.zeros((16, 16), np.int64)
    for r in range(16):
        d = r // 4
        load[r, 4 * d : 4 * d + 4] = 20000 if d == 0 else 2000
    load[0:4, 0] = 60000
    return load


def _domain(gbps, **enc):
    from expertmesh.planner.hybrid import choose_domain

    topo = Topology.generate(4, 4, masters=1, spare=2, inter_dc_gbps=gbps, inter_dc_latency_ms=1)
    cfg = HybridSettings(cost=_DOM_COST, encoding=enc)
    base = static_placement(16, 3, 16, 1)
    return choose_domain(_dom_load(), base, topo, _DOM_MODEL, cfg)


def test_the_domain_grows_as_the_wan_gets_faster():
    sizes = [_domain(g) for g in (1, 10, 30, 100, 400)]
    assert sizes == sorted(sizes), sizes  # never smaller on a faster WAN
    assert sizes[0] == 1 and sizes[-1] == 4, sizes


def test_the_domain_grows_as_migration_gets_cheaper():
    # at 30 Gbit/s a bf16 copy across the WAN does not pay its way; a 4-bit one does
    assert _domain(30) == 1
    assert _domain(30, weight_bytes=0.5, grad_bytes=0.5) == 4


def test_hybrid_plans_with_the_domain_it_chose():
    topo = Topology.generate(4, 4, masters=1, spare=2, inter_dc_gbps=400, inter_dc_latency_ms=1)
    load = _dom_load()
    pol = make_policy("hybrid", {"cost": _DOM_COST.model_dump(), "move_masters": False})
    prev = None
    for t in range(3):
        ctx = PolicyContext(topology=topo, model=_DOM_MODEL, step=t, layer=0, load=load,
                            history=load[None] if t else np.zeros((0, 16, 16), np.int64),
                            previous=prev)  # fmt: skip
        prev = plan_layer(pol, ctx)
        check_layer_plan(prev, load, topo.slots_per_rank)
    assert pol.domain_size == 4
    # copies of DC 0's experts now compute in other DCs, and the route sends them tokens
    dst_dc = topo.rank_dc[prev.route[:, 2]]
    src_dc = topo.rank_dc[prev.route[:, 0]]
    assert ((src_dc == 0) & (dst_dc != 0) & (prev.route[:, 3] > 0)).any()
    fixed = make_policy("hybrid", {"cost": _DOM_COST.model_dump(), "domain": 1})
    ctx = PolicyContext(topology=topo, model=_DOM_MODEL, step=0, layer=0, load=load,
                        history=np.zeros((0, 16, 16), np.int64), previous=None)  # fmt: skip
    plan_layer(fixed, ctx)
    assert fixed.domain_size == 1
    with pytest.raises(ValueError, match="domain 3"):
        plan_layer(make_policy("hybrid", {"domain": 3}), ctx)
