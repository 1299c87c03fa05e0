"""Pure pieces of the MoE layer (workers/moe.py): destinations by route shares, the
largest-remainder split; ``random_plan`` serves the SPMD plane's equivalence tests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from expertmesh.planner import Placement, Topology
from expertmesh.workers.moe import assign_destinations, largest_remainder


def random_plan(rng: np.random.Generator, topo: Topology, num_experts: int) -> tuple:
    """Random placement (every expert >= 1 copy, random replicas, random master) and a
    random route with random shares over the holders."""
    num_ranks, slots = topo.num_ranks, topo.slots_per_rank
    phy2log = np.full((num_ranks, slots), -1, np.int32)
    for e in range(num_experts):  # one copy each, on a rank with room
        free = [r for r in range(num_ranks) if (phy2log[r] < 0).any()]
        r = int(rng.choice(free))
        phy2log[r, np.flatnonzero(phy2log[r] < 0)[0]] = e
    for r in range(num_ranks):
        for s in np.flatnonzero(phy2log[r] < 0):
            if rng.random() < 0.7:
                missing = [e for e in range(num_experts) if e not in phy2log[r]]
                if missing:
                    phy2log[r, s] = int(rng.choice(missing))
    master = np.empty(num_experts, np.int64)
    for e in range(num_experts):
        master[e] = int(rng.choice(np.flatnonzero(phy2log.ravel() == e)))
    placement = Placement(phy2log, master)
    holds = placement.holds()
    rows = []
    for src in range(num_ranks):
        for e in range(num_experts):
            if rng.random() < 0.2:
                continue  # the plan did not see (src, e): fallback routing
            for dst in np.flatnonzero(holds[:, e]):
                rows.append((src, e, int(dst), int(rng.integers(0, 5))))
    return placement, np.array(rows, np.int64).reshape(-1, 4)


def test_assign_destinations_follows_route_shares_and_holders() -> None:
    rank_dc = np.array([0, 0, 1, 1])
    holds = np.zeros((4, 3), bool)
    holds[[0, 2], 0] = True
    holds[[1, 3], 1] = True
    holds[2, 2] = True
    idx = np.array([[0, 1]] * 10 + [[2, 0]] * 2)
    route = np.array([[0, 0, 0, 3], [0, 0, 2, 1]])  # 3:1 between ranks 0 and 2
    dst = assign_destinations(0, idx, route, holds, rank_dc)
    assert holds[dst, idx].all()
    zero = dst[idx == 0]
    assert (zero == 0).sum() == 9 and (zero == 2).sum() == 3
    assert set(dst[idx == 1].tolist()) == {1}  # unseen by the route: own DC's copy
    bad = np.array([[0, 0, 1, 5]])
    with pytest.raises(ValueError, match="does not hold"):
        assign_destinations(0, idx, bad, holds, rank_dc)


@given(
    total=st.integers(0, 1000),
    weights=st.lists(st.integers(0, 50), min_size=1, max_size=8).filter(lambda w: sum(w) > 0),
)
def test_largest_remainder_sums_and_stays_close(total: int, weights: list[int]) -> None:
    out = largest_remainder(total, np.array(weights, float))
    assert out.sum() == total
    exact = total * np.array(weights) / sum(weights)
    assert (np.abs(out - exact) < 1).all()
