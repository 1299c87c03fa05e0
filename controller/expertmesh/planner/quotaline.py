"""``quota``'s rule domain by domain in plain Python: the line of pieces and receivers.

The rule of :mod:`expertmesh.planner.quota` (its module docstring) for one domain and one
``T`` is a walk over a few pieces and receivers (a few dozen), cheaper as a plain loop
than as vector code (:func:`try_quota`); :func:`search_one` finds a domain's smallest
feasible ``T`` with the secant probes of ``quota._search``, and :func:`segments` cuts
its replicas from the line. :func:`solve_domains` runs the whole uncapped solve of
``quota.balance_demand`` this way: what depends only on the masters and the domains
(:class:`Layout`, made once for each such layout and kept), then a few numpy calls per
solve for the sums and bounds, and the rest over lists. The same ``T``, bounds,
replicas (in the same order) and slots as ``quota``'s vector rule
(``tests/unit/test_quota_speed.py``).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np

__all__ = [
    "Layout",
    "layout",
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
        close = min(close, total)
        walked.append((r, u, close))
        u = close
    return total - u, pieces, walked


def search_one(
    items: Items, recv: Receivers, lower: int, upper: int, width: int
) -> tuple[int, Pieces, Walked]:
    """``quota._search``'s probes for one domain (``width``: its ranks): the smallest ``T``
    in ``[lower, upper]`` where the rule places every piece, with its pieces and
    receivers (none at ``upper``: no rank is above it)."""
    lo, hi = lower - 1, upper
    galloping, last = True, None  # last: the last failure's (T, shortfall)
    probe = min(lo + 1, hi)
    best: tuple[Pieces, Walked] = ([], [])
    while hi - lo > 1:
        short, pieces, walked = try_quota(items, recv, probe)
        if short == 0:
            hi, best = probe, (pieces, walked)
        else:
            lo = probe
        if hi - lo <= 1:
            break
        if not galloping:
            probe = (lo + hi) // 2
        elif short == 0:  # the first success, reached from below: T - 1, then bisection
            galloping = False
            probe = hi - 1
        else:
            probe = secant_step(lo, hi, short, last, width)
            last = (lo, short)
    return hi, best[0], best[1]


def segments(pieces: Pieces, walked: Walked) -> list[tuple[int, int, int]]:
    """``(expert, rank, tokens)`` of one domain's replicas at a feasible ``T``: every
    piece's overlap with each receiver's stretch of the line, in line order
    (``quota._replicas``)."""
    out: list[tuple[int, int, int]] = []
    num = len(walked)
    j, end = 0, 0
    for neg, e in pieces:
        start, end = end, end - neg
        while walked[j][2] <= start:
            j += 1
        for i in range(j, num):
            r, a, b = walked[i]
            if a >= end:
                break
            out.append((e, r, (end if end < b else b) - (start if start > a else a)))
    return out


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
    sizes: list[int]  # [D] ranks of each domain
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
        ranks_of=ranks_of,
        recv_of=recv_of,
        experts_of=experts_of,
        free=free.tolist(),
        free_slots=free_slots,
        masters_only=masters_only,
    )


def solve_domains(
    demand: np.ndarray, lay: Layout
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The uncapped rule's smallest ``T`` [D] for ``demand`` [E] (int64, 2**53 tokens at
    most in all), the lower bound [D] it searched from, and the replicas ``(expert, rank,
    tokens)`` each [N] in line order: ``quota._search_domains`` of ``quota._problem``."""
    num_ranks, num_domains = lay.dom.size, len(lay.sizes)
    base = np.bincount(lay.mrank, weights=demand, minlength=num_ranks).astype(np.int64)  # M
    work = np.bincount(lay.dom, weights=base, minlength=num_domains).astype(np.int64)
    lower = -(-work // np.array(lay.sizes))  # ceil of the domain mean
    upper = np.maximum.reduceat(base[lay.rank_order], lay.rank_starts)  # static max
    if demand.size:  # an expert split over every copy it can have
        split = -(-demand // lay.copies)
        lower[lay.expert_doms] = np.maximum(
            lower[lay.expert_doms], np.maximum.reduceat(split[lay.expert_order], lay.expert_starts)
        )
    lower = np.minimum(lower, upper)
    quota = upper.tolist()
    made: list[tuple[int, int, int]] = []
    m, dem, free = base.tolist(), demand.tolist(), lay.free
    for d, low in enumerate(lower.tolist()):
        if low >= quota[d]:  # no rank above the bound: the static max, no replica
            continue
        items: Items = []  # in shed order: rank, then demand descending (lower id on ties)
        for r in lay.ranks_of[d]:
            a = m[r]
            if a <= low:
                continue
            # stable: the experts ascending, so lower ids first on equal demand
            for e in sorted(lay.experts_of[r], key=dem.__getitem__, reverse=True):
                x = dem[e]
                if a <= low or not x:
                    break
                items.append((a, x, e))
                a -= x
        # receivers by M ascending, lower rank on ties (stable: the ranks ascending)
        recv = [(r, m[r], free[r]) for r in sorted(lay.recv_of[d], key=m.__getitem__)]
        quota[d], pieces, walked = search_one(items, recv, low, quota[d], lay.sizes[d])
        made.extend(segments(pieces, walked))
    flat = np.fromiter(itertools.chain.from_iterable(made), np.int64, 3 * len(made))
    cols = flat.reshape(-1, 3).T
    return np.array(quota, dtype=np.int64), lower, (cols[0], cols[1], cols[2])


def place_replicas(lay: Layout, rep_expert: np.ndarray, rep_rank: np.ndarray) -> np.ndarray:
    """[R * S] int32 phy2log: the masters, plus each replica (expert, rank) [N] in the next
    free slot of its rank, in their order (the k-th replica of a rank in its k-th free slot)."""
    flat = lay.masters_only.copy()
    used = [0] * len(lay.free_slots)
    at = []
    for r in rep_rank.tolist():
        at.append(lay.free_slots[r][used[r]])
        used[r] += 1
    flat[at] = rep_expert
    return flat
