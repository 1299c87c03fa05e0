"""The split by DC of every microbatch (planner/dcsplit.py): every token routed in full,
only to DCs that hold its expert, home tokens stay home, the same answer on every call,
the busiest DC's tokens per rank at the optimum (an LP over the same counts, solved by
scipy, as the reference) and never above a slow-loop route's; the cheapest links only;
the worker's pieces that turn a split into destinations and a DC's counts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from expertmesh.planner.dcsplit import MAX_EXACT_DCS, split_dcs
from expertmesh.workers.moe import relay_counts, relay_rank, split_destinations

pytestmark = pytest.mark.unit


def _case(
    seed: int, dcs: int = 3, per_dc: int = 3, experts: int = 24, held: int = 12
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Skewed counts [R, E]; each DC holds ``held`` experts, every expert some DC."""
    rng = np.random.default_rng(seed)
    rank_dc = np.repeat(np.arange(dcs), per_dc)
    holds = np.zeros((dcs, experts), bool)
    for d in range(dcs):
        holds[d, rng.choice(experts, held, replace=False)] = True
    for e in np.flatnonzero(~holds.any(axis=0)):
        holds[rng.integers(dcs), e] = True
    pop = rng.gamma(0.4, 1.0, experts)
    counts = np.stack(
        [rng.multinomial(int(rng.integers(0, 500)), pop / pop.sum()) for _ in rank_dc]
    )
    return counts.astype(np.int64), holds, rank_dc


def _level(tokens: np.ndarray, rank_dc: np.ndarray) -> float:
    per_dc = tokens.sum(axis=(0, 1))
    ranks = np.bincount(rank_dc[rank_dc >= 0], minlength=per_dc.size)
    return float(max(per_dc[d] / ranks[d] for d in range(per_dc.size) if ranks[d]))


def _lp_level(counts: np.ndarray, holds: np.ndarray, rank_dc: np.ndarray) -> float:
    """The reference: min over splittable flows of the busiest DC's tokens per rank
    (home tokens fixed at home), as a plain LP over (rank, expert, DC) flows."""
    num_dcs = holds.shape[0]
    ranks = np.bincount(rank_dc, minlength=num_dcs)
    home = np.zeros(num_dcs)
    var = []  # (r, e, d) crossing flows
    for r, e in zip(*np.nonzero(counts), strict=True):
        if holds[rank_dc[r], e]:
            home[rank_dc[r]] += counts[r, e]
        else:
            var += [(r, e, d) for d in np.flatnonzero(holds[:, e])]
    n = len(var) + 1  # the last variable: the level
    c = np.zeros(n)
    c[-1] = 1
    a_eq, b_eq = [], []
    for r, e in {(v[0], v[1]) for v in var}:
        row = np.zeros(n)
        row[[i for i, v in enumerate(var) if v[:2] == (r, e)]] = 1
        a_eq.append(row)
        b_eq.append(counts[r, e])
    a_ub, b_ub = [], []
    for d in range(num_dcs):
        row = np.zeros(n)
        row[[i for i, v in enumerate(var) if v[2] == d]] = 1
        row[-1] = -ranks[d]
        a_ub.append(row)
        b_ub.append(-home[d])
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq or None, b_eq=b_eq or None, method="highs")
    assert res.status == 0
    return float(res.x[-1])


@given(seed=st.integers(0, 100_000), dcs=st.integers(2, 4), per_dc=st.integers(1, 3))
@settings(max_examples=60, deadline=None)
def test_every_token_goes_in_full_to_a_holder_and_home_tokens_stay(
    seed: int, dcs: int, per_dc: int
) -> None:
    counts, holds, rank_dc = _case(seed, dcs, per_dc, experts=16, held=7)
    out = split_dcs(counts, holds, rank_dc)
    assert out.tokens.shape == (*counts.shape, dcs)
    assert (out.tokens >= 0).all()
    np.testing.assert_array_equal(out.tokens.sum(axis=2), counts)  # conservation
    assert not (out.tokens.sum(axis=0) > 0)[~holds.T].any()  # only holders receive
    for r in range(counts.shape[0]):  # a DC that holds the expert keeps its tokens
        mine = holds[rank_dc[r]]
        np.testing.assert_array_equal(out.tokens[r, mine, rank_dc[r]], counts[r, mine])
    np.testing.assert_array_equal(out.dc_tokens, out.tokens.sum(axis=(0, 1)))
    again = split_dcs(counts.copy(), holds.copy(), rank_dc.copy())  # every rank agrees
    np.testing.assert_array_equal(again.tokens, out.tokens)


@given(seed=st.integers(0, 100_000), dcs=st.integers(2, 4))
@settings(max_examples=40, deadline=None)
def test_the_busiest_dc_is_at_the_optimum_and_below_any_route(seed: int, dcs: int) -> None:
    """Equal ranks per DC: the integer optimum is ceil(LP level x ranks) tokens; a
    slow-loop route (each (source DC, expert) stream whole to one holder, by rotation as
    hybrid's, or at random) never does better."""
    counts, holds, rank_dc = _case(seed, dcs, 3, experts=16, held=6)
    out = split_dcs(counts, holds, rank_dc)
    assert out.exact
    lp = _lp_level(counts, holds, rank_dc)
    assert out.dc_tokens.max() == math.ceil(lp * 3 - 1e-6)
    total = counts.sum()
    if total:
        assert out.floor == pytest.approx(out.dc_tokens.max() / 3 / (total / rank_dc.size))
    rng = np.random.default_rng(seed)
    for rotation in range(3):
        route = np.zeros_like(out.tokens)
        for r, e in zip(*np.nonzero(counts), strict=True):
            cand = np.flatnonzero(holds[:, e])
            d = (
                rank_dc[r]
                if holds[rank_dc[r], e]
                else cand[(rank_dc[r] + e + rotation) % cand.size]
            )
            route[r, e, d] = counts[r, e]
        assert _level(out.tokens, rank_dc) <= _level(route, rank_dc)
        split = np.zeros_like(out.tokens)  # a random splittable one
        for r, e in zip(*np.nonzero(counts), strict=True):
            if holds[rank_dc[r], e]:
                split[r, e, rank_dc[r]] = counts[r, e]
            else:
                cand = np.flatnonzero(holds[:, e])
                split[r, e, cand] = rng.multinomial(counts[r, e], np.ones(cand.size) / cand.size)
        assert _level(out.tokens, rank_dc) <= _level(split, rank_dc)


def test_unequal_dcs_and_ranks_not_taking_part() -> None:
    """DCs of 1, 2 and 4 live ranks (one rank out): the level is the smallest over every
    integer split (brute force over a small case)."""
    rank_dc = np.array([0, 1, 1, 2, 2, 2, 2, -1])
    holds = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], bool)
    counts = np.array([[5, 9, 0, 0], [0, 0, 0, 7], [3, 0, 0, 6], [4, 0, 1, 0], [0, 8, 0, 0],
                       [0, 0, 0, 0], [2, 6, 0, 1], [0, 0, 0, 0]], np.int64)  # fmt: skip
    out = split_dcs(counts, holds, rank_dc)
    ranks = np.array([1, 2, 4])
    # crossing demand: expert 0 from DCs 1, 2 (only DC 0 holds it: 9 tokens); expert 1 from
    # DC 2 (DCs 0, 1: 14 tokens); expert 3 from DC 1 (only DC 2: 13 tokens)
    home = np.array([14, 0, 1 + 1])
    best = math.inf
    for to0 in range(15):  # expert 1's 14 crossing tokens: to0 to DC 0, the rest to DC 1
        per = home + np.array([9 + to0, 14 - to0, 13])
        best = min(best, float((per / ranks).max()))
    assert _level(out.tokens, rank_dc) == best
    assert out.tokens[7].sum() == 0
    with pytest.raises(ValueError, match="not taking part"):
        split_dcs(counts + np.eye(8, 4, dtype=np.int64)[::-1], holds, rank_dc)


def test_crossing_tokens_go_only_to_the_cheapest_holders() -> None:
    """DC 0 lacks expert 0, held by DCs 1 and 2; the link 0 -> 2 costs 4x: everything goes
    to DC 1 however loaded, while DC 3's tokens (equal links to both) spread."""
    rank_dc = np.arange(4)
    holds = np.array([[0, 1], [1, 1], [1, 0], [0, 0]], bool)
    counts = np.array([[100, 0], [0, 50], [0, 0], [60, 0]], np.int64)
    cost = np.ones((4, 4)) - np.eye(4)
    cost[0, 2] = 4.0
    out = split_dcs(counts, holds, rank_dc, cost)
    assert out.tokens[0, 0].tolist() == [0, 100, 0, 0]
    assert out.tokens[3, 0].tolist() == [0, 0, 60, 0]  # DC 1 already has 150
    free = split_dcs(counts, holds, rank_dc)  # equal links: DC 0's tokens spread as well
    assert free.dc_tokens.tolist() == [0, 105, 105, 0]


def test_many_dcs_fall_back_to_the_pour() -> None:
    counts, holds, rank_dc = _case(5, dcs=MAX_EXACT_DCS + 2, per_dc=1, experts=40, held=10)
    out = split_dcs(counts, holds, rank_dc)
    assert not out.exact
    np.testing.assert_array_equal(out.tokens.sum(axis=2), counts)
    assert not (out.tokens.sum(axis=0) > 0)[~holds.T].any()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda c, h, d: (-c, h, d), ">= 0"),
        (lambda c, h, d: (c.astype(float), h, d), "integer"),
        (lambda c, h, d: (c, h[:, :-1], d), "holds"),
        (lambda c, h, d: (c, h, d[:-1]), "rank_dc"),
        (lambda c, h, d: (c, h, d + 5), "rank_dc"),
        (lambda c, h, d: (c, np.zeros_like(h), d), "no holder"),
    ],
)
def test_bad_input_is_refused(change: object, match: str) -> None:
    counts, holds, rank_dc = _case(1)
    c, h, d = change(counts + 1, holds, rank_dc)  # type: ignore[operator]
    with pytest.raises(ValueError, match=match):
        split_dcs(c, h, d)
    with pytest.raises(ValueError, match="cost"):
        split_dcs(counts, holds, rank_dc, np.full((2, 2), 1.0))


@given(seed=st.integers(0, 10_000))
@settings(max_examples=30, deadline=None)
def test_destinations_and_a_dcs_counts_follow_the_split(seed: int) -> None:
    """Each rank's assignments go to its split's DCs, to the DC's holder; what every rank
    of a DC holds after the relays equals :func:`relay_counts` (simulated with relay_rank)."""
    counts, holds, rank_dc = _case(seed, 3, 3, experts=8, held=4)
    rng = np.random.default_rng(seed)
    idx = [np.repeat(np.arange(8), c).reshape(-1, 1)[rng.permutation(int(c.sum()))] for c in counts]
    holder = np.where(holds, np.arange(3)[:, None] * 3, -1)  # the DC's first rank
    out = split_dcs(counts, holds, rank_dc)
    got = np.zeros((9, 8), np.int64)  # what each rank holds after the cross-DC dispatch
    for r in range(9):
        dst = split_destinations(idx[r], out.tokens[r], holder)
        for e in range(8):
            mine = dst[idx[r] == e]
            assert np.bincount(rank_dc[mine], minlength=3).tolist() == out.tokens[r, e].tolist()
        for a in range(idx[r].size):
            b = int(rank_dc[dst.reshape(-1)[a]])
            got[relay_rank(r, b, rank_dc), idx[r].reshape(-1)[a]] += 1
    for d in range(3):
        np.testing.assert_array_equal(relay_counts(out.tokens, d, rank_dc), got[rank_dc == d])
    with pytest.raises(ValueError, match="does not fit"):
        split_destinations(idx[0], out.tokens[1] + 1, holder)
    # the right sums, but a token sent to a DC without a copy of its expert (where rank 0
    # has tokens of an expert some DC lacks: not every seed's case has one)
    lacked = np.flatnonzero((~holds).any(axis=0) & (out.tokens[0].sum(axis=1) > 0))
    if lacked.size == 0:
        return
    e = int(lacked[0])
    wrong = out.tokens[0].copy()
    src = int(np.flatnonzero(wrong[e])[0])
    wrong[e, src] -= 1
    wrong[e, int(np.flatnonzero(~holds[:, e])[0])] += 1
    with pytest.raises(ValueError, match="does not fit its holders"):
        split_destinations(idx[0], wrong, holder)
