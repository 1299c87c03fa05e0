"""Pure pieces the MoE layer and the expert sync call (workers/replicas.py,
workers/dcspread.py, workers/hops.py, workers/bundles.py): the replica fetch's all-to-all
sizes and orders agree between every sender and receiver; each DC's holder is its lowest
live rank holding the expert; the split by DC has a choice only for an expert two live DCs
hold and some live DC lacks; the remembered expert sync hops are the plans' own; a token
bundle unpacks to what was packed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from expertmesh.workers.dcspread import can_spread, dc_holders
from expertmesh.workers.hops import HopCache, plan_hops
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


def _ranks(rank_dc: np.ndarray, live: np.ndarray) -> SimpleNamespace:
    """A stand-in comm (no process groups: the hops read only the live ranks and DCs)."""
    rd = np.where(live, rank_dc, -1)
    return SimpleNamespace(
        live=live, rank_dc=rd,
        dc_ranks=[np.flatnonzero(rd == d) for d in range(int(rank_dc.max()) + 1)],
    )  # fmt: skip


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
    cache, counts = HopCache([experts, experts]), [experts, experts]
    c = _ranks(rank_dc, np.ones(6, bool))
    for old, new in [(a, a), (a, b), (a, a), (b, b), (b, b), (a, b)]:
        assert cache.hops(c, old, new) == plan_hops(c, old, new, counts)
    # a rank leaves: new comm, same plans
    live = np.ones(6, bool)
    live[int(rng.integers(6))] = False
    c = _ranks(rank_dc, live)
    assert cache.hops(c, b, b) == plan_hops(c, b, b, counts)
    assert cache.hops(c, a, b) == plan_hops(c, a, b, counts)


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


@given(
    seed=st.integers(0, 10_000),
    shapes=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), min_size=1, max_size=4),
    cols=st.integers(1, 3),
)
def test_a_token_bundle_unpacks_to_what_was_packed(seed: int, shapes: list, cols: int) -> None:
    """Bundles of (tokens, assignments) packed in one buffer unpack to the same tokens,
    weights and metadata, each assignment's row offset by the rows of the bundles before
    it (planted: without the offset, a second bundle's rows point into the first's)."""
    import torch

    from expertmesh.workers.bundles import lengths, pack, unpack

    rng = np.random.default_rng(seed)
    n, d, m_all = 5, 3, 7
    x, w = torch.randn(n, d), torch.randn(m_all)
    bundles = []
    for nu, nm in shapes:
        rows = rng.choice(n, size=min(nu, n), replace=False)
        meta = rng.integers(0, 1_000_000, (nm, cols))
        meta[:, 0] = rng.integers(0, max(rows.size, 1), nm)
        bundles.append((rows, rng.integers(0, m_all, nm), meta))
    got = np.array([(r.size, i.size) for r, i, _ in bundles], np.int64).reshape(-1, 2)
    buf = torch.cat(pack(x, w, bundles, torch.device("cpu")))
    assert buf.numel() == sum(lengths(got, d, cols))
    x_in, w_in, meta_in = unpack(buf, got, d, cols)
    assert torch.equal(x_in, torch.cat([x[torch.as_tensor(r)] for r, _, _ in bundles]))
    assert torch.equal(w_in, torch.cat([w[torch.as_tensor(i)] for _, i, _ in bundles]))
    offsets = np.cumsum([0] + [r.size for r, _, _ in bundles])[:-1]
    want = np.concatenate([m + np.eye(1, cols, 0, np.int64) * o for (_, _, m), o in
                           zip(bundles, offsets, strict=True)])  # fmt: skip
    assert np.array_equal(meta_in, want)
