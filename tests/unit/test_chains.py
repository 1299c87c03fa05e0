"""Chains after quota (planner/chains.py) and the workers' solve with them: every token
stays with its expert, only on copies or new replicas within free slots, no rank above
where it started and the max never up; the one-spare-slot case the rule leaves (two
overloaded ranks, one idle) evened out; the same answer on every call."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.planner import Placement
from expertmesh.planner.chains import relieve
from expertmesh.planner.fastquota import DEFAULTS, EXACT
from expertmesh.workers.balance import DomainBase, solve

pytestmark = pytest.mark.unit


def _case(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """comp [Rd, E] with each expert at its home only, skewed; free slots 0-2 per rank."""
    rng = np.random.default_rng(seed)
    rd, experts = int(rng.integers(2, 6)), int(rng.integers(3, 12))
    home = rng.integers(0, rd, experts)
    home[rng.random(experts) < 0.1] = -1  # not held here
    comp = np.zeros((rd, experts), np.int64)
    tokens = (rng.pareto(1.2, experts) * 100).astype(np.int64)
    held = home >= 0
    comp[home[held], np.flatnonzero(held)] = tokens[held]
    return comp, home, rng.integers(0, 3, rd)


@given(seed=st.integers(0, 100_000), least=st.integers(1, 50))
@settings(max_examples=150, deadline=None)
def test_tokens_stay_with_their_expert_on_copies_within_free_slots(seed: int, least: int) -> None:
    comp, home, free = _case(seed)
    out = relieve(comp, home, free, least=least)
    np.testing.assert_array_equal(out.sum(axis=0), comp.sum(axis=0))  # per expert
    assert (out >= 0).all()
    new = (out > 0) & (comp == 0)  # new replicas: within each rank's free slots
    new[home[home >= 0], np.flatnonzero(home >= 0)] = False
    assert (new.sum(axis=1) <= free).all()
    assert (out[new] >= least).all() or not new.any()
    assert out.sum(axis=1).max() <= comp.sum(axis=1).max()  # the max never goes up
    np.testing.assert_array_equal(relieve(comp.copy(), home.copy(), free.copy(), least=least), out)


def test_a_chain_evens_out_what_the_rule_leaves() -> None:
    """Three ranks, one free slot each: A (2345) and B (2345) over, C (1312) under; the
    rule gives C's slot a piece of A's hot expert and stops (B has no receiver). Along the
    chain B -> A (A's free slot) -> C (C's copy of A's expert) every rank ends near 2000."""
    home = np.array([0, 0, 0, 1, 1, 1, 2, 2])
    comp = np.array([[967, 833, 545, 0, 0, 0, 0, 0],
                     [0, 0, 0, 1345, 500, 500, 0, 0],
                     [0, 0, 0, 0, 0, 0, 1000, 312]], np.int64)  # fmt: skip
    out = relieve(comp, home, np.array([1, 1, 1]), least=10)
    per = out.sum(axis=1)
    assert per.max() - per.min() <= 2, per
    assert (out[0, 3:6] > 0).sum() == 1 and (out[2, :3] > 0).sum() == 1  # one new copy each
    none = relieve(comp, home, np.array([0, 0, 0]))  # no free slot, no shared copy: as is
    np.testing.assert_array_equal(none, comp)


def test_bad_input_is_refused() -> None:
    comp, home, free = _case(3)
    with pytest.raises(ValueError, match="non-negative"):
        relieve(-comp - 1, home, free)
    with pytest.raises(ValueError, match="home"):
        relieve(comp, home[:-1], free)
    with pytest.raises(ValueError, match="no home"):
        relieve(comp + 1, np.full_like(home, -1), free)


@given(seed=st.integers(0, 10_000))
@settings(max_examples=60, deadline=None)
def test_the_solve_with_chains_routes_in_full_to_copies_and_beats_the_rule(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ranks, slots, experts = 3, 5, 12  # a DC of 3 ranks, 4 homes + 1 free slot each
    p2l = np.full((ranks, slots), -1, np.int32)
    p2l[:, :4] = rng.permutation(experts).reshape(ranks, 4)
    master = np.array([int(np.flatnonzero(p2l.ravel() == e)[0]) for e in range(experts)])
    base = DomainBase.of(Placement(p2l, master), np.arange(ranks))
    pop = rng.pareto(1.0, experts) + 0.05
    counts = np.stack([rng.multinomial(2000, pop / pop.sum()) for _ in range(ranks)])
    rule = solve(counts, base, settings=EXACT)
    step = solve(counts, base, settings=DEFAULTS)
    got = np.zeros_like(counts)
    np.add.at(got, (step.route[:, 0], step.route[:, 1]), step.route[:, 3])
    np.testing.assert_array_equal(got, counts)  # in full, from the right sources
    copies = {(int(base.home[v]), int(e)) for v, e in enumerate(base.experts)}
    copies |= {(int(r), int(e)) for r, e in step.replicas}
    assert {(int(d), int(e)) for _, e, d, _ in step.route} <= copies
    assert (np.bincount(step.replicas[:, 0], minlength=ranks) <= 1).all()  # one free slot
    per = np.bincount(step.route[:, 2], weights=step.route[:, 3], minlength=ranks)
    assert per.max() <= rule.quota * 1.01 + 1  # the rule's T, with its tolerance
    assert step.quota == per.max()
    for src, dst, e in step.fetch:  # weights from the home, only where not resident
        assert not base.resident[dst, e] and base.resident[src, e]
