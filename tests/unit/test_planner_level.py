"""The planner's level on a step's exact counts (runtime/stepstats.py: planner_level): the
split by DC and quota inside each DC solved by the controller, per microbatch and layer."""

from __future__ import annotations

import numpy as np
import pytest

from expertmesh.planner import Placement, Topology
from expertmesh.planner.dcsplit import split_dcs
from expertmesh.planner.static import static_placement
from expertmesh.runtime.stepstats import planner_level

pytestmark = pytest.mark.unit


def _two_dcs(holds_dc1: list[int]) -> Placement:
    """2 DCs x 1 rank, 2 experts, 3 slots: rank 0 masters expert 0, rank 1 expert 1 and
    holds copies of ``holds_dc1``."""
    phy2log = np.full((2, 3), -1, np.int32)
    phy2log[0, 0], phy2log[1, 0] = 0, 1
    for i, e in enumerate(holds_dc1):
        phy2log[1, 1 + i] = e
    return Placement(phy2log, np.array([0, 3], np.int64))


def test_home_tokens_stay_and_crossing_ones_even_out_the_dcs() -> None:
    rank_dc = np.array([0, 1])
    counts = np.array([[[[50, 10], [10, 10]]]], np.int64)  # [k=1, L=1, R=2, E=2]
    # expert 0 only in DC 0: it computes 50 + 10, DC 1 the 20 of expert 1: 60 / 40
    assert planner_level(counts, [_two_dcs([])], rank_dc) == [[1.5]]
    # expert 0 in both DCs: DC 1 keeps its own 10 home; DC 0 sends its 10 of expert 1 over
    assert planner_level(counts, [_two_dcs([0])], rank_dc) == [[50 / 40]]


def test_every_microbatch_is_solved_on_its_own_counts() -> None:
    """Two microbatches with opposite skews: summed they would look balanced."""
    rank_dc = np.array([0, 1])
    counts = np.array([[[[60, 0], [0, 20]]], [[[20, 0], [0, 60]]]], np.int64)  # [2, 1, 2, 2]
    grid = planner_level(counts, [_two_dcs([])], rank_dc)
    assert grid == [[1.5], [1.5]]  # each microbatch 60 / 40; their sum would give 1.0
    assert planner_level(counts.sum(axis=0, keepdims=True), [_two_dcs([])], rank_dc) == [[1.0]]


def test_the_level_is_at_or_above_the_floor_of_the_split() -> None:
    topo = Topology.generate(3, 3, masters=3, spare=2)
    rng = np.random.default_rng(0)
    pop = rng.gamma(0.4, 1.0, 24)
    counts = np.stack([rng.multinomial(512, pop / pop.sum()) for _ in range(9)])  # [R, E]
    p = static_placement(9, topo.slots_per_rank, 24, 3)
    rank_dc = np.asarray(topo.rank_dc)
    ((level,),) = planner_level(counts[None, None], [p], rank_dc)
    holds = np.stack([p.holds()[rank_dc == d].any(axis=0) for d in range(3)])
    assert level >= split_dcs(counts, holds, rank_dc).floor - 1e-12


def test_bad_shapes_are_refused() -> None:
    rank_dc = np.array([0, 1])
    with pytest.raises(ValueError, match="counts"):
        planner_level(np.zeros((1, 2, 2, 2), np.int64), [_two_dcs([])], rank_dc)
