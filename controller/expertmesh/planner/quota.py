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
from typing import ClassVar, Literal

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


@dataclass(frozen=True, eq=False)
class _Problem:
    """Arrays of one solve that do not depend on ``T`` (``D`` domains, ``R`` ranks)."""

    demand: np.ndarray  # [E] tokens of each expert
    master_rank: np.ndarray  # [E]
    rank_domain: np.ndarray  # [R] domain id in [0, D)
    base: np.ndarray  # [R] M: demand on each rank from its masters
    free: np.ndarray  # [R] free slots
    shed_order: np.ndarray  # [E] experts by (master rank, demand desc, id)
    shed_before: np.ndarray  # [E] demand of the same rank's experts earlier in shed_order
    receivers: np.ndarray  # [Q] ranks with a free slot by (domain, M asc, rank)
    max_replicas: int
    num_domains: int


@dataclass(frozen=True, eq=False)
class _Fit:
    """The outcome of the rule for one ``T`` per domain."""

    feasible: np.ndarray  # [D] bool
    piece_expert: np.ndarray  # [P] pieces in line order
    piece_start: np.ndarray  # [P] position on the line
    piece_end: np.ndarray  # [P]
    recv_rank: np.ndarray  # [Q'] receivers with capacity > 0 in line order
    recv_start: np.ndarray  # [Q']
    recv_end: np.ndarray  # [Q']
    first_recv: np.ndarray  # [P] first receiver each piece overlaps
    num_recv: np.ndarray  # [P] receivers each piece overlaps


def _problem(
    load: np.ndarray, masters: Placement, rank_domain: np.ndarray, max_replicas: int
) -> _Problem:
    num_ranks, num_slots = masters.phy2log.shape
    demand = load.sum(axis=0)  # [E]
    master_rank = masters.master // num_slots
    base = np.bincount(master_rank, weights=demand, minlength=num_ranks).astype(np.int64)
    free = num_slots - np.bincount(master_rank, minlength=num_ranks)
    shed_order = np.lexsort((-demand, master_rank))
    d_sorted = demand[shed_order]
    cum = np.cumsum(d_sorted) - d_sorted  # [E] exclusive
    rank_first = np.searchsorted(master_rank[shed_order], master_rank[shed_order])
    shed_before = cum - cum[rank_first]
    has_free = np.flatnonzero(free > 0)
    receivers = has_free[np.lexsort((base[has_free], rank_domain[has_free]))]
    return _Problem(
        demand=demand,
        master_rank=master_rank,
        rank_domain=rank_domain,
        base=base,
        free=free,
        shed_order=shed_order,
        shed_before=shed_before,
        receivers=receivers,
        max_replicas=max_replicas,
        num_domains=int(rank_domain.max()) + 1,
    )


def _fit(pb: _Problem, quota: np.ndarray) -> _Fit:
    """Apply the rule of the module docstring with quota [D] to every domain at once."""
    num_domains = pb.num_domains
    t_rank = quota[pb.rank_domain]  # [R]
    excess = np.maximum(pb.base - t_rank, 0)
    order = pb.shed_order
    shed = np.clip(excess[pb.master_rank[order]] - pb.shed_before, 0, pb.demand[order])  # [E]
    give = shed > 0
    p_exp, p_amt = order[give], shed[give]
    p_dom = pb.rank_domain[pb.master_rank[p_exp]]
    line = np.lexsort((p_exp, -p_amt, p_dom))
    p_exp, p_amt, p_dom = p_exp[line], p_amt[line], p_dom[line]

    cap = t_rank[pb.receivers] - pb.base[pb.receivers]
    keep = cap > 0
    r_rank, r_cap = pb.receivers[keep], cap[keep]
    r_dom = pb.rank_domain[r_rank]

    need = np.bincount(p_dom, weights=p_amt, minlength=num_domains).astype(np.int64)
    have = np.bincount(r_dom, weights=r_cap, minlength=num_domains).astype(np.int64)
    span = np.maximum(need, have)
    offset = np.cumsum(span) - span  # [D] where each domain's stretch of the line starts
    p_end = np.cumsum(p_amt) + (offset - (np.cumsum(need) - need))[p_dom]
    p_start = p_end - p_amt
    r_start, r_end = _walk(p_end, r_cap, r_dom, pb.free[r_rank], offset)

    first_recv = np.searchsorted(r_end, p_start, side="right")
    num_recv = np.searchsorted(r_start, p_end, side="left") - first_recv  # [P]
    got = np.bincount(r_dom, weights=r_end - r_start, minlength=num_domains)
    bad = got < need
    bad |= np.bincount(p_dom, weights=num_recv > pb.max_replicas, minlength=num_domains) > 0
    return _Fit(
        feasible=~bad,
        piece_expert=p_exp,
        piece_start=p_start,
        piece_end=p_end,
        recv_rank=r_rank,
        recv_start=r_start,
        recv_end=r_end,
        first_recv=first_recv,
        num_recv=num_recv,
    )


def _walk(
    p_end: np.ndarray, cap: np.ndarray, dom: np.ndarray, slots: np.ndarray, offset: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Receivers' intervals [start, end) on the line, each [Q'], closing a receiver early
    when it has taken a fragment of ``slots`` pieces (the rest of its capacity is wasted).

    Receiver ``q`` starting at ``u`` ends at ``min(u + cap[q], f-th piece end after u)``
    and the next one starts there. That recursion is solved by iterating the
    wastes to a fixed point: after ``k`` rounds the first ``k`` receivers are exact,
    and in practice it settles after a few rounds (one per receiver that wastes).
    """
    p_end_inf = np.append(p_end, np.iinfo(np.int64).max)
    dom_first = np.searchsorted(dom, dom)  # [Q'] first receiver of the same domain
    waste = np.zeros_like(cap)
    for _ in range(cap.size + 1):
        end = np.cumsum(cap - waste)
        start = end - (cap - waste)
        start = start - start[dom_first] + offset[dom]
        nth_end = np.searchsorted(p_end, start, side="right") + slots - 1
        close = np.minimum(start + cap, p_end_inf[np.minimum(nth_end, p_end.size)])
        new_waste = start + cap - close
        if np.array_equal(new_waste, waste):
            return start, close
        waste = new_waste
    raise RuntimeError("unreachable: the waste iteration settles within Q + 1 rounds")


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


def _search(pb: _Problem, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """[D] smallest feasible quota per domain, bisecting all domains together.

    Invariant: ``lo`` infeasible (below the lower bound at first), ``hi`` feasible.
    """
    lo, hi = lower - 1, upper.copy()
    while True:
        open_ = hi - lo > 1
        if not open_.any():
            return hi
        mid = np.where(open_, (lo + hi) // 2, hi)
        ok = _fit(pb, mid).feasible
        hi = np.where(open_ & ok, mid, hi)
        lo = np.where(open_ & ~ok, mid, lo)


def _replicas(pb: _Problem, fit: _Fit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicas of a feasible fit in line order: expert, rank and tokens, each [N]."""
    piece = np.repeat(np.arange(fit.piece_expert.size), fit.num_recv)
    step = np.arange(piece.size) - np.repeat(np.cumsum(fit.num_recv) - fit.num_recv, fit.num_recv)
    recv = fit.first_recv[piece] + step
    lo = np.maximum(fit.piece_start[piece], fit.recv_start[recv])
    hi = np.minimum(fit.piece_end[piece], fit.recv_end[recv])
    return fit.piece_expert[piece], fit.recv_rank[recv], hi - lo


def _place(masters: Placement, rep_expert: np.ndarray, rep_rank: np.ndarray) -> Placement:
    """Masters plus replicas, each replica in the next free slot of its rank."""
    phy2log = masters.phy2log.copy()
    free_slots = np.argsort(phy2log >= 0, axis=1, kind="stable")  # [R, S] free slots first
    order = np.argsort(rep_rank, kind="stable")
    ranks = rep_rank[order]
    nth = np.arange(ranks.size) - np.searchsorted(ranks, ranks)
    phy2log[ranks, free_slots[ranks, nth]] = rep_expert[order]
    return Placement(phy2log=phy2log, master=masters.master.copy())


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
    cold = col < 0

    src, exp = np.nonzero(load[:, cold])
    exp = np.flatnonzero(cold)[exp]
    rows = [np.stack([src, exp, pb.master_rank[exp], load[src, exp]], axis=1)]

    # copies of the hot experts: replicas in line order, then the masters
    c_exp = np.concatenate([rep_expert, hot])
    c_rank = np.concatenate([rep_rank, pb.master_rank[hot]])
    rep_sum = np.bincount(rep_expert, weights=rep_tokens, minlength=num_experts).astype(np.int64)
    c_need = np.concatenate([rep_tokens, pb.demand[hot] - rep_sum[hot]])
    c_col = col[c_exp]
    left = load[:, hot].copy()  # [R, K] tokens not yet given to a copy
    take = np.zeros((num_ranks, c_exp.size), dtype=np.int64)  # [R, C]
    copy_id = np.arange(c_exp.size)
    own = np.minimum(c_need, left[c_rank, c_col])  # locality first
    left[c_rank, c_col] -= own
    take[c_rank, copy_id] = own
    c_need = c_need - own

    nth = _nth_of_group(rep_expert)
    for j in range(int(nth.max()) + 1 if nth.size else 0):
        c = np.flatnonzero(nth == j)
        cols = c_col[c]
        w = left[:, cols]  # [R, n]
        total = np.maximum(w.sum(axis=0), 1)
        num = w * c_need[c]
        share, rem = num // total, num % total
        short = c_need[c] - share.sum(axis=0)
        order = np.argsort(-rem, axis=0, kind="stable")
        pos = np.empty_like(order)
        np.put_along_axis(pos, order, np.arange(num_ranks)[:, None], axis=0)
        share += pos < short
        left[:, cols] = w - share
        take[:, c] += share
    take[:, rep_expert.size :] += left  # masters take the rest

    s, c = np.nonzero(take)
    rows.append(np.stack([s, c_exp[c], c_rank[c], take[s, c]], axis=1))
    return np.concatenate(rows).astype(np.int64, copy=False)


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

    phy2log = np.full((num_ranks, num_slots), -1, dtype=np.int32)
    phy2log.ravel()[masters.master] = np.arange(num_experts)
    base = Placement(phy2log=phy2log, master=masters.master.astype(np.int64))
    pb = _problem(load, base, dom, max_replicas_per_expert or num_ranks)
    lower, upper = _bounds(pb)
    quota = _search(pb, lower, upper)
    rep_expert, rep_rank, rep_tokens = _replicas(pb, _fit(pb, quota))
    route = (
        _split(load, pb, rep_expert, rep_rank, rep_tokens)
        if with_route
        else np.zeros((0, 4), np.int64)
    )
    return QuotaSolution(
        placement=_place(base, rep_expert, rep_rank),
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
        if np.array_equal(sol.placement.holds(), placement.holds()):
            return sol.route
        return route_even(ctx.load, placement, self._domain(ctx))
