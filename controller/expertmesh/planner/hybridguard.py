"""The guard of ``hybrid``'s slow loop (:mod:`expertmesh.planner.hybrid`, step 4) without
scoring what cannot win: a lower bound of a candidate's modeled step from its holder sets
alone, and the candidates scored in the order of that bound, each distinct one once; a
candidate is laid out on ranks (the domain-based partition) only when it is scored."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

from expertmesh.planner.costmodel import (
    CostSettings,
    crossings,
    expected_crossings,
)
from expertmesh.planner.domainquota import DomainSolution, dc_holds, holder_routing, sum_rows
from expertmesh.planner.hybridpairs import HybridInputs
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import Placement
from expertmesh.planner.topology import Topology
from expertmesh.planner.traffic import TokenTraffic

__all__ = ["GuardCosts", "chain_floor", "guard_bound", "plain_floor"]


class GuardCosts:
    """:func:`~expertmesh.planner.hybrid.guard_cost` of one solve's candidates, each distinct
    placement (``phy2log`` and ``master``) scored once (the guard's candidates often
    coincide: a fill share that finds no free slot, a pair choice equal to plain EP, the
    running plan), and :meth:`scores`: candidates given by their holder sets, each laid out
    (``build``) and scored only where its :func:`guard_bound` says it can win.

    ``build``: the placement of holder sets [D, E] (masters included) with every master
    in DC ``master_dc`` [E]; a pure function of its argument."""

    def __init__(
        self,
        inp: HybridInputs,
        cost: Callable[[HybridInputs, Placement], float],
        build: Callable[[np.ndarray], Placement],
        master_dc: np.ndarray,
    ) -> None:
        self.inp, self.cost, self.build, self.master_dc = inp, cost, build, master_dc
        self.seen: dict[tuple[object, ...], float] = {}
        self.built: dict[bytes, Placement] = {}
        self.bounds: dict[bytes, float] = {}

    def __call__(self, cand: Placement) -> float:
        key = self._key(cand)
        if key not in self.seen:
            self.seen[key] = self.cost(self.inp, cand)
        return self.seen[key]

    @staticmethod
    def _key(cand: Placement) -> tuple[object, ...]:
        return (cand.phy2log.shape, cand.phy2log.dtype.str, cand.phy2log.tobytes(),
                cand.master.tobytes())  # fmt: skip

    def placement(self, holds: np.ndarray) -> Placement:
        """The candidate of holder sets ``holds`` [D, E] laid out (once per holder sets)."""
        key = holds.tobytes()
        if key not in self.built:
            self.built[key] = self.build(holds)
        return self.built[key]

    def _scored(self, holds: np.ndarray) -> bool:
        got = self.built.get(holds.tobytes())
        return got is not None and self._key(got) in self.seen

    def bound(self, holds: np.ndarray) -> float:
        """:func:`guard_bound` of holder sets ``holds`` [D, E] (once per holder sets)."""
        key = holds.tobytes()
        if key not in self.bounds:
            self.bounds[key] = guard_bound(self.inp, holds, self.master_dc)
        return self.bounds[key]

    def above(self, cands: Iterable[np.ndarray], bar: float) -> bool:
        """Whether every candidate's (holder sets [D, E]) lower bound is above ``bar``: none
        of them can cost ``bar`` or less (stops at the first that can)."""
        return all(self.bound(h) > bar for h in cands)

    def scores(self, cands: list[np.ndarray], ceiling: float = np.inf) -> list[float]:
        """The cost of each candidate (holder sets [D, E], masters included), or ``inf``
        for one whose lower bound is above ``ceiling`` or above the cost of one scored
        before it (lowest bound first): such a candidate is never the list's fastest, nor
        does it tie with it, so ``argmin`` of the result is ``argmin`` of the exact costs
        wherever that is at most ``ceiling``. Only the candidates scored are laid out."""
        bounds = [-np.inf if self._scored(h) else self.bound(h) for h in cands]
        out = [np.inf] * len(cands)
        best = ceiling
        for i in np.argsort(bounds, kind="stable").tolist():
            if bounds[i] > best:
                continue
            out[i] = self(self.placement(cands[i]))
            best = min(best, out[i])
        return out


def guard_bound(inp: HybridInputs, holds: np.ndarray, master_dc: np.ndarray) -> float:
    """A lower bound of :func:`~expertmesh.planner.hybrid.guard_cost` for ``inside="quota"``
    (``-inf`` otherwise) of the candidate holding ``holds`` [D, E] (one copy of each held
    ``(d, e)``, masters included) with masters in DC ``master_dc`` [E], from what its
    holder sets fix before quota runs and before its copies are laid out on ranks: the
    tokens that cross between DCs (every DC pair's crossings, whatever the balance inside
    DCs, :func:`_dc_pairs`), the mean compute, and the expert bytes that cross.
    :func:`chain_floor` at the mean rank's tokens (with the replica gradients on the
    backward tail where they return there: one update per microbatch), or the WAN links'
    resource bound: tokens of both phases (both passes when training), one sync per
    (expert, remote DC) (in-DC replicas add none) and the copies from ``previous`` into a
    DC that held none of that expert (whatever ranks they land on, each crosses from its
    master's DC in ``previous``); no port and no late copy (each only adds). A few array
    passes instead of a :func:`~expertmesh.planner.hybrid.compose`."""
    if inp.cfg.inside != "quota":
        return -np.inf
    topology, model, cost = inp.topology, inp.model, inp.cfg.cost
    fixed = _bound_inputs(inp)
    num_dcs = topology.num_dcs
    pair = _dc_pairs(fixed, holds, topology.rank_dc)
    if pair is None:
        return -np.inf  # an expert with load and no copy: compose says why
    a, b = np.nonzero(pair > 0)
    k = model.top_k
    if cost.hierarchical and k > 1:
        x = expected_crossings(fixed.dc_tokens[a], pair[a, b], k)
    else:
        x = pair[a, b]
    nbytes = x * float(model.token_bytes)
    crossing = np.zeros((num_dcs, num_dcs))
    crossing[a, b] = nbytes
    link = (2.0 if model.training else 1.0) * (crossing + crossing.T)
    tail = None
    if model.training:  # replica sync: weights out of the master's DC, gradients back
        mdc = master_dc
        d, ex = np.nonzero(holds & (np.arange(num_dcs)[:, None] != mdc[None, :]))
        per = float(cost.microbatches_per_update)
        enc = inp.cfg.encoding
        grads = np.zeros((num_dcs, num_dcs))
        np.add.at(grads, (d, mdc[ex]), enc.gradient_bytes(model) / per)
        np.add.at(link, (mdc[ex], d), enc.refresh_bytes(model) / per)
        link += grads
        if cost.microbatches_per_update == 1:  # the gradients return on the backward tail
            tail = grads
    chain = chain_floor((a, b, nbytes), fixed.mean, topology, model, cost, tail=tail)
    if fixed.previous is not None:  # what copy_streams charges across DCs, at least
        held, src = fixed.previous
        d, ex = np.nonzero(holds & ~held)
        cross = d != src[ex]
        d, ex = d[cross], ex[cross]
        enc, share = inp.cfg.encoding, 1.0 / inp.cfg.period
        nbytes = np.where(
            d == master_dc[ex], enc.copy_bytes(model, True), enc.copy_bytes(model, False)
        )
        np.add.at(link, (src[ex], d), nbytes * share)
    bw = topology.dc_gbps * 1e9 / 8.0
    resource = float(np.max(np.where(link > 0, link / bw, 0.0), initial=0.0))
    return max(chain, resource) * (1.0 - 1e-9)


class _Fixed(NamedTuple):
    """What :func:`guard_bound` takes from one solve's inputs alone (every candidate of
    the solve shares it): ``load`` [R, E] and ``local`` [D, E] (its sums by DC) as
    integers in floats, ``used`` [E] experts with load, ``dc_tokens`` [D], ``mean`` tokens
    per rank, ``previous``: what the running plan holds [D, E] and its masters' DCs [E]
    (``None`` without one), and the ranks' ``sizes`` [D] and ``place`` [R] in their DC
    (``None`` unless each DC's ranks are consecutive)."""

    load: np.ndarray
    local: np.ndarray
    used: np.ndarray
    dc_tokens: np.ndarray
    mean: float
    previous: tuple[np.ndarray, np.ndarray] | None
    sizes: np.ndarray | None
    place: np.ndarray | None


@functools.lru_cache(maxsize=1)
def _bound_inputs(inp: HybridInputs) -> _Fixed:
    """:class:`_Fixed` of ``inp`` (one per solve: its candidates are bounded one by one)."""
    topology, load = inp.topology, inp.load
    rank_dc, num_dcs = topology.rank_dc, topology.num_dcs
    dc_tokens = np.bincount(rank_dc, weights=load.sum(axis=1), minlength=num_dcs)
    previous = sizes = place = None
    if inp.previous is not None:
        previous = (dc_holds(inp.previous, topology), rank_dc[inp.previous.master_rank()])
    if not (rank_dc.size and np.any(rank_dc[1:] < rank_dc[:-1])):  # as _ordinal counts
        sizes = np.bincount(rank_dc, minlength=num_dcs)
        place = np.arange(rank_dc.size) - np.searchsorted(rank_dc, rank_dc)
    return _Fixed(
        load=load.astype(np.float64),
        local=sum_rows(load, rank_dc, num_dcs),
        used=np.asarray(load.any(axis=0)),
        dc_tokens=dc_tokens / inp.model.top_k,
        mean=float(load.sum()) / topology.num_ranks,
        previous=previous,
        sizes=sizes,
        place=place,
    )


def _dc_pairs(fixed: _Fixed, holds: np.ndarray, rank_dc: np.ndarray) -> np.ndarray | None:
    """[D, D] assignments from DC ``a`` to copies in another DC ``b`` (0 on the diagonal)
    under holder sets ``holds`` [D, E], as the route of
    :func:`~expertmesh.planner.domainquota.remote_holder` sends them, or ``None`` when an
    expert with load has no copy. An expert with one holder takes every other DC's tokens
    (from ``local``, no [R, E] pass); only the columns of experts held more than once go
    rank by rank. Sums of integers: the same floats as summing the route's cells."""
    num_dcs = holds.shape[0]
    h = holds.sum(axis=0)
    if (fixed.used & (h == 0)).any():
        return None
    if fixed.place is None or fixed.sizes is None:  # DCs' ranks not consecutive
        pair = np.bincount(
            holder_routing(holds, rank_dc).pair_key,
            weights=fixed.load.ravel(),
            minlength=num_dcs**2,
        ).reshape(num_dcs, num_dcs)
        np.fill_diagonal(pair, 0.0)
        return pair
    lack = ~holds
    one = np.flatnonzero(h == 1)
    d, c = np.nonzero(lack[:, one])
    key = d * num_dcs + np.argmax(holds[:, one], axis=0)[c]
    pair = np.bincount(key, weights=fixed.local[d, one[c]], minlength=num_dcs**2)
    pair = pair.astype(np.float64, copy=False)  # empty weights count in int64
    many = np.flatnonzero(h > 1)
    if many.size:  # remote_holder's rotation, on these columns only
        held = holds[:, many]
        lacking = np.where(held, 0, fixed.sizes[:, None])
        before = np.cumsum(lacking, axis=0) - lacking  # [D, M] ranks without e before d
        j = (before[rank_dc] + fixed.place[:, None] + many[None, :]) % h[many]  # [R, M]
        v_e, v_d = np.nonzero(held.T)  # each expert's holders, in DC order
        dst = v_d[np.searchsorted(v_e, np.arange(many.size)) + j]
        away = lack[:, many][rank_dc]
        key = (rank_dc[:, None] * num_dcs + dst)[away]
        pair += np.bincount(key, weights=fixed.load[:, many][away], minlength=num_dcs**2)
    return pair.reshape(num_dcs, num_dcs)


def chain_floor(
    pairs: tuple[np.ndarray, np.ndarray, np.ndarray],
    tokens: float,
    topology: Topology,
    model: ModelSpec,
    cost: CostSettings,
    *,
    tail: np.ndarray | None = None,
) -> float:
    """A floor of the chain of :func:`~expertmesh.planner.costmodel.step_cost`: dispatch and
    combine at their busiest WAN link plus the message overhead, compute at ``tokens``
    on the busiest rank, no port; times ``1 - 1e-9`` for rounding. ``pairs``: ``(src DC,
    dst DC, bytes)`` [P] each, the token bytes that cross each ordered DC pair in one phase
    (one row per pair). ``tail`` [D, D]: replica gradient bytes on each link in the
    backward tail (dispatch backward: combine's links plus these), ``None``: none counted.
    Training's chain is ``P1 + pipe(D, 2F, C) - C + T`` (``T`` the tail, at least ``C``),
    and ``pipe(D, 2F, C) - C`` is at least ``(D + 2F) / chunks``."""
    a, b, nbytes = pairs
    keep = nbytes > 0
    a, b, nbytes = a[keep], b[keep], nbytes[keep]
    bw = topology.dc_gbps * 1e9 / 8.0
    lat = topology.dc_latency_ms / 1e3
    chunks = cost.pipeline_chunks
    msg = cost.message_seconds * chunks
    disp = float(np.max(lat[a, b] + nbytes / bw[a, b], initial=0.0)) + msg
    comb = float(np.max(lat[b, a] + nbytes / bw[b, a], initial=0.0)) + msg
    fwd = tokens * 2.0 * model.expert_params / cost.flops_per_second
    chain = _pipe_floor((disp, fwd, comb), chunks)
    if model.training:
        back = _pipe_floor((disp, 2.0 * fwd, comb), chunks)
        if tail is not None:
            link = tail.copy()
            np.add.at(link, (b, a), nbytes)  # combine runs each pair's reverse link
            busy = np.max(lat + link / bw, where=link > 0, initial=0.0)
            back = max(back, (disp + 2.0 * fwd) / chunks + float(busy) + msg)
        chain += back
    return chain * (1.0 - 1e-9)


def plain_floor(
    plain: DomainSolution,
    traffic: TokenTraffic,
    topology: Topology,
    model: ModelSpec,
    cost: CostSettings,
) -> float:
    """A lower bound of what :func:`~expertmesh.planner.hybrid.compose` scores ``plain`` (a
    solution without replicas, :func:`~expertmesh.planner.domainquota.at_home`) at, from
    ``traffic``: the traffic of the solution with replicas on the same holder sets inside
    each DC (its DC pairs are plain's: the holder sets fix them). :func:`chain_floor` with
    compute at plain's busiest rank (every virtual expert at its home)."""
    x = crossings(traffic, model.top_k, cost.hierarchical) * float(model.token_bytes)
    busiest = np.bincount(plain.home, weights=plain.demand.astype(np.float64))
    return chain_floor(
        (traffic.pair_src, traffic.pair_dst, x),
        float(busiest.max(initial=0.0)),
        topology,
        model,
        cost,
    )


def _pipe_floor(parts: tuple[float, float, float], chunks: int) -> float:
    longest = max(parts)
    return longest + (sum(parts) - longest) / chunks
