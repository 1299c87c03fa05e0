"""The migration scheduler (:class:`~expertmesh.planner.migration._Scheduler`) element by
element, on Python lists: the same rounds, passes, proposals and acceptance rule, without
dozens of numpy calls per pass (a re-plan moves a few experts: ``quota`` a dozen every
step). Only where every other DC is equally near (no per-pair links).
``tests/unit/test_migration.py`` checks that the two agree.

Each round: the level of every open job (0: a holder of its expert in its node, 1: in its
DC, 2: elsewhere; a master move's is where its fixed source is), then passes of
proposals (a job's source) and acceptance (the first proposal, in priority order, of each
group it belongs to: source rank, destination rank, node entry, DC entry, ordered DC
pair), until a pass proposes or accepts nothing. The copies a round brings are holders
(relays) from the next round on.
"""

from __future__ import annotations

import bisect
from collections import Counter

__all__ = ["small_rounds"]


def small_rounds(
    jobs: tuple[list[int], list[int], list[int], list[bool]],
    ranks: tuple[list[int], list[int], int, int],
    holds: tuple[list[int], list[int]],
    max_passes: int,
) -> tuple[list[int], list[int]]:
    """``(src [J], round [J])`` of the jobs ``(expert, dst, fixed source or -1, master)``
    (lists [J]); ``ranks``: ``(node [R], DC [R], nodes, DCs)``; ``holds``: ``(expert,
    rank)`` lists [H] of the old copies (any order, with multiplicity; experts without a
    job are ignored); at most ``max_passes`` passes a round."""
    return _Rounds(jobs, ranks, holds).run(max_passes)


class _Rounds:
    """The jobs, what derives from them, and the holders of their experts (kept up to
    date as copies land)."""

    def __init__(
        self,
        jobs: tuple[list[int], list[int], list[int], list[bool]],
        ranks: tuple[list[int], list[int], int, int],
        holds: tuple[list[int], list[int]],
    ) -> None:
        e, dst, fixed, master = jobs
        node, dc, num_nodes, num_dcs = ranks
        self.e, self.dst, self.fixed, self.node, self.dc = e, dst, fixed, node, dc
        self.num_dcs = num_dcs
        n = self.n = len(e)
        dnode = self.dnode = [node[d] for d in dst]
        ddc = self.ddc = [dc[d] for d in dst]
        self.nkey = [x * num_nodes + y for x, y in zip(e, dnode, strict=True)]
        self.dkey = [x * num_dcs + y for x, y in zip(e, ddc, strict=True)]
        # priority: masters, experts with more jobs, expert, destination (a stable sort)
        fanout = Counter(e)
        order = sorted(range(n), key=lambda i: (not master[i], -fanout[e[i]], e[i], dst[i]))
        prio = self.prio = [0] * n
        for p, i in enumerate(order):
            prio[i] = p
        self.fixed_level = [
            (2 if dc[f] != ddc[i] else 1 if node[f] != dnode[i] else 0) if f >= 0 else 0
            for i, f in enumerate(fixed)
        ]
        # holders of the jobs' experts: expert -> ranks, ascending, with multiplicity
        # and the nodes and DCs holding each (kept up to date as copies land)
        holders: dict[int, list[int]] = {x: [] for x in fanout}
        nodes: dict[int, set[int]] = {x: set() for x in fanout}
        dcs: dict[int, set[int]] = {x: set() for x in fanout}
        for x, r in zip(*holds, strict=True):
            h = holders.get(x)
            if h is not None:
                h.append(r)
                nodes[x].add(node[r])
                dcs[x].add(dc[r])
        for h in holders.values():
            h.sort()
        self.holders, self.nodes, self.dcs = holders, nodes, dcs

    def run(self, max_passes: int) -> tuple[list[int], list[int]]:
        """``(src [J], round [J])``: rounds until every job has one."""
        n, e, dst, fixed, prio = self.n, self.e, self.dst, self.fixed, self.prio
        dnode, ddc, nkey, dkey = self.dnode, self.ddc, self.nkey, self.dkey
        nodes, dcs = self.nodes, self.dcs
        src, rnd = [-1] * n, [-1] * n
        okey = [0] * n  # order of acceptance in the round: level 2 first, then priority
        pending = list(range(n))
        k = 0
        while pending:
            fixed_j: list[int] = []
            by_level: tuple[list[int], list[int], list[int]] = ([], [], [])
            for i in pending:
                if fixed[i] >= 0:
                    lv = self.fixed_level[i]
                    fixed_j.append(i)
                else:
                    x = e[i]
                    lv = 0 if dnode[i] in nodes[x] else 1 if ddc[i] in dcs[x] else 2
                    by_level[lv].append(i)
                okey[i] = (2 - lv) * n + prio[i]
            by_level[0].sort(key=lambda i: nkey[i] * n + prio[i])
            if not fixed_j and not by_level[1] and not by_level[2]:
                self._node_round(by_level[0], k, (src, rnd), max_passes)
                self._landed(pending, rnd, k)
                pending = [i for i in pending if rnd[i] < 0]
                k += 1
                continue
            busy_src: set[int] = set()
            busy_dst: set[int] = set()
            entries: tuple[set[int], set[int], set[int]] = (set(), set(), set())  # node, DC, pair
            progress = False
            for _ in range(max_passes):
                props = [
                    (i, fixed[i])
                    for i in fixed_j
                    if dst[i] not in busy_dst and fixed[i] not in busy_src
                ]
                # level 0: the q-th job of a node entry takes its q-th free holder there
                if by_level[0]:
                    jobs = [i for i in by_level[0] if dst[i] not in busy_dst]
                    self._pair(props, jobs, nkey, busy_src, (self.node, dnode))
                # level 1: one job per node entry this round, a free holder in its DC
                if by_level[1]:
                    jobs = self._best(by_level[1], nkey, entries[0], busy_dst)
                    jobs.sort(key=lambda i: dkey[i] * n + prio[i])
                    self._pair(props, jobs, dkey, busy_src, (self.dc, ddc))
                # level 2: one job per DC entry this round, a free holder anywhere
                if by_level[2]:
                    jobs = self._best(by_level[2], dkey, entries[1], busy_dst)
                    jobs.sort(key=lambda i: e[i] * n + prio[i])
                    self._pair(props, jobs, e, busy_src, None)
                if not props:
                    break
                acc = self._accept(props, okey, entries)
                if not acc:
                    break
                for i, r in acc:
                    busy_src.add(r)
                    busy_dst.add(dst[i])
                    src[i], rnd[i] = r, k
                progress = True
            if not progress:  # cannot happen: a round's first proposal always fits
                raise RuntimeError("migration scheduler made no progress")
            self._landed(pending, rnd, k)
            pending = [i for i in pending if rnd[i] < 0]
            k += 1
        return src, rnd

    def _landed(self, pending: list[int], rnd: list[int], k: int) -> None:
        """The copies round ``k`` brought are holders from now on."""
        e, dst, node, dc = self.e, self.dst, self.node, self.dc
        for i in pending:
            if rnd[i] == k:
                x, d = e[i], dst[i]
                bisect.insort(self.holders[x], d)
                self.nodes[x].add(node[d])
                self.dcs[x].add(dc[d])

    def _node_round(
        self, jobs: list[int], k: int, out: tuple[list[int], list[int]], max_passes: int
    ) -> None:
        """Round ``k`` when every open job copies inside its node (level 0, no master move):
        :meth:`run`'s passes with what they reduce to, the same sources. Every proposal is
        from the job's node, so no node or DC entry and no DC pair is used, and acceptance
        goes by priority alone (one level); ``jobs`` sorted by (node entry, priority)."""
        e, dst, prio, nkey, dnode = self.e, self.dst, self.prio, self.nkey, self.dnode
        node, holders = self.node, self.holders
        src, rnd = out
        busy_src: set[int] = set()
        busy_dst: set[int] = set()
        progress = False
        for _ in range(max_passes):
            # the q-th job of a node entry takes its q-th free holder in that node
            props = []
            last, q = -1, 0
            free: list[int] = []
            for i in jobs:
                if dst[i] in busy_dst:
                    continue
                c = nkey[i]
                if c != last:
                    last, q, d = c, 0, dnode[i]
                    free = [r for r in holders[e[i]] if r not in busy_src and node[r] == d]
                else:
                    q += 1
                if q < len(free):
                    props.append((prio[i], i, free[q]))
            if not props:
                break
            props.sort()
            s_src: set[int] = set()
            s_dst: set[int] = set()
            acc = []
            for _, i, r in props:
                d = dst[i]
                if r not in s_src and d not in s_dst:
                    acc.append((i, r, d))
                s_src.add(r)
                s_dst.add(d)
            for i, r, d in acc:
                busy_src.add(r)
                busy_dst.add(d)
                src[i], rnd[i] = r, k
            progress = True
        if not progress:  # cannot happen: a round's first proposal always fits
            raise RuntimeError("migration scheduler made no progress")

    def _best(
        self, jobs: list[int], key: list[int], taken: set[int], busy_dst: set[int]
    ) -> list[int]:
        """The highest-priority job of ``jobs`` for each ``key`` not in ``taken``, among
        those whose destination has not received this round."""
        dst, prio = self.dst, self.prio
        best: dict[int, int] = {}
        for i in jobs:
            if dst[i] in busy_dst:
                continue
            c = key[i]
            if c in taken:
                continue
            b = best.get(c)
            if b is None or prio[i] < prio[b]:
                best[c] = i
        return list(best.values())

    def _pair(
        self,
        props: list[tuple[int, int]],
        jobs: list[int],
        key: list[int],
        busy_src: set[int],
        near: tuple[list[int], list[int]] | None,
    ) -> None:
        """Append to ``props`` the q-th job of each ``key`` (``jobs`` sorted by it, ties in
        the order to pair them) with the q-th free holder of its expert, by rank, that is
        in the job's place (``near``: ``(place [R], place of each job [J])``, its node or
        its DC; anywhere when None). Jobs of one key share an expert and a place: one list
        of free holders per key."""
        e, holders = self.e, self.holders
        last = -1
        q = 0
        free: list[int] = []
        for i in jobs:
            c = key[i]
            if c != last:
                last, q = c, 0
                if near is None:
                    free = [r for r in holders[e[i]] if r not in busy_src]
                else:
                    where, d = near[0], near[1][i]
                    free = [r for r in holders[e[i]] if r not in busy_src and where[r] == d]
            else:
                q += 1
            if q < len(free):
                props.append((i, free[q]))

    def _accept(
        self,
        props: list[tuple[int, int]],
        okey: list[int],
        entries: tuple[set[int], set[int], set[int]],
    ) -> list[tuple[int, int]]:
        """The proposals ``(job, src)`` that pass the round's entries (node, DC, DC pair),
        in acceptance order (``okey``), each accepted when it is the first of every group
        it belongs to (a rejected one still counts as first); adds the accepted entries."""
        node, dc, dnode, ddc = self.node, self.dc, self.dnode, self.ddc
        nkey, dkey, dst, num_dcs = self.nkey, self.dkey, self.dst, self.num_dcs
        ent_node, ent_dc, ent_pair = entries
        rows = []
        for i, r in props:
            cn, cd = node[r] != dnode[i], dc[r] != ddc[i]
            pair = dc[r] * num_dcs + ddc[i]
            if (cn and nkey[i] in ent_node) or (cd and (dkey[i] in ent_dc or pair in ent_pair)):
                continue
            rows.append((okey[i], i, r, cn, cd, pair))
        rows.sort()
        s_src: set[int] = set()
        s_dst: set[int] = set()
        s_node: set[int] = set()
        s_dc: set[int] = set()
        s_pair: set[int] = set()
        acc = []
        for _, i, r, cn, cd, pair in rows:
            d = dst[i]
            ok = r not in s_src and d not in s_dst
            s_src.add(r)
            s_dst.add(d)
            if cn:
                c = nkey[i]
                ok = ok and c not in s_node
                s_node.add(c)
            if cd:
                c = dkey[i]
                ok = ok and c not in s_dc and pair not in s_pair
                s_dc.add(c)
                s_pair.add(pair)
            if ok:
                acc.append((i, r))
                if cn:
                    ent_node.add(nkey[i])
                if cd:
                    ent_dc.add(dkey[i])
                    ent_pair.add(pair)
        return acc
