"""Migration: turn an old placement into a new one with the least traffic.

Two steps, as the brief's problem 3 asks (docs/migration.md has the equations):

1. :func:`align_placement` (assignment): lay the new placement over the old one
   so that every copy that can stay in its slot does, optionally relabeling
   ranks inside a DC (whole nodes, then ranks inside a node) by solving an
   assignment problem, and keep every master on its old rank when the new
   placement still has a copy there.
2. :func:`plan_migration` (transfers, then rounds): each slot whose content
   changes becomes one frozen :class:`Transfer`; a scheduler batches them into
   rounds in which every copy comes from the *nearest* rank holding the expert
   at that round (old holders, plus ranks that received it in an earlier round,
   which act as relays), so an expert copied to many ranks fans out through a
   doubling tree in ``O(log n)`` rounds.

Round invariant (checked by ``refs.check_migration``): inside one round each
rank sends at most one transfer and receives at most one transfer, and each
ordered pair of DCs ``(a, b)``, ``a != b``, carries at most one transfer (the
WAN link of a DC pair is one shared link per direction; we do not model
several transfers sharing it). Copies inside one rank (a second copy of an
expert the rank already has) use no link and are exempt.

Two-phase apply: incoming weights are staged and the slots switch at commit,
so every old copy stays readable as a source during all rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from expertmesh.planner.align import _check_pair, align_placement
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import Migration, Placement, Transfer, TransferKind
from expertmesh.planner.smallrounds import small_rounds
from expertmesh.planner.topology import Topology

__all__ = ["align_placement", "migration_moves", "plan_migration"]

# Upper bound on matching passes inside one round (each pass accepts >= 1 transfer;
# what is left waits for the next round, which keeps every invariant).
MAX_PASSES = 64
#: most jobs the scheduler runs in plain Python (:meth:`_Scheduler.run_small`)
SMALL_JOBS = 512


# ---------------------------------------------------------------- transfers


@dataclass(frozen=True, eq=False)
class _Jobs:
    """Transfers over links, arrays [J]; the scheduler gives each a source and a round.

    ``fixed_src`` is the old master rank for a master move (only it has the optimizer
    state) and ``-1`` for a replica, whose source is the nearest holder of its round.
    """

    expert: np.ndarray
    dst: np.ndarray
    slot: np.ndarray
    fixed_src: np.ndarray
    nbytes: np.ndarray
    master: np.ndarray  # bool


def _first_in_group(key: np.ndarray) -> np.ndarray:
    """[N] bool: the element is the first with its key (keys in priority order)."""
    first = np.zeros(key.size, dtype=bool)
    if key.size == 0:
        return first
    o = np.argsort(key, kind="stable")  # equal keys keep their order: a run starts first
    k = key[o]
    start = np.empty(key.size, dtype=bool)
    start[0] = True
    np.not_equal(k[1:], k[:-1], out=start[1:])
    first[o[start]] = True
    return first


def _rank_in_group(key: np.ndarray) -> np.ndarray:
    """[N] int64, ``key`` sorted: position of each element inside its run of equal keys."""
    return np.arange(key.size) - np.searchsorted(key, key)


def _isin(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.isin(a, b)`` for 1-d int arrays, without its set-up where they are small (the
    scheduler asks with a round's few entries, often none, many times per migration)."""
    if a.size == 0 or b.size == 0:
        return np.zeros(a.shape, dtype=bool)
    if a.size * b.size <= 8192:
        out: np.ndarray = (a[:, None] == b[None, :]).any(axis=1)
        return out
    return np.isin(a, b)


def _member(sorted_keys: np.ndarray, query: np.ndarray) -> np.ndarray:
    """[N] bool: ``query`` [N] occurs in ``sorted_keys`` [H] (sorted)."""
    if sorted_keys.size == 0:
        return np.zeros(query.size, dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_keys, query), sorted_keys.size - 1)
    return sorted_keys[pos] == query


def _pair_sorted(dkey: np.ndarray, hkey: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inside each group, pair the q-th job with the q-th holder. ``dkey`` [N] and ``hkey``
    [H] are non-negative group ids, each sorted (ties in the order to pair them). Returns
    positions ``(job [P], holder [P])``."""
    if dkey.size == 0 or hkey.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    span = max(dkey.size, hkey.size) + 1
    dcode = dkey * span + _rank_in_group(dkey)
    hcode = hkey * span + _rank_in_group(hkey)
    pos = np.minimum(np.searchsorted(hcode, dcode), hcode.size - 1)
    hit = hcode[pos] == dcode
    return np.flatnonzero(hit), pos[hit]


class _Holders:
    """Holders of a round sorted three ways: by (expert, node), (expert, DC), expert;
    ties by rank. ``key[level]``, ``rank[level]`` [H]."""

    def __init__(self, hold_e: np.ndarray, hold_r: np.ndarray, sched: _Scheduler) -> None:
        keys = (
            hold_e * sched.num_nodes + sched.node[hold_r],
            hold_e * sched.num_dcs + sched.dc[hold_r],
            hold_e,
        )
        self.key: list[np.ndarray] = []
        self.rank: list[np.ndarray] = []
        for k in keys:
            o = np.lexsort((hold_r, k))
            self.key.append(k[o])
            self.rank.append(hold_r[o])

    def free(self, level: int, busy_src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(key, rank)`` of the holders whose rank has not sent yet this round."""
        ok = ~busy_src[self.rank[level]]
        return self.key[level][ok], self.rank[level][ok]


class _Round:
    """What one round has used so far: ports of ranks, node and DC entries, DC pairs."""

    def __init__(self, num_ranks: int) -> None:
        self.busy_src = np.zeros(num_ranks, dtype=bool)
        self.busy_dst = np.zeros(num_ranks, dtype=bool)
        self.node_entries = np.zeros(0, dtype=np.int64)  # keys expert * nodes + node
        self.dc_entries = np.zeros(0, dtype=np.int64)  # keys expert * DCs + DC
        self.pairs = np.zeros(0, dtype=np.int64)  # keys src DC * DCs + dst DC


class _Scheduler:
    """Rounds for :class:`_Jobs` (see :func:`plan_migration` and docs/migration.md).

    A replica job's *level* in a round is where its nearest holders are: 0 in its
    node, 1 elsewhere in its DC, 2 in other DCs (then the DCs at the least
    distance). It copies only from free holders of its level, so it may wait a round
    for a nearer relay. At most one transfer of an expert enters a node (a DC) from
    outside per round: the rest of that node (DC) copies from the newcomer next round,
    which gives each expert a doubling tree. Inside a round, jobs propose sources in
    passes; a proposal is accepted when it is the first, in priority order, of every
    group it belongs to (source rank, destination rank, node entry, DC entry, ordered
    DC pair), so the accepted set never breaks the round invariant.
    Priority: level 2 first, then masters, experts with more copies to make, expert,
    destination rank.
    """

    def __init__(self, jobs: _Jobs, topology: Topology, num_experts: int) -> None:
        self.topo = topology
        self.node, self.dc = topology.rank_node, topology.rank_dc
        self.num_nodes, self.num_dcs = topology.num_nodes, topology.num_dcs
        self.jobs = jobs
        self.e, self.dst, self.fixed = jobs.expert, jobs.dst, jobs.fixed_src
        self.dnode, self.ddc = self.node[self.dst], self.dc[self.dst]
        self.nkey = self.e * self.num_nodes + self.dnode  # node entry of each job
        self.dkey = self.e * self.num_dcs + self.ddc  # DC entry of each job
        n = self.e.size
        fanout = np.bincount(self.e, minlength=num_experts)
        self.prio = np.empty(n, dtype=np.int64)
        self.prio[np.lexsort((self.dst, self.e, -fanout[self.e], ~jobs.master))] = np.arange(n)
        self.is_fixed = self.fixed >= 0
        fsrc = np.where(self.is_fixed, self.fixed, 0)
        self.fixed_level = np.where(
            self.dc[fsrc] != self.ddc, 2, np.where(self.node[fsrc] != self.dnode, 1, 0)
        )

    def run(self, hold_e: np.ndarray, hold_r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``hold_e``, ``hold_r`` [H]: old copies. Returns ``(src [J], round [J])``: with at
        most :data:`SMALL_JOBS` jobs and no per-pair links, :meth:`run_small` (the same
        answer in plain Python), else :meth:`run_arrays`."""
        if self.e.size <= SMALL_JOBS and not self.topo.pairs:
            return self.run_small(hold_e, hold_r)
        return self.run_arrays(hold_e, hold_r)

    def run_arrays(self, hold_e: np.ndarray, hold_r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The scheduler in numpy passes over every job (any size, any topology)."""
        n = self.e.size
        src = np.full(n, -1, dtype=np.int64)
        rnd = np.full(n, -1, dtype=np.int64)
        hold_e, hold_r = hold_e.astype(np.int64), hold_r.astype(np.int64)
        k = 0
        while (rnd < 0).any():
            holders = _Holders(hold_e, hold_r, self)
            level = self._levels(holders)
            order_key = (2 - level) * n + self.prio  # smaller goes first
            pending = rnd < 0
            fixed = np.flatnonzero(pending & self.is_fixed)
            by_level = []  # replica jobs of each level, level 0 sorted by (node entry, prio)
            for lv in range(3):
                j = np.flatnonzero(pending & ~self.is_fixed & (level == lv))
                by_level.append(j[np.lexsort((self.prio[j], self.nkey[j]))] if lv == 0 else j)
            state = _Round(self.topo.num_ranks)
            for _ in range(MAX_PASSES):
                pj, ps = self._propose(fixed, by_level, holders, state)
                if pj.size == 0:
                    break
                pj, ps = self._accept(pj, ps, order_key, state)
                if pj.size == 0:
                    break
                src[pj], rnd[pj] = ps, k
            if not (rnd == k).any():  # cannot happen: a round's first proposal always fits
                raise RuntimeError("migration scheduler made no progress")
            hold_e = np.concatenate([hold_e, self.e[rnd == k]])
            hold_r = np.concatenate([hold_r, self.dst[rnd == k]])
            k += 1
        return src, rnd

    def run_small(self, hold_e: np.ndarray, hold_r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`run_arrays` in plain Python (:func:`_small`), for few jobs on a
        topology without per-pair links (every other DC equally near)."""
        return _small(self.jobs, self.topo, hold_e, hold_r)

    def _levels(self, holders: _Holders) -> np.ndarray:
        """[J] 0, 1 or 2: where the nearest holders of each job's expert are."""
        in_node = _member(holders.key[0], self.nkey)
        in_dc = _member(holders.key[1], self.dkey)
        level = np.where(in_node, 0, np.where(in_dc, 1, 2))
        return np.where(self.is_fixed, self.fixed_level, level)

    def _propose(
        self, fixed: np.ndarray, by_level: list[np.ndarray], holders: _Holders, state: _Round
    ) -> tuple[np.ndarray, np.ndarray]:
        """One pass of proposals ``(job [P], src [P])`` from the round's open jobs: master
        moves ``fixed`` and replica jobs ``by_level``; a job whose destination received
        this round (it may have been accepted) is closed."""
        jobs, srcs = [], []
        j = fixed[~state.busy_dst[self.dst[fixed]] & ~state.busy_src[self.fixed[fixed]]]
        jobs.append(j)
        srcs.append(self.fixed[j])
        # level 0: a free holder in the job's node
        j = by_level[0][~state.busy_dst[self.dst[by_level[0]]]]
        hk, hr = holders.free(0, state.busy_src)
        a, b = _pair_sorted(self.nkey[j], hk)
        jobs.append(j[a])
        srcs.append(hr[b])
        # level 1: one job per (expert, node) this round, a free holder in the job's DC
        j = by_level[1][~state.busy_dst[self.dst[by_level[1]]]]
        j = self._best_per(j[~_isin(self.nkey[j], state.node_entries)], self.nkey)
        j = j[np.lexsort((self.prio[j], self.dkey[j]))]
        hk, hr = holders.free(1, state.busy_src)
        a, b = _pair_sorted(self.dkey[j], hk)
        jobs.append(j[a])
        srcs.append(hr[b])
        # level 2: one job per (expert, DC) this round, a free holder in a nearest DC
        j = by_level[2][~state.busy_dst[self.dst[by_level[2]]]]
        j = self._best_per(j[~_isin(self.dkey[j], state.dc_entries)], self.dkey)
        if not self.topo.pairs:  # every other DC is equally near
            j = j[np.lexsort((self.prio[j], self.e[j]))]
            hk, hr = holders.free(2, state.busy_src)
            a, b = _pair_sorted(self.e[j], hk)
            jobs.append(j[a])
            srcs.append(hr[b])
        else:
            jj, ss = self._nearest_dcs(j, holders, state)
            jobs.append(jj)
            srcs.append(ss)
        return np.concatenate(jobs), np.concatenate(srcs)

    def _best_per(self, j: np.ndarray, key: np.ndarray) -> np.ndarray:
        """The highest-priority job of ``j`` for each value of ``key[j]``."""
        j = j[np.lexsort((self.prio[j], key[j]))]
        return j[_first_in_group(key[j])]

    def _nearest_dcs(
        self, j: np.ndarray, holders: _Holders, state: _Round
    ) -> tuple[np.ndarray, np.ndarray]:
        """Level-2 proposals when DC pairs differ: job ``j[i]`` picks among free holders
        in the DCs nearest to its DC (nearest over all holders, free or not) whose DC
        pair is unused this round; the q-th job of an expert takes the (q mod n)-th."""
        if j.size == 0:
            return j, j
        he, hr = holders.key[2], holders.rank[2]
        free = ~state.busy_src[hr]
        start = np.searchsorted(he, self.e[j])
        count = np.searchsorted(he, self.e[j], side="right") - start
        rows = np.repeat(np.arange(j.size), count)  # one row per (job, holder of its expert)
        h = np.repeat(start - np.cumsum(count) + count, count) + np.arange(rows.size)
        hdc, jdc = self.dc[hr[h]], self.ddc[j][rows]
        dist = self.topo.dc_latency_ms[hdc, jdc] / 1e3 + 8e-3 / self.topo.dc_gbps[hdc, jdc]
        best = np.full(j.size, np.inf)
        np.minimum.at(best, rows, dist)
        pair = hdc * self.num_dcs + jdc
        cand = (dist <= best[rows] * (1 + 1e-12)) & free[h] & ~_isin(pair, state.pairs)
        rows, h = rows[cand], h[cand]
        n_cand = np.bincount(rows, minlength=j.size)
        ej = self.e[j]
        order = np.lexsort((self.prio[j], ej))
        q = np.empty(j.size, dtype=np.int64)
        q[order] = _rank_in_group(ej[order])
        has = n_cand > 0
        pick = (np.cumsum(n_cand) - n_cand)[has] + q[has] % n_cand[has]
        return j[has], hr[h[pick]]

    def _accept(
        self, pj: np.ndarray, ps: np.ndarray, order_key: np.ndarray, state: _Round
    ) -> tuple[np.ndarray, np.ndarray]:
        """The proposals ``(job, src)`` first in every group they belong to; marks them used."""
        cross_node = self.node[ps] != self.dnode[pj]
        cross_dc = self.dc[ps] != self.ddc[pj]
        pair = self.dc[ps] * self.num_dcs + self.ddc[pj]
        ok = ~(cross_node & _isin(self.nkey[pj], state.node_entries))
        ok &= ~(cross_dc & (_isin(self.dkey[pj], state.dc_entries) | _isin(pair, state.pairs)))
        o = np.flatnonzero(ok)[np.argsort(order_key[pj[ok]], kind="stable")]
        pj, ps, cross_node, cross_dc, pair = pj[o], ps[o], cross_node[o], cross_dc[o], pair[o]
        solo = -1 - np.arange(pj.size)  # a key no other proposal shares
        acc = _first_in_group(ps) & _first_in_group(self.dst[pj])
        acc &= _first_in_group(np.where(cross_node, self.nkey[pj], solo))
        acc &= _first_in_group(np.where(cross_dc, self.dkey[pj], solo))
        acc &= _first_in_group(np.where(cross_dc, pair, solo))
        pj, ps = pj[acc], ps[acc]
        state.busy_src[ps] = True
        state.busy_dst[self.dst[pj]] = True
        cn, cd = cross_node[acc], cross_dc[acc]
        state.node_entries = np.concatenate([state.node_entries, self.nkey[pj][cn]])
        state.dc_entries = np.concatenate([state.dc_entries, self.dkey[pj][cd]])
        state.pairs = np.concatenate([state.pairs, pair[acc][cd]])
        return pj, ps


def _ranks(topology: Topology) -> tuple[list[int], list[int], int, int]:
    """``(node [R], DC [R], nodes, DCs)`` of ``topology``'s ranks, as the small scheduler
    reads them."""
    return (
        topology.rank_node.tolist(), topology.rank_dc.tolist(), topology.num_nodes,
        topology.num_dcs,
    )  # fmt: skip


def _small(
    jobs: _Jobs, topology: Topology, hold_e: np.ndarray, hold_r: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`_Scheduler.run_arrays` element by element
    (:func:`~expertmesh.planner.smallrounds.small_rounds`): the same ``(src [J], round
    [J])`` for few jobs where every other DC is equally near (no per-pair links)."""
    src, rnd = small_rounds(
        (jobs.expert.tolist(), jobs.dst.tolist(), jobs.fixed_src.tolist(), jobs.master.tolist()),
        _ranks(topology), (hold_e.tolist(), hold_r.tolist()), MAX_PASSES,
    )  # fmt: skip
    return np.array(src, dtype=np.int64), np.array(rnd, dtype=np.int64)


def _jobs_and_local_copies(
    old: Placement, new: Placement, model: ModelSpec
) -> tuple[_Jobs, np.ndarray, np.ndarray]:
    """Split the slots that change into link transfers and local copies.

    Returns ``(jobs, local [M, 3], after [M] bool)``: ``local`` rows ``(expert, rank,
    slot)`` are copies inside a rank, from a copy it had in ``old`` (``after`` False,
    round 0) or from the one its job brings (``after`` True, the round after).
    """
    num_slots = new.phy2log.shape[1]
    num_experts = new.master.shape[0]
    old_p2l, new_p2l = old.phy2log, new.phy2log.astype(np.int64)

    def had(rank: np.ndarray, expert: np.ndarray) -> np.ndarray:  # old has it there
        out: np.ndarray = (old_p2l[rank] == expert[:, None]).any(axis=1)
        return out

    old_mr, new_mr = old.master // num_slots, new.master // num_slots
    mexp = np.flatnonzero(old_mr != new_mr)  # experts whose master changes rank
    m_dst = new_mr[mexp]
    need = (new_p2l >= 0) & (new_p2l != old_p2l)
    if mexp.size:  # (a re-plan rarely moves a master: then none of this is needed)
        m_had = had(m_dst, mexp)
        m_bytes = np.where(m_had, model.master_bytes - model.expert_bytes, model.master_bytes)
        need.flat[new.master[mexp]] = False  # a moved master's slot: the master move writes it
        m_got = (m_dst * num_experts + mexp)[~m_had]  # (rank, expert) a master move brings
    else:
        m_bytes = m_got = mexp
    dr, ds = np.nonzero(need)  # by rank, then slot
    de = new_p2l[dr, ds]
    local0 = had(dr, de)  # the rank already holds the expert
    key = dr * num_experts + de
    sk = np.sort(key)
    if (sk[1:] == sk[:-1]).any():  # the first slot of each (rank, expert)
        first = np.zeros(dr.size, dtype=bool)
        first[np.unique(key, return_index=True)[1]] = True
    else:  # each (rank, expert) once (a rank rarely gets two new copies of one expert)
        first = np.ones(dr.size, dtype=bool)
    net = ~local0 & first & ~_isin(key, m_got)
    nn = int(net.sum())
    jobs = _Jobs(
        expert=_cat(mexp, de[net]),
        dst=_cat(m_dst, dr[net]),
        slot=_cat(new.master[mexp] % num_slots, ds[net]),
        fixed_src=_cat(old_mr[mexp], np.full(nn, -1)),
        nbytes=_cat(m_bytes, np.full(nn, model.expert_bytes)).astype(np.int64),
        master=_cat(np.ones(mexp.size, dtype=bool), np.zeros(nn, dtype=bool)),
    )
    loc = ~net
    if nn == net.size:  # no local copies
        return jobs, np.zeros((0, 3), dtype=np.result_type(de, dr, ds)), np.zeros(0, dtype=bool)
    return jobs, np.stack([de[loc], dr[loc], ds[loc]], axis=1), ~local0[loc]


def _cat(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.concatenate([a, b])`` of 1-d arrays, or the one that is not empty itself when
    the other adds nothing (and it already has the concatenation's dtype): for a new array
    nobody else holds (a job column; a column sorted into a new array)."""
    if b.size == 0 and a.dtype == np.result_type(a, b):
        return a
    if a.size == 0 and b.dtype == np.result_type(a, b):
        return b
    return np.concatenate([a, b])


def _scheduled(
    old: Placement,
    new: Placement,
    topology: Topology,
    model: ModelSpec,
    num_experts: int,
    *,
    columns: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6),
) -> tuple[list[np.ndarray], _Jobs, np.ndarray, np.ndarray]:
    """The transfers of :func:`plan_migration` as arrays [M] in its order (round, destination
    rank, slot): expert, source, destination, slot, bytes, round, master move (those of
    ``columns``, in that order); its link jobs and their ``(src, round)`` [J] from the
    scheduler. Placements already checked."""
    jobs, local, after = _jobs_and_local_copies(old, new, model)
    if jobs.expert.size <= SMALL_JOBS and not topology.pairs:  # _Scheduler.run's choice
        # the small scheduler reads only the holders of the jobs' experts: find just those
        # (a table over experts, its extra last entry for the empty slots' -1)
        wanted = np.zeros(num_experts + 1, dtype=bool)
        wanted[jobs.expert] = True
        r, s = np.nonzero(wanted[old.phy2log])
        src, rnd = _small(jobs, topology, old.phy2log[r, s], r)
    else:
        r, s = np.nonzero(old.phy2log >= 0)
        src, rnd = _Scheduler(jobs, topology, num_experts).run(old.phy2log[r, s], r)
    # local copies: round 0, or the round after the job that brings the expert
    local_round = np.zeros(len(local), dtype=np.int64)
    if after.any():
        arrival = jobs.dst * num_experts + jobs.expert
        o = np.argsort(arrival)
        at = np.searchsorted(arrival[o], local[after, 1] * num_experts + local[after, 0])
        local_round[after] = rnd[o[at]] + 1
    parts = (
        lambda: (jobs.expert, local[:, 0]),
        lambda: (src, local[:, 1]),
        lambda: (jobs.dst, local[:, 1]),
        lambda: (jobs.slot, local[:, 2]),
        lambda: (jobs.nbytes, np.zeros(len(local), dtype=np.int64)),
        lambda: (rnd, local_round),
        lambda: (jobs.master, np.zeros(len(local), dtype=bool)),
    )
    cols = {c: _cat(*parts[c]()) for c in {*columns, 2, 3, 5}}
    order = np.lexsort((cols[3], cols[2], cols[5]))
    return [cols[c][order] for c in columns], jobs, src, rnd


def migration_moves(
    old: Placement, new: Placement, topology: Topology, model: ModelSpec
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(src, dst, expert, master)`` [M] of the transfers of ``plan_migration(old, new,
    topology, model)``, in its order, without building them or their rounds' seconds
    (the simulator costs a migration from these). ``old`` and ``new`` are not checked:
    pass placements :func:`align_placement` has checked (its ``old`` and its result)."""
    fast = _replica_moves(old, new, topology)
    if fast is not None:
        return fast
    num_experts = new.master.shape[0]
    e, src, dst, master = _scheduled(old, new, topology, model, num_experts, columns=(0, 1, 2, 6))[
        0
    ]
    return src, dst, e, master


def _replica_moves(
    old: Placement, new: Placement, topology: Topology
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """:func:`migration_moves` in plain Python where :func:`_scheduled` would run the small
    scheduler on replica jobs alone: no per-pair links, at most :data:`SMALL_JOBS` slots
    change, no master changes rank, and every changed slot is a link transfer (its rank
    neither held its expert nor gets it twice: no local copy). ``None`` otherwise. A
    re-plan that adds and drops a few replicas (``quota``, every step) is this case:
    :func:`_jobs_and_local_copies`' job columns and :func:`_scheduled`'s merge with the
    local copies are then dozens of numpy calls on a dozen elements."""
    old_p2l, new_p2l = old.phy2log, new.phy2log
    num_slots = new_p2l.shape[1]
    if topology.pairs:
        return None
    if (
        not np.array_equal(old.master, new.master)
        and ((old.master // num_slots) != (new.master // num_slots)).any()
    ):
        return None
    dr, ds = np.nonzero((new_p2l >= 0) & (new_p2l != old_p2l))  # by rank, then slot
    n = dr.size
    if n > SMALL_JOBS:
        return None
    de = new_p2l[dr, ds]
    e, r = de.tolist(), dr.tolist()
    if (old_p2l[dr] == de[:, None]).any():
        return None  # a local copy from one the rank holds
    if len(set(zip(r, e, strict=True))) != n:
        return None  # a rank gets two copies of one expert: the second is a local copy
    # the holders of the jobs' experts (a table over experts, its last entry for the -1)
    wanted = np.zeros(new.master.shape[0] + 1, dtype=bool)
    wanted[de] = True
    hr, hs = np.nonzero(wanted[old_p2l])
    src, rnd = small_rounds(
        (e, r, [-1] * n, [False] * n), _ranks(topology),
        (old_p2l[hr, hs].tolist(), hr.tolist()), MAX_PASSES,
    )  # fmt: skip
    # plan_migration's order: by round, then rank and slot (the jobs' order already)
    src_a, dst, expert = np.array(src, dtype=np.int64), dr, de.astype(np.int64)
    if any(rnd):  # more than one round
        o = np.argsort(np.array(rnd), kind="stable")
        src_a, dst, expert = src_a[o], dst[o], expert[o]
    return src_a, dst, expert, np.zeros(n, dtype=bool)


def plan_migration(
    old: Placement, new: Placement, topology: Topology, model: ModelSpec
) -> Migration:
    """The transfers that turn ``old`` into ``new``, scheduled in rounds.

    - ``old``, ``new``: placements on ``topology`` (``new`` usually from
      :func:`align_placement`); ``phy2log`` [R, S], ``master`` [E].

    Every slot of ``new`` whose content changes (and is not empty) gets one
    :class:`Transfer`; kept slots get none, except an optimizer-state-only master
    move onto a kept copy. Kinds and bytes:

    - ``MASTER`` when an expert's master changes rank: from the old master rank,
      ``model.master_bytes`` (weights + optimizer state), or ``master_bytes -
      expert_bytes`` when the new master rank already had a copy;
    - ``REPLICA`` otherwise: ``model.expert_bytes`` from a nearest holder of its
      round (old copies and relays, see :class:`_Scheduler`); a second copy on a rank
      that has, or has just received, the expert is a local copy: ``src_rank ==
      dst_rank``, 0 bytes, no link, in round 0 or the round after the arrival.

    Round invariant: each rank sends <= 1 and receives <= 1 transfer over a link, and
    each ordered DC pair carries <= 1. ``round_seconds[k]`` is the max over round
    ``k``'s link transfers of ``latency + nbytes / bandwidth`` (0 if it has none).
    ``kept`` counts slots whose copy stays.
    """
    _, _, num_experts = _check_pair(old, new, topology)
    cols, jobs, src, rnd = _scheduled(old, new, topology, model, num_experts)
    seconds = np.zeros(int(cols[5].max()) + 1 if cols[5].size else 0)
    if src.size:
        lat, bw = topology.links(src, jobs.dst)
        np.maximum.at(seconds, rnd, lat + jobs.nbytes / bw)
    kinds = (TransferKind.REPLICA, TransferKind.MASTER)
    rows = zip(*(col.tolist() for col in cols), strict=True)
    transfers = tuple(Transfer(e, a, b, c, nb, k, kinds[m]) for e, a, b, c, nb, k, m in rows)
    kept = int(((new.phy2log == old.phy2log) & (new.phy2log >= 0)).sum())
    return Migration(transfers=transfers, round_seconds=tuple(seconds.tolist()), kept=kept)
