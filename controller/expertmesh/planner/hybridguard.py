"""The guard of ``hybrid``'s slow loop (:mod:`expertmesh.planner.hybrid`, step 4) without
scoring what cannot win: a lower bound of a candidate's modeled step from its holder sets
alone, and the candidates scored in the order of that bound, each distinct one once; a
candidate is laid out on ranks (the domain-based partition) only when it is scored."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

from expertmesh.planner.costmodel import (
    CostSettings,
    crossings,
    expected_crossings,
    pair_links,
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

    def bounds_of(self, cands: list[np.ndarray]) -> np.ndarray:
        """[C] :func:`guard_bound` of each of ``cands`` (holder sets [D, E]), those not
        bounded before in one batch (the same floats as one by one)."""
        keys = [h.tobytes() for h in cands]
        new: dict[bytes, np.ndarray] = {}
        for key, h in zip(keys, cands, strict=True):
            if key not in self.bounds and key not in new:
                new[key] = h
        if new:
            got = guard_bound(self.inp, np.stack(list(new.values())), self.master_dc)
            got = np.broadcast_to(np.asarray(got, dtype=np.float64), (len(new),))
            self.bounds.update(zip(new, got.tolist(), strict=True))
        return np.array([self.bounds[k] for k in keys], dtype=np.float64)

    def above(self, cands: Iterable[np.ndarray], bar: float) -> bool:
        """Whether every candidate's (holder sets [D, E]) lower bound is above ``bar``: none
        of them can cost ``bar`` or less."""
        return bool((self.bounds_of(list(cands)) > bar).all())

    def scores(self, cands: list[np.ndarray], ceiling: float = np.inf) -> list[float]:
        """The cost of each candidate (holder sets [D, E], masters included), or ``inf``
        for one whose lower bound is above ``ceiling`` or above the cost of one scored
        before it (lowest bound first): such a candidate is never the list's fastest, nor
        does it tie with it, so ``argmin`` of the result is ``argmin`` of the exact costs
        wherever that is at most ``ceiling``. Only the candidates scored are laid out."""
        scored = [self._scored(h) for h in cands]
        fresh = self.bounds_of([h for h, done in zip(cands, scored, strict=True) if not done])
        bounds = np.full(len(cands), -np.inf)
        bounds[~np.array(scored, dtype=bool)] = fresh
        out = [np.inf] * len(cands)
        best = ceiling
        for i in np.argsort(bounds, kind="stable").tolist():
            if bounds[i] > best:
                continue
            out[i] = self(self.placement(cands[i]))
            best = min(best, out[i])
        return out


def guard_bound(inp: HybridInputs, holds: np.ndarray, master_dc: np.ndarray) -> float | np.ndarray:
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
    passes instead of a :func:`~expertmesh.planner.hybrid.compose`.

    ``holds`` [C, D, E]: the bounds of ``C`` candidates at once, [C], each the float it has
    alone (one pass of array operations over all of them, every sum in the same order)."""
    if inp.cfg.inside != "quota":
        return -np.inf if holds.ndim == 2 else np.full(holds.shape[0], -np.inf)
    if holds.ndim == 2:
        return float(_bounds(inp, _bound_inputs(inp), holds[None], master_dc)[0])
    return _bounds(inp, _bound_inputs(inp), holds, master_dc)


def _bounds(
    inp: HybridInputs, fixed: _Fixed, holds: np.ndarray, master_dc: np.ndarray
) -> np.ndarray:
    """:func:`guard_bound` of every candidate ``holds`` [C, D, E]: [C]. Each step of the
    bound over a leading candidate axis: maxima per candidate, and ``np.add.at`` adding
    to each candidate's cells in the order it does for that candidate alone."""
    topology, model, cost = inp.topology, inp.model, inp.cfg.cost
    num_cands, num_dcs = holds.shape[0], topology.num_dcs
    pair, valid = _dc_pairs_all(fixed, holds, topology.rank_dc)
    c, a, b = np.nonzero(pair > 0)
    k = model.top_k
    if cost.hierarchical and k > 1:
        x = expected_crossings(fixed.dc_tokens[a], pair[c, a, b], k)
    else:
        x = pair[c, a, b]
    crossing = np.zeros((num_cands, num_dcs, num_dcs))  # token bytes per pair and phase
    crossing[c, a, b] = x * float(model.token_bytes)
    link = (2.0 if model.training else 1.0) * (crossing + crossing.transpose(0, 2, 1))
    tail = None
    if model.training:  # replica sync: weights out of the master's DC, gradients back
        mdc = master_dc
        cc, d, ex = np.nonzero(holds & (np.arange(num_dcs)[:, None] != mdc[None, :]))
        per = float(cost.microbatches_per_update)
        enc = inp.cfg.encoding
        grads = np.zeros((num_cands, num_dcs, num_dcs))
        np.add.at(grads, (cc, d, mdc[ex]), enc.gradient_bytes(model) / per)
        np.add.at(link, (cc, mdc[ex], d), enc.refresh_bytes(model) / per)
        link += grads
        if cost.microbatches_per_update == 1:  # the gradients return on the backward tail
            tail = grads
    chain = _chain_floors(crossing, fixed.mean, topology, model, cost, tail=tail)
    if fixed.previous is not None:  # what copy_streams charges across DCs, at least
        held, src = fixed.previous
        cc, d, ex = np.nonzero(holds & ~held)
        cross = d != src[ex]
        cc, d, ex = cc[cross], d[cross], ex[cross]
        enc, share = inp.cfg.encoding, 1.0 / inp.cfg.period
        nbytes = np.where(
            d == master_dc[ex], enc.copy_bytes(model, True), enc.copy_bytes(model, False)
        )
        np.add.at(link, (cc, src[ex], d), nbytes * share)
    bw = pair_links(topology)[0]
    resource = np.max(np.where(link > 0, link / bw, 0.0), axis=(1, 2), initial=0.0)
    out = np.maximum(chain, resource) * (1.0 - 1e-9)
    return np.where(valid, out, -np.inf)  # an expert with load and no copy: compose says why


def _chain_floors(
    crossing: np.ndarray,
    tokens: float,
    topology: Topology,
    model: ModelSpec,
    cost: CostSettings,
    *,
    tail: np.ndarray | None,
) -> np.ndarray:
    """:func:`chain_floor` of every candidate: ``crossing`` [C, D, D] token bytes of each
    ordered DC pair in one phase (0: none), ``tail`` [C, D, D] or ``None``; [C]. The same
    floats: each pair's time as there, the maxima over each candidate's pairs."""
    bw, lat = pair_links(topology)
    chunks = cost.pipeline_chunks
    msg = cost.message_seconds * chunks
    has = crossing > 0
    axes = (1, 2)
    disp = np.max(lat + crossing / bw, axis=axes, where=has, initial=0.0) + msg
    comb = np.max(lat.T + crossing / bw.T, axis=axes, where=has, initial=0.0) + msg
    fwd = tokens * 2.0 * model.expert_params / cost.flops_per_second
    chain = _pipe_floors(disp, fwd, comb, chunks)
    if model.training:
        back = _pipe_floors(disp, 2.0 * fwd, comb, chunks)
        if tail is not None:
            link = tail + crossing.transpose(0, 2, 1)  # combine runs each pair's reverse link
            busy = np.max(lat + link / bw, axis=axes, where=link > 0, initial=0.0)
            back = np.maximum(back, (disp + 2.0 * fwd) / chunks + busy + msg)
        chain = chain + back
    return chain * (1.0 - 1e-9)


def _pipe_floors(disp: np.ndarray, fwd: float, comb: np.ndarray, chunks: int) -> np.ndarray:
    """:func:`_pipe_floor` of ``(disp[i], fwd, comb[i])`` for every ``i`` (the same floats)."""
    longest = np.maximum(np.maximum(disp, fwd), comb)
    return longest + (disp + fwd + comb - longest) / chunks


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


def _bound_inputs(inp: HybridInputs) -> _Fixed:
    """:class:`_Fixed` of ``inp``, once per solve (kept while ``inp`` lives)."""
    got = _FIXED.get(inp)
    if got is None:
        got = _FIXED[inp] = _fixed(inp)
    return got


#: :func:`_bound_inputs` of the solves alive
_FIXED: weakref.WeakKeyDictionary[HybridInputs, _Fixed] = weakref.WeakKeyDictionary()


def _fixed(inp: HybridInputs) -> _Fixed:
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
    expert with load has no copy (:func:`_dc_pairs_all` of one candidate)."""
    pair, valid = _dc_pairs_all(fixed, holds[None], rank_dc)
    return pair[0] if valid[0] else None


def _dc_pairs_all(
    fixed: _Fixed, holds: np.ndarray, rank_dc: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_dc_pairs` of every candidate ``holds`` [C, D, E]: ``(pair [C, D, D], valid
    [C])`` (``valid``: every expert with load has a copy; the pairs of the others mean
    nothing). An expert with one holder takes every other DC's tokens (from ``local``, no
    [R, E] pass); only the columns of experts held more than once go rank by rank. Sums of
    integers (exact in any order): the same floats as summing the route's cells."""
    num_cands, num_dcs = holds.shape[:2]
    dd = num_dcs * num_dcs
    h = holds.sum(axis=1)  # [C, E]
    valid = ~(fixed.used[None, :] & (h == 0)).any(axis=1)
    if fixed.place is None or fixed.sizes is None:  # DCs' ranks not consecutive
        each = np.zeros((num_cands, num_dcs, num_dcs))
        for c in range(num_cands):
            each[c] = np.bincount(
                holder_routing(holds[c], rank_dc).pair_key,
                weights=fixed.load.ravel(),
                minlength=dd,
            ).reshape(num_dcs, num_dcs)
            np.fill_diagonal(each[c], 0.0)
        return each, valid
    # an expert with one holder b: every other DC a sends it its tokens, local[a, e]
    one = (holds & (h == 1)[:, None, :]).transpose(0, 2, 1).astype(np.float64)  # [C, E, D]
    pair = np.matmul(fixed.local, one)  # [C, D, D]: a -> b over b's one-holder experts
    pair[:, np.arange(num_dcs), np.arange(num_dcs)] = 0.0  # b's own tokens stay
    pair = pair.reshape(-1)
    mc, me = np.nonzero(h > 1)  # [M] the columns held more than once
    if mc.size:  # remote_holder's rotation, on these columns only
        held = holds[mc, :, me].T  # [D, M]
        lacking = np.where(held, 0, fixed.sizes[:, None])
        before = np.cumsum(lacking, axis=0) - lacking  # [D, M] ranks without e before d
        j = (before[rank_dc] + fixed.place[:, None] + me[None, :]) % h[mc, me]  # [R, M]
        v_e, v_d = np.nonzero(held.T)  # each column's holders, in DC order
        dst = v_d[np.searchsorted(v_e, np.arange(mc.size)) + j]
        away = ~held[rank_dc]  # [R, M]
        key = (mc[None, :] * dd + rank_dc[:, None] * num_dcs + dst)[away]
        pair += np.bincount(key, weights=fixed.load[:, me][away], minlength=num_cands * dd)
    return pair.reshape(num_cands, num_dcs, num_dcs), valid


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
    bw, lat = pair_links(topology)
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
    *,
    cross: np.ndarray | None = None,
) -> float:
    """A lower bound of what :func:`~expertmesh.planner.hybrid.compose` scores ``plain`` (a
    solution without replicas, :func:`~expertmesh.planner.domainquota.at_home`) at, from
    ``traffic``: the traffic of the solution with replicas on the same holder sets inside
    each DC (its DC pairs are plain's: the holder sets fix them). :func:`chain_floor` with
    compute at plain's busiest rank (every virtual expert at its home). Only ``plain``'s
    homes and demands are read: the solution with replicas that ``at_home`` would turn
    into ``plain`` serves as well. ``cross``: ``crossings(traffic, model.top_k,
    cost.hierarchical)`` when the caller has them."""
    if cross is None:
        cross = crossings(traffic, model.top_k, cost.hierarchical)
    x = cross * float(model.token_bytes)
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
