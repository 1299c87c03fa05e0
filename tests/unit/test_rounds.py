"""Transfer rounds (planner/rounds.py): replaying the moves on the holder sets gives every
rank what the new placement needs, each move's source holds the expert when its round
starts, and after deaths nothing is sent from or to a dead rank."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.planner import Topology
from expertmesh.planner.migration import align_placement, plan_migration
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import Migration, Placement
from expertmesh.planner.rounds import migration_rounds, recovery_rounds
from expertmesh.planner.static import static_placement

TOPO = Topology.generate(3, 2, masters=1, spare=3)  # 3 DCs x 2 ranks, 4 slots each
E = 6
MODEL = ModelSpec(num_experts=E, num_layers=1)


def _random(rng: np.random.Generator, live: np.ndarray | None = None) -> Placement:
    """Every expert at least once (on live ranks when ``live`` is given), its master on
    its first copy."""
    ranks = np.flatnonzero(live) if live is not None else np.arange(TOPO.num_ranks)
    p2l = np.full((TOPO.num_ranks, TOPO.slots_per_rank), -1, dtype=np.int32)
    cells = [(int(r), s) for r in ranks for s in range(TOPO.slots_per_rank)]
    order = rng.permutation(len(cells))
    for i, e in enumerate(rng.permutation(E)):
        p2l[cells[order[i]]] = e
    for k in order[E:]:
        if rng.random() < 0.6:
            p2l[cells[k]] = rng.integers(0, E)
    flat = p2l.ravel()
    master = np.array([np.flatnonzero(flat == e)[0] for e in range(E)])
    return Placement(phy2log=p2l, master=master)


def _replay(old: Placement, rounds: list, live: np.ndarray) -> np.ndarray:
    """[R, E] what the ranks hold after the rounds; asserts each source holds its expert
    when the round starts and is live."""
    have = old.holds() & live[:, None]
    for rnd in rounds:
        start = have.copy()
        for _, e, src, dst, kind in rnd:
            assert live[src] and live[dst]
            assert start[src, e], f"expert {e} sent from rank {src}, which does not hold it yet"
            if kind == "w":
                have[dst, e] = True
    return have


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), planned=st.booleans())
def test_migration_rounds_deliver_every_copy_and_move_masters(seed: int, planned: bool) -> None:
    rng = np.random.default_rng(seed)
    old, new = _random(rng), _random(rng)
    if planned:  # the planner's own transfers (relays included) are kept where valid
        new = align_placement(old, new, TOPO)
        mig = plan_migration(old, new, TOPO, MODEL)
    else:
        mig = Migration()
    rounds = migration_rounds([old], [new], [mig], TOPO)
    have = _replay(old, rounds, np.ones(TOPO.num_ranks, bool))
    assert (have >= new.holds()).all()
    moved = np.flatnonzero(old.master_rank() != new.master_rank())
    opt = {(e, src, dst) for rnd in rounds for _, e, src, dst, kind in rnd if kind == "opt"}
    assert opt == {(int(e), int(old.master_rank()[e]), int(new.master_rank()[e])) for e in moved}


def test_migration_rounds_send_nothing_for_the_same_placement() -> None:
    p = static_placement(TOPO.num_ranks, TOPO.slots_per_rank, E, TOPO.masters_per_rank)
    assert migration_rounds([p, p], [p, p], [Migration(), Migration()], TOPO) == []
    with pytest.raises(ValueError, match="one entry per layer"):
        migration_rounds([p], [p, p], [Migration()], TOPO)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), dead=st.sets(st.integers(0, 5), min_size=1, max_size=3))
def test_recovery_rounds_use_live_holders_and_list_the_rest(seed: int, dead: set[int]) -> None:
    rng = np.random.default_rng(seed)
    live = np.ones(TOPO.num_ranks, bool)
    live[sorted(dead)] = False
    old, new = _random(rng), _random(rng, live)
    rounds, restore = recovery_rounds([old], [new], live, TOPO)
    have = _replay(old, rounds, live)
    restored = {(e, r) for _, e, r, kind in restore if kind == "w"}
    for r, e in zip(*np.nonzero(new.holds()), strict=True):
        assert have[r, e] or (int(e), int(r)) in restored
    for _, e, _, kind in restore:  # only what no live rank has
        if kind == "w":
            assert not (old.holds()[:, e] & live).any()
        else:
            assert not live[old.master_rank()[e]]
    lost = {int(e) for e in range(E) if not live[old.master_rank()[e]]}
    moved = {int(e) for e in range(E) if old.master_rank()[e] != new.master_rank()[e]}
    assert {e for _, e, _, kind in restore if kind == "opt"} == lost & moved


def test_recovery_rounds_refuse_copies_on_dead_ranks() -> None:
    p = static_placement(TOPO.num_ranks, TOPO.slots_per_rank, E, TOPO.masters_per_rank)
    live = np.ones(TOPO.num_ranks, bool)
    live[0] = False
    with pytest.raises(ValueError, match="dead ranks"):
        recovery_rounds([p], [p], live, TOPO)
