"""``balance_domain``: quota inside one domain, fast enough for every microbatch (issue 12).

The fast loop of the brief, as the workers run it: after the gate, the ranks of one
domain exchange their exact counts and every rank calls :func:`balance_domain` on the
same input, so every rank gets the same answer without a round trip. It is the rule of
:mod:`expertmesh.planner.quota` (``refs.quota_fit_ref`` in plain loops) for one
domain, with the same smallest quota ``T``, the same replicas in the same slots and the
same token split (``settings=EXACT``; ``tests/unit/test_fastquota.py`` checks it against
the reference and against ``quota_balance``), plus the replica economy of
:class:`BalanceSettings`. ``expertmesh.workers.quota_torch`` is the same solve on torch
tensors (on their device), equal to this one.

**Call** (shapes; ``R`` ranks of the domain, ``S`` slots per rank, ``E`` experts)::

    balance_domain(counts [R_src, E] int, phy2log [R, S] int, settings=DEFAULTS)
        -> DomainBalance

- ``counts[r, e]``: tokens (top-k assignments) source row ``r`` sends to expert ``e``
  this microbatch. Rows ``0 .. R-1`` are the domain's ranks in order; rows ``R ..``
  (optional) are sources outside the domain that send tokens in (another DC's ranks,
  or one row per remote DC): they are routed like the others but have no own-rank copy.
  Every expert with tokens must be held in the domain.
- ``phy2log[r, s]``: the expert in slot ``s`` of rank ``r`` before this microbatch's
  replicas: masters and the slow loop's copies, each expert at most once in the domain
  (its *home*, which computes what its replicas leave), ``-1`` for a free (spare) slot.
  ``domainquota.rehome`` turns a placement with several copies into one.

**Result** (:class:`DomainBalance`, numpy int64; ``N`` replicas, ``K`` experts with
replicas, ``C = N + K`` copies of those experts):

- ``replicas`` [N, 3] ``(rank, slot, expert)`` to add, in line order, each in the lowest
  free slot of its rank; ``replica_tokens`` [N] the tokens each computes.
- ``copy_rank``, ``copy_expert`` [C]: the replicas (same order), then the home of every
  expert with replicas (experts ascending); ``split`` [C, R_src]: tokens each source row
  sends to each copy. Every other expert's tokens go whole to its home:
  ``counts[r, e]`` to ``home_rank[e]`` ([E], ``-1`` where not held).
- ``rank_tokens`` [R]: tokens each rank computes; ``quota``: the ``T`` used,
  ``smallest``: the rule's smallest feasible ``T``, ``lower_bound``: no plan goes below.

:func:`route_rows` expands a result into the planner's route rows ``[M, 4]``
``(src, expert, dst, tokens)``. Deterministic: integer arithmetic, ties broken by id, no
randomness; the few float operations (``floor(T (1 + tolerance))``, the share's minimum,
the search's step, which only picks the next probe) are IEEE double basic operations,
the same on every host.

**Speed.** One domain needs no vector bookkeeping across domains: the rule for one ``T``
is a plain loop over the few pieces and receivers (a few dozen); the search steps up
from the lower bound by the secant of the shortfall (tokens a probe leaves unplaced),
then checks ``T - 1`` and bisects, about 3-6 probes a solve where bisection took 10-20;
only the replicated experts' tokens are split (``[C, R_src]``), every other expert goes
whole to its home without rows. Up to ``SMALL_DOMAIN_SLOTS`` slots (8-16 ranks) the setup,
the replica table and the split run in plain Python over lists (each numpy call costs
about 1 us, more than the arithmetic at that size; profiled at 8 ranks the numpy split
was 45% of a solve); the same results as the numpy forms used above that size. Figures: ``docs/benchmarks.md`` (``make bench-balance``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from expertmesh.planner.costmodel import CostSettings, TransferEncoding
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import check_load
from expertmesh.planner.quota import capped_fit
from expertmesh.planner.topology import Link

__all__ = [
    "DEFAULTS",
    "EXACT",
    "MAX_EXPERT_TOKENS",
    "BalanceSettings",
    "DomainBalance",
    "Prepared",
    "balance_domain",
    "choose",
    "homes",
    "prepare",
    "prepare_lists",
    "replica_min_tokens",
    "replica_table",
    "reuse_slots",
    "route_rows",
    "setup",
]

# a product need * tokens in the split must fit in int64: one expert's tokens stay below this
MAX_EXPERT_TOKENS = 1 << 31


# up to this many slots in the domain, the solve's setup runs in plain Python over lists
# (prepare_lists): fewer than numpy's per-call costs (about 1 us a call) at 8-16 ranks
SMALL_DOMAIN_SLOTS = 128


class BalanceSettings(BaseModel):
    """The replica economy of one domain's solve. The defaults were chosen on the
    measurements of ``docs/quota.md`` (replicas vs max/mean on skewed loads);
    :data:`EXACT` is the rule alone."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    tolerance: float = Field(
        default=0.01,
        ge=0.0,
        le=1.0,
        description="accept T up to (1 + tolerance) x the smallest feasible T when the rule "
        "needs fewer replicas there",
    )
    min_tokens_per_replica: int = Field(
        default=0,
        ge=0,
        description="a replica that would compute fewer tokens is not made; its tokens stay "
        "at the home (the home's rank may then exceed T by them); see replica_min_tokens "
        "for the cost model's break-even",
    )
    min_replica_share: float = Field(
        default=0.005,
        ge=0.0,
        le=1.0,
        description="the same as a share of the domain's mean tokens per rank (the larger "
        "of the two minimums applies)",
    )
    max_replicas_per_expert: int | None = Field(
        default=None, ge=1, description="at most this many replicas of one expert (None: no bound)"
    )
    chains: bool = Field(
        default=True,
        description="after the rule, the workers' solve shifts tokens along chains of copies "
        "(planner/chains.py: an overloaded rank's free slot takes another's excess while "
        "a rank below takes more of its expert); the rule alone makes receivers of ranks "
        "below T only",
    )


# the rule alone: the smallest T, every replica it makes (quota's own results)
EXACT = BalanceSettings(tolerance=0.0, min_replica_share=0.0, chains=False)
DEFAULTS = BalanceSettings()


@dataclass(frozen=True, eq=False)
class DomainBalance:
    """One microbatch of one layer in one domain (shapes: the module docstring)."""

    quota: int
    smallest: int
    lower_bound: int
    replicas: np.ndarray
    replica_tokens: np.ndarray
    home_rank: np.ndarray
    copy_rank: np.ndarray
    copy_expert: np.ndarray
    split: np.ndarray
    rank_tokens: np.ndarray


class Prepared(NamedTuple):
    """What the rule needs, as plain ints (shared by the numpy and torch solves)."""

    over: list[tuple[int, list[tuple[int, int]]]]  # (M, [(demand, expert)...]) by M desc
    recv: list[tuple[int, int, int]]  # (M, rank, free slots) by M asc, rank asc
    lower: int
    upper: int
    work: np.ndarray  # [R] M: the demand of the experts each rank is home to
    mean: float  # tokens per rank of the domain


def prepare(
    demand: np.ndarray, home_rank: np.ndarray, free: np.ndarray, max_rep: int | None = None
) -> Prepared:
    """The rule's inputs from per-expert ``demand`` [E], ``home_rank`` [E] (-1: not held)
    and ``free`` [R] slots; bounds as in ``quota``: the ceiling mean, and an expert split
    over every copy it can have (1 + min(max_rep, the other ranks with a free slot))."""
    num_ranks = free.size
    held = np.flatnonzero((home_rank >= 0) & (demand > 0))  # [H]
    rank, dem = home_rank[held], demand[held]
    work = np.bincount(rank, weights=dem, minlength=num_ranks).astype(np.int64)  # M, [R]
    recv = np.flatnonzero(free > 0)
    recv = recv[np.argsort(work[recv], kind="stable")]  # M ascending, rank ascending
    upper = int(work.max(initial=0))
    lower = -(-int(work.sum()) // num_ranks)
    if held.size:  # an expert split over its home and every other rank with a free slot
        others = recv.size - (free[rank] > 0)
        copies = 1 + (others if max_rep is None else np.minimum(others, max_rep))
        lower = max(lower, int((-(-dem // copies)).max()))
    lower = min(lower, upper)
    over = np.flatnonzero(work > lower)
    over = over[np.argsort(-work[over], kind="stable")]  # [O] M descending
    pos = np.full(num_ranks, -1, np.int64)
    pos[over] = np.arange(over.size)
    mine = np.flatnonzero(pos[rank] >= 0)  # the experts of ranks that may shed
    order = mine[np.lexsort((held[mine], -dem[mine], pos[rank[mine]]))]
    items = list(zip(dem[order].tolist(), held[order].tolist(), strict=True))
    cut = np.searchsorted(pos[rank[order]], np.arange(over.size + 1)).tolist()
    return Prepared(
        over=[(m, items[a:b]) for m, a, b in zip(work[over].tolist(), cut, cut[1:], strict=False)],
        recv=list(zip(work[recv].tolist(), recv.tolist(), free[recv].tolist(), strict=True)),
        lower=lower,
        upper=upper,
        work=work,
        mean=float(work.sum()) / num_ranks,
    )


Segment = tuple[int, int, int, int]  # (expert, rank, tokens, j: the j-th replica of its expert)


def _fit(pb: Prepared, quota: int, max_rep: int | None) -> tuple[int, int, list[Segment]]:
    """The rule for ``quota`` (``quota``'s module doc): ``(shortfall, ranks in play,
    replicas)``; feasible iff ``shortfall == 0`` and no bound was broken (then
    ``shortfall`` is -1). With ``max_rep`` the capped rule (``quota.capped_fit``)."""
    if max_rep is not None:
        short, made = capped_fit(pb.over, pb.recv, quota, max_rep)
        nth: dict[int, int] = {}
        segs: list[Segment] = []
        for e, r, t in made:
            j = nth.get(e, 0)
            segs.append((e, r, t, j))
            nth[e] = j + 1
        return short, len(pb.over), segs
    pieces: list[tuple[int, int]] = []  # (-amount, expert)
    busy = 0
    for m, items in pb.over:
        if m <= quota:
            break
        busy += 1
        excess = m - quota
        for d, e in items:
            if d >= excess:
                pieces.append((-excess, e))
                break
            pieces.append((-d, e))
            excess -= d
    if not pieces:
        return 0, busy, []
    pieces.sort()
    recv = pb.recv
    num_recv = len(recv)
    q, out = 0, list[Segment]()
    cap, slots, rank = (quota - recv[0][0], recv[0][2], recv[0][1]) if recv else (0, 0, -1)
    for i, (neg, e) in enumerate(pieces):
        amount, j = -neg, 0
        while amount:
            if q == num_recv or cap <= 0:  # no receiver left below the quota
                return amount + sum(-p for p, _ in pieces[i + 1 :]), busy + q, out
            take = amount if amount < cap else cap
            out.append((e, rank, take, j))
            j += 1
            amount -= take
            cap -= take
            slots -= 1
            if cap == 0 or slots == 0:  # full, or out of slots: the rest stays unused
                q += 1
                if q < num_recv:
                    m, rank, slots = recv[q]
                    cap = quota - m
        if max_rep is not None and j > max_rep:
            return -1, busy + q, out
    return 0, busy + q, out


def _search(pb: Prepared, max_rep: int | None) -> tuple[int, list[Segment]]:
    """The smallest ``T`` for which the rule succeeds, and its replicas.

    Invariant: ``lo`` fails (``lower - 1`` at first), ``hi`` succeeds (the static max
    needs no replica). Until a probe succeeds, each failure steps up to where the
    shortfall (tokens left unplaced) would reach 0 if it kept falling as it did between
    the last two failures (at first: one token per rank in play per unit of ``T``), at
    most to the midpoint; the shortfall falls about linearly where receivers run out of
    slots, so this lands on or just below the answer. After the first success ``T - 1``,
    then plain bisection. Without ``max_replicas_per_expert`` the rule is monotone in
    ``T`` (see ``quota``), so this is the smallest feasible ``T``. With it, where it is
    not, the probes are ``quota``'s (a doubling gap, then bisection), so both end at the
    same ``T`` (``T - 1`` fails).
    """
    lo, hi = pb.lower - 1, pb.upper
    best: list[Segment] = []
    probe, gap, found = pb.lower, 1, False
    last: tuple[int, int] | None = None  # the last failure's (T, shortfall)
    while hi - lo > 1:
        short, busy, segs = _fit(pb, probe, max_rep)
        if short == 0:
            hi, best = probe, segs
        else:
            lo = probe
        if hi - lo <= 1:
            break
        if max_rep is not None:  # quota's own probes: a doubling gap, then bisection
            gap *= 2
            probe = min(lo + gap, (lo + hi) // 2) if hi == pb.upper else (lo + hi) // 2
        elif found:
            probe = (lo + hi) // 2
        elif short > 0:  # the shortfall falls about linearly in T: step to where it is 0
            drop = 0 if last is None else last[1] - short
            slope = drop / (probe - last[0]) if last is not None and drop > 0 else busy
            last = (probe, short)
            probe = min(lo + max(1, math.ceil(short / slope)), (lo + hi) // 2)
        else:  # the first success, reached from below: T - 1, then bisection
            found = True
            probe = hi - 1
    return hi, best


def choose(pb: Prepared, settings: BalanceSettings) -> tuple[int, int, list[Segment]]:
    """``(T used, smallest T, replicas)`` under ``settings``: the smallest ``T``; with a
    tolerance, ``floor(T (1 + tol))`` instead when the rule succeeds there with fewer
    replicas; then the replicas below the larger of ``min_tokens_per_replica`` and
    ``ceil(min_replica_share * mean)`` are dropped."""
    max_rep = settings.max_replicas_per_expert
    smallest, segs = _search(pb, max_rep)
    quota = smallest
    if settings.tolerance > 0 and segs:
        loose = min(int(smallest * (1.0 + settings.tolerance)), pb.upper)
        if loose > smallest:
            short, _, more = _fit(pb, loose, max_rep)
            if short == 0 and len(more) < len(segs):
                quota, segs = loose, more
    least = max(settings.min_tokens_per_replica, math.ceil(settings.min_replica_share * pb.mean))
    if least > 1:
        segs = _drop_small(segs, least)
    return quota, smallest, segs


def _drop_small(segs: list[Segment], least: int) -> list[Segment]:
    """``segs`` without those under ``least`` tokens, ``j`` renumbered per expert."""
    out: list[Segment] = []
    nth: dict[int, int] = {}
    for e, r, t, _ in segs:
        if t >= least:
            j = nth.get(e, 0)
            out.append((e, r, t, j))
            nth[e] = j + 1
    return out


def _check(counts: np.ndarray, phy2log: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``counts`` as int64 and ``phy2log`` as int64, or ``ValueError``."""
    counts = check_load(counts)
    phy2log = np.asarray(phy2log)
    if phy2log.ndim != 2 or phy2log.dtype.kind not in "iu":
        raise ValueError(f"phy2log must be [R, S] integer, got {phy2log.shape} {phy2log.dtype}")
    num_ranks, num_experts = phy2log.shape[0], counts.shape[1]
    if counts.shape[0] < num_ranks or num_ranks == 0:
        raise ValueError(f"counts has {counts.shape[0]} source rows for {num_ranks} ranks")
    phy2log = phy2log.astype(np.int64, copy=False)
    if phy2log.size and (phy2log.min() < -1 or phy2log.max() >= num_experts):
        raise ValueError(f"phy2log holds an expert outside -1 .. {num_experts - 1}")
    return counts, phy2log


def homes(demand: np.ndarray, phy2log: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``home_rank`` [E] (-1: not held), ``free`` [R] slots, and the flat free slots [F]
    ascending; ``ValueError`` on an expert held twice, tokens for an expert
    the domain does not hold, or an expert with too many tokens."""
    num_experts, num_slots = demand.size, phy2log.shape[1]
    flat = phy2log.ravel()
    held = np.flatnonzero(flat >= 0)
    experts = flat[held]
    home_slot = np.full(num_experts, -1, np.int64)
    home_slot[experts] = held
    if np.bincount(experts, minlength=1).max() > 1:
        raise ValueError("phy2log holds an expert twice in the domain (keep one home per expert)")
    home_rank = np.where(home_slot >= 0, home_slot // num_slots, -1)
    if (demand[home_rank < 0] > 0).any():
        missing = np.flatnonzero((home_rank < 0) & (demand > 0))
        raise ValueError(f"tokens for experts the domain does not hold: {missing[:8].tolist()}")
    if demand.size and demand.max() >= MAX_EXPERT_TOKENS:
        raise ValueError(f"an expert has {int(demand.max())} tokens (at most 2^31 - 1)")
    empty = np.flatnonzero(flat < 0)
    free = np.bincount(empty // num_slots, minlength=phy2log.shape[0])
    return home_rank, free, empty


def prepare_lists(
    demand: list[int], phy2log: list[list[int]], max_rep: int | None = None
) -> tuple[Prepared, np.ndarray, np.ndarray]:
    """:func:`homes` and :func:`prepare` in plain Python over lists: for a small domain
    (a few dozen slots) cheaper than their numpy calls; the same results and errors.
    Returns ``(Prepared, home_rank [E], empty [F])``."""
    num_ranks, num_slots = len(phy2log), len(phy2log[0])
    home = [-1] * len(demand)
    work, free, empty = [0] * num_ranks, [0] * num_ranks, []
    mine: list[list[tuple[int, int]]] = [[] for _ in range(num_ranks)]
    for r, row in enumerate(phy2log):
        for s, e in enumerate(row):
            if e < 0:
                free[r] += 1
                empty.append(r * num_slots + s)
            elif home[e] >= 0:
                raise ValueError(
                    "phy2log holds an expert twice in the domain (keep one home per expert)"
                )
            else:
                home[e] = r
                if demand[e]:
                    work[r] += demand[e]
                    mine[r].append((-demand[e], e))
    missing = [e for e, d in enumerate(demand) if d and home[e] < 0]
    if missing:
        raise ValueError(f"tokens for experts the domain does not hold: {missing[:8]}")
    if demand and max(demand) >= MAX_EXPERT_TOKENS:
        raise ValueError(f"an expert has {max(demand)} tokens (at most 2^31 - 1)")
    recv = sorted((work[r], r, free[r]) for r in range(num_ranks) if free[r] > 0)
    total, upper = sum(work), max(work)
    lower = -(-total // num_ranks)
    for r, items in enumerate(mine):
        if items:
            others = len(recv) - (free[r] > 0)
            copies = 1 + (others if max_rep is None else min(others, max_rep))
            lower = max(lower, -(min(items)[0] // copies))
    lower = min(lower, upper)
    over = sorted(
        ((work[r], [(-d, e) for d, e in sorted(mine[r])]) for r in range(num_ranks)
         if work[r] > lower),
        key=lambda x: -x[0],
    )  # fmt: skip
    pb = Prepared(over, recv, lower, upper, np.array(work, np.int64), float(total) / num_ranks)
    return pb, np.array(home, np.int64), np.array(empty, np.int64)


def setup(
    demand: np.ndarray, phy2log: np.ndarray, max_rep: int | None
) -> tuple[Prepared, np.ndarray, np.ndarray]:
    """``(Prepared, home_rank [E], empty [F])`` from ``demand`` [E] and ``phy2log`` [R, S]
    (int64): :func:`prepare_lists` up to ``SMALL_DOMAIN_SLOTS`` slots, else
    :func:`homes` and :func:`prepare` (the same results)."""
    if phy2log.size <= SMALL_DOMAIN_SLOTS:
        return prepare_lists(demand.tolist(), phy2log.tolist(), max_rep)
    home_rank, free, empty = homes(demand, phy2log)
    return prepare(demand, home_rank, free, max_rep), home_rank, empty


def replica_table(
    seg: np.ndarray, empty: np.ndarray, num_slots: int, home_rank: np.ndarray, work: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``replicas`` [N, 3] ``(rank, slot, expert)`` of the replicas ``seg`` [N, 4]
    (expert, rank, tokens, j), each in the next free slot of its rank in line order
    (``empty``: the free flat slots ascending), and ``rank_tokens`` [R] (``work`` [R] less
    what the replicas take from their homes). A rank's replicas need not be consecutive
    (the capped rule returns to a receiver)."""
    ranks = seg[:, 1]
    order = np.argsort(ranks, kind="stable")  # by rank, line order inside a rank
    by_rank = ranks[order]
    nth = np.empty(ranks.size, np.int64)  # earlier replicas on the same rank
    nth[order] = np.arange(ranks.size) - np.searchsorted(by_rank, by_rank)
    replicas = np.empty((ranks.size, 3), np.int64)
    slot = empty[np.searchsorted(empty // num_slots, ranks) + nth]
    replicas[:, 0], replicas[:, 1] = np.divmod(slot, num_slots)
    replicas[:, 2] = seg[:, 0]
    moved = np.bincount(ranks, weights=seg[:, 2], minlength=work.size)
    moved -= np.bincount(home_rank[seg[:, 0]], weights=seg[:, 2], minlength=work.size)
    return replicas, work + moved.astype(np.int64)


def _replica_table_lists(
    segs: list[Segment], empty: np.ndarray, num_slots: int, home_rank: np.ndarray, work: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`replica_table` in plain Python over lists, for a small domain; the same
    results."""
    free: dict[int, list[int]] = {}
    for f in empty.tolist():
        free.setdefault(f // num_slots, []).append(f)
    used: dict[int, int] = {}
    tokens = work.tolist()
    home = home_rank.tolist()
    rows = []
    for e, r, t, _ in segs:
        i = used.get(r, 0)
        used[r] = i + 1
        rows.append((r, free[r][i] % num_slots, e))
        tokens[r] += t
        tokens[home[e]] -= t
    return np.array(rows, np.int64).reshape(-1, 3), np.array(tokens, np.int64)


def _split(
    counts: np.ndarray, home_rank: np.ndarray, seg: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``copy_rank``, ``copy_expert`` [C] and ``split`` [C, R_src] (module docstring) for
    the replicas ``seg`` [N, 4] (expert, rank, tokens, j): each copy first takes its own
    rank's tokens; then replica ``j`` of every expert, pass by pass, takes what it still
    needs from the sources' remaining tokens in proportion, floors plus one token each to
    the largest remainders (lower source first on ties); the home takes the rest."""
    num_src = counts.shape[0]
    n = seg.shape[0]
    if not n:
        z = np.zeros(0, np.int64)
        return z, z, np.zeros((0, num_src), np.int64)
    hot = np.flatnonzero(np.bincount(seg[:, 0], minlength=counts.shape[1]))  # [K]
    col = np.searchsorted(hot, seg[:, 0])  # [N]
    k = hot.size
    c_col = np.concatenate([col, np.arange(k)])  # [C]
    c_rank = np.concatenate([seg[:, 1], home_rank[hot]])
    left = counts.T[hot]  # [K, R_src] tokens of each source not yet given to a copy
    need = np.empty(n + k, np.int64)
    need[:n] = seg[:, 2]
    need[n:] = left.sum(axis=1) - np.bincount(col, weights=seg[:, 2], minlength=k).astype(np.int64)
    own = np.minimum(need, left[c_col, c_rank])  # own rank first
    left[c_col, c_rank] -= own
    need -= own
    split = np.empty((n + k, num_src), np.int64)
    rev = np.arange(num_src - 1, -1, -1)  # [R_src] remainder ties to the lower source
    passes = int(seg[:, 3].max()) + 1
    for j in range(passes):
        c = np.flatnonzero(seg[:, 3] == j) if passes > 1 else np.arange(n)
        cols = c_col[c]
        w, nd = left[cols], need[c]  # [n_j, R_src], [n_j]
        share, rem = np.divmod(w * nd[:, None], np.maximum(w.sum(axis=1), 1)[:, None])
        short = nd - share.sum(axis=1)  # < R_src tokens the floors leave out
        if short.any():
            key = rem * num_src + rev  # distinct within a row
            cut = np.sort(key, axis=1)[np.arange(c.size), num_src - np.maximum(short, 1)]
            cut[short == 0] = np.iinfo(np.int64).max
            share += key >= cut[:, None]
        left[cols] = w - share
        split[c] = share
    split[n:] = left
    split[np.arange(n + k), c_rank] += own
    return c_rank, np.concatenate([seg[:, 0], hot]), split


def _split_lists(
    counts: np.ndarray, home_rank: np.ndarray, seg: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_split` in plain Python over lists, for a small domain (a few dozen copies
    and sources: cheaper than its ~40 numpy calls); the same results."""
    num_src, n = counts.shape[0], seg.shape[0]
    if not n:
        z = np.zeros(0, np.int64)
        return z, z, np.zeros((0, num_src), np.int64)
    rows = seg.tolist()
    hot = sorted({r[0] for r in rows})
    at = {e: i for i, e in enumerate(hot)}
    left = counts.T[hot].tolist()  # [K][R_src]
    c_col = [at[r[0]] for r in rows] + list(range(len(hot)))
    c_rank = [r[1] for r in rows] + home_rank[hot].tolist()
    need = [r[2] for r in rows] + [sum(x) for x in left]
    for e, _, t, _ in rows:
        need[n + at[e]] -= t
    own = [min(nd, left[c][r]) for nd, c, r in zip(need, c_col, c_rank, strict=True)]
    before = [left[c][r] for c, r in zip(c_col, c_rank, strict=True)]
    for c, r, b, o in zip(c_col, c_rank, before, own, strict=True):
        left[c][r] = b - o  # own rank first (taken from the counts before any copy's)
    need = [nd - o for nd, o in zip(need, own, strict=True)]
    split: list[list[int]] = [[] for _ in range(n)]
    passes = max(r[3] for r in rows) + 1
    order = range(num_src)
    for j in range(passes):
        for i in [i for i in range(n) if rows[i][3] == j]:  # one copy per expert a pass
            w, nd = left[c_col[i]], need[i]
            tot = max(sum(w), 1)
            parts = [divmod(x * nd, tot) for x in w]
            share, rem = [p[0] for p in parts], [p[1] for p in parts]
            short = nd - sum(share)
            if short > 0:  # one more token to the largest remainders, lower source first
                for src in sorted(order, key=lambda q: (-rem[q], q))[:short]:
                    share[src] += 1
            left[c_col[i]] = [x - y for x, y in zip(w, share, strict=True)]
            split[i] = share
    split += [list(x) for x in left]
    for i, (r, o) in enumerate(zip(c_rank, own, strict=True)):
        split[i][r] += o
    return (
        np.array(c_rank, np.int64),
        np.array([r[0] for r in rows] + hot, np.int64),
        np.array(split, np.int64).reshape(-1, num_src),
    )


def balance_domain(
    counts: np.ndarray, phy2log: np.ndarray, settings: BalanceSettings = DEFAULTS
) -> DomainBalance:
    """Replicas and token split for one domain's microbatch (module docstring).

    ``ValueError`` on shapes that do not match, negative counts, an expert held twice,
    tokens for an expert the domain does not hold."""
    counts, phy2log = _check(counts, phy2log)
    demand = counts.sum(axis=0)  # [E]
    pb, home_rank, empty = setup(demand, phy2log, settings.max_replicas_per_expert)
    quota, smallest, segs = choose(pb, settings)
    seg = np.array(segs, np.int64).reshape(-1, 4)  # [N] expert, rank, tokens, j
    if phy2log.size <= SMALL_DOMAIN_SLOTS:  # plain Python: fewer than numpy's per-call costs
        replicas, rank_tokens = _replica_table_lists(
            segs, empty, phy2log.shape[1], home_rank, pb.work
        )
        copy_rank, copy_expert, split = _split_lists(counts, home_rank, seg)
    else:
        replicas, rank_tokens = replica_table(seg, empty, phy2log.shape[1], home_rank, pb.work)
        copy_rank, copy_expert, split = _split(counts, home_rank, seg)
    return DomainBalance(
        quota=quota,
        smallest=smallest,
        lower_bound=pb.lower,
        replicas=replicas,
        replica_tokens=seg[:, 2].copy(),
        home_rank=home_rank,
        copy_rank=copy_rank,
        copy_expert=copy_expert,
        split=split,
        rank_tokens=rank_tokens,
    )


def reuse_slots(
    replicas: np.ndarray, phy2log: np.ndarray, cached: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Seat ``replicas`` [N, 3] ``(rank, slot, expert)`` (a result's) where their weights
    already are: a replica goes to a free slot of its rank that ``cached`` [R, S] says
    holds its expert (what every slot holds now: last microbatch's replicas in the free
    slots of ``phy2log`` [R, S]; -1 empty), the others, in line order, to the lowest free
    slots left. Returns the re-seated replicas [N, 3] (same ranks and experts) and
    ``fresh`` [N] bool: the weights must be sent. ``ValueError`` on shapes that differ
    or more replicas on a rank than it has free slots."""
    replicas, phy2log, cached = (np.asarray(x, np.int64) for x in (replicas, phy2log, cached))
    if cached.shape != phy2log.shape or replicas.ndim != 2 or replicas.shape[1] != 3:
        raise ValueError(f"cached {cached.shape} must match phy2log {phy2log.shape}")
    free = phy2log < 0
    out = replicas.copy()
    fresh = np.ones(replicas.shape[0], bool)
    taken: set[tuple[int, int]] = set()
    rows = replicas.tolist()
    for i, (r, _, e) in enumerate(rows):
        hit = np.flatnonzero(free[r] & (cached[r] == e))
        if hit.size and (r, int(hit[0])) not in taken:
            out[i, 1], fresh[i] = hit[0], False
            taken.add((r, int(hit[0])))
    for i, (r, _, _) in enumerate(rows):
        if fresh[i]:
            slot = next((int(x) for x in np.flatnonzero(free[r]) if (r, int(x)) not in taken), -1)
            if slot < 0:
                raise ValueError(f"rank {r} has more replicas than free slots")
            out[i, 1] = slot
            taken.add((r, slot))
    return out, fresh


def route_rows(result: DomainBalance, counts: np.ndarray) -> np.ndarray:
    """Route rows [M, 4] ``(src, expert, dst, tokens)`` of ``counts`` [R_src, E] under
    ``result`` (rows with tokens only; the planner's route format)."""
    counts = np.asarray(counts, dtype=np.int64)
    n_copies = result.copy_expert.size
    cold = np.ones(counts.shape[1], bool)
    cold[result.copy_expert] = False
    src, exp = np.nonzero(counts * cold[None, :])
    rows = [np.stack([src, exp, result.home_rank[exp], counts[src, exp]], axis=1)]
    if n_copies:
        c, s = np.nonzero(result.split)
        rows.append(
            np.stack([s, result.copy_expert[c], result.copy_rank[c], result.split[c, s]], axis=1)
        )
    return np.concatenate(rows).astype(np.int64)


def replica_min_tokens(
    model: ModelSpec,
    link: Link,
    cost: CostSettings | None = None,
    encoding: TransferEncoding | None = None,
) -> int:
    """Tokens a replica must compute to pay for itself on the domain's ``link``
    (``topology.intra_node`` for a node domain, ``intra_dc`` for a DC), by the cost model:
    it costs its weights once per microbatch (and, training, its gradient back to the
    home) on that link, ``latency + bytes / bandwidth``; each token it computes is taken
    off an overloaded rank, saving ``model.flops_per_token / flops_per_second`` of
    straggler compute. The break-even, rounded up; a value for
    ``BalanceSettings.min_tokens_per_replica`` when the fan-out is not hidden."""
    cost = cost or CostSettings()
    encoding = encoding or TransferEncoding()
    nbytes = encoding.refresh_bytes(model) / cost.microbatches_per_update
    if model.training:
        nbytes += encoding.gradient_bytes(model) / cost.microbatches_per_update
    per_token = model.flops_per_token / cost.flops_per_second
    return math.ceil(link.transfer_seconds(nbytes) / per_token)
