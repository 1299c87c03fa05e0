"""hybrid's bounds, exact where it skips work: the guard bound's DC pairs are the route's."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import expertmesh.planner.domainquota as domainquota
import expertmesh.planner.hybridguard as hybridguard
from expertmesh.planner import Topology


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
        load=load.astype(np.float64), local=domainquota._sum_rows(load, rank_dc, dcs),
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
