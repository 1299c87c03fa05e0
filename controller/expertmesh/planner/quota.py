"""``quota``: exact-load balancing every microbatch inside each domain (the brief's problem 1).

Masters stay where the slow loop put them (the previous plan's masters, else
:func:`~expertmesh.planner.static.static_placement`). Every microbatch starts
from masters only (replicas are transient) and, from the exact ``load`` [R, E],
puts replicas of overloaded experts on spare slots of ranks in the master's
domain and splits each expert's tokens among its copies so that no rank of a
domain computes more than a quota ``T``. ``T`` is the smallest integer for which
the rule below succeeds, found by bisection, per domain, between the domain's
lower bound and its static maximum (always feasible: no replicas).

**Domains and out-of-domain masters.** A master lives in one domain, and all
copies of an expert are placed in its master's domain. Tokens from sources in
that domain stay in it; tokens of source ranks in other domains have no copy in
their own domain, so they leave it for the master's domain (the only
cross-domain traffic ``quota`` makes; which experts live in which DC is the slow
loop's decision, e.g. ``hybrid``). So the work of domain ``d`` is the demand of
the experts mastered in ``d``, from every source, and domains are solved
independently (and simultaneously, vectorized). The floor of max/mean is
``max_d(work_d / ranks_d) / mean``.

**The rule for a quota T** (one domain; :func:`expertmesh.planner.refs.quota_fit_ref`
is the same rule in plain loops):

1. Expert ``e``'s demand ``d[e] = load[:, e].sum()`` sits on its master's rank;
   ``M[r]`` is the demand on rank ``r``.
2. A rank with ``M[r] > T`` sheds ``M[r] - T`` tokens from its experts, largest
   demand first (lower expert id on ties), each giving all it has until the
   excess is covered. Each expert that gives tokens is a *piece*.
3. *Receivers*: ranks of the domain with ``M[r] < T`` and a free slot, capacity
   ``T - M[r]``, in order of ``M`` ascending (lower rank on ties). Pieces in
   order of amount descending (lower expert id on ties).
4. Lay the pieces end to end on a line and the receivers end to end beside
   them; a piece puts one replica on every receiver its interval overlaps,
   carrying the overlap. ``T`` is feasible iff the capacity covers the pieces,
   no receiver overlaps more pieces than it has free slots, and no piece
   overlaps more than ``max_replicas_per_expert`` receivers.

Overloaded ranks end at exactly ``T``, so the achieved max equals ``T`` (or the
static max when no replica helps). The search assumes feasibility is monotone in
``T``; without ``max_replicas_per_expert`` it was on every case tried (the unit
tests compare it with a linear scan), with the bound it is not always (a piece
may straddle one receiver more at a larger ``T``), and the search then returns
a ``T`` whose ``T - 1`` fails. Limits of the rule: overloaded ranks never
receive, and a receiver out of slots wastes the rest of its capacity.

**Route.** Each copy computes exactly its amount. It takes tokens from its own
rank first (locality; masters too), then replica ``j`` of each expert (in the
order they were laid out) splits what it still needs among the sources'
remaining tokens in proportion, rounded by largest remainder (ties to the lower
source rank); the master takes what is left from each source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

import numpy as np
from pydantic import Field

from expertmesh.planner.plan import Placement, check_load
from expertmesh.planner.policy import Policy, PolicyContext, PolicySettings, register
from expertmesh.planner.routing import route_even
from expertmesh.planner.static import static_placement
from expertmesh.planner.topology import Topology
from expertmesh.planner.traffic import TokenTraffic, weighted_traffic

__all__ = ["QuotaPolicy", "QuotaSettings", "QuotaSolution", "quota_balance", "quota_traffic"]


class QuotaSettings(PolicySettings):
    """Settings of the ``quota`` policy."""

    domain: Literal["dc", "node", "global"] = Field(
        default="dc",
        description="where tokens and replicas stay: a DC, a node (NVLink island), or everywhere",
    )
    max_replicas_per_expert: int | None = Field(
        default=None, ge=1, description="at most this many replicas of one expert (None: no bound)"
    )


@dataclass(frozen=True, eq=False)
class QuotaSolution:
    """What :func:`quota_balance` decides for one layer and one microbatch.

    - ``placement``: masters in their slots plus this microbatch's replicas in free slots.
    - ``route``: [N, 4] int64 ``(src_rank, expert, dst_rank, tokens)``.
    - ``quota``: [D] the smallest feasible ``T`` of each domain (its max tokens per rank).
    - ``lower_bound``: [D] the bound the search started from (no plan can go below it).
    - ``replicas``: ``(expert, rank, tokens)`` of every replica in line order, each [N].
    """

    placement: Placement
    route: np.ndarray
    quota: np.ndarray
    lower_bound: np.ndarray
    replicas: tuple[np.ndarray, np.ndarray, np.ndarray] = (
        np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    )  # fmt: skip


class _Problem(NamedTuple):
    """What one solve knows before choosing ``T`` (``D`` domains, ``R`` ranks)."""

    demand: np.ndarray  # [E] tokens of each expert
    master_rank: np.ndarray  # [E]
    rank_domain: np.ndarray  # [R] domain id in [0, D)
    base: np.ndarray  # [R] M: demand on each rank from its masters
    free: np.ndarray  # [R] free slots
    shed_order: np.ndarray  # [E] experts by (master rank, demand desc, id)
    shed_dom: np.ndarray  # [E] domain, in shed order
    shed_demand: np.ndarray  # [E] demand, in shed order
    shed_above: np.ndarray  # [E] M of the rank minus the demand of its experts shed earlier
    # receivers (ranks with a free slot) by (domain, M ascending, rank): their rank, M,
    # free slots, and where each domain's start in that order ([D + 1])
    recv_lists: tuple[list[int], list[int], list[int], list[int]]
    max_replicas: int
    num_domains: int


class _Fit(NamedTuple):
    """The rule applied with one ``T`` per domain: its line of ``P`` pieces and the
    receivers that take something."""

    feasible: np.ndarray  # [D] bool
    piece_expert: np.ndarray  # [P] in line order
    piece_end: np.ndarray  # [P] where each piece ends on the line (pieces are contiguous)
    piece_amount: np.ndarray  # [P]
    piece_domain: np.ndarray  # [P]
    receivers: tuple[list[int], list[int], list[int]]  # rank, start, end; in line order


def _problem(
    load: np.ndarray, master_rank: np.ndarray, num_slots: int, dom: np.ndarray, max_replicas: int
) -> _Problem:
    num_ranks, num_domains = dom.size, int(dom.max(initial=0)) + 1
    demand = load.sum(axis=0)  # [E]
    base = np.bincount(master_rank, weights=demand, minlength=num_ranks).astype(np.int64)
    free = num_slots - np.bincount(master_rank, minlength=num_ranks)
    # by master rank, then demand descending, then id (stable): one integer key
    top = int(demand.max(initial=0)) + 1
    shed_order = np.argsort(master_rank * top + (top - 1 - demand), kind="stable")
    shed_rank, shed_demand = master_rank[shed_order], demand[shed_order]
    before = np.cumsum(shed_demand) - shed_demand  # [E] exclusive
    shed_before = before - before[np.searchsorted(shed_rank, shed_rank)]
    has_free = np.flatnonzero(free > 0)
    top = int(base.max(initial=0)) + 1
    recv = has_free[np.argsort(dom[has_free] * top + base[has_free], kind="stable")]
    return _Problem(
        demand=demand,
        master_rank=master_rank,
        rank_domain=dom,
        base=base,
        free=free,
        shed_order=shed_order,
        shed_dom=dom[shed_rank],
        shed_demand=shed_demand,
        shed_above=base[shed_rank] - shed_before,
        recv_lists=(
            recv.tolist(),
            base[recv].tolist(),
            free[recv].tolist(),
            np.searchsorted(dom[recv], np.arange(num_domains + 1)).tolist(),
        ),
        max_replicas=max_replicas,
        num_domains=num_domains,
    )


def _fit(pb: _Problem, quota: np.ndarray) -> _Fit:
    """Apply the rule of the module docstring with ``quota`` [D] to every domain at once.

    All pieces share one line, domain by domain; a domain's receivers start where
    its pieces start and stop where they end.
    """
    shed = np.minimum(np.maximum(pb.shed_above - quota[pb.shed_dom], 0), pb.shed_demand)  # [E]
    give = np.flatnonzero(shed)
    p_exp, p_amt, p_dom = pb.shed_order[give], shed[give], pb.shed_dom[give]
    line = np.lexsort((p_exp, -p_amt, p_dom))
    p_exp, p_amt, p_dom = p_exp[line], p_amt[line], p_dom[line]
    p_end = np.cumsum(p_amt)
    need = np.bincount(p_dom, weights=p_amt, minlength=pb.num_domains).astype(np.int64)
    dom_end = np.cumsum(need)  # [D] where each domain's pieces end on the line
    feasible, receivers = _walk(p_end, dom_end, quota, pb)
    fit = _Fit(feasible, p_exp, p_end, p_amt, p_dom, receivers)
    if pb.max_replicas < pb.rank_domain.size:
        _, count, *_ = _overlaps(fit)
        too_many = np.bincount(p_dom, weights=count > pb.max_replicas, minlength=pb.num_domains)
        feasible &= too_many == 0
    return fit


def _walk(
    p_end: np.ndarray, dom_end: np.ndarray, quota: np.ndarray, pb: _Problem
) -> tuple[np.ndarray, tuple[list[int], list[int], list[int]]]:
    """Lay the receivers beside the pieces; returns whether each domain's pieces were all
    covered ([D] bool), and the rank, start and end of each receiver that takes something.

    ``p_end``: [P] piece ends; ``dom_end``: [D] where each domain's pieces end;
    ``quota``: [D]. A domain's first receiver starts where its pieces start; receiver
    ``q`` starting at ``u`` ends at ``min(u + T - M[q], the f-th piece end after u, the
    domain's end)`` with ``f`` its free slots (out of slots, the rest of its capacity
    is wasted), and the next one starts there. Sequential by nature; a plain loop over
    the receivers is cheaper here than any numpy detour.
    """
    ends = [*p_end.tolist(), np.iinfo(np.int64).max]
    last = len(ends) - 1
    stop, limit = dom_end.tolist(), quota.tolist()
    ranks, bases, slots, first = pb.recv_lists
    reached = [False] * len(stop)
    rank: list[int] = []
    start: list[int] = []
    end: list[int] = []
    k = 0
    for d in range(len(stop)):
        u = stop[d - 1] if d else 0
        if u == stop[d]:
            reached[d] = True
            continue
        for i in range(first[d], first[d + 1]):  # receivers by M ascending
            close = limit[d] - bases[i]  # capacity
            if close <= 0:
                break
            while ends[k] <= u:  # k: the first piece ending after u
                k += 1
            close += u
            out_of_slots = ends[min(k + slots[i] - 1, last)]
            if out_of_slots < close:
                close = out_of_slots
            if close >= stop[d]:
                close = stop[d]
                reached[d] = True
            rank.append(ranks[i])
            start.append(u)
            end.append(close)
            if reached[d]:
                break
            u = close
    return np.array(reached), (rank, start, end)


def _bounds(pb: _Problem) -> tuple[np.ndarray, np.ndarray]:
    """[D] lower bound (no plan does better) and static max (feasible with no replica)."""
    num_domains = pb.num_domains
    ranks = np.bincount(pb.rank_domain, minlength=num_domains)
    work = np.bincount(pb.rank_domain, weights=pb.base, minlength=num_domains).astype(np.int64)
    lower = -(-work // ranks)  # ceil of the domain mean
    # an expert has at most 1 + min(max_replicas, other ranks with a free slot) copies
    slots = np.bincount(pb.rank_domain, weights=pb.free > 0, minlength=num_domains).astype(int)
    others = slots[pb.rank_domain[pb.master_rank]] - (pb.free[pb.master_rank] > 0)
    copies = 1 + np.minimum(pb.max_replicas, others)  # [E]
    per_copy = -(-pb.demand // copies)
    dom_e = pb.rank_domain[pb.master_rank]
    lower = np.maximum(lower, _segment_max(per_copy, dom_e, num_domains))
    upper = _segment_max(pb.base, pb.rank_domain, num_domains)
    return np.minimum(lower, upper), upper


def _segment_max(values: np.ndarray, segment: np.ndarray, num: int) -> np.ndarray:
    out = np.zeros(num, dtype=np.int64)
    np.maximum.at(out, segment, values)
    return out


def _search(pb: _Problem, lower: np.ndarray, upper: np.ndarray) -> tuple[np.ndarray, _Fit]:
    """[D] smallest feasible quota per domain, and its fit, searching all domains together.

    Invariant: ``lo`` infeasible (``lower - 1`` at first: below the bound), ``hi``
    feasible (the static max at first). Probes gallop up from the lower bound
    (``lo + 1, lo + 2, lo + 4, ...``, never past the midpoint) until one succeeds, then
    bisect: the answer is usually a few tokens above the bound.
    """
    lo, hi = lower - 1, upper.copy()
    gap = np.ones_like(lo)
    galloping = np.ones(lo.shape, dtype=bool)
    fit = None  # the fit of the last probe, reused when it is the answer
    while (open_ := hi - lo > 1).any():
        mid = (lo + hi) // 2
        probe = np.where(galloping, np.minimum(lo + gap, mid), mid)
        probe = np.where(open_, probe, hi)
        fit = _fit(pb, probe)
        ok = fit.feasible
        hi = np.where(open_ & ok, probe, hi)
        lo = np.where(open_ & ~ok, probe, lo)
        galloping &= ~ok
        gap *= 2
        if not np.array_equal(probe, hi):
            fit = None
    return hi, fit if fit is not None else _fit(pb, hi)


def _overlaps(fit: _Fit) -> tuple[np.ndarray, ...]:
    """Which receivers each piece overlaps: first [P] and count [P] (indices into the
    receiver arrays rank, start and end [Q'], also returned)."""
    r_rank, r_start, r_end = (np.array(x, dtype=np.int64) for x in fit.receivers)
    p_start = fit.piece_end - fit.piece_amount
    first = np.searchsorted(r_end, p_start, side="right")
    count = np.searchsorted(r_start, fit.piece_end, side="left") - first
    return first, count, r_rank, r_start, r_end


def _replicas(fit: _Fit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicas of a feasible fit in line order: expert, rank and tokens, each [N]."""
    first, count, r_rank, r_start, r_end = _overlaps(fit)
    piece = np.repeat(np.arange(first.size), count)
    recv = first[piece] + np.arange(piece.size) - np.repeat(np.cumsum(count) - count, count)
    lo = np.maximum(fit.piece_end[piece] - fit.piece_amount[piece], r_start[recv])
    hi = np.minimum(fit.piece_end[piece], r_end[recv])
    return fit.piece_expert[piece], r_rank[recv], hi - lo


def _place(masters: Placement, rep_expert: np.ndarray, rep_rank: np.ndarray) -> Placement:
    """Masters plus replicas [N], each replica in the next free slot of its rank."""
    flat = masters.phy2log.ravel().copy()
    num_slots = masters.slots_per_rank
    free = np.flatnonzero(flat < 0)  # [F] free slots, rank by rank
    first = np.searchsorted(free // num_slots, rep_rank)  # [N] first free slot of the rank
    flat[free[first + _nth_of_group(rep_rank)]] = rep_expert
    return Placement(flat.reshape(masters.phy2log.shape), masters.master)


def _split(
    load: np.ndarray,
    pb: _Problem,
    rep_expert: np.ndarray,
    rep_rank: np.ndarray,
    rep_tokens: np.ndarray,
) -> np.ndarray:
    """Route [N, 4]: experts without replicas go whole to the master; see the module doc."""
    num_ranks, num_experts = load.shape
    hot = np.unique(rep_expert)  # [K] experts with replicas
    col = np.full(num_experts, -1)
    col[hot] = np.arange(hot.size)

    # copies of the hot experts: replicas in line order, then the masters
    c_exp = np.concatenate([rep_expert, hot])  # [C]
    c_rank = np.concatenate([rep_rank, pb.master_rank[hot]])
    given = np.bincount(col[rep_expert], weights=rep_tokens, minlength=hot.size).astype(np.int64)
    c_need = np.concatenate([rep_tokens, pb.demand[hot] - given])
    c_col = col[c_exp]
    left = load[:, hot].T.copy()  # [K, R] tokens of each source not yet given to a copy
    take = np.zeros((c_exp.size, num_ranks), dtype=np.int64)  # [C, R]
    own = np.minimum(c_need, left[c_col, c_rank])  # locality first
    left[c_col, c_rank] -= own
    take[np.arange(c_exp.size), c_rank] = own
    c_need -= own

    nth = _nth_of_group(rep_expert)  # [N] replica j of its expert
    by_nth = np.argsort(nth, kind="stable")
    rounds = np.split(by_nth, np.flatnonzero(np.diff(nth[by_nth])) + 1) if nth.size else []
    for c in rounds:  # replica j of each expert that has one
        cols, need = c_col[c], c_need[c]
        w = left[cols]  # [n, R]
        share, rem = np.divmod(w * need[:, None], np.maximum(w.sum(axis=1), 1)[:, None])
        short = need - share.sum(axis=1)  # tokens the floors leave out, < R
        depth = int(short.max())
        if depth:  # one more token to the `short` largest remainders (lower rank on ties)
            order = np.argsort(-rem, axis=1, kind="stable")[:, :depth]  # [n, depth]
            share[np.arange(c.size)[:, None], order] += np.arange(depth) < short[:, None]
        left[cols] = w - share
        take[c] += share
    take[rep_expert.size :] += left  # masters take the rest

    copy, src = np.nonzero(take)
    cold = np.flatnonzero(col < 0)
    cold_load = load[:, cold]  # [R, E - K]
    dense = bool(cold_load.all())
    num_cold = cold_load.size if dense else int(np.count_nonzero(cold_load))
    out = np.empty((num_cold + src.size, 4), dtype=np.int64)
    if dense:  # every (source, cold expert) pair has tokens: write [R, E - K] blocks
        block = out[:num_cold].reshape(num_ranks, cold.size, 4)
        block[:, :, 0] = np.arange(num_ranks)[:, None]
        block[:, :, 1] = cold
        block[:, :, 2] = pb.master_rank[cold]
        block[:, :, 3] = cold_load
    else:
        r, k = np.nonzero(cold_load)
        out[:num_cold, 0] = r
        out[:num_cold, 1] = cold[k]
        out[:num_cold, 2] = pb.master_rank[cold[k]]
        out[:num_cold, 3] = cold_load[r, k]
    out[num_cold:, 0] = src
    out[num_cold:, 1] = c_exp[copy]
    out[num_cold:, 2] = c_rank[copy]
    out[num_cold:, 3] = take[copy, src]
    return out


def _nth_of_group(values: np.ndarray) -> np.ndarray:
    """[N] how many earlier entries of ``values`` [N] are equal to each entry."""
    order = np.argsort(values, kind="stable")
    sorted_ = values[order]
    out = np.empty_like(order)
    out[order] = np.arange(values.size) - np.searchsorted(sorted_, sorted_)
    return out


def quota_traffic(
    load: np.ndarray, solution: QuotaSolution, topology: Topology, top_k: int
) -> TokenTraffic:
    """The cost model's view of ``solution``'s route, without its [N, 4] rows.

    The route rule of the module docstring in fractions instead of whole tokens: each
    copy keeps what it can of its own rank's tokens, then replicas take their amount in
    proportion to what every source has left (which stays proportional to what it had
    after the own-rank step), and the master the rest. Equal to
    ``traffic_from_route(solution.route, ...)`` up to the largest-remainder rounding;
    ``O(R E + D^2 E)`` instead of the route's ``O(R x copies)`` rows.
    """
    num_experts = load.shape[1]
    rep_expert, rep_rank, rep_tokens = solution.replicas
    master_rank = solution.placement.master_rank()
    demand = load.sum(axis=0)
    rep_sum = np.bincount(rep_expert, weights=rep_tokens, minlength=num_experts)
    c_exp = np.concatenate([rep_expert, np.arange(num_experts)])
    c_rank = np.concatenate([rep_rank, master_rank])
    need = np.concatenate([rep_tokens, demand - rep_sum]).astype(np.float64)
    hot = np.zeros(num_experts, bool)
    hot[rep_expert] = True
    left = load.astype(np.float64)
    # own rank first, for every copy of an expert with replicas (a cold master takes all)
    own = np.where(hot[c_exp], np.minimum(need, left[c_rank, c_exp]), 0.0)
    np.subtract.at(left, (c_rank, c_exp), own)
    rest = left.sum(axis=0)  # [E]
    weight = (need - own) / np.where(rest > 0, rest, 1.0)[c_exp]
    return weighted_traffic(load, left, (c_rank, c_exp, weight, own), topology, top_k)


def quota_balance(
    load: np.ndarray,
    masters: Placement,
    rank_domain: np.ndarray | None = None,
    max_replicas_per_expert: int | None = None,
    *,
    with_route: bool = True,
) -> QuotaSolution:
    """Balance one layer's microbatch by quota inside each domain (see the module doc).

    - ``load``: [R, E] tokens from source rank ``r`` to logical expert ``e``.
    - ``masters``: placement whose ``master`` [E] gives each expert's slot; only the
      master slots of its ``phy2log`` [R, S] are kept (other copies are dropped).
    - ``rank_domain``: [R] domain id of each rank (any ints; ``None``: one domain).
    - ``max_replicas_per_expert``: bound on replicas of one expert, ``None`` for none.
    - ``with_route``: build the route rows (``False``: an empty route, for callers that
      only need the placement and :func:`quota_traffic`).

    Raises ``ValueError`` on shapes that do not match or a bound below 1.
    """
    num_ranks, num_slots = masters.phy2log.shape
    num_experts = int(masters.master.shape[0])
    load = check_load(load, num_ranks, num_experts)
    if masters.master.min(initial=0) < 0 or masters.master.max(initial=0) >= masters.phy2log.size:
        raise ValueError("master slot index out of range")
    if not np.array_equal(masters.phy2log.ravel()[masters.master], np.arange(num_experts)):
        raise ValueError("a master slot does not hold its expert")
    if max_replicas_per_expert is not None and max_replicas_per_expert < 1:
        raise ValueError("max_replicas_per_expert must be >= 1 or None")
    if rank_domain is None:
        dom = np.zeros(num_ranks, dtype=np.int64)
    else:
        raw = np.asarray(rank_domain)
        if raw.shape != (num_ranks,):
            raise ValueError(f"rank_domain must be [{num_ranks}], got {raw.shape}")
        dom = np.unique(raw, return_inverse=True)[1].astype(np.int64)

    master = masters.master.astype(np.int64)
    phy2log = np.full((num_ranks, num_slots), -1, dtype=np.int32)
    phy2log.ravel()[master] = np.arange(num_experts)
    pb = _problem(load, master // num_slots, num_slots, dom, max_replicas_per_expert or num_ranks)
    lower, upper = _bounds(pb)
    quota, fit = _search(pb, lower, upper)
    rep_expert, rep_rank, rep_tokens = _replicas(fit)
    route = (
        _split(load, pb, rep_expert, rep_rank, rep_tokens)
        if with_route
        else np.zeros((0, 4), np.int64)
    )
    return QuotaSolution(
        placement=_place(Placement(phy2log, master), rep_expert, rep_rank),
        route=route,
        quota=quota,
        lower_bound=lower,
        replicas=(rep_expert, rep_rank, rep_tokens),
    )


@register
class QuotaPolicy(Policy):
    """Per-microbatch replicas and token split by smallest quota (see the module doc).

    ``place`` solves and remembers the solution of the context it solved; ``route``
    returns its route (built then, once; slots may be permuted in between, ranks
    are not) and ``route_traffic`` its cost-model view without rows. For any other
    placement ``route`` falls back to an even split inside domains.
    """

    name = "quota"
    Settings = QuotaSettings
    relabel_ranks: ClassVar[bool] = False

    def __init__(self, settings: PolicySettings | None = None) -> None:
        super().__init__(settings)
        self._last: tuple[PolicyContext, QuotaSolution, bool] | None = None

    def _domain(self, ctx: PolicyContext) -> np.ndarray | None:
        kind = self.settings.domain  # type: ignore[attr-defined]
        if kind == "dc":
            return ctx.topology.rank_dc
        if kind == "node":
            return ctx.topology.rank_node
        return None

    def solve(self, ctx: PolicyContext, with_route: bool = True) -> QuotaSolution:
        """The full solution for ``ctx`` (placement, route unless ``with_route`` is False,
        quota per domain)."""
        if self._last is not None and self._last[0] is ctx and (self._last[2] or not with_route):
            return self._last[1]
        t = ctx.topology
        if ctx.previous is not None:
            masters = ctx.previous.placement
        else:
            masters = static_placement(
                t.num_ranks, t.slots_per_rank, ctx.model.num_experts, t.masters_per_rank
            )
        sol = quota_balance(
            ctx.load,
            masters,
            self._domain(ctx),
            self.settings.max_replicas_per_expert,  # type: ignore[attr-defined]
            with_route=with_route,
        )
        self._last = (ctx, sol, with_route)
        return sol

    def place(self, ctx: PolicyContext) -> Placement:
        return self.solve(ctx, with_route=False).placement

    def route_traffic(self, ctx: PolicyContext, placement: Placement) -> TokenTraffic | None:
        """The cost model's view of the route (:func:`quota_traffic`) without building its
        rows, or ``None`` when ``placement`` is not the one this context solved to."""
        sol = self.solve(ctx, with_route=False)
        if not np.array_equal(sol.placement.holds(), placement.holds()):
            return None
        return quota_traffic(ctx.load, sol, ctx.topology, ctx.model.top_k)

    def route(self, ctx: PolicyContext, placement: Placement) -> np.ndarray:
        sol = self.solve(ctx)
        if placement is sol.placement or np.array_equal(sol.placement.holds(), placement.holds()):
            return sol.route
        return route_even(ctx.load, placement, self._domain(ctx))
