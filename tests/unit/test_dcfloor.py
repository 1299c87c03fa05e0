"""even_dcs: holder sets evened out for the split by DC (planner/dcfloor.py), and hybrid's
slow loop with it (``even_dcs``) and its re-plan cadence under a controller that plans
every N steps."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.planner import ModelSpec, Topology, make_policy
from expertmesh.planner.dcfloor import crossing_assignments, even_dcs
from expertmesh.planner.dcsplit import split_dcs
from expertmesh.planner.domainquota import dc_holds
from expertmesh.planner.hybrid import HybridSettings, plan_hybrid
from expertmesh.planner.plan import LayerPlan
from expertmesh.planner.policy import PolicyContext
from expertmesh.planner.static import static_placement

pytestmark = pytest.mark.unit


def _case(seed: int, dcs: int = 3, per_dc: int = 3, experts: int = 24, cap: int = 12):
    """Skewed load [R, E]; masters spread over the DCs, then random copies up to ``cap``."""
    rng = np.random.default_rng(seed)
    rank_dc = np.repeat(np.arange(dcs), per_dc)
    master_dc = rng.permutation(np.arange(experts) % dcs)
    holds = np.zeros((dcs, experts), bool)
    holds[master_dc, np.arange(experts)] = True
    for d in range(dcs):
        free = np.flatnonzero(~holds[d])
        room = cap - int(holds[d].sum())
        holds[d, rng.choice(free, min(room, free.size), replace=False)] = True
    pop = rng.gamma(0.4, 1.0, experts)
    load = np.stack([rng.multinomial(int(rng.integers(200, 800)), pop / pop.sum())
                     for _ in rank_dc])  # fmt: skip
    return load.astype(np.int64), holds, master_dc, np.full(dcs, cap), rank_dc


@given(seed=st.integers(0, 100_000), dcs=st.integers(2, 4), per_dc=st.integers(1, 3))
@settings(max_examples=40, deadline=None)
def test_evened_holder_sets_keep_masters_and_capacity_and_never_cross_more(seed, dcs, per_dc):
    load, holds, master_dc, cap, rank_dc = _case(seed, dcs, per_dc, experts=4 * dcs, cap=6)
    new = even_dcs(load, holds, master_dc, cap, rank_dc)
    assert new[master_dc, np.arange(master_dc.size)].all()  # masters stay
    assert (new.sum(axis=1) <= np.maximum(cap, holds.sum(axis=1))).all()
    assert new.any(axis=0).all()
    assert crossing_assignments(load, new, rank_dc) <= crossing_assignments(load, holds, rank_dc)
    assert split_dcs(load, new, rank_dc).floor <= split_dcs(load, holds, rank_dc).floor + 1e-12


def test_a_dc_holding_the_hot_experts_alone_hands_one_a_copy_elsewhere() -> None:
    # 2 DCs x 1 rank, 4 experts: DC 0 masters the hot 0 and 1, DC 1 the cold 2 and 3
    rank_dc = np.array([0, 1])
    load = np.array([[300, 300, 10, 10], [300, 300, 10, 10]], np.int64)
    master_dc = np.array([0, 0, 1, 1])
    holds = np.array([[1, 1, 0, 0], [0, 0, 1, 1]], bool)
    assert split_dcs(load, holds, rank_dc).floor == pytest.approx(1200 / 620)
    new = even_dcs(load, holds, master_dc, np.array([2, 3]), rank_dc)  # DC 1: one more
    assert new[0].tolist() == [True, True, False, False] and new[1, :2].sum() == 1
    # DC 1's own tokens for the copied expert stay home: DC 0 computes 600 + 300
    assert split_dcs(load, new, rank_dc).floor == pytest.approx(900 / 620)
    assert (
        crossing_assignments(load, new, rank_dc) == 320 < crossing_assignments(load, holds, rank_dc)
    )
    # room for both: DC 1 gets both hot experts, the two DCs even out
    both = even_dcs(load, holds, master_dc, np.array([2, 4]), rank_dc)
    assert both[1].all() and split_dcs(load, both, rank_dc).floor == pytest.approx(640 / 620)
    # no room, and DC 1 holds only masters: nothing can move
    assert np.array_equal(even_dcs(load, holds, master_dc, np.array([2, 2]), rank_dc), holds)


def test_bad_input_is_refused() -> None:
    load, holds, master_dc, cap, rank_dc = _case(0)
    with pytest.raises(ValueError, match="master_dc"):
        even_dcs(load, holds & False, master_dc, cap, rank_dc)
    with pytest.raises(ValueError, match="load"):
        even_dcs(-load, holds, master_dc, cap, rank_dc)
    with pytest.raises(ValueError, match="rank_dc"):
        even_dcs(load, holds, master_dc, cap, rank_dc[:-1])


def _demo_shape() -> tuple[Topology, ModelSpec]:
    topo = Topology.generate(3, 3, masters=3, spare=2).with_inter_dc(1.0, 20.0)
    return topo, ModelSpec(num_experts=24, top_k=2, hidden=32, ffn_hidden=64)


def test_hybrid_with_even_dcs_lowers_the_floor_without_more_crossings() -> None:
    topo, model = _demo_shape()
    rank_dc = topo.rank_dc
    base = static_placement(topo.num_ranks, topo.slots_per_rank, 24, 3)
    lowered = 0
    for seed in range(10):
        rng = np.random.default_rng(seed)
        pop = rng.gamma(0.3, 1.0, 24)
        est = np.stack([rng.multinomial(2048, pop / pop.sum()) for _ in range(9)]).astype(float)
        load = np.rint(est).astype(np.int64)
        plans = [
            plan_hybrid(est, base, topo, model, HybridSettings(reserve_slots=1, even_dcs=on))
            for on in (False, True)
        ]
        holds = [dc_holds(p, topo) for p in plans]
        floors = [split_dcs(load, h, rank_dc).floor for h in holds]
        assert floors[1] <= floors[0] + 1e-12
        assert crossing_assignments(load, holds[1], rank_dc) <= crossing_assignments(
            load, holds[0], rank_dc
        )
        assert np.array_equal(plans[1].master, plans[0].master)  # masters stay
        lowered += floors[1] < floors[0] - 1e-3
    assert lowered >= 3  # it does something on skewed loads


def test_hybrid_replans_every_period_when_asked_every_n_steps() -> None:
    """A controller with ``every_n:5`` plans after steps 4, 9, 14, 19: none is a multiple
    of ``period=10``; the slow loop must still re-plan 10 steps after its last re-plan."""
    topo, model = _demo_shape()
    pol = make_policy("hybrid", {"period": 10, "window": 1, "reserve_slots": 1})
    rng = np.random.default_rng(3)
    prev, held = None, {}
    for step in (4, 9, 14, 19, 24):
        pop = rng.gamma(0.3, 1.0, 24)  # the routing drifts: every window a new skew
        load = np.stack([rng.multinomial(2048, pop / pop.sum()) for _ in range(9)])
        ctx = PolicyContext(topology=topo, model=model, step=step, layer=0, load=load,
                            history=load[None], previous=prev)  # fmt: skip
        placement = pol.place(ctx)
        prev = LayerPlan(placement=placement, route=pol.route(ctx, placement))
        held[step] = dc_holds(placement, topo)
    assert np.array_equal(held[4], held[9])  # 5 steps after: the holder sets stay
    assert not np.array_equal(held[9], held[14])  # 10 steps after step 4: re-planned
    assert np.array_equal(held[14], held[19]) and not np.array_equal(held[19], held[24])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), dcs=st.sampled_from([2, 3, 4, 13]), per_dc=st.integers(1, 3))
def test_the_floor_bound_is_below_the_split_floor(seed, dcs, per_dc):
    from expertmesh.planner.dcfloor import floor_bound

    load, holds, _, _, rank_dc = _case(seed, dcs=dcs, per_dc=per_dc, experts=16, cap=16 // dcs + 3)
    rng = np.random.default_rng(seed)
    for _ in range(3):  # the case's holder sets, then random ones (every expert held)
        dc_load = np.zeros(holds.shape, np.int64)
        np.add.at(dc_load, rank_dc, load)
        ranks = np.bincount(rank_dc, minlength=dcs)
        assert floor_bound(dc_load, holds, ranks) <= split_dcs(load, holds, rank_dc).floor
        holds = rng.random(holds.shape) < 0.3
        holds[rng.integers(0, dcs, 16), np.arange(16)] = True


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), dcs=st.sampled_from([2, 3, 4]), room=st.integers(0, 6))
def test_even_dcs_skipping_splits_by_the_bound_picks_what_splitting_all_picks(seed, dcs, room):
    import expertmesh.planner.dcfloor as dcfloor

    load, holds, master_dc, caps, rank_dc = _case(seed, dcs=dcs, cap=24 // dcs + room)
    got = even_dcs(load, holds, master_dc, caps, rank_dc)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(dcfloor, "floor_bound", lambda dc_load, holds, ranks: -np.inf)
        want = even_dcs(load, holds, master_dc, caps, rank_dc)
    assert np.array_equal(got, want)
