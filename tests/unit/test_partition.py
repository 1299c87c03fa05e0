"""Domain-based partition: copies land in their DC, slots hold, masters stay, heavy experts split."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.planner import Placement, Topology
from expertmesh.planner.partition import DomainDemand, partition_domains
from expertmesh.planner.static import static_placement

TOPO = Topology.generate(2, 4, masters=2, spare=2)  # 2 DCs x 4 ranks x 4 slots


def _demand(count, local, gain=np.inf, master_slot=None):
    base = static_placement(8, 4, 8, 2)
    mdc = TOPO.rank_dc[base.master_rank()]
    return base, DomainDemand(
        count=count,
        local=local,
        remote=np.zeros(8),
        master_dc=mdc,
        master_slot=base.master if master_slot is None else master_slot,
        gain=np.full(2, gain),
    )


def _counts(p: Placement) -> np.ndarray:
    out = np.zeros((2, 8), np.int64)
    r, s = np.nonzero(p.phy2log >= 0)
    np.add.at(out, (TOPO.rank_dc[r], p.phy2log[r, s]), 1)
    return out


def test_masters_stay_and_replicas_go_to_their_dc():
    count = np.zeros((2, 8), np.int64)
    count[0, :4] = count[1, 4:] = 1  # masters
    count[0, 5] = count[1, 0] = 1  # one replica each way
    base, d = _demand(count, np.ones((2, 8)))
    p = partition_domains(TOPO, d)
    assert np.array_equal(p.master, base.master)
    assert np.array_equal(_counts(p), count)


def test_a_heavy_expert_splits_over_ranks_of_its_dc():
    count = np.zeros((2, 8), np.int64)
    count[0, :4] = count[1, 4:] = 1
    local = np.ones((2, 8))
    local[0, 0] = 1000.0  # expert 0 is hot in DC 0
    _, d = _demand(count, local, gain=10.0)
    p = partition_domains(TOPO, d)
    c = _counts(p)
    assert c[0, 0] == 4  # one copy on every rank of DC 0
    holders = np.flatnonzero((p.phy2log == 0).any(axis=1))
    assert sorted(holders.tolist()) == [0, 1, 2, 3]
    _, d = _demand(count, local, gain=np.inf)
    assert _counts(partition_domains(TOPO, d))[0, 0] == 1  # never split


def test_a_moved_master_is_placed_in_its_new_dc():
    count = np.zeros((2, 8), np.int64)
    count[0, :4] = count[1, 4:] = 1
    base, d = _demand(count, np.ones((2, 8)))
    mdc = d.master_dc.copy()
    mdc[7] = 0
    count = count.copy()
    count[1, 7], count[0, 7] = 0, 1
    slot = base.master.copy()
    slot[7] = -1
    d = DomainDemand(count, d.local, d.remote, mdc, slot, d.gain)
    p = partition_domains(TOPO, d)
    assert TOPO.rank_dc[p.master_rank()[7]] == 0
    assert p.phy2log.reshape(-1)[p.master[7]] == 7


def test_previous_copies_stay_on_their_rank():
    count = np.zeros((2, 8), np.int64)
    count[0, :4] = count[1, 4:] = 1
    count[0, 6] = 1
    base, d = _demand(count, np.ones((2, 8)))
    prev = base.phy2log.copy()
    prev[2, 3] = 6  # rank 2 held a replica of expert 6
    p = partition_domains(TOPO, d, Placement(prev, base.master))
    assert (p.phy2log[2] == 6).any()


def test_too_many_copies_is_a_value_error():
    count = np.ones((2, 8), np.int64) * 3  # 24 copies, 16 slots per DC
    _, d = _demand(count, np.ones((2, 8)))
    with pytest.raises(ValueError, match="slots"):
        partition_domains(TOPO, d)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), gain=st.sampled_from([0.0, 5.0, np.inf]))
def test_layout_invariants(seed, gain):
    rng = np.random.default_rng(seed)
    count = np.zeros((2, 8), np.int64)
    count[0, :4] = count[1, 4:] = 1
    extra = rng.random((2, 8)) < 0.4
    count = np.maximum(count, extra.astype(np.int64))
    local = rng.random((2, 8)) * 100 * (count > 0)
    base, d = _demand(count, local, gain=gain)
    p = partition_domains(TOPO, d)
    c = _counts(p)
    assert (c >= count).all() and (c[count == 0] == 0).all()  # only splits add copies
    assert (c <= 4).all()  # at most one per rank of the DC
    for r in range(8):  # no expert twice on a rank
        row = p.phy2log[r][p.phy2log[r] >= 0]
        assert len(set(row.tolist())) == row.size
    assert np.array_equal(p.master, base.master)
    flat = p.phy2log.reshape(-1)
    assert np.array_equal(flat[p.master], np.arange(8))


def test_the_reserve_stays_on_every_rank_where_the_dc_has_room():
    """DC 0's rank 0 holds a cold master, ranks 1-3 hot ones; 3 more copies come in. By
    work alone they land on the cold rank (least loaded) and fill it; with ``reserve=1``
    every rank keeps a free slot (4 ranks x 4 slots hold 4 masters + 3 copies)."""
    count = np.zeros((2, 8), np.int64)
    count[0, :4] = count[1, 4:] = 1  # masters
    count[0, 4:7] = 1  # three copies of DC 1's experts
    local = np.ones((2, 8))
    local[0, 1:4] = 500.0  # the masters of ranks 1-3 are hot (static: rank r holds r)
    base, d = _demand(count, local)
    plain = partition_domains(TOPO, d)
    kept = partition_domains(TOPO, DomainDemand(**{**d.__dict__, "reserve": 1}))
    free = (kept.phy2log[:4] < 0).sum(axis=1)
    assert free.min() >= 1, kept.phy2log[:4]
    assert ((plain.phy2log[:4] < 0).sum(axis=1) == 0).any()  # the work-only layout fills one
    np.testing.assert_array_equal(_counts(kept), count)
    np.testing.assert_array_equal(kept.master, base.master)
