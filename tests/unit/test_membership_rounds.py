"""How the members of a changed membership get from the committed plan to the new one
(expertmesh.planner.rounds.source_rounds): only ranks that trained until now
send; what none of them holds comes from the checkpoint."""

from __future__ import annotations

import numpy as np

from expertmesh.planner import Placement, Topology
from expertmesh.planner.rounds import source_rounds as membership_rounds

TOPO = Topology.generate(2, 2, masters=1, spare=1)  # ranks 0, 1 in DC 0; 2, 3 in DC 1


def _p(rows: list[list[int]], master: list[int]) -> Placement:
    return Placement(np.asarray(rows), np.asarray(master))


def test_copies_come_from_the_nearest_source_and_the_rest_from_the_checkpoint() -> None:
    # experts 0..3; old: rank r masters expert r, rank 1 also holds 2, rank 3 holds 0
    old = _p([[0, -1], [1, 2], [2, -1], [3, 0]], [0, 2, 4, 6])
    # rank 3 died and rank 2 rejoins after a pause: neither is a source (rank 2's copies
    # are stale); rank 2 masters 2 and 3 in the new plan, rank 0 holds 3 too
    new = _p([[0, 3], [1, 2], [2, 3], [-1, -1]], [0, 2, 4, 5])
    sources = np.array([True, True, False, False])
    rounds, restore = membership_rounds([old], [new], sources, TOPO)
    assert rounds == [[(0, 2, 1, 2, "w")]]  # expert 2 to rank 2 from rank 1, not its own
    # expert 3: no source holds it (weights from the checkpoint on ranks 0 and 2); the
    # Adam state of both of rank 2's masters from the checkpoint (expert 2's old master
    # is rank 2 itself, stale; expert 3's died)
    assert sorted(restore) == [(0, 2, 2, "opt"), (0, 3, 0, "w"), (0, 3, 2, "opt"), (0, 3, 2, "w")]


def test_a_master_that_moves_between_sources_takes_its_adam_state_along() -> None:
    old = _p([[0, -1], [1, -1], [2, -1], [3, -1]], [0, 2, 4, 6])
    new = _p([[0, 1], [-1, -1], [2, 3], [-1, -1]], [0, 1, 4, 5])  # ranks 1, 3 gone
    sources = np.array([True, False, True, False])
    rounds, restore = membership_rounds([old], [new], sources, TOPO)
    assert rounds == []  # ranks 0 and 2 keep what they had
    assert sorted(restore) == [(0, 1, 0, "opt"), (0, 1, 0, "w"), (0, 3, 2, "opt"), (0, 3, 2, "w")]
    # every rank a source, ranks 0 and 1 swap their experts: each master's weights and Adam
    # state come from the other
    moved = _p([[1, -1], [0, -1], [2, -1], [3, -1]], [2, 0, 4, 6])
    rounds, restore = membership_rounds([old], [moved], np.ones(4, bool), TOPO)
    assert restore == []
    assert sorted(rounds[0]) == [
        (0, 0, 0, 1, "opt"),
        (0, 0, 0, 1, "w"),
        (0, 1, 1, 0, "opt"),
        (0, 1, 1, 0, "w"),
    ]
