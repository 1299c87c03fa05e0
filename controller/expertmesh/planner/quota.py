"""``quota``: exact-load balancing every microbatch inside each domain (brief problem 1).

Masters stay where the slow loop put them (the previous plan's, else
:func:`~expertmesh.planner.static.static_placement`); every microbatch starts from
masters only. From the exact ``load`` [R, E], ranks above a quota ``T`` shed tokens to
replicas on free slots of ranks of the same domain, so that no rank computes more
than ``T``; ``T`` is the smallest integer for which the rule below succeeds, per
domain, searched from a lower bound up to the static max (which always succeeds).
All copies of an expert live in its master's domain: tokens of other domains, which
hold no copy, go there (the only cross-domain traffic ``quota`` makes). With
``max_replicas_per_expert`` the rule for a capped ``T`` below applies instead; it is not
always monotone in ``T``, and the search then returns a ``T`` whose ``T - 1`` fails.
Design, measurements, limits: ``docs/quota.md``.

**The rule for a quota T** (per domain; ``refs.quota_fit_ref`` is it in plain loops):

1. Expert ``e``'s demand ``load[:, e].sum()`` sits on its master's rank; ``M[r]``
   is the demand on rank ``r``.
2. A rank with ``M[r] > T`` sheds ``M[r] - T`` tokens from its experts, largest
   demand first (lower id on ties), each giving all it has until the excess is
   covered. Each expert that gives is a *piece*; pieces are ordered by amount
   descending (lower id on ties).
3. *Receivers* are the ranks with ``M[r] < T`` and a free slot, capacity ``T - M[r]``,
   in order of ``M`` ascending (lower rank on ties).
4. Walk both lists: the current receiver takes as much of the current piece as it
   can (one replica of that expert); it closes when full or when it holds as many
   replicas as it has free slots (the rest of its capacity is then unused).
   ``T`` succeeds iff every piece is placed, each on at most
   ``max_replicas_per_expert`` receivers.

**The rule for a capped T** (``max_replicas_per_expert = k``; :func:`capped_fit`,
``refs.quota_fit_ref`` in plain loops). The walk above lays pieces end to end, so a piece
straddles receivers and the cap fails it; ``T`` then rose far above what one replica per
hot expert reaches by hand (43-58% above the lower bound at EP64 with ``k = 1``). Instead:

1. ``M[r]`` as above; receivers as above, each with capacity ``T - M[r]`` and its free slots.
2. Overloaded ranks in order of ``M`` descending (lower rank on ties); each sheds
   ``M[r] - T`` from its experts, largest demand first (lower id on ties): expert ``e``
   offers ``min(excess left, demand)`` to the ``k`` receivers with the most capacity left
   (lower rank on ties; a receiver needs a free slot), each taking what it can in that
   order (one replica each); what they cannot take is shed by the rank's next expert.
3. ``T`` succeeds iff every overloaded rank sheds its whole excess.

**Route.** Each copy computes exactly its amount: first its own rank's tokens,
then replica ``j`` of each expert (in walk order) splits what it still needs among
the sources' remaining tokens in proportion, rounded by largest remainder (lower
rank on ties); the master takes what is left.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

import numpy as np
from pydantic import Field

from expertmesh.planner.plan import Placement, check_load
from expertmesh.planner.policy import Policy, PolicyContext, PolicySettings, register
from expertmesh.planner.quotaline import (
    Items,
    Layout,
    layout,
    place_replicas,
    search_one,
    secant_step,
    segments,
    solve_domains,
)
from expertmesh.planner.routing import route_even, route_locality
from expertmesh.planner.static import static_placement
from expertmesh.planner.traffic import TokenTraffic, quota_traffic

__all__ = [
    "QuotaPolicy",
    "QuotaSettings",
    "QuotaSolution",
    "balance_demand",
    "capped_fit",
    "quota_balance",
    "quota_route",
]
# Tokens one solve may hold in all: sums of token counts (per rank, per domain) stay exact
# integers, also where numpy sums them as float64.
MAX_TOKENS = 2**53

# quota_traffic (the cost model's view of quota's route) lives beside the other views in
# expertmesh.planner.traffic and is imported here for the policy.


class QuotaSettings(PolicySettings):
    """Settings of the ``quota`` policy."""

    domain: Literal["dc", "node", "global"] = Field(
        default="dc",
        description="where tokens and replicas stay: a DC, a node (NVLink island), or everywhere",
    )
    max_replicas_per_expert: int | None = Field(
        default=None, ge=1, description="at most this many replicas of one expert (None: no bound)"
    )
    tolerance: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="accept T up to (1 + tolerance) x the smallest feasible T of a domain when "
        "the rule makes fewer replicas there (0: the exact optimum; docs/quota.md)",
    )
    min_replica_share: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="drop replicas computing fewer tokens than this share of their domain's "
        "mean tokens per rank (their tokens stay at the master)",
    )


@dataclass(frozen=True, eq=False)
class QuotaSolution:
    """What :func:`quota_balance` decides for one layer and one microbatch.

    - ``placement``: masters in their slots plus this microbatch's replicas in free slots.
    - ``route``: [N, 4] int64 ``(src_rank, expert, dst_rank, tokens)``.
    - ``quota``: [D] the ``T`` of each domain: the smallest feasible one, or a larger one
      within the tolerance (the domain's max tokens per rank, but for the tokens of
      replicas dropped by ``min_replica_share``).
    - ``lower_bound``: [D] the bound the search started from (no plan can go below it).
    - ``replicas``: ``(expert, rank, tokens)`` of every replica in line order, each [N].
    """

    placement: Placement
    route: np.ndarray
    quota: np.ndarray
    lower_bound: np.ndarray
    replicas: tuple[np.ndarray, np.ndarray, np.ndarray]


class _Problem(NamedTuple):
    """What one solve knows before choosing ``T`` (``D`` domains)."""

    shed_order: np.ndarray  # [E] experts by (master rank, demand desc, id)
    shed_dom: np.ndarray  # [E] domain, in shed order
    shed_demand: np.ndarray  # [E] demand, in shed order
    shed_above: np.ndarray  # [E] M of the rank minus the demand of its experts shed earlier
    # receivers (ranks with a free slot) by (domain, M ascending, rank): rank, M, free
    # slots; and where each domain starts in that order ([D + 1])
    recv_lists: tuple[list[int], list[int], list[int], list[int]]
    lower: np.ndarray  # [D] no plan goes below: the domain mean, or an expert split in all
    upper: np.ndarray  # [D] static max (no replica needed)
    max_replicas: int | None
    # with max_replicas: per domain, its ranks as (M, [(demand, expert)...]) by M descending
    # (lower rank on ties), experts by demand descending (lower id on ties)
    over: list[list[tuple[int, list[tuple[int, int]]]]] | None = None


class _Fit(NamedTuple):
    """The rule applied with one ``T`` per domain: ``P`` pieces laid end to end on one
    line, domain after domain, and the receivers that take something. The capped rule
    gives its replicas directly (``replicas``; the line fields are then empty)."""

    feasible: np.ndarray  # [D] bool
    piece_expert: np.ndarray  # [P] in line order
    piece_end: np.ndarray  # [P] where each piece ends on the line
    piece_amount: np.ndarray  # [P]
    receivers: tuple[list[int], list[int], list[int]]  # rank, start, end; in line order
    replicas: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    shortfall: list[int] | None = None  # [D] tokens left unplaced (uncapped rule)


def _problem(
    demand: np.ndarray,
    master_rank: np.ndarray,
    num_slots: int,
    dom: np.ndarray,
    max_rep: int | None,
) -> _Problem:
    """``demand`` [E]: tokens of each expert; ``master_rank`` [E]; ``dom`` [R] domain ids."""
    num_ranks, num_domains = dom.size, int(dom.max(initial=0)) + 1
    base = np.zeros(num_ranks, dtype=np.int64)  # M, summed exactly (not through float64)
    np.add.at(base, master_rank, demand)
    free = num_slots - np.bincount(master_rank, minlength=num_ranks)
    # by master rank, then demand descending, then id (keys, not one product: that overflowed
    # int64 for demands near 2**58)
    shed_order = np.lexsort((np.arange(demand.size), -demand, master_rank))
    shed_rank, shed_demand = master_rank[shed_order], demand[shed_order]
    before = np.cumsum(shed_demand) - shed_demand  # [E] exclusive
    before -= before[np.searchsorted(shed_rank, shed_rank)]
    recv = np.flatnonzero(free > 0)
    recv = recv[np.lexsort((recv, base[recv], dom[recv]))]  # by domain, M ascending, rank
    # bounds: an expert has at most 1 + min(max_rep, other ranks with a free slot) copies
    dom_e = dom[master_rank]
    others = np.bincount(dom[recv], minlength=num_domains)[dom_e] - (free[master_rank] > 0)
    copies = 1 + (others if max_rep is None else np.minimum(max_rep, others))  # [E]
    work = np.bincount(dom, weights=base, minlength=num_domains).astype(np.int64)
    lower = -(-work // np.bincount(dom, minlength=num_domains))  # ceil of the domain mean
    upper = np.zeros(num_domains, dtype=np.int64)
    np.maximum.at(lower, dom_e, -(-demand // copies))
    np.maximum.at(upper, dom, base)
    over: list[list[tuple[int, list[tuple[int, int]]]]] | None = None
    if max_rep is not None:
        over = [[] for _ in range(num_domains)]
        order = np.lexsort((np.arange(num_ranks), -base))  # M descending, rank ascending
        starts = np.searchsorted(shed_rank, np.arange(num_ranks + 1)).tolist()
        exp_list, dem_list = shed_order.tolist(), shed_demand.tolist()
        for r in order.tolist():
            a, b = starts[r], starts[r + 1]
            items = [(d, e) for d, e in zip(dem_list[a:b], exp_list[a:b], strict=True) if d]
            over[int(dom[r])].append((int(base[r]), items))
    return _Problem(
        shed_order=shed_order,
        shed_dom=dom[shed_rank],
        shed_demand=shed_demand,
        shed_above=base[shed_rank] - before,
        recv_lists=(
            recv.tolist(),
            base[recv].tolist(),
            free[recv].tolist(),
            np.searchsorted(dom[recv], np.arange(num_domains + 1)).tolist(),
        ),
        lower=np.minimum(lower, upper),
        upper=upper,
        max_replicas=max_rep,
        over=over,
    )


def capped_fit(
    over: list[tuple[int, list[tuple[int, int]]]],
    recv: list[tuple[int, int, int]],
    quota: int,
    max_rep: int,
) -> tuple[int, list[tuple[int, int, int]]]:
    """The capped rule of the module docstring for one domain and one ``quota``.

    ``over``: the domain's ranks as ``(M, [(demand, expert), ...])``, ``M`` descending
    (lower rank on ties), experts by demand descending (lower id on ties; ranks with
    ``M <= quota`` are skipped); ``recv``: ``(M, rank, free slots)`` of the ranks with a
    free slot. Returns ``(shortfall, replicas)``: the excess left unshed (0: ``quota``
    succeeds) and ``(expert, rank, tokens)`` in the order made. Plain ints: ``quota`` and
    ``fastquota`` share it."""
    heap = [(m - quota, rank) for m, rank, free in recv if m < quota]  # (-capacity, rank)
    heapq.heapify(heap)
    slots = {rank: free for _, rank, free in recv}
    out: list[tuple[int, int, int]] = []
    for i, (m, items) in enumerate(over):
        if m <= quota:
            continue
        excess = m - quota
        for d, e in items:
            if excess == 0:
                break
            want = min(excess, d)
            taken = [heapq.heappop(heap) for _ in range(min(max_rep, len(heap)))]
            for neg, rank in taken:
                cap = -neg
                if want:
                    give = min(want, cap)
                    out.append((e, rank, give))
                    cap, want, excess = cap - give, want - give, excess - give
                    slots[rank] -= 1
                if cap and slots[rank]:
                    heapq.heappush(heap, (-cap, rank))
        if excess:
            return excess + sum(x - quota for x, _ in over[i + 1 :] if x > quota), out
    return 0, out


def _fit_capped(pb: _Problem, quota: np.ndarray) -> _Fit:
    """:func:`capped_fit` in every domain, replicas domain after domain."""
    over, cap = pb.over, pb.max_replicas
    if over is None or cap is None:
        raise ValueError("the capped rule needs max_replicas_per_expert")
    ranks, bases, slots, first = pb.recv_lists
    feasible = np.zeros(quota.size, dtype=bool)
    made: list[tuple[int, int, int]] = []
    for d, t in enumerate(quota.tolist()):
        lo, hi = first[d], first[d + 1]
        recv = list(zip(bases[lo:hi], ranks[lo:hi], slots[lo:hi], strict=True))
        short, out = capped_fit(over[d], recv, t, cap)
        feasible[d] = short == 0
        made.extend(out)
    cols = np.array(made, dtype=np.int64).reshape(-1, 3).T
    empty = np.zeros(0, dtype=np.int64)
    return _Fit(feasible, empty, empty, empty, ([], [], []), (cols[0], cols[1], cols[2]))


def _fit(pb: _Problem, quota: np.ndarray) -> _Fit:
    """Apply the rule of the module docstring with ``quota`` [D] to every domain at once."""
    if pb.max_replicas is not None:
        return _fit_capped(pb, quota)
    shed = np.minimum(np.maximum(pb.shed_above - quota[pb.shed_dom], 0), pb.shed_demand)  # [E]
    give = np.flatnonzero(shed)
    p_exp, p_amt, p_dom = pb.shed_order[give], shed[give], pb.shed_dom[give]
    line = np.lexsort((p_exp, -p_amt, p_dom))
    p_exp, p_amt, p_dom = p_exp[line], p_amt[line], p_dom[line]
    p_end = np.cumsum(p_amt)
    need = np.bincount(p_dom, weights=p_amt, minlength=quota.size).astype(np.int64)
    short, receivers = _walk(p_end, np.cumsum(need), quota, pb.recv_lists)
    return _Fit(np.array(short) == 0, p_exp, p_end, p_amt, receivers, shortfall=short)


def _walk(
    p_end: np.ndarray,
    dom_end: np.ndarray,
    quota: np.ndarray,
    receivers: tuple[list[int], list[int], list[int], list[int]],
) -> tuple[list[int], tuple[list[int], list[int], list[int]]]:
    """Step 4 of the rule for every domain: the tokens of each domain's pieces left
    unplaced ([D]; 0: all placed), and rank, start and end on the line of each receiver
    that takes some.

    ``p_end``: [P] piece ends on the line, domain after domain; ``dom_end``: [D] where
    each domain's pieces end; ``quota``: [D]. Sequential by nature: a plain loop over
    a few dozen receivers per domain is cheaper than any numpy detour.
    """
    ends = [*p_end.tolist(), np.iinfo(np.int64).max]
    last = len(ends) - 1
    stop, limit = dom_end.tolist(), quota.tolist()
    ranks, bases, slots, first = receivers
    short = [0] * len(stop)
    rank: list[int] = []
    start: list[int] = []
    end: list[int] = []
    k = 0
    for d, (t, top) in enumerate(zip(limit, stop, strict=True)):
        u = stop[d - 1] if d else 0
        if u == top:
            continue
        short[d] = top - u
        lo, hi = first[d], first[d + 1]  # receivers by M ascending
        for r, m, f in zip(ranks[lo:hi], bases[lo:hi], slots[lo:hi], strict=True):
            if m >= t:  # full already, and so are the rest
                break
            while ends[k] <= u:  # k: the first piece ending after u
                k += 1
            close = u + t - m
            kf = k + f - 1  # the f-th piece end after u closes it: out of slots
            if kf < last and ends[kf] < close:
                close = ends[kf]
            rank.append(r)
            start.append(u)
            if close >= top:
                end.append(top)
                short[d] = 0
                break
            end.append(close)
            u = close
            short[d] = top - u
    return short, (rank, start, end)


def _search(pb: _Problem, sizes: np.ndarray) -> tuple[np.ndarray, _Fit]:
    """[D] smallest feasible quota per domain, and its fit, searching all domains together.
    ``sizes``: [D] ranks of each domain.

    Invariant: ``lo`` fails (``lower - 1`` at first), ``hi`` succeeds (the static max
    at first). Until a domain's probe succeeds, each failure steps up to where its
    shortfall (tokens left unplaced) would reach 0 if it kept falling as it did between
    its last two failures (at first: one token per rank of the domain per unit of ``T``,
    an underestimate of the step), at most to the midpoint; after its first success,
    ``T - 1``, then bisection (fastquota's search, per domain). The rule is monotone in
    ``T`` without ``max_replicas_per_expert``, so any probes inside ``(lo, hi)`` end at the
    same smallest ``T``; with it, the probes gallop up from the lower bound (``lo + 1, 2,
    4, ...``, never past the midpoint) until one succeeds, then bisect.
    """
    lo, hi = (pb.lower - 1).tolist(), pb.upper.tolist()  # per domain, plain ints
    num = len(lo)
    gap, galloping = [1] * num, [True] * num
    last: list[tuple[int, int] | None] = [None] * num  # the last failure's (T, shortfall)
    secant = pb.max_replicas is None
    width = sizes.tolist()
    probe = [min(lo[d] + 1, hi[d]) for d in range(num)]
    fit, used = None, hi
    while any(b - a > 1 for a, b in zip(lo, hi, strict=True)):
        used = list(probe)
        fit = _fit(pb, np.array(used, dtype=np.int64))
        short = fit.shortfall
        for d, ok in enumerate(fit.feasible.tolist()):
            a, b = lo[d], hi[d]
            if b - a <= 1:
                continue
            if ok:
                hi[d] = probe[d]
            else:
                lo[d] = probe[d]
            a, b = lo[d], hi[d]
            if b - a <= 1:
                probe[d] = b
            elif not secant:
                if not ok:
                    gap[d] *= 2
                else:
                    galloping[d] = False
                probe[d] = min(a + gap[d], (a + b) // 2) if galloping[d] else (a + b) // 2
            elif not galloping[d]:
                probe[d] = (a + b) // 2
            elif ok:  # the first success, reached from below: T - 1, then bisection
                galloping[d] = False
                probe[d] = b - 1
            else:
                s = short[d] if short is not None else 0
                probe[d] = secant_step(a, b, s, last[d], width[d])
                last[d] = (a, s)
    if fit is None or used != hi:  # the last probe is the answer unless it failed somewhere
        fit = _fit(pb, np.array(hi, dtype=np.int64))
    return np.array(hi, dtype=np.int64), fit


def _search_domains(
    pb: _Problem,
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """:func:`_search` without ``max_replicas_per_expert`` domain by domain, in plain
    Python over the few items and receivers of each (:func:`~expertmesh.planner.quotaline.search_one`;
    the rule is monotone in ``T``, so any probes end at the same ``T`` [D]); and the
    replicas of ``_replicas(_fit(pb, T))``, ``(expert, rank, tokens)`` each [N] in line
    order. No numpy call per probe: most domains are settled by their first probe (the
    lower bound), and the vector rule costs dozens of numpy calls for each."""
    items = _domain_items(pb)
    ranks, bases, slots, first = pb.recv_lists
    quota = pb.upper.tolist()
    made: list[tuple[int, int, int]] = []
    for d, lower in enumerate(pb.lower.tolist()):
        lo, hi = first[d], first[d + 1]
        recv = list(zip(ranks[lo:hi], bases[lo:hi], slots[lo:hi], strict=True))
        quota[d], pieces, walked = search_one(items[d], recv, lower, quota[d])
        made.extend(segments(pieces, walked))
    cols = np.array(made, dtype=np.int64).reshape(-1, 3).T
    return np.array(quota, dtype=np.int64), (cols[0], cols[1], cols[2])


def _domain_items(pb: _Problem) -> list[Items]:
    """Per domain, ``(M less the demand shed before it, demand, expert)`` of every expert
    with demand that sheds at some ``T >= lower`` (in shed order): at ``T`` it sheds
    ``min(first - T, demand)`` where ``first > T`` (the vector rule's ``shed``)."""
    can = (pb.shed_above > pb.lower[pb.shed_dom]) & (pb.shed_demand > 0)
    idx = np.flatnonzero(can)
    out: list[Items] = [[] for _ in range(pb.lower.size)]
    cols = (pb.shed_above[idx], pb.shed_demand[idx], pb.shed_order[idx])
    for d, a, m, e in zip(pb.shed_dom[idx].tolist(), *(c.tolist() for c in cols), strict=True):
        out[d].append((a, m, e))
    return out


def _loosen(
    pb: _Problem, quota: np.ndarray, fit: _Fit, dom: np.ndarray, tolerance: float
) -> tuple[np.ndarray, _Fit]:
    """Per domain, ``floor(T (1 + tolerance))`` (at most the static max) instead of the
    smallest ``T`` where the rule succeeds there with fewer replicas."""
    loose = np.minimum((quota * (1.0 + tolerance)).astype(np.int64), pb.upper)
    other = _fit(pb, loose)

    def count(f: _Fit) -> np.ndarray:
        return np.bincount(dom[_replicas(f)[1]], minlength=quota.size)

    better = other.feasible & (loose > quota) & (count(other) < count(fit))
    if not better.any():
        return quota, fit
    quota = np.where(better, loose, quota)
    return quota, _fit(pb, quota)


def _overlaps(fit: _Fit) -> tuple[np.ndarray, ...]:
    """Receivers each piece overlaps: first [P] and count [P], indices into the
    receivers' rank, start and end [Q'] (also returned)."""
    r_rank, r_start, r_end = (np.array(x, dtype=np.int64) for x in fit.receivers)
    first = np.searchsorted(r_end, fit.piece_end - fit.piece_amount, side="right")
    count = np.searchsorted(r_start, fit.piece_end, side="left") - first
    return first, count, r_rank, r_start, r_end


def _replicas(fit: _Fit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicas of a feasible fit in line order: expert, rank and tokens, each [N]."""
    if fit.replicas is not None:
        return fit.replicas
    first, count, r_rank, r_start, r_end = _overlaps(fit)
    piece = np.repeat(np.arange(first.size), count)
    recv = first[piece] + np.arange(piece.size) - np.repeat(np.cumsum(count) - count, count)
    lo = np.maximum(fit.piece_end[piece] - fit.piece_amount[piece], r_start[recv])
    hi = np.minimum(fit.piece_end[piece], r_end[recv])
    return fit.piece_expert[piece], r_rank[recv], hi - lo


def quota_balance(
    load: np.ndarray,
    masters: Placement,
    rank_domain: np.ndarray | None = None,
    max_replicas_per_expert: int | None = None,
    *,
    with_route: bool = True,
    tolerance: float = 0.0,
    min_replica_share: float = 0.0,
) -> QuotaSolution:
    """Balance one layer's microbatch by quota inside each domain (see the module doc).

    - ``load``: [R, E] tokens from source rank ``r`` to logical expert ``e``.
    - ``masters``: placement whose ``master`` [E] gives each expert's slot; only the
      master slots of its ``phy2log`` [R, S] are kept (other copies are dropped).
    - ``rank_domain``: [R] domain id of each rank (any ints; ``None``: one domain).
    - ``max_replicas_per_expert``: bound on replicas of one expert, ``None`` for none.
    - ``with_route``: build the route rows (``False``: an empty route; see
      :func:`quota_route` and :func:`quota_traffic`).
    - ``tolerance``, ``min_replica_share``: the replica economy of :class:`QuotaSettings`
      (0: the rule's exact optimum), per domain as in
      :func:`expertmesh.planner.fastquota.balance_domain`.

    Raises ``ValueError`` on shapes that do not match, or a bound below 1.
    """
    num_ranks = masters.phy2log.shape[0]
    load = check_load(load, num_ranks, int(masters.master.shape[0]))
    solution = balance_demand(
        load.sum(axis=0),
        masters,
        rank_domain,
        max_replicas_per_expert,
        tolerance=tolerance,
        min_replica_share=min_replica_share,
    )
    if not with_route:
        return solution
    return dataclasses.replace(solution, route=quota_route(load, solution))


def balance_demand(
    demand: np.ndarray,
    masters: Placement,
    rank_domain: np.ndarray | None = None,
    max_replicas_per_expert: int | None = None,
    *,
    tolerance: float = 0.0,
    min_replica_share: float = 0.0,
) -> QuotaSolution:
    """:func:`quota_balance` from each expert's total only: the rule for ``T`` needs no
    more (the route does; this solution's is empty).

    ``demand``: [E] int tokens of each logical expert this microbatch; the rest as in
    :func:`quota_balance`. ``ValueError`` on shapes that do not match, negative demand, 2**53
    tokens or more in all (:data:`MAX_TOKENS`), or a bound below 1.
    """
    num_ranks, num_slots = masters.phy2log.shape
    num_experts = int(masters.master.shape[0])
    demand = np.asarray(demand)
    if demand.shape != (num_experts,) or demand.dtype.kind not in "iu":
        raise ValueError(f"demand must be [{num_experts}] integer tokens, got {demand.shape}")
    if demand.size and demand.min() < 0:
        raise ValueError("demand has negative token counts")
    if float(demand.sum(dtype=np.float64)) >= MAX_TOKENS:
        raise ValueError("demand holds 2**53 tokens or more in all: beyond exact counting")
    master = masters.master.astype(np.int64)
    lay = _LAYOUTS.get(_layout_key(master, num_ranks, num_slots, rank_domain))
    if lay is None and (
        master.min(initial=0) < 0 or master.max(initial=0) >= num_ranks * num_slots
    ):
        raise ValueError("master slot index out of range")  # (a layout's masters passed)
    if max_replicas_per_expert is not None and max_replicas_per_expert < 1:
        raise ValueError("max_replicas_per_expert must be >= 1 or None")
    if not (0.0 <= tolerance <= 1.0 and 0.0 <= min_replica_share <= 1.0):
        raise ValueError("tolerance and min_replica_share must be in [0, 1]")
    if rank_domain is not None and np.shape(rank_domain) != (num_ranks,):
        raise ValueError(f"rank_domain must be [{num_ranks}], got {np.shape(rank_domain)}")
    if lay is None:
        lay = _layout(master, num_ranks, num_slots, rank_domain)
    if not (masters.phy2log.ravel()[master] == lay.experts).all():
        raise ValueError("a master slot does not hold its expert")
    dom, num_domains = lay.dom, len(lay.sizes)
    slot = None  # the flat slot of each replica, when solve_domains gave them
    if max_replicas_per_expert is None and tolerance == 0:
        quota, lower, (rep_expert, rep_rank, rep_tokens), slot = solve_domains(
            demand.astype(np.int64, copy=False), lay
        )
    else:
        pb = _problem(demand.astype(np.int64), lay.mrank, num_slots, dom, max_replicas_per_expert)
        quota, fit = _search(pb, lay.size_arr)
        if tolerance > 0:
            quota, fit = _loosen(pb, quota, fit, dom, tolerance)
        rep_expert, rep_rank, rep_tokens = _replicas(fit)
        lower = pb.lower
    if min_replica_share > 0:  # per domain: at least ceil(share * mean tokens per rank)
        total = np.bincount(dom[lay.mrank], weights=demand, minlength=num_domains)
        least = np.ceil(min_replica_share * (total / lay.size_arr))
        keep = rep_tokens >= least[dom[rep_rank]]
        rep_expert, rep_rank, rep_tokens = rep_expert[keep], rep_rank[keep], rep_tokens[keep]
        slot = None  # the k-th replica kept on a rank takes its k-th free slot
    if slot is None:
        flat = place_replicas(lay, rep_expert, rep_rank)
    else:
        flat = lay.masters_only.copy()
        flat[slot] = rep_expert
    phy2log = flat.reshape(num_ranks, num_slots)
    return QuotaSolution(
        placement=Placement(phy2log, master),
        route=np.zeros((0, 4), np.int64),
        quota=quota,
        lower_bound=lower,
        replicas=(rep_expert, rep_rank, rep_tokens),
    )


#: layouts of recent solves by (ranks, slots, masters, domain ids): a run solves on the same
#: masters and domains step after step
_LAYOUTS: dict[tuple[object, ...], Layout] = {}


def _layout_key(
    master: np.ndarray, num_ranks: int, num_slots: int, rank_domain: object
) -> tuple[object, ...]:
    """What :func:`_layout` keeps a layout by: sizes, masters and domain ids, as bytes."""
    ids = None if rank_domain is None else np.asarray(rank_domain)
    dom = None if ids is None else (ids.dtype.str, ids.shape, ids.tobytes())
    return (num_ranks, num_slots, master.tobytes(), dom)


def _layout(
    master: np.ndarray, num_ranks: int, num_slots: int, rank_domain: np.ndarray | None
) -> Layout:
    """:func:`~expertmesh.planner.quotaline.layout` of valid masters ``master`` [E] (int64)
    in domains ``rank_domain`` [R] (any ids, renumbered by :func:`_dense`; None: one),
    kept in :data:`_LAYOUTS`."""
    key = _layout_key(master, num_ranks, num_slots, rank_domain)
    got = _LAYOUTS.get(key)
    if got is None:
        dom = np.zeros(num_ranks, np.int64)
        if rank_domain is not None:
            dom = _dense(np.asarray(rank_domain))
        if len(_LAYOUTS) >= 16:
            _LAYOUTS.clear()
        got = _LAYOUTS[key] = layout(master, num_ranks, num_slots, dom)
    return got


def _dense(ids: np.ndarray) -> np.ndarray:
    """[R] int64 ``ids`` renumbered ``0 .. D-1`` in the order of their values (the inverse
    of ``np.unique``); ids that already are (a topology's ``rank_dc``) without sorting."""
    if ids.dtype.kind in "iu" and ids.size and ids.min() >= 0 and np.bincount(ids).all():
        return ids.astype(np.int64)
    return np.unique(ids, return_inverse=True)[1].astype(np.int64).reshape(-1)


def quota_route(load: np.ndarray, solution: QuotaSolution) -> np.ndarray:
    """Route [N, 4] of ``load`` [R, E] over ``solution`` (the module doc's rule, by
    :func:`~expertmesh.planner.routing.route_locality`); ``solution.route`` is this
    unless :func:`quota_balance` was told not to build it."""
    return route_locality(load, solution.placement.master_rank(), solution.replicas)


@register
class QuotaPolicy(Policy):
    """Per-microbatch replicas and token split by smallest quota (see the module doc).

    ``place`` solves and remembers the last context; ``route`` and ``route_traffic``
    serve that solution when given its placement (slots may have been permuted, ranks
    not), and ``route`` falls back to an even split inside domains otherwise.
    """

    name = "quota"
    Settings = QuotaSettings
    relabel_ranks: ClassVar[bool] = False
    #: solved every microbatch on the critical path; every replica's weights fan out then
    microbatch_copies: ClassVar[str] = "all"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        super().__init__(settings)
        self._last: tuple[PolicyContext, QuotaSolution] | None = None  # and its route:
        self._last_route: np.ndarray | None = None
        self._static: dict[tuple[int, int, int, int], Placement] = {}

    def _domain(self, ctx: PolicyContext) -> np.ndarray | None:
        kind = self.settings.domain  # type: ignore[attr-defined]
        return {"dc": ctx.topology.rank_dc, "node": ctx.topology.rank_node}.get(kind)

    def solve(self, ctx: PolicyContext) -> QuotaSolution:
        """The solution for ``ctx`` (its ``route`` is empty: :meth:`route` builds it)."""
        if self._last is not None and self._last[0] is ctx:
            return self._last[1]
        t = ctx.topology
        if ctx.previous is not None:
            masters = ctx.previous.placement
        else:  # the same static placement every time: made once
            key = (t.num_ranks, t.slots_per_rank, ctx.model.num_experts, t.masters_per_rank)
            if key not in self._static:
                self._static = {key: static_placement(*key)}
            masters = self._static[key]
        cfg = self.settings
        sol = quota_balance(
            ctx.load,
            masters,
            self._domain(ctx),
            cfg.max_replicas_per_expert,  # type: ignore[attr-defined]
            with_route=False,
            tolerance=cfg.tolerance,  # type: ignore[attr-defined]
            min_replica_share=cfg.min_replica_share,  # type: ignore[attr-defined]
        )
        self._last, self._last_route = (ctx, sol), None
        return sol

    def place(self, ctx: PolicyContext) -> Placement:
        return self.solve(ctx).placement

    def _solved(self, ctx: PolicyContext, placement: Placement) -> QuotaSolution | None:
        sol = self.solve(ctx)
        if placement is sol.placement or np.array_equal(sol.placement.holds(), placement.holds()):
            return sol
        return None

    def route_traffic(self, ctx: PolicyContext, placement: Placement) -> TokenTraffic | None:
        """The cost model's view of the route (:func:`quota_traffic`) without building its
        rows, or ``None`` when ``placement`` is not the one this context solved to."""
        sol = self._solved(ctx, placement)
        return None if sol is None else quota_traffic(ctx.load, sol, ctx.topology, ctx.model.top_k)

    def route(self, ctx: PolicyContext, placement: Placement) -> np.ndarray:
        sol = self._solved(ctx, placement)
        if sol is None:
            return route_even(ctx.load, placement, self._domain(ctx))
        if self._last_route is None:
            self._last_route = quota_route(ctx.load, sol)
        return self._last_route
