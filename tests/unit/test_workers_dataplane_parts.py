"""Pure pieces the MoE layer calls (workers/replicas.py, workers/dcspread.py): the replica
fetch's all-to-all sizes and orders agree between every sender and receiver; each DC's
holder is its lowest live rank holding the expert; the split by DC has a choice only for
an expert two live DCs hold and some live DC lacks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from expertmesh.workers.dcspread import can_spread, dc_holders
from expertmesh.workers.replicas import fetch_splits

pytestmark = pytest.mark.unit


@given(
    size=st.integers(1, 5),
    rows=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 9)), max_size=12),
)
def test_fetch_splits_agree_between_sender_and_receiver(size: int, rows: list) -> None:
    fetch = np.array([(s % size, t % size, e) for s, t, e in rows], np.int64).reshape(-1, 3)
    per = 7
    got = [fetch_splits(fetch, m, size, per) for m in range(size)]
    for s in range(size):
        for t in range(size):
            # what s sends t, in s's order, is what t receives from s, in t's order
            sent = [e for (a, b, e) in sorted(fetch.tolist(), key=lambda x: (x[1], x[2]))
                    if a == s and b == t]  # fmt: skip
            assert got[s][0][t] == per * len(sent)
            assert got[t][1][s] == per * len(sent)
            out_s = got[s][2]
            start = sum(got[s][0][:t]) // per
            assert out_s[start : start + len(sent)] == sent
            inc_t = got[t][3]
            start = sum(got[t][1][:s]) // per
            assert inc_t[start : start + len(sent)] == sent


def test_dc_holders_is_the_lowest_live_rank() -> None:
    holds = np.array([[1, 0, 1], [1, 1, 0], [0, 1, 1], [0, 0, 1]], bool)  # [R=4, E=3]
    dc_ranks = [np.array([0, 1]), np.array([2, 3]), np.array([], np.int64)]
    got = dc_holders(holds, dc_ranks)
    assert got.tolist() == [[0, 1, 0], [-1, 2, 2], [-1, -1, -1]]


def test_can_spread_needs_two_live_holders_and_a_live_dc_without() -> None:
    ranks = [np.array([0]), np.array([1]), np.array([2])]
    every = np.array([[0, 1], [1, 0], [2, 1]])  # [D, E]: every DC holds both
    assert not can_spread(every, ranks)
    one = np.array([[0, -1], [-1, 1], [-1, -1]])  # each expert one holder
    assert not can_spread(one, ranks)
    two = np.array([[0, -1], [1, 1], [-1, -1]])  # expert 0: DCs 0 and 1; DC 2 lacks it
    assert can_spread(two, ranks)
    gone = [np.array([0]), np.array([1]), np.array([], np.int64)]  # DC 2 has no live rank
    assert not can_spread(np.array([[0, -1], [1, 1], [-1, -1]]), gone)


def _fake_ep(rank_dc: np.ndarray, plans: list) -> tuple:
    """An ExpertParallel over stand-in layers and comm (no process groups: _hops reads
    only the plans, the live ranks and the DCs)."""
    from types import SimpleNamespace

    from expertmesh.workers.experts import ExpertParallel

    def comm(live: np.ndarray) -> SimpleNamespace:
        rd = np.where(live, rank_dc, -1)
        return SimpleNamespace(
            rank=0, live=live, rank_dc=rd,
            dc_ranks=[np.flatnonzero(rd == d) for d in range(int(rank_dc.max()) + 1)],
        )  # fmt: skip

    layers = [
        SimpleNamespace(
            plan=p,
            num_experts=p.holds.shape[1],
            held=list,
            ffn_hidden=8,
            gate=SimpleNamespace(in_features=4),
        )
        for p in plans
    ]
    ep = ExpertParallel(comm(np.ones(rank_dc.size, bool)), layers, lr=1e-3)  # type: ignore[arg-type]
    return ep, comm


@given(seed=st.integers(0, 10_000))
def test_expert_sync_hops_cache_matches_a_fresh_computation(seed: int) -> None:
    """The remembered hops are the plans' own after plan switches (new plan objects, equal
    or not) and membership changes; a cache keyed without the new plans or the live ranks
    fails (planted: keyed on ``old`` alone, the switch's hops are the committed plan's)."""
    from expertmesh.planner.plan import Placement
    from expertmesh.workers.layer import LayerPlan

    rng = np.random.default_rng(seed)
    rank_dc = np.array([0, 0, 1, 1, 2, 2])
    experts, slots = 6, 4

    def plan() -> LayerPlan:
        p2l = np.full((6, slots), -1, np.int32)
        master = np.zeros(experts, np.int64)
        for e in range(experts):  # a master per expert, and random copies
            r = int(rng.integers(6))
            s = int(np.flatnonzero(p2l[r] < 0)[0]) if (p2l[r] < 0).any() else None
            while s is None:
                r = (r + 1) % 6
                s = int(np.flatnonzero(p2l[r] < 0)[0]) if (p2l[r] < 0).any() else None
            p2l[r, s] = e
            master[e] = r * slots + s
        for r, s in zip(*np.nonzero(p2l < 0), strict=True):
            if rng.random() < 0.5:
                p2l[r, s] = int(rng.integers(experts))
        return LayerPlan(Placement(p2l, master), np.zeros((0, 4), np.int64))

    a, b = [plan(), plan()], [plan(), plan()]
    ep, comm = _fake_ep(rank_dc, a)
    for old, new in [(a, a), (a, b), (a, a), (b, b), (b, b), (a, b)]:
        assert ep._hops(old, new) == ep._plan_hops(old, new)
    # a rank leaves: new comm, same plans
    live = np.ones(6, bool)
    live[int(rng.integers(6))] = False
    ep.comm = comm(live)
    assert ep._hops(b, b) == ep._plan_hops(b, b)
    assert ep._hops(a, b) == ep._plan_hops(a, b)


@given(seed=st.integers(0, 10_000))
def test_the_replay_and_the_workers_ask_the_same_can_spread(seed: int) -> None:
    """One definition (planner.dcsplit.can_spread): the replay's flag from a placement
    equals the layer's from its DCs' holders, on random placements of 3 DCs x 2 ranks."""
    from expertmesh.planner.plan import Placement
    from expertmesh.sim.replay import _can_spread

    rng = np.random.default_rng(seed)
    rank_dc = np.array([0, 0, 1, 1, 2, 2])
    p2l = np.where(rng.random((6, 3)) < 0.4, rng.integers(0, 4, (6, 3)), -1).astype(np.int32)
    p = Placement(p2l, np.zeros(4, np.int64))
    ranks = [np.flatnonzero(rank_dc == d) for d in range(3)]
    want = can_spread(dc_holders(p.holds(), ranks), ranks)
    assert _can_spread(p, rank_dc, 3) == want
