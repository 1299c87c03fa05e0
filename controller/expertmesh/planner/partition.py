"""Domain-based partition: lay out each DC's expert copies on its ranks so the DC balances.

Input is what a cross-DC planner decided per DC: which experts it holds and the
tokens each will compute. Inside each DC (the domain) this module

1. splits heavy experts over extra local copies while a DC has free slots and
   the work a copy takes off the busiest copy of that expert outweighs its sync
   (D'Hondt order, as DeepSeek EPLB replicates; ``gain`` threshold per DC);
2. keeps copies where the previous placement already has them (no migration);
3. packs the rest heaviest first onto the rank with the least predicted work
   that has a free slot and does not hold that expert yet (LPT), vectorized
   over DCs.

Tokens inside a DC split evenly over its copies of an expert; tokens of DCs that
hold none spread evenly over every copy. Public entry: :func:`partition_domains`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from expertmesh.planner.plan import Placement
from expertmesh.planner.topology import Topology

__all__ = ["DomainDemand", "partition_domains"]


@dataclass(frozen=True, eq=False)
class DomainDemand:
    """What each DC must hold.

    - ``count``: [D, E] int copies of expert e in DC d (>= 1 in its master's DC).
    - ``local``: [D, E] float tokens DC d computes for e (split over its copies).
    - ``remote``: [E] float tokens of DCs without a copy, spread evenly over every copy.
    - ``master_dc``: [E] DC of each master; ``master_slot``: [E] flat slot ``r * S + s`` of
      a master that stays where it is, ``-1`` for one to place in ``master_dc``.
    - ``gain``: [D] tokens an extra local copy must take off the busiest copy to be worth
      its sync (``inf``: never split).
    - ``reserve``: slots each rank keeps free where its DC has room (the fast loop's spare
      slots: a rank full of cold experts cannot take a replica of a hot one); copies go
      into a rank's reserve only once every rank of the DC is down to its reserve.
    """

    count: np.ndarray
    local: np.ndarray
    remote: np.ndarray
    master_dc: np.ndarray
    master_slot: np.ndarray
    gain: np.ndarray
    reserve: int = 0


def _splits(topology: Topology, demand: DomainDemand, free: np.ndarray) -> np.ndarray:
    """[D, E] extra copies: D'Hondt picks (largest tokens per copy first) while the work
    taken off per copy ``w / (c (c + 1))`` reaches ``gain`` and the DC has free slots."""
    num_dcs, num_experts = demand.count.shape
    extra = np.zeros((num_dcs, num_experts), np.int64)
    copies = demand.count.sum(axis=0)  # [E]
    per_copy_remote = demand.remote / np.maximum(copies, 1)
    total = demand.local + demand.count * per_copy_remote[None, :]  # [D, E] work in DC d
    sizes = np.bincount(topology.rank_dc, minlength=num_dcs)
    d, e = np.nonzero((demand.count > 0) & (total > 0))
    if d.size == 0:
        return extra
    base = demand.count[d, e]
    room = np.maximum(np.minimum(sizes[d] - base, free[d]), 0)  # at most one copy per rank
    n = np.repeat(np.arange(d.size), room)
    c = base[n] + (np.arange(n.size) - np.repeat(np.cumsum(room) - room, room))  # copies before
    w = total[d[n], e[n]]
    taken = w / (c * (c + 1.0))
    ok = taken >= demand.gain[d[n]]
    n, c, w = n[ok], c[ok], w[ok]
    order = np.lexsort((-(w / c), d[n]))  # per DC, D'Hondt priority
    n = n[order]
    dd = d[n]
    rank_in_dc = np.arange(n.size) - np.searchsorted(dd, dd, "left")
    take = rank_in_dc < free[dd]
    np.add.at(extra, (d[n[take]], e[n[take]]), 1)
    return extra


def partition_domains(
    topology: Topology, demand: DomainDemand, previous: Placement | None = None
) -> Placement:
    """The placement [R, S] holding ``demand``, balanced inside each DC."""
    num_dcs, num_experts = demand.count.shape
    num_ranks, slots = topology.num_ranks, topology.slots_per_rank
    rank_dc = topology.rank_dc
    if demand.count[demand.master_dc, np.arange(num_experts)].min(initial=1) < 1:
        raise ValueError("every master's DC must hold at least one copy")
    sizes = np.bincount(rank_dc, minlength=num_dcs)
    free = sizes * slots - demand.count.sum(axis=1)
    if free.min(initial=0) < 0:
        raise ValueError("a DC holds more copies than it has slots")
    count = demand.count + _splits(topology, demand, free)
    phy2log = np.full((num_ranks, slots), -1, np.int32)
    flat = phy2log.reshape(-1)
    stay = np.flatnonzero(demand.master_slot >= 0)
    flat[demand.master_slot[stay]] = stay
    master = demand.master_slot.astype(np.int64).copy()

    # copies to place: every copy but staying masters; the master's copy is copy 0
    need = count.copy()
    need[demand.master_dc[stay], stay] -= 1
    d, e = np.nonzero(need > 0)
    reps = need[d, e]
    cd, ce = np.repeat(d, reps), np.repeat(e, reps)
    is_master = np.zeros(cd.size, bool)
    moved = demand.master_slot < 0
    first = np.cumsum(reps) - reps  # first copy of each (d, e)
    mark = moved[e] & (demand.master_dc[e] == d)
    is_master[first[mark]] = True
    remote_share = demand.remote / np.maximum(count.sum(axis=0), 1)  # [E] per copy
    weight = demand.local[cd, ce] / count[cd, ce] + remote_share[ce]
    rank_w = np.zeros(num_ranks)
    mr = demand.master_slot[stay] // slots
    md = demand.master_dc[stay]
    np.add.at(rank_w, mr, demand.local[md, stay] / count[md, stay] + remote_share[stay])
    where = np.full(cd.size, -1, np.int64)
    if previous is not None:
        _keep(topology, previous, phy2log, (cd, ce, is_master), where, reserve=demand.reserve)
        kept = where >= 0
        np.add.at(rank_w, where[kept], weight[kept])
    _lpt(topology, phy2log, (cd, ce, weight), rank_w, where, reserve=demand.reserve)
    if demand.reserve:  # what did not fit outside the reserve goes into it
        _lpt(topology, phy2log, (cd, ce, weight), rank_w, where)
    # a local split whose only free slots sit on ranks that hold the expert is dropped; a
    # master in that spot takes over one of its DC's copies instead
    for i in np.flatnonzero(is_master):
        r = where[i]
        if r < 0:
            holders = np.flatnonzero((rank_dc == cd[i]) & (phy2log == ce[i]).any(axis=1))
            if holders.size == 0:
                raise ValueError(f"partition: DC {int(cd[i])} has no slot for a master")
            r = int(holders[0])
        master[ce[i]] = r * slots + int(np.flatnonzero(phy2log[r] == ce[i])[0])
    return Placement(phy2log=phy2log, master=master)


def _keep(
    topology: Topology,
    previous: Placement,
    phy2log: np.ndarray,
    copies: tuple[np.ndarray, np.ndarray, np.ndarray],
    where: np.ndarray,
    *,
    reserve: int = 0,
) -> None:
    """Copies that a rank of the same DC held before stay on that rank (non-master copies
    first take the previous replicas, a moved master takes any previous copy), where it
    has more than ``reserve`` free slots."""
    cd, ce, _ = copies
    num_experts = int(previous.master.size)
    r, s = np.nonzero(previous.phy2log >= 0)
    e = previous.phy2log[r, s].astype(np.int64)
    # previous holders that can take it again: a free slot, not holding it already
    ok = (phy2log[r] < 0).any(axis=1) & (phy2log[r] != e[:, None]).all(axis=1)
    pair = np.unique(r[ok] * num_experts + e[ok])  # one per (rank, expert)
    r, e = pair // num_experts, pair % num_experts
    kp = topology.rank_dc[r] * num_experts + e
    o = np.lexsort((r, kp))
    kp, rp = kp[o], r[o]
    pos_prev = np.arange(kp.size) - np.searchsorted(kp, kp, "left")
    lookup = {(int(k), int(p)): int(x) for k, p, x in zip(kp, pos_prev, rp, strict=True)}
    # the i-th new copy of a (DC, expert) goes back to the i-th previous holder
    key_new = cd * num_experts + ce
    o2 = np.argsort(key_new, kind="stable")
    kn = key_new[o2]
    pos_new = np.arange(kn.size) - np.searchsorted(kn, kn, "left")
    for i, k, p in zip(o2, kn, pos_new, strict=True):
        rank = lookup.get((int(k), int(p)))
        if rank is None:
            continue
        slot = np.flatnonzero(phy2log[rank] < 0)
        if slot.size <= reserve or (phy2log[rank] == ce[i]).any():
            continue
        phy2log[rank, slot[0]] = ce[i]
        where[i] = rank


def _lpt(
    topology: Topology,
    phy2log: np.ndarray,
    copies: tuple[np.ndarray, np.ndarray, np.ndarray],
    rank_w: np.ndarray,
    where: np.ndarray,
    *,
    reserve: int = 0,
) -> None:
    """Place copies with ``where < 0``: heaviest first per DC, onto the least-loaded rank of
    its DC with a free slot beyond ``reserve`` that does not hold the expert (copies that
    find none stay unplaced). Vectorized over DCs."""
    cd, ce, weight = copies
    todo = np.flatnonzero(where < 0)
    if todo.size == 0:
        return
    sizes = np.array([dc.num_ranks for dc in topology.dcs])
    width = int(sizes.max())
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    valid = np.arange(width)[None, :] < sizes[:, None]
    ranks = np.where(valid, first[:, None] + np.arange(width)[None, :], 0)  # [D, width]
    load = np.where(valid, rank_w[ranks], np.inf)
    room = np.where(valid, np.maximum((phy2log < 0).sum(axis=1) - reserve, 0)[ranks], 0)
    order = todo[np.lexsort((-weight[todo], cd[todo]))]
    dd = cd[order]
    pos = np.arange(order.size) - np.searchsorted(dd, dd, "left")
    for i in range(int(pos.max()) + 1):
        take = order[pos == i]
        dcs = cd[take]
        rr = ranks[dcs]  # [n, width]
        holds = (phy2log[rr] == ce[take][:, None, None]).any(axis=2)
        cand = np.where((room[dcs] > 0) & ~holds, load[dcs], np.inf)
        col = np.argmin(cand, axis=1)
        ok = np.isfinite(cand[np.arange(take.size), col])
        take, dcs, col = take[ok], dcs[ok], col[ok]
        rank = ranks[dcs, col]
        slot = np.argmax(phy2log[rank] < 0, axis=1)
        phy2log[rank, slot] = ce[take]
        where[take] = rank
        load[dcs, col] += weight[take]
        rank_w[rank] += weight[take]  # one copy per DC a round: the ranks are distinct
        room[dcs, col] -= 1
