"""``fastermoe``: FasterMoE's dynamic shadowing, the classic baseline for cross-DC EP.

FasterMoE (He et al., PPoPP 2022) keeps expert parallelism's placement and,
every iteration after the gate has run, *shadows* the hottest experts: their
weights are broadcast to every rank, each rank computes its own tokens for
them, and their gradients are reduced back to the owner. It shadows the
hottest experts one by one while its performance model says the iteration
gets faster. Here that model is :func:`~expertmesh.planner.costmodel.modeled_step`,
the same one ``hybrid`` and the simulator use, so the comparison is fair.

Masters never move (static EP's placement). A shadow needs a free slot on every
rank, so the number of shadows is bounded by the fewest free slots of any rank.
Before a candidate is costed, :func:`shadow_floor` bounds its modeled time from
below; a candidate whose floor already reaches the best time so far ends the
search, as its full costing would have (the same plans, for a fraction of the work).
"""

from __future__ import annotations

import functools
import weakref
from typing import ClassVar, cast

import numpy as np
from pydantic import Field

from expertmesh.planner.costmodel import (
    CostSettings,
    TransferEncoding,
    crossings,
    modeled_step,
    pair_links,
    step_cost,
)
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import Placement
from expertmesh.planner.policy import Policy, PolicyContext, PolicySettings, register
from expertmesh.planner.routing import route_even
from expertmesh.planner.static import static_placement
from expertmesh.planner.topology import Topology
from expertmesh.planner.traffic import TokenTraffic, even_traffic
from expertmesh.planner.trafficbase import _EXACT, _groups

__all__ = ["FasterMoEPolicy", "master_traffic", "shadow", "shadow_floor", "shadow_traffic"]


def shadow(masters: Placement, experts: np.ndarray) -> Placement:
    """``masters`` with each of ``experts`` [j] copied to every rank but its master's.

    ``masters``: a placement whose slots hold masters only. Rank ``r`` puts the ``i``-th
    shadow into its ``i``-th free slot; ``ValueError`` if some rank lacks the slots.
    """
    phy2log = masters.phy2log.copy()
    num_ranks, slots = phy2log.shape
    j = int(experts.size)
    if j == 0:
        return masters
    occupied = phy2log >= 0
    free_count = slots - occupied.sum(axis=1)
    if free_count.min() < j:
        raise ValueError(f"{j} shadows need {j} free slots on every rank")
    free_slots = np.argsort(occupied, axis=1, kind="stable")[:, :j]  # [R, j] free first
    value = np.broadcast_to(experts.astype(np.int32), (num_ranks, j)).copy()
    own = masters.master_rank()[experts][None, :] == np.arange(num_ranks)[:, None]
    value[own] = -1  # the master's rank already holds it
    rows = np.repeat(np.arange(num_ranks), j)
    phy2log[rows, free_slots.ravel()] = value.ravel()
    return Placement(phy2log=phy2log, master=masters.master.copy())


def master_traffic(
    load: np.ndarray, masters: Placement, topology: Topology, top_k: int
) -> TokenTraffic:
    """``even_traffic(load, masters, topology, top_k, domain="rank")`` of a placement that
    holds one copy of each expert (its master): every assignment goes to the master.

    The same floats: each count is a sum of whole tokens of ``load`` [R, E] (non-negative,
    as every load), exact in float64 while the total is below 2**53, so any order of
    summation gives it (above, ``even_traffic`` is called). First ``tok`` [R, R] in
    int64, each source rank's tokens to the masters of each rank; then, in float64, its
    sums by DC with one small product each (``tok @ onehot``: rows by DC of the master,
    ``onehot.T @ tok``: by DC of the source, and the DC pairs), and those by node alike.
    """
    num_ranks, num_experts = load.shape
    if masters.num_ranks != num_ranks or num_ranks != topology.num_ranks:
        raise ValueError("load, masters and topology disagree on the number of ranks")
    if np.count_nonzero(masters.phy2log >= 0) != num_experts:
        raise ValueError("master_traffic needs a placement of masters only")
    load = load.astype(np.int64, copy=False)
    tok = _by_master_rank(load, masters.master_rank())  # [R src, R master]
    if int(tok.sum()) >= _EXACT:  # the total of load, wrapped alike
        return even_traffic(load, masters, topology, top_k, domain="rank")
    (node_of, node_hot, node_hot_t), (dc_of, dc_hot, dc_hot_t) = _groups(topology)
    tokf = tok.astype(np.float64)
    rows = np.arange(num_ranks)
    to_dc = tokf @ dc_hot  # [R, D] each source's tokens to the masters of each DC
    from_dc = dc_hot_t @ tokf  # [D, R] each DC's tokens to each master rank
    pair = dc_hot_t @ to_dc  # [D, D] src -> dst
    # [R] each, for every source (sent) and master rank (came): its own rank's, node's,
    # DC's and all tokens; the shells are the differences
    levels = np.empty((2, num_ranks, 4))
    sent, came = levels[0], levels[1]
    sent[:, 0] = came[:, 0] = tokf.diagonal()
    sent[:, 2] = to_dc[rows, dc_of]
    sent[:, 3] = to_dc.sum(axis=1)
    came[:, 2] = from_dc[dc_of, rows]
    came[:, 3] = from_dc.sum(axis=0)
    if node_hot is dc_hot:  # a node per DC
        sent[:, 1] = sent[:, 2]
        came[:, 1] = came[:, 2]
    else:
        sent[:, 1] = (tokf @ node_hot)[rows, node_of]
        came[:, 1] = (node_hot_t @ tokf)[node_of, rows]
    shells = np.empty((2, num_ranks, 3))
    np.subtract(levels[:, :, 1:], levels[:, :, :-1], out=shells)
    num_dcs = pair.shape[0]
    dc_tokens = pair.sum(axis=1) / top_k  # [D] tokens (not assignments) from each DC
    dense = pair.reshape(-1)
    dense[:: num_dcs + 1] = 0.0  # within a DC
    at = np.flatnonzero(dense > 0)
    return TokenTraffic(
        came[:, 3].copy(), shells[0], shells[1], at // num_dcs, at % num_dcs, dense[at],
        dc_tokens,
    )  # fmt: skip


def _by_master_rank(load: np.ndarray, mrank: np.ndarray) -> np.ndarray:
    """[R, R] int64: ``load`` [R, E] summed over the experts of each master rank
    (``mrank`` [E]); static EP's ``E / R`` consecutive experts a rank by adding
    neighbours: pairs while the count is even (two strided views each), then the rest."""
    num_ranks, num_experts = load.shape
    per = num_experts // num_ranks
    if (
        0 < per <= 8
        and per * num_ranks == num_experts
        and np.array_equal(mrank, _blocks(num_experts, per))
    ):
        out = load
        while per % 2 == 0:
            pairs = out.reshape(num_ranks, -1, 2)
            out, per = pairs[:, :, 0] + pairs[:, :, 1], per // 2
        if per > 1:  # the slices of a [R, R, per] view added
            view = out.reshape(num_ranks, num_ranks, per)
            out = view[:, :, 0].copy()
            for i in range(1, per):
                out += view[:, :, i]
        return out.reshape(num_ranks, num_ranks)
    by_master = np.argsort(mrank, kind="stable")  # [E] experts by master rank
    bounds = np.searchsorted(mrank[by_master], np.arange(num_ranks + 1))  # [R + 1]
    cum = np.zeros((num_ranks, num_experts + 1), np.int64)  # [R, E + 1]
    np.cumsum(load[:, by_master], axis=1, out=cum[:, 1:])
    return cum[:, bounds[1:]] - cum[:, bounds[:-1]]


@functools.lru_cache(maxsize=8)
def _blocks(num_experts: int, per: int) -> np.ndarray:
    """[E] static EP's master rank of each expert: ``per`` consecutive experts a rank."""
    out = np.arange(num_experts) // per
    out.flags.writeable = False
    return out


#: per topology: for its ranks' nodes and DCs (sorted, contiguous), the run of each rank
def shadow_traffic(
    traffic: TokenTraffic, load: np.ndarray, masters: Placement, topology: Topology, expert: int
) -> TokenTraffic:
    """``traffic`` of ``load`` [R, E] routed to its experts' only copies (or the source's
    own shadow), updated for one more shadowed ``expert``: every rank now computes its own
    tokens for it. Equal to ``even_traffic(load, shadow(...), domain="rank")``, in ``O(R +
    D^2)`` instead of ``O(R E + D^2 E)``."""
    col = load[:, expert].astype(np.float64)  # [R]
    m = int(masters.master_rank()[expert])
    ranks = np.arange(topology.num_ranks)
    shell = np.asarray(topology.link_class(ranks, np.full_like(ranks, m)))  # [R]
    rank_tokens = traffic.rank_tokens + col
    rank_tokens[m] -= col.sum()
    rank_out = traffic.rank_out.copy()
    rank_in = traffic.rank_in.copy()
    for j in (1, 2, 3):
        sel = shell == j
        rank_out[sel, j - 1] -= col[sel]
        rank_in[m, j - 1] -= col[sel].sum()
    num_dcs = topology.num_dcs
    dense = np.zeros((num_dcs, num_dcs))
    dense[traffic.pair_src, traffic.pair_dst] = traffic.pair_tokens
    per_dc = np.bincount(topology.rank_dc, weights=col, minlength=num_dcs)
    dense[:, topology.rank_dc[m]] -= per_dc
    np.fill_diagonal(dense, 0.0)
    src, dst = np.nonzero(dense > 1e-9)
    return TokenTraffic(
        rank_tokens, np.maximum(rank_out, 0.0), np.maximum(rank_in, 0.0),
        src.astype(np.int64), dst.astype(np.int64), dense[src, dst], traffic.dc_tokens,
    )  # fmt: skip


def shadow_floor(
    traffic: TokenTraffic,
    load: np.ndarray,
    masters: Placement,
    expert: int,
    *,
    topology: Topology,
    model: ModelSpec,
    settings: CostSettings,
    cross: np.ndarray | None = None,
) -> float:
    """A lower bound on ``modeled_step(...).seconds`` of a shadowing placement with one
    more shadow, ``expert`` (a copy on every rank but its master's), from ``traffic``, the
    token traffic before it (of ``load`` [R, E] on ``masters`` plus the earlier shadows).

    What the shadow leaves alone bounds it: the DC pairs into other DCs than the
    master's carry the same tokens, so the busiest of them bounds dispatch and combine;
    compute is exact (``rank_tokens`` moves ``load[:, expert]`` from the master to each
    source); and when training with one microbatch per update the backward tail carries,
    from every other DC to the master's, at least the shadow's gradient on top of that
    pair's combine bytes. With ``pipeline_chunks == 1`` the chain is ``2 dispatch + 3
    compute_fwd + combine + tail`` (forward only: ``dispatch + compute_fwd + combine``)
    and the step at least that; with more chunks no bound is derived (0.0). ``cross``:
    ``crossings(traffic, model.top_k, settings.hierarchical)`` when the caller has it.
    """
    if settings.pipeline_chunks != 1:
        return 0.0
    m = int(masters.master[expert]) // masters.slots_per_rank
    mdc = int(topology.rank_dc[m])
    msg = settings.message_seconds
    lat, bw, symmetric = _dc_links(topology)
    src, dst = traffic.pair_src, traffic.pair_dst
    if cross is None:
        cross = crossings(traffic, model.top_k, settings.hierarchical)
    nbytes = cross * float(model.token_bytes)
    kept = dst != mdc  # [P] pairs whose tokens the shadow does not touch
    # the busiest link among the kept DC pairs src -> dst (0: none)
    dispatch = msg + float((lat[src, dst] + nbytes / bw[src, dst]).max(where=kept, initial=0.0))
    # the combine runs each pair backwards (links alike both ways: the dispatch's time)
    combine = dispatch
    if not symmetric:
        back_link = lat[dst, src] + nbytes / bw[dst, src]
        combine = msg + float(back_link.max(where=kept, initial=0.0))
    col = load[:, expert].astype(np.float64)
    rank_tokens = traffic.rank_tokens + col
    rank_tokens[m] -= col.sum()
    fwd = float(rank_tokens.max()) * 2.0 * model.expert_params / settings.flops_per_second
    if not model.training:
        return dispatch + fwd + combine
    tail = combine
    if settings.microbatches_per_update == 1:  # gradients on the tail, not in the background
        back = np.zeros(topology.num_dcs)  # combine bytes on y -> mdc: the pairs mdc -> y
        out = src == mdc
        back[dst[out]] = nbytes[out]
        # each other DC y -> mdc with its gradient on top
        times = lat[:, mdc] + (back + _ENCODING.gradient_bytes(model)) / bw[:, mdc]
        times[mdc] = -np.inf
        tail = max(tail, msg + float(times.max(initial=0.0)))
    return 2.0 * dispatch + 3.0 * fwd + combine + tail


#: the default encoding (frozen): a replica gradient's bytes
_ENCODING = TransferEncoding()

#: per topology: [D, D] DC link latency (s) and bandwidth (bytes/s), and whether both are
#: symmetric
_LINKS: weakref.WeakKeyDictionary[Topology, tuple[np.ndarray, np.ndarray, bool]] = (
    weakref.WeakKeyDictionary()
)


def _dc_links(topology: Topology) -> tuple[np.ndarray, np.ndarray, bool]:
    """[D, D] latency and bytes per second of every DC pair (:func:`pair_links`) and
    whether the links are alike both ways (once per topology)."""
    got = _LINKS.get(topology)
    if got is None:
        bw, lat = pair_links(topology)
        got = _LINKS[topology] = (lat, bw, bool((lat == lat.T).all() and (bw == bw.T).all()))
    return got


class FasterMoESettings(PolicySettings):
    """Settings of :class:`FasterMoEPolicy`."""

    max_shadows: int | None = Field(
        default=None,
        ge=0,
        le=4096,
        description="most experts shadowed at once (None: as many as every rank has free slots)",
    )
    cost: CostSettings = Field(
        default_factory=CostSettings, description="the cost model the shadowing rule minimizes"
    )


@register
class FasterMoEPolicy(Policy):
    """Shadow the hottest experts on every rank while the modeled step time keeps falling."""

    name = "fastermoe"
    Settings = FasterMoESettings
    relabel_ranks = False
    #: the even split its route uses: own rank's copy, else the only copy (the master)
    even_split: ClassVar[tuple[str, str]] = ("rank", "spread")
    #: shadows are chosen on each microbatch's load and broadcast before they compute
    microbatch_copies: ClassVar[str] = "all"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        super().__init__(settings)
        #: the last context, the placement place() chose for it and that placement's traffic
        self._last: tuple[PolicyContext, Placement, TokenTraffic] | None = None
        #: the masters of the last step: (what they were made from, them, most shadows)
        self._masters: tuple[tuple[object, ...], Placement, int] | None = None

    @property
    def cfg(self) -> FasterMoESettings:
        return cast(FasterMoESettings, self.settings)

    def masters(self, ctx: PolicyContext) -> Placement:
        """The master-only placement shadows are added to (static EP's, kept forever)."""
        if ctx.previous is None:
            t = ctx.topology
            return static_placement(
                t.num_ranks, t.slots_per_rank, ctx.model.num_experts, t.masters_per_rank
            )
        prev = ctx.previous.placement
        phy2log = np.full_like(prev.phy2log, -1)
        flat = phy2log.reshape(-1)
        flat[prev.master] = np.arange(prev.master.size)
        return Placement(phy2log=phy2log, master=prev.master.copy())

    def _base(self, ctx: PolicyContext) -> tuple[Placement, int]:
        """:meth:`masters` and the most shadows it has room for (``max_shadows`` too), made
        again only when the previous plan's masters (or shape) changed: a fresh copy each
        step cost more than the rest of a step that shadows nothing. A previous plan of the
        masters alone is returned itself (equal arrays), so the engine needs no alignment."""
        t, prev = ctx.topology, None if ctx.previous is None else ctx.previous.placement
        key: tuple[object, ...] = (
            (t.num_ranks, t.slots_per_rank, ctx.model.num_experts, t.masters_per_rank)
            if prev is None
            else (prev.phy2log.shape, prev.master.dtype.str, prev.master.tobytes())
        )
        if self._masters is None or self._masters[0] != key:
            base = self.masters(ctx)
            free = base.slots_per_rank - (base.phy2log >= 0).sum(axis=1)
            limit = int(free.min())
            if self.cfg.max_shadows is not None:
                limit = min(limit, self.cfg.max_shadows)
            self._masters = (key, base, limit)
        key, base, limit = self._masters
        if prev is not None and prev is not base and np.array_equal(prev.phy2log, base.phy2log):
            self._masters = (key, prev, limit)
            return prev, limit
        return base, limit

    def place(self, ctx: PolicyContext) -> Placement:
        base, limit = self._base(ctx)
        demand = ctx.load.sum(axis=0)
        order = None  # experts by demand descending (lower id on ties), sorted when needed
        topo, model, cs = ctx.topology, ctx.model, self.cfg.cost
        traffic = master_traffic(ctx.load, base, topo, model.top_k)
        best, best_traffic = base, traffic
        # each traffic's DC pair crossings, for its step cost and the next shadow's floor
        x = crossings(traffic, model.top_k, cs.hierarchical)
        best_cost = step_cost(topo, model, traffic, None, cs, cross=x).seconds
        for j in range(1, limit + 1):
            if j == 1:  # argsort's first: the first of the hottest
                e = int(np.argmax(demand))
            else:
                if order is None:
                    order = np.argsort(-demand, kind="stable")
                e = int(order[j - 1])
            floor = shadow_floor(
                traffic, ctx.load, base, e, topology=topo, model=model, settings=cs, cross=x
            )
            if floor > best_cost * (1.0 + 1e-9):  # the margin covers rounding: c >= best_cost
                break
            cand = shadow(base, np.array([e]) if order is None else order[:j])
            traffic = shadow_traffic(traffic, ctx.load, base, topo, e)
            x = crossings(traffic, model.top_k, cs.hierarchical)
            c = modeled_step(topo, model, traffic, cand, settings=cs, cross=x).seconds
            if c >= best_cost:
                break
            best, best_cost, best_traffic = cand, c, traffic
        self._last = (ctx, best, best_traffic)
        return best

    def route_traffic(self, ctx: PolicyContext, placement: Placement) -> TokenTraffic | None:
        """The traffic :meth:`place` costed for its choice for ``ctx`` when ``placement``
        holds the same experts on every rank (slots may be permuted), else ``None``: the
        even split's (whole-token counts, below 2**53 in all the floats of ``even_traffic``)."""
        if self._last is None or self._last[0] is not ctx:
            return None
        _, chosen, traffic = self._last
        if placement is not chosen and not np.array_equal(
            np.sort(placement.phy2log, axis=1), np.sort(chosen.phy2log, axis=1)
        ):
            return None
        return traffic

    def route(self, ctx: PolicyContext, placement: Placement) -> np.ndarray:
        return route_even(ctx.load, placement, np.arange(ctx.topology.num_ranks))
