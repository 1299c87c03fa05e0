"""even_traffic_steps' whole-token path (planner/evensplit.py: _whole_loads, integer shares,
_nonlocal_sums) gives the same floats, bit for bit, as the float path it replaces and as
even_traffic step by step."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.planner import Placement, Topology
from expertmesh.planner import evensplit as es
from expertmesh.planner.traffic import TokenTraffic, even_traffic, even_traffic_steps
from expertmesh.planner.trafficbase import _pairs, _pairs_steps

FIELDS = ("rank_tokens", "rank_out", "rank_in", "pair_src", "pair_dst", "pair_tokens", "dc_tokens")


def _bits(t: TokenTraffic) -> list[tuple[str, tuple[int, ...], bytes]]:
    return [(np.asarray(getattr(t, f)).dtype.str, np.shape(getattr(t, f)),
             np.ascontiguousarray(getattr(t, f)).tobytes()) for f in FIELDS]  # fmt: skip


def _placement(rng: np.random.Generator, ranks: int, experts: int) -> Placement:
    """Masters in order (``experts / ranks`` a rank) and a replica or two of a few experts
    in the two spare slots of random ranks."""
    per = experts // ranks
    p2l = np.full((ranks, per + 2), -1, np.int64)
    p2l[:, :per] = np.arange(experts).reshape(ranks, per)
    for r in rng.choice(ranks, size=ranks // 2, replace=False):
        p2l[r, per : per + 2] = rng.choice(experts, size=2, replace=False)
    master = np.arange(experts) // per * (per + 2) + np.arange(experts) % per
    return Placement(phy2log=p2l, master=master)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), nodes=st.sampled_from([1, 2]),
       domain=st.sampled_from(["node", "dc"]))  # fmt: skip
def test_whole_path_equals_float_path(seed, nodes, domain):
    topo = Topology.generate(3, 4, nodes_per_dc=nodes, masters=2, spare=2)
    rng = np.random.default_rng(seed)
    placement = _placement(rng, 12, 24)
    # 37 steps: three chunks of _WHOLE_STEPS (16), the last one short
    loads = rng.integers(0, 60, size=(37, 12, 24)) * (rng.random((37, 1, 24)) < 0.8)
    assert loads.shape[0] > 2 * es._WHOLE_STEPS
    seen: list[bool] = []  # a call of _whole_loads a chunk: whether it gave whole loads
    whole_loads = es._whole_loads

    def spy(*args):
        got = whole_loads(*args)
        seen.append(got is not None)
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(es, "_whole_loads", spy)
        fast = even_traffic_steps(loads, placement, topo, 2, domain=domain)
        assert seen == [True] * 3  # the whole path ran, on each of the three chunks
        mp.setattr(es, "_whole_runs", lambda topology: None)
        slow = even_traffic_steps(loads, placement, topo, 2, domain=domain)
        assert seen == [True] * 3  # and the float path did not take it
    assert [_bits(t) for t in fast] == [_bits(t) for t in slow]
    one = [even_traffic(x, placement, topo, 2, domain=domain) for x in loads]
    assert [_bits(t) for t in fast] == [_bits(t) for t in one]


def test_a_later_chunk_reaching_2_53_takes_the_float_path(monkeypatch):
    """The first chunk is whole tokens below 2**53, the second reaches it: the whole
    path gives up (``break``) and every step goes the float path, the same floats."""
    topo = Topology.generate(3, 4, nodes_per_dc=2, masters=2, spare=2)
    rng = np.random.default_rng(7)
    placement = _placement(rng, 12, 24)
    loads = rng.integers(0, 60, size=(37, 12, 24))
    loads[es._WHOLE_STEPS + 3, 5, 7] = 2**53  # in the second chunk
    seen: list[bool] = []
    whole_loads = es._whole_loads

    def spy(*args):
        got = whole_loads(*args)
        seen.append(got is None)
        return got

    monkeypatch.setattr(es, "_whole_loads", spy)
    fast = even_traffic_steps(loads, placement, topo, 2, domain="dc")
    assert seen == [False, True]  # the first chunk whole, the second gave up
    monkeypatch.setattr(es, "_whole_runs", lambda topology: None)
    slow = even_traffic_steps(loads, placement, topo, 2, domain="dc")
    assert seen == [False, True]  # the float path did not take the whole path
    assert [_bits(t) for t in fast] == [_bits(t) for t in slow]


def test_an_expert_without_a_copy_must_have_no_load():
    topo = Topology.generate(2, 4, masters=2, spare=2)
    rng = np.random.default_rng(3)
    placement = _placement(rng, 8, 16)
    p2l = placement.phy2log.copy()
    p2l[p2l == 5] = -1  # expert 5 has no copy, and load
    loads = rng.integers(1, 9, size=(2, 8, 16))
    with pytest.raises(ValueError, match="no copy"):
        even_traffic_steps(loads, Placement(phy2log=p2l, master=placement.master), topo, 2,
                           domain="dc")  # fmt: skip


def test_pairs_of_steps_are_pairs_of_each_step():
    rng = np.random.default_rng(5)
    dense = rng.random((6, 4, 4)) * (rng.random((6, 4, 4)) < 0.5)
    dense[2] = 0.0  # a step without pairs
    dense[4] = np.diag([1.0, 2.0, 3.0, 4.0])  # the diagonal is no pair
    got = _pairs_steps(dense.copy())
    want = [_pairs(d.copy()) for d in dense]
    assert len(got) == 6 and [len(g[0]) for g in got][2] == 0
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("order", ["in order", "shuffled", "uneven"])
def test_one_copy_split_equals_the_float_path(order):
    """Static EP (one copy an expert): the rank-to-rank path (experts in order, 4 a rank, or
    shuffled, or 5 and 3 on two ranks) gives _even_split's floats, bit for bit, over more
    than 8 steps."""
    topo = Topology.generate(2, 4, nodes_per_dc=2, masters=4, spare=2)
    rng = np.random.default_rng(7)
    experts = np.arange(32) if order == "in order" else rng.permutation(32)
    counts = [5, 3, 4, 4, 4, 4, 4, 4] if order == "uneven" else [4] * 8
    p2l = np.full((8, 6), -1, np.int64)
    master = np.empty(32, np.int64)
    at = 0
    for r, n in enumerate(counts):
        p2l[r, :n] = experts[at : at + n]
        master[experts[at : at + n]] = r * 6 + np.arange(n)
        at += n
    placement = Placement(phy2log=p2l, master=master)
    loads = rng.integers(0, 40, size=(13, 8, 32))
    seen: list[str] = []  # the calls of _one_copy_split (whether it gave the split) and _even_split
    one_copy_split, even_split = es._one_copy_split, es._even_split

    def spy(*args):
        got = one_copy_split(*args)
        seen.append("one copy" if got is not None else "None")
        return got

    def float_spy(*args):
        seen.append("float")
        return even_split(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(es, "_one_copy_split", spy)
        mp.setattr(es, "_even_split", float_spy)
        fast = even_traffic_steps(loads, placement, topo, 2)
    assert seen == ["one copy"]  # the one-copy path ran, and its split is what came back
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(es, "_one_copy_split", lambda *a: None)
        slow = even_traffic_steps(loads, placement, topo, 2)
    assert [_bits(t) for t in fast] == [_bits(t) for t in slow]


@pytest.mark.parametrize("n", [5, 70])
def test_pairs_row_by_row(n):
    """_pairs with cached cell indices (small) and without (large): off-diagonal positive
    cells, row by row, int64."""
    rng = np.random.default_rng(n)
    dense = rng.random((n, n)) * (rng.random((n, n)) < 0.3)
    src, dst, val = _pairs(dense.copy())
    want_src, want_dst = np.nonzero((dense > 0) & ~np.eye(n, dtype=bool))
    assert src.dtype == dst.dtype == np.int64
    np.testing.assert_array_equal(src, want_src)
    np.testing.assert_array_equal(dst, want_dst)
    np.testing.assert_array_equal(val, dense[want_src, want_dst])
