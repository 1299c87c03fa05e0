"""hybrid's slow loop does less work without deciding otherwise: the guard's lower bound,
the candidates it skips, and the domain sizes scored again only when the estimate moves."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import expertmesh.planner.domainquota as domainquota
import expertmesh.planner.hybrid as hybrid
import expertmesh.planner.hybridguard as hybridguard
from expertmesh.planner import ModelSpec, Topology, make_policy
from expertmesh.planner.costmodel import CostSettings
from expertmesh.planner.hybrid import HybridSettings, plan_hybrid
from expertmesh.planner.policy import PolicyContext
from expertmesh.planner.runner import plan_layer
from expertmesh.planner.static import static_placement
from expertmesh.planner.trace import TraceSettings, generate_trace
from expertmesh.sim.engine import COLUMNS, dense_source, simulate
from tests.unit.test_hybrid import _dom_load


def _case(seed: int, gbps: float, dcs: int):
    topo = Topology.generate(dcs, 4, masters=2, spare=2, inter_dc_gbps=gbps, inter_dc_latency_ms=5)
    rng = np.random.default_rng(seed)
    num_experts = topo.num_ranks * 2
    p = rng.dirichlet(np.full(num_experts, 0.3))
    load = rng.multinomial(4096, p, size=topo.num_ranks)  # top-2, skewed
    base = static_placement(topo.num_ranks, topo.slots_per_rank, num_experts, 2)
    return topo, load, base


def _solve(topo, load, base, model, cfg, previous=None):
    return plan_hybrid(load.astype(float), base, topo, model, cfg, previous=previous)


_CASES = dict(
    seed=st.integers(0, 10_000),
    gbps=st.sampled_from([0.05, 1.0, 10.0, 400.0]),
    dcs=st.sampled_from([2, 3]),
    ffn=st.sampled_from([1, 256, 8192]),
    training=st.booleans(),
    hierarchical=st.booleans(),
    again=st.booleans(),
)


def _setup(seed, gbps, dcs, ffn, training, hierarchical):
    topo, load, base = _case(seed, gbps, dcs)
    model = ModelSpec(
        num_experts=base.master.size, top_k=2, hidden=512, ffn_hidden=ffn, training=training
    )
    cfg = HybridSettings(cost=CostSettings(hierarchical=hierarchical, flops_per_second=1e13))
    return topo, load, base, model, cfg


@settings(max_examples=25, deadline=None)
@given(**_CASES)
def test_the_guard_bound_is_below_the_cost_of_every_candidate(
    monkeypatch_module, seed, gbps, dcs, ffn, training, hierarchical, again
):
    # every candidate the guard bounds, also those it then neither lays out nor scores
    topo, load, base, model, cfg = _setup(seed, gbps, dcs, ffn, training, hierarchical)
    seen = []
    scores, above = hybridguard.GuardCosts.scores, hybridguard.GuardCosts.above

    def check(guard, cands):
        for holds in cands:
            bound = hybridguard.guard_bound(guard.inp, holds, guard.master_dc)
            seen.append((bound, guard.cost(guard.inp, guard.build(holds))))

    def checked(self, cands, ceiling=np.inf):
        check(self, cands)
        return scores(self, cands, ceiling)

    def checked_above(self, cands, bar):  # also the candidates only bounded, never scored
        cands = list(cands)
        check(self, cands)
        return above(self, cands, bar)

    with monkeypatch_module.context() as m:  # undone after each example
        m.setattr(hybridguard.GuardCosts, "scores", checked)
        m.setattr(hybridguard.GuardCosts, "above", checked_above)
        prev = _solve(topo, load, base, model, cfg)
        if again:  # a second re-plan from a running plan: copies from it are charged too
            _solve(topo, np.roll(load, 1, axis=1), prev, model, cfg, previous=prev)
    assert seen
    for bound, c in seen:
        assert bound <= c, (bound, c)


@settings(max_examples=25, deadline=None)
@given(**_CASES)
def test_skipping_candidates_by_the_bound_picks_what_scoring_all_picks(
    monkeypatch_module, seed, gbps, dcs, ffn, training, hierarchical, again
):
    topo, load, base, model, cfg = _setup(seed, gbps, dcs, ffn, training, hierarchical)
    plans = []
    for bounded in (True, False):
        with monkeypatch_module.context() as m:
            if not bounded:  # no bound: every candidate scored
                m.setattr(hybridguard, "guard_bound", lambda inp, holds, mdc: -np.inf)
            first = _solve(topo, load, base, model, cfg)
            second = _solve(topo, np.roll(load, 1, axis=1), first, model, cfg, previous=first)
            plans.append((first, second) if again else (first,))
    for a, b in zip(*plans, strict=True):
        assert np.array_equal(a.phy2log, b.phy2log)
        assert np.array_equal(a.master, b.master)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m


# ---- the domain sizes are scored again only when the estimate moved ----

_MODEL = ModelSpec(num_experts=16, top_k=2, ffn_hidden=16384)
_COST = CostSettings(flops_per_second=1e14)


def _skewed() -> np.ndarray:
    """DC 0 ten times as busy as the others: a domain of 4 DCs spreads it (400 Gbit/s)."""
    return _dom_load()


def _even() -> np.ndarray:
    """Every DC as busy, each on its own experts: nothing to gain beyond a DC."""
    load = np.zeros((16, 16), np.int64)
    for r in range(16):
        d = r // 4
        load[r, 4 * d : 4 * d + 4] = 2000
    return load


_TOPO_400 = dict(inter_dc_gbps=400, inter_dc_latency_ms=1)


def _count_choices(monkeypatch) -> list[int]:
    """A list that grows by one at every :func:`choose_domain` call."""
    calls: list[int] = []
    choose = hybrid.choose_domain

    def counted(*args, **kw):
        calls.append(1)
        return choose(*args, **kw)

    monkeypatch.setattr(hybrid, "choose_domain", counted)
    return calls


def _period_one(tolerance: float):
    return make_policy(
        "hybrid",
        {"cost": _COST.model_dump(), "move_masters": False, "period": 1, "window": 1,
         "domain_tolerance": tolerance},
    )  # fmt: skip


def _run(loads: list[np.ndarray], tolerance: float, monkeypatch) -> tuple[list[int], int]:
    topo = Topology.generate(4, 4, masters=1, spare=2, **_TOPO_400)
    calls = _count_choices(monkeypatch)
    pol = _period_one(tolerance)
    prev, sizes = None, []
    for t, load in enumerate(loads):
        hist = loads[t - 1][None] if t else np.zeros((0, 16, 16), np.int64)
        ctx = PolicyContext(topology=topo, model=_MODEL, step=t, layer=0, load=load,
                            history=hist, previous=prev)  # fmt: skip
        prev = plan_layer(pol, ctx)
        sizes.append(pol.domain_size)
    return sizes, len(calls)


def test_the_domain_is_kept_while_the_estimate_stays_and_scored_when_it_moves(monkeypatch):
    loads = [_skewed()] * 4 + [_even()] * 3
    sizes, calls = _run(loads, 0.05, monkeypatch)
    # step 0 guesses an even load (domain 1); from step 1 on the skewed window: 4; the
    # window turns even at step 5 (it lags the load by one step): 1 again
    assert sizes == [1, 4, 4, 4, 4, 1, 1], sizes
    # scored at step 0, at step 1 (the first real window), at step 5 (the window moved);
    # steps 2-4 and 6 see the same window and the same holder sets
    assert calls == 3, calls


def test_tolerance_zero_scores_the_domain_at_every_replan(monkeypatch):
    loads = [_skewed()] * 4 + [_even()] * 3
    sizes, calls = _run(loads, 0.0, monkeypatch)
    assert sizes == [1, 4, 4, 4, 4, 1, 1], sizes
    assert calls == len(loads)


# ---- compose skips scoring the plan without replicas when its floor is above ----


@settings(max_examples=30, deadline=None)
@given(**_CASES)
def test_the_floor_without_replicas_is_below_its_modeled_step(
    seed, gbps, dcs, ffn, training, hierarchical, again
):
    from expertmesh.planner.costmodel import modeled_step
    from expertmesh.planner.domainquota import at_home, domain_quota, domain_traffic, rehome

    topo, load, base, model, cfg = _setup(seed, gbps, dcs, ffn, training, hierarchical)
    plan = _solve(topo, load, base, model, cfg) if again else rehome(base, load, topo)
    balanced = domain_quota(load, plan, topo)
    plain = at_home(balanced, plan, topo)
    traffic = domain_traffic(load, balanced, topo, model.top_k)
    floor = hybridguard.plain_floor(plain, traffic, topo, model, cfg.cost)
    own = domain_traffic(load, plain, topo, model.top_k)
    step = modeled_step(topo, model, own, plain.placement, settings=cfg.cost)
    assert floor <= step.seconds, (floor, step.seconds)


def _compose_ref(load, base, topo, model, cfg, before):
    """compose's choice scoring both options, as it did before the floor."""
    from expertmesh.planner.costmodel import modeled_step, transfer_seconds
    from expertmesh.planner.domainquota import at_home, domain_quota, domain_traffic

    def score(sol):
        copies = hybrid._replica_copies(sol, before, topo, model, cfg.encoding)
        traffic = domain_traffic(load, sol, topo, model.top_k)
        step = modeled_step(topo, model, traffic, sol.placement, settings=cfg.cost,
                            encoding=cfg.encoding, extra=copies)  # fmt: skip
        late = transfer_seconds(copies, topo) - step.phases.get("dispatch", 0.0)
        return step.seconds + max(0.0, late)

    balanced = domain_quota(load, base, topo)
    if balanced.replicas[0].size == 0:
        return balanced, score(balanced), False
    plain = at_home(balanced, base, topo)
    a, b = score(plain), score(balanced)
    return (plain, a, True) if a <= b else (balanced, b, False)


@settings(max_examples=40, deadline=None)
@given(  # fast links and expensive copies too: there the plan without replicas wins
    **_CASES | dict(gbps=st.sampled_from([0.05, 10.0, 400.0, 3200.0]),
                    ffn=st.sampled_from([1, 256, 8192, 65536]))
)  # fmt: skip
def test_compose_with_the_floor_is_compose_scoring_both(
    seed, gbps, dcs, ffn, training, hierarchical, again
):
    from expertmesh.planner.domainquota import rehome

    topo, load, base, model, cfg = _setup(seed, gbps, dcs, ffn, training, hierarchical)
    plan = _solve(topo, load, base, model, cfg)
    before = plan.holds() if again else None
    for b in (rehome(plan, load, topo), rehome(base, load, topo)):
        sol, _, cost = hybrid.compose(load, b, topo, model, cfg, before=before)
        ref, ref_cost, _ = _compose_ref(load, b, topo, model, cfg, before)
        assert cost == pytest.approx(ref_cost, rel=1e-12)
        assert np.array_equal(sol.placement.phy2log, ref.placement.phy2log)


def test_compose_keeps_the_plan_without_replicas_where_it_wins():
    # the equality above means something where the unreplicated plan can win: a copy moves
    # 100 MB to save the compute of a few tokens (and some skewed loads still replicate)
    from expertmesh.planner.domainquota import rehome

    topo = Topology.generate(2, 4, masters=2, spare=2, inter_dc_gbps=3200, inter_dc_latency_ms=0)
    model = ModelSpec(num_experts=8, top_k=2, hidden=256, ffn_hidden=65536)
    base = static_placement(topo.num_ranks, topo.slots_per_rank, 8, 2)
    won = []
    for seed, scale in [(s, x) for s in range(4) for x in (1, 2000)]:
        load = np.random.default_rng(seed).integers(0, 10, size=(topo.num_ranks, 8)) * scale
        load[:, 0] *= 5  # skewed: quota alone would replicate expert 0
        b = rehome(base, load, topo)
        cfg = HybridSettings()
        sol, _, cost = hybrid.compose(load, b, topo, model, cfg)
        ref, ref_cost, plain_won = _compose_ref(load, b, topo, model, cfg, None)
        assert cost == pytest.approx(ref_cost, rel=1e-12)
        assert np.array_equal(sol.placement.phy2log, ref.placement.phy2log)
        won.append(plain_won)
    assert any(won) and not all(won), won


def test_each_layer_keeps_its_own_domain(monkeypatch):
    # one policy plans every layer (as the runner and the controller do): layer 0 skewed
    # (a domain of 4 DCs), layer 1 even (a DC); each re-plan keeps that layer's choice
    topo = Topology.generate(4, 4, masters=1, spare=2, **_TOPO_400)
    calls = _count_choices(monkeypatch)
    sizes = {}
    for tol in (0.05, 0.0):
        calls.clear()
        pol = _period_one(tol)
        prev = [None, None]
        got = []
        for t in range(5):
            for layer, load in enumerate((_skewed(), _even())):
                hist = load[None] if t else np.zeros((0, 16, 16), np.int64)
                ctx = PolicyContext(topology=topo, model=_MODEL, step=t, layer=layer, load=load,
                                    history=hist, previous=prev[layer])  # fmt: skip
                prev[layer] = plan_layer(pol, ctx)
                got.append(pol.domain_size)
        sizes[tol] = (got, len(calls))
    assert sizes[0.05][0] == sizes[0.0][0]
    assert sizes[0.0][0][2:] == [4, 1] * 4  # from step 1 on, each layer its own
    assert sizes[0.0][1] == 10 and sizes[0.05][1] == 4  # scored at steps 0 and 1 only


# ---- memoized holders and the DC pairs of domain_traffic: the same floats ----


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), dcs=st.sampled_from([2, 3, 4]))
def test_remote_holder_memo_equals_a_fresh_solve(seed, dcs):
    topo = Topology.generate(dcs, 3, masters=2, spare=2)
    rng = np.random.default_rng(seed)
    for _ in range(3):  # several holder sets in turn, each asked twice
        holds = rng.random((dcs, 12)) < 0.5
        holds[rng.integers(0, dcs, 12), np.arange(12)] = True
        first = domainquota.remote_holder(holds, topo.rank_dc)
        domainquota._HOLDERS.clear()
        fresh = domainquota.remote_holder(holds.copy(), topo.rank_dc)
        again = domainquota.remote_holder(holds.copy(), topo.rank_dc)
        assert np.array_equal(first, fresh) and again is fresh
        assert not again.flags.writeable  # shared: no caller may change it


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), dcs=st.sampled_from([2, 3]), nodes=st.sampled_from([1, 2]))
def test_domain_traffic_pairs_are_the_sum_over_the_sent_tokens(seed, dcs, nodes):
    """The DC pairs summed over every (rank, expert), zeros included, are the floats of the
    sum over the tokens that leave their DC alone (the form before the memo)."""
    topo = Topology.generate(dcs, 4, nodes_per_dc=nodes, masters=2, spare=2)
    rng = np.random.default_rng(seed)
    num_experts = 2 * topo.num_ranks
    load = rng.multinomial(999, rng.dirichlet(np.full(num_experts, 0.3)), size=topo.num_ranks)
    base = static_placement(topo.num_ranks, topo.slots_per_rank, num_experts, 2)
    sol = domainquota.domain_quota(load, base, topo)
    got = domainquota.domain_traffic(load, sol, topo, 2)
    lf = load.astype(np.float64)
    away = np.where(sol.holds[topo.rank_dc], 0.0, lf)
    r, e = np.nonzero(away)
    key = topo.rank_dc[r] * dcs + sol.v_dc[sol.to_v[r, e]]
    pair = np.bincount(key, weights=away[r, e])
    flat = np.flatnonzero(pair)
    assert np.array_equal(got.pair_src * dcs + got.pair_dst, flat)
    assert got.pair_tokens.tobytes() == pair[flat].tobytes()


def _sim_rows(policies, monkeypatch, memo):
    topo = Topology.generate(4, 4, masters=2, spare=2, inter_dc_gbps=400.0)
    model = ModelSpec(num_experts=32, top_k=4, hidden=512, ffn_hidden=256)
    settings_ = TraceSettings(
        num_steps=12, num_layers=2, num_ranks=topo.num_ranks, num_experts=32, top_k=4,
        tokens_per_rank=512, imbalance=2.0, seed=3,
    )  # fmt: skip
    domainquota._HOLDERS.clear()
    if not memo:
        monkeypatch.setattr(domainquota, "_HOLDERS_KEPT", 0)
    res = simulate(
        dense_source(generate_trace(settings_).load), topo, model, policies,
        policy_settings={"hybrid": {"period": 3, "window": 2}},
        cost=CostSettings(solve_on_critical_path=False),
    )  # fmt: skip
    monkeypatch.undo()
    skip = ("solve_seconds", "exposed_seconds")
    return [
        [(c, v) for c, v in zip(COLUMNS, r.values(), strict=True) if c not in skip]
        for r in res.runs[0].rows
    ]


def test_plans_of_a_small_run_equal_those_without_the_memo(monkeypatch):
    """hybrid over a small run: every step's modeled results with the memo equal those of
    the algorithm without it (plant: a memo keyed on the shape alone fails here)."""
    with_memo = _sim_rows(["hybrid"], monkeypatch, memo=True)
    without = _sim_rows(["hybrid"], monkeypatch, memo=False)
    assert len(with_memo) == 12
    assert with_memo == without


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), dcs=st.sampled_from([1, 2, 3, 5]), shuffle=st.booleans())
def test_ordinal_of_the_ranks_without_an_expert_equals_the_cumsum(seed, dcs, shuffle):
    rng = np.random.default_rng(seed)
    rank_dc = np.sort(rng.integers(0, dcs, 3 * dcs))
    if shuffle:  # DCs whose ranks are not consecutive: the cumsum itself
        rng.shuffle(rank_dc)
    holds = rng.random((dcs, 7)) < 0.5
    away = ~holds[rank_dc]
    got = domainquota._ordinal(holds, rank_dc, away)
    want = np.cumsum(away, axis=0) - 1
    assert np.array_equal(np.where(away, got, 0), np.where(away, want, 0))


# ---- the holder sets' routing memoized: every microbatch between re-plans shares it ----


def _solve_fresh(load, base, topo, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(domainquota, "_ROUTINGS", {})
        m.setattr(domainquota, "_ROUTINGS_KEPT", 0)
        m.setattr(domainquota, "_HOLDERS", {})
        m.setattr(domainquota, "_HOLDERS_KEPT", 0)
        sol = domainquota.domain_quota(load, base, topo)
        return sol, domainquota.domain_traffic(load, sol, topo, 2)


def _same_solution(a, b):
    for f in ("holds", "v_dc", "v_expert", "home", "demand", "inflow", "quota", "to_v"):
        assert getattr(a, f).tobytes() == getattr(b, f).tobytes(), f
    assert a.placement.phy2log.tobytes() == b.placement.phy2log.tobytes()
    for x, y in zip(a.replicas, b.replicas, strict=True):
        assert x.tobytes() == y.tobytes()


def _same_traffic(a, b):
    for f in ("rank_tokens", "rank_out", "rank_in", "pair_src", "pair_dst", "pair_tokens",
              "dc_tokens"):  # fmt: skip
        assert getattr(a, f).tobytes() == getattr(b, f).tobytes(), f


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), dcs=st.sampled_from([2, 3, 4]), nodes=st.sampled_from([1, 2]))
def test_routing_memo_equals_a_fresh_solve(monkeypatch_module, seed, dcs, nodes):
    """domain_quota and domain_traffic with the routing memo (several holder sets in turn,
    each asked again after another's, and a load that differs each time) equal the solve
    without it, to the bit; the memo's arrays are read-only."""
    topo = Topology.generate(dcs, 4, nodes_per_dc=nodes, masters=2, spare=2)
    rng = np.random.default_rng(seed)
    num_experts = 2 * topo.num_ranks
    static = static_placement(topo.num_ranks, topo.slots_per_rank, num_experts, 2)
    bases = []
    for _ in range(3):  # holder sets: masters plus random copies in other DCs
        free = np.argsort(domainquota.dc_holds(static, topo) + rng.random((dcs, num_experts)))
        d = np.repeat(np.arange(dcs), 5)
        e = free[:, :5].ravel()  # 5 copies in each DC of experts it does not hold
        mdc = topo.rank_dc[static.master_rank()]
        holds = hybrid._holds(dcs, mdc, (d, e))
        cand = hybrid._build(_inputs(topo, rng, num_experts), static, np.zeros(num_experts, bool),
                             mdc, holds)  # fmt: skip
        bases.append(cand)
    for i in [0, 1, 0, 2, 1, 1]:
        load = rng.multinomial(999, rng.dirichlet(np.full(num_experts, 0.3)), size=topo.num_ranks)
        sol = domainquota.domain_quota(load, bases[i], topo)
        traffic = domainquota.domain_traffic(load, sol, topo, 2)
        ref, ref_traffic = _solve_fresh(load, bases[i], topo, monkeypatch_module)
        _same_solution(sol, ref)
        _same_traffic(traffic, ref_traffic)
    assert not sol.to_v.flags.writeable


def _inputs(topo, rng, num_experts):
    from expertmesh.planner.hybridpairs import HybridInputs

    model = ModelSpec(num_experts=num_experts, top_k=2, hidden=512, ffn_hidden=256)
    est = rng.multinomial(999, rng.dirichlet(np.full(num_experts, 0.3)), size=topo.num_ranks)
    dc_load = np.zeros((topo.num_dcs, num_experts))
    np.add.at(dc_load, topo.rank_dc, est)
    return HybridInputs(topo, model, HybridSettings(), est.astype(float), est, dc_load,
                        dc_load.sum(axis=1) / 2, None)  # fmt: skip
