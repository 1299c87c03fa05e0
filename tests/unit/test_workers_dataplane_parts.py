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
