"""``quota``'s rule domain by domain in plain Python: the line of pieces and receivers.

The rule of :mod:`expertmesh.planner.quota` (its module docstring) for one domain and one
``T`` is a walk over a few pieces and receivers (a few dozen), cheaper as a plain loop
than as vector code (:func:`try_quota`); :func:`search_one` finds a domain's smallest
feasible ``T`` (the one of ``quota._search``), probing where :func:`next_failure_end`
says the walk changes, and :func:`segments` cuts its replicas from the line.
:func:`solve_domains` runs the whole uncapped solve of ``quota.balance_demand`` this
way: what depends only on the masters and the domains (:class:`Layout`, made once for
each such layout and kept), then a few numpy calls per solve for the sums and bounds,
and the rest over lists. The same ``T``, bounds,
replicas (in the same order) and slots as ``quota``'s vector rule
(``tests/unit/test_quota_speed.py``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = [
    "Layout",
    "layout",
    "next_failure_end",
    "place_replicas",
    "search_one",
    "secant_step",
    "segments",
    "solve_domains",
    "try_quota",
]

Items = list[tuple[int, int, int]]  # one domain's (M less earlier sheds, demand, expert)
Receivers = list[tuple[int, int, int]]  # one domain's (rank, M, free slots), M ascending
Pieces = list[tuple[int, int]]  # one domain's (-amount, expert) in line order
Walked = list[tuple[int, int, int]]  # (rank, start, end) on the line of each receiver used


def secant_step(a: int, b: int, short: int, last: tuple[int, int] | None, width: int) -> int:
    """The next probe after a failure at ``a`` (``b`` succeeds) that left ``short``
    tokens unplaced: where the shortfall reaches 0 if it falls about linearly in ``T`` as
    it did since the failure before (``last``: its ``(T, shortfall)``; None, or no drop:
    ``width`` tokens per unit of ``T``), at least ``a + 1``, at most the midpoint."""
    drop = 0 if last is None else last[1] - short
    slope = drop / (a - last[0]) if last is not None and drop > 0 else width
    return min(a + max(1, math.ceil(short / max(slope, 1e-9))), (a + b) // 2)


def try_quota(items: Items, recv: Receivers, quota: int) -> tuple[int, Pieces, Walked]:
    """The rule for one domain at ``quota`` (``quota._fit`` and ``quota._walk`` for one
    domain): ``(shortfall, pieces, receivers that take some)``; 0 shortfall: feasible."""
    pieces = sorted([(quota - a if a - quota < m else -m, e) for a, m, e in items if a > quota])
    ends, total = [], 0
    for neg, _ in pieces:
        total -= neg
        ends.append(total)
    num = len(ends)
    walked: Walked = []
    u = k = 0
    for r, m, f in recv:
        if m >= quota or u >= total:  # full already, and so are the rest; or all placed
            break
        while ends[k] <= u:  # k: the first piece ending after u
            k += 1
        close = u + quota - m
        kf = k + f - 1  # the f-th piece end after u closes it: out of slots
        if kf < num and ends[kf] < close:
            close = ends[kf]
        close = total if close > total else close  # min(): a builtin call, dearer
        walked.append((r, u, close))
        u = close
    return total - u, pieces, walked


_NEVER = 1 << 62  # no change ahead


def next_failure_end(items: Items, recv: Receivers, quota: int) -> int:
    """A ``T > quota`` such that, if the rule fails at ``quota``, it fails at every ``T``
    in between (a hint for :func:`search_one`, which checks where it leads).

    While no comparison the rule makes changes its outcome (which items shed, whole or in
    part, the pieces' order, the receivers taken, which piece end or capacity closes
    each), every quantity of the walk is linear in ``T``: a piece a rank sheds in part
    shrinks by 1 a unit of ``T``, a capacity grows by 1. This is the first ``T`` where a
    comparison flips, or where the shortfall, linear until then, reaches 0. (Each
    comparison as ``d + slope * t >= 0`` after ``t`` more units: with ``d >= 0`` and
    ``slope < 0`` it flips at ``t = d // -slope + 1``.)"""
    ahead = _NEVER
    raw = []  # (-amount, expert, slope of the amount)
    for a, m, e in items:
        if a > quota:
            t = a - quota  # the rank stops shedding the expert at T = a
            ahead = t if t < ahead else ahead  # (min(): a builtin call, dearer)
            if a - quota < m:
                raw.append((quota - a, e, -1))
            else:  # whole until T passes a - m
                raw.append((-m, e, 0))
                t = a - m - quota + 1
                ahead = t if t < ahead else ahead
    raw.sort()
    ends: list[int] = []
    slopes: list[int] = []
    total = slope = 0
    prev_neg, prev_e, prev_s = 0, 0, 0
    for neg, e, s in raw:
        if prev_s < s:  # a shrinking piece before a whole one: they swap
            t = neg - prev_neg + 1 if prev_e < e else max(neg - prev_neg, 1)
            ahead = t if t < ahead else ahead
        prev_neg, prev_e, prev_s = neg, e, s
        total -= neg
        slope += s
        ends.append(total)
        slopes.append(slope)
    num = len(ends)
    u = k = su = 0  # su: the slope of u
    for _, m, f in recv:
        if m >= quota:  # full already, and so are the rest: until T passes m
            ahead = min(ahead, m - quota + 1)
            break
        if u >= total:
            if su < slope and (u - total) // (slope - su) + 1 < ahead:
                ahead = (u - total) // (slope - su) + 1
            break
        if slope < su and (total - u - 1) // (su - slope) + 1 < ahead:
            ahead = (total - u - 1) // (su - slope) + 1
        while ends[k] <= u:
            sk = slopes[k]
            if su < sk and (u - ends[k]) // (sk - su) + 1 < ahead:
                ahead = (u - ends[k]) // (sk - su) + 1
            k += 1
        sk = slopes[k]
        if sk < su and (ends[k] - u - 1) // (su - sk) + 1 < ahead:
            ahead = (ends[k] - u - 1) // (su - sk) + 1
        close, sc = u + quota - m, su + 1
        kf = k + f - 1
        if kf < num:
            ef, sf = ends[kf], slopes[kf]
            if ef < close:
                if sc < sf and (close - ef - 1) // (sf - sc) + 1 < ahead:
                    ahead = (close - ef - 1) // (sf - sc) + 1
                close, sc = ef, sf
            elif sf < sc and (ef - close) // (sc - sf) + 1 < ahead:
                ahead = (ef - close) // (sc - sf) + 1
        if close > total:
            if sc < slope and (close - total - 1) // (slope - sc) + 1 < ahead:
                ahead = (close - total - 1) // (slope - sc) + 1
            close, sc = total, slope
        elif slope < sc and (total - close) // (sc - slope) + 1 < ahead:
            ahead = (total - close) // (sc - slope) + 1
        u, su = close, sc
    if total > u and su > slope:  # where the shortfall reaches 0
        ahead = min(ahead, -(-(total - u) // (su - slope)))
    return quota + ahead


def search_one(items: Items, recv: Receivers, lower: int, upper: int) -> tuple[int, Pieces, Walked]:
    """The smallest ``T`` in ``[lower, upper]`` where the rule places every piece, with
    its pieces and receivers (none at ``upper``: no rank is above it).

    Probes: ``lower``, where most domains settle; after a failure at ``T``,
    :func:`next_failure_end` of ``T``, until one succeeds; then ``T - 1``, which fails
    unless the hint was wrong; bisection after that. The rule is monotone in ``T`` (no
    cap: module doc of ``quota``), so any probes end at the smallest feasible ``T``, the
    one of ``quota._search``."""
    lo, hi = lower - 1, upper  # lo fails, hi succeeds
    best: tuple[Pieces, Walked] = ([], [])
    probe = lower
    while hi - lo > 1:
        short, pieces, walked = try_quota(items, recv, probe)
        if short == 0:
            hi, best = probe, (pieces, walked)
            break
        lo = probe
        probe = min(max(next_failure_end(items, recv, lo), lo + 1), hi - 1)
    check = True  # hi - 1 first, then bisection
    while hi - lo > 1:
        probe = hi - 1 if check else (lo + hi) // 2
        short, pieces, walked = try_quota(items, recv, probe)
        if short == 0:
            hi, best, check = probe, (pieces, walked), False
        else:
            lo = probe
    return hi, best[0], best[1]


def segments(pieces: Pieces, walked: Walked) -> list[tuple[int, int, int]]:
    """``(expert, rank, tokens)`` of one domain's replicas at a feasible ``T``: every
    piece's overlap with each receiver's stretch of the line, in line order
    (``quota._replicas``)."""
    out: tuple[list[int], list[int], list[int]] = ([], [], [])
    _cut(pieces, walked, out)
    return list(zip(*out, strict=True))


def _cut(pieces: Pieces, walked: Walked, out: tuple[list[int], list[int], list[int]]) -> None:
    """:func:`segments`, appended to ``out``: its expert, rank and tokens lists."""
    exps, ranks, toks = out
    num = len(walked)
    j = end = 0
    for neg, e in pieces:
        start = end
        end -= neg
        while walked[j][2] <= start:
            j += 1
        for i in range(j, num):
            r, a, b = walked[i]
            if a >= end:
                break
            exps.append(e)
            ranks.append(r)
            toks.append((end if end < b else b) - (start if start > a else a))


class Layout(NamedTuple):
    """What an uncapped solve needs that depends only on the masters and the domains
    (``R`` ranks, ``S`` slots a rank, ``E`` experts, ``D`` domains)."""

    dom: np.ndarray  # [R] int64 domain ids 0 .. D-1
    mrank: np.ndarray  # [E] int64 master rank
    copies: np.ndarray  # [E] most copies an expert can have: 1 + others with a free slot
    rank_order: np.ndarray  # [R] ranks by domain (stable); rank_starts [D] into it
    rank_starts: np.ndarray
    expert_order: np.ndarray  # [E] experts by domain (stable); where each domain that has
    expert_starts: np.ndarray  # experts starts in it, and which domains those are
    expert_doms: np.ndarray
    sizes: list[int]  # [D] ranks of each domain (and as an array)
    size_arr: np.ndarray
    experts: np.ndarray  # [E] 0 .. E-1 (read-only)
    ranks_of: list[list[int]]  # per domain, its ranks ascending
    recv_of: list[list[int]]  # per domain, its ranks with a free slot ascending
    experts_of: list[list[int]]  # per rank, the experts it is master of, ascending
    free: list[int]  # [R] free slots
    free_slots: list[list[int]]  # per rank, its free flat slots ascending
    masters_only: np.ndarray  # [R * S] int32 phy2log of the masters alone (read-only)


def layout(master: np.ndarray, num_ranks: int, num_slots: int, dom: np.ndarray) -> Layout:
    """The :class:`Layout` of masters in flat slots ``master`` [E] (int64, valid) on
    ``num_ranks`` ranks of ``num_slots`` slots, in domains ``dom`` [R] (0 .. D-1, each
    used)."""
    num_experts = master.size
    mrank = master // num_slots
    num_domains = int(dom.max(initial=0)) + 1
    free = num_slots - np.bincount(mrank, minlength=num_ranks)
    dom_e = dom[mrank]
    others = np.bincount(dom[free > 0], minlength=num_domains)[dom_e] - (free[mrank] > 0)
    rank_order = np.argsort(dom, kind="stable")
    expert_order = np.argsort(dom_e, kind="stable")
    by_dom = dom_e[expert_order]
    expert_starts = np.zeros(0, np.int64)
    if num_experts:
        expert_starts = np.flatnonzero(np.r_[True, by_dom[1:] != by_dom[:-1]])
    masters_only = np.full(num_ranks * num_slots, -1, np.int32)
    masters_only[master] = np.arange(num_experts)
    masters_only.flags.writeable = False
    experts = np.arange(num_experts)
    size_arr = np.bincount(dom, minlength=num_domains)
    experts.flags.writeable = size_arr.flags.writeable = False
    ranks_of: list[list[int]] = [[] for _ in range(num_domains)]
    recv_of: list[list[int]] = [[] for _ in range(num_domains)]
    for r, (d, f) in enumerate(zip(dom.tolist(), free.tolist(), strict=True)):
        ranks_of[d].append(r)
        if f > 0:
            recv_of[d].append(r)
    experts_of: list[list[int]] = [[] for _ in range(num_ranks)]
    for e, r in enumerate(mrank.tolist()):
        experts_of[r].append(e)
    free_slots: list[list[int]] = [[] for _ in range(num_ranks)]
    for f in np.flatnonzero(masters_only < 0).tolist():
        free_slots[f // num_slots].append(f)
    return Layout(
        dom=dom,
        mrank=mrank,
        copies=1 + others,
        rank_order=rank_order,
        rank_starts=np.searchsorted(dom[rank_order], np.arange(num_domains)),
        expert_order=expert_order,
        expert_starts=expert_starts,
        expert_doms=by_dom[expert_starts],
        sizes=[len(x) for x in ranks_of],
        size_arr=size_arr,
        experts=experts,
        ranks_of=ranks_of,
        recv_of=recv_of,
        experts_of=experts_of,
        free=free.tolist(),
        free_slots=free_slots,
        masters_only=masters_only,
    )


def solve_domains(
    demand: np.ndarray, lay: Layout
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """The uncapped rule's smallest ``T`` [D] for ``demand`` [E] (int64, 2**53 tokens at
    most in all), the lower bound [D] it searched from, the replicas ``(expert, rank,
    tokens)`` each [N] in line order: ``quota._search_domains`` of ``quota._problem``; and
    the flat slot of each replica [N], :func:`place_replicas`' (the k-th replica of a rank
    in its k-th free slot)."""
    num_ranks, num_domains = lay.dom.size, len(lay.sizes)
    base = np.bincount(lay.mrank, weights=demand, minlength=num_ranks).astype(np.int64)  # M
    work = np.bincount(lay.dom, weights=base, minlength=num_domains).astype(np.int64)
    lower = -(-work // lay.size_arr)  # ceil of the domain mean
    upper = np.maximum.reduceat(base[lay.rank_order], lay.rank_starts)  # static max
    if demand.size:  # an expert split over every copy it can have
        split = -(-demand // lay.copies)
        lower[lay.expert_doms] = np.maximum(
            lower[lay.expert_doms], np.maximum.reduceat(split[lay.expert_order], lay.expert_starts)
        )
    lower = np.minimum(lower, upper)
    quota = upper.tolist()
    rep: tuple[list[int], list[int], list[int]] = ([], [], [])  # expert, rank, tokens
    m, dem, free = base.tolist(), demand.tolist(), lay.free
    by_demand, by_m = dem.__getitem__, m.__getitem__
    for d, low in enumerate(lower.tolist()):
        if low >= quota[d]:  # no rank above the bound: the static max, no replica
            continue
        items: Items = []  # in shed order: rank, then demand descending (lower id on ties)
        for r in lay.ranks_of[d]:
            a = m[r]
            if a <= low:
                continue
            # stable: the experts ascending, so lower ids first on equal demand
            for e in sorted(lay.experts_of[r], key=by_demand, reverse=True):
                x = dem[e]
                if a <= low or not x:
                    break
                items.append((a, x, e))
                a -= x
        # receivers by M ascending, lower rank on ties (stable: the ranks ascending)
        recv = [(r, m[r], free[r]) for r in sorted(lay.recv_of[d], key=by_m)]
        quota[d], pieces, walked = search_one(items, recv, low, quota[d])
        _cut(pieces, walked, rep)
    cols = tuple(np.array(x, dtype=np.int64) for x in rep)
    slot = np.array(_slots(lay.free_slots, rep[1]), dtype=np.int64)
    return np.array(quota, dtype=np.int64), lower, (cols[0], cols[1], cols[2]), slot


def _slots(free_slots: list[list[int]], ranks: list[int]) -> list[int]:
    """The flat slot of replicas on ``ranks`` in order: the k-th on a rank in its k-th
    free slot (``free_slots``: per rank, ascending)."""
    taken = [0] * len(free_slots)
    out = []
    for r in ranks:
        k = taken[r]
        taken[r] = k + 1
        out.append(free_slots[r][k])
    return out


def place_replicas(lay: Layout, rep_expert: np.ndarray, rep_rank: np.ndarray) -> np.ndarray:
    """[R * S] int32 phy2log: the masters, plus each replica (expert, rank) [N] in the next
    free slot of its rank, in their order (the k-th replica of a rank in its k-th free slot)."""
    flat = lay.masters_only.copy()
    flat[_slots(lay.free_slots, rep_rank.tolist())] = rep_expert
    return flat
