"""migration_moves: the transfers of plan_migration as arrays, whichever path computes them
(the plain-Python replica path, the small scheduler, the numpy one)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import expertmesh.planner.migration as mig_mod
from expertmesh.planner import ModelSpec, Placement, Topology, TransferKind
from expertmesh.planner.migration import align_placement, migration_moves, plan_migration
from tests.unit.test_migration import cases


def _from_plan(old: Placement, new: Placement, topo: Topology, model: ModelSpec):
    mig = plan_migration(old, new, topo, model)
    t = mig.transfers
    return (
        [x.src_rank for x in t],
        [x.dst_rank for x in t],
        [x.expert for x in t],
        [x.kind == TransferKind.MASTER for x in t],
    )


def _check(old: Placement, new: Placement, topo: Topology, model: ModelSpec) -> None:
    got = migration_moves(old, new, topo, model)
    assert [a.dtype for a in got] == [np.dtype(np.int64)] * 3 + [np.dtype(bool)]
    assert [a.tolist() for a in got] == list(_from_plan(old, new, topo, model))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.booleans())
def test_moves_are_plan_migrations_transfers(case, relabel):
    topo, old, new = case
    model = ModelSpec(num_experts=int(new.master.size), hidden=8, ffn_hidden=8)
    _check(old, align_placement(old, new, topo, relabel_ranks=relabel), topo, model)


def _scale_replan(seed: int, masters: bool) -> tuple[Topology, ModelSpec, Placement, Placement]:
    """The scale run's EP group (8 DCs x 8 ranks, 256 experts, 4 + 2 slots) and a re-plan
    that adds and drops replicas of hot experts (and with ``masters`` moves two masters to
    other ranks: one of an expert with replicas, one of an expert without, every copy on
    their old master ranks emptied, so that align_placement cannot keep them there)."""
    topo = Topology.generate(8, 8)
    model = ModelSpec(num_experts=256)
    rng = np.random.default_rng(seed)
    p2l = np.full((64, 6), -1, dtype=np.int32)
    p2l[:, :4] = np.arange(256).reshape(64, 4)
    spare = np.argwhere(p2l < 0)
    take = rng.choice(len(spare), size=int(rng.integers(1, 40)), replace=False)
    p2l[spare[take, 0], spare[take, 1]] = rng.integers(0, 256, size=3)[
        rng.integers(0, 3, take.size)
    ]
    old = Placement(phy2log=p2l, master=(np.arange(256) // 4) * 6 + np.arange(256) % 4)
    p2l = p2l.copy()
    drop = rng.choice(len(spare), size=int(rng.integers(0, 20)), replace=False)
    p2l[spare[drop, 0], spare[drop, 1]] = -1
    add = rng.choice(len(spare), size=int(rng.integers(1, 30)), replace=False)
    p2l[spare[add, 0], spare[add, 1]] = rng.integers(0, 256, size=4)[rng.integers(0, 4, add.size)]
    master = old.master.copy()
    moved: list[int] = []
    if masters:
        hot = np.unique(p2l[:, 4:][p2l[:, 4:] >= 0])  # experts with a replica
        for e in (int(rng.choice(hot)), int(rng.choice(np.setdiff1d(np.arange(256), hot)))):
            home = e // 4
            p2l[home][p2l[home] == e] = -1  # no copy left on the old master rank
            at = np.argwhere(p2l == e)  # a replica elsewhere becomes the master
            if not len(at):  # else a copy in a free slot of another rank
                free = np.argwhere(p2l < 0)
                free = free[free[:, 0] != home]
                at = free[[int(rng.integers(len(free)))]]
            r, s = at[0]
            p2l[r, s] = e
            master[e] = r * 6 + s
            moved.append(e)
    new = align_placement(old, Placement(phy2log=p2l, master=master), topo)
    # exactly the moved masters change rank once aligned (a master on its old rank moves nothing)
    assert np.flatnonzero(old.master // 6 != new.master // 6).tolist() == sorted(moved)
    return topo, model, old, new


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("masters", [False, True])
def test_moves_on_the_scale_group_every_path(seed, masters):
    topo, model, old, new = _scale_replan(seed, masters)
    _check(old, new, topo, model)
    want = [a.tolist() for a in migration_moves(old, new, topo, model)]
    assert sum(want[3]) == (2 if masters else 0)  # the two masters' moves, if any
    if masters:  # which leave the plain-Python replica path
        assert mig_mod._replica_moves(old, new, topo) is None
    saved = mig_mod.SMALL_JOBS
    try:
        # no plain-Python path (_replica_moves then always gives None: no count of changed
        # slots is below 0) and no small scheduler: the numpy scheduler
        mig_mod.SMALL_JOBS = -1
        assert [a.tolist() for a in migration_moves(old, new, topo, model)] == want
    finally:
        mig_mod.SMALL_JOBS = saved


def test_the_replica_path_runs_on_a_replica_replan():
    # a re-plan that only adds replicas on other ranks takes the plain-Python path; one
    # that also moves a master or copies inside a rank does not
    fast = [
        c
        for c in map(lambda s: _scale_replan(s, False), range(16))
        if mig_mod._replica_moves(*c[2:], c[0]) is not None
    ]
    assert len(fast) >= 8
    topo, model, old, new = fast[0]
    p2l = new.phy2log.copy()
    r, s = np.argwhere(p2l < 0)[0]
    p2l[r, s] = p2l[r, 0]  # a second copy of an expert the rank holds: a local copy
    local = Placement(phy2log=p2l, master=new.master)
    assert mig_mod._replica_moves(old, local, topo) is None
    _check(old, local, topo, model)


def test_a_master_that_changes_rank_leaves_the_replica_path():
    # built directly (align_placement may keep a master where it was): expert 5's master
    # moves from rank 1 to a spare slot of rank 40, its old slot emptied, next to a
    # replica added elsewhere; the move is a master transfer, on the general path
    topo, model, old, _ = _scale_replan(0, False)
    p2l = old.phy2log.copy()
    master = old.master.copy()
    assert master[5] // 6 == 1
    s = int(np.flatnonzero(p2l[40] < 0)[0])
    p2l[40, s], p2l[1, 1] = 5, -1
    master[5] = 40 * 6 + s
    r = int(np.flatnonzero((p2l < 0).any(axis=1) & ~(p2l == 9).any(axis=1))[-1])
    p2l[r, int(np.flatnonzero(p2l[r] < 0)[0])] = 9  # and a replica of expert 9
    new = Placement(phy2log=p2l, master=master)
    assert (old.master // 6 != new.master // 6).sum() == 1
    assert mig_mod._replica_moves(old, new, topo) is None
    _check(old, new, topo, model)
    _src, dst, expert, is_master = migration_moves(old, new, topo, model)
    assert (expert[is_master] == 5).all() and (dst[is_master] == 40).all() and is_master.any()
    assert ((expert == 9) & ~is_master).any()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.booleans())
def test_align_with_old_checked_is_the_same_alignment(case, relabel):
    # old_checked skips old's value checks only (the simulator's previous placement, made
    # or checked by an earlier alignment): the same placement; a bad new still raises
    topo, old, new = case
    want = align_placement(old, new, topo, relabel_ranks=relabel)
    got = align_placement(old, new, topo, relabel_ranks=relabel, old_checked=True)
    assert np.array_equal(got.phy2log, want.phy2log)
    assert np.array_equal(got.master, want.master)
    bad = Placement(phy2log=new.phy2log, master=(new.master + 1) % new.phy2log.size)
    if not (bad.phy2log.ravel()[bad.master] == np.arange(bad.master.size)).all():
        with pytest.raises(ValueError, match="new"):
            align_placement(old, bad, topo, old_checked=True)
        with pytest.raises(ValueError, match="old"):
            align_placement(bad, old, topo)
        align_placement(bad, old, topo, old_checked=True)  # old's values: not checked
