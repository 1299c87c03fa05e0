"""The guard of ``hybrid``'s slow loop (:mod:`expertmesh.planner.hybrid`, step 4) without
scoring what cannot win: a lower bound of a candidate's modeled step from its holder sets
alone, and the candidates scored in the order of that bound, each distinct one once; a
candidate is laid out on ranks (the domain-based partition) only when it is scored."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from expertmesh.planner.costmodel import (
    CostSettings,
    crossings,
    expected_crossings,
)
from expertmesh.planner.domainquota import DomainSolution, _routing, dc_holds
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

    def scores(self, cands: list[np.ndarray], ceiling: float = np.inf) -> list[float]:
        """The cost of each candidate (holder sets [D, E], masters included), or ``inf``
        for one whose lower bound is above ``ceiling`` or above the cost of one scored
        before it (lowest bound first): such a candidate is never the list's fastest, nor
        does it tie with it, so ``argmin`` of the result is ``argmin`` of the exact costs
        wherever that is at most ``ceiling``. Only the candidates scored are laid out."""
        bounds = [
            -np.inf if self._scored(h) else guard_bound(self.inp, h, self.master_dc) for h in cands
        ]
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
    DCs), the mean compute, and the expert bytes that cross. :func:`chain_floor` at the
    mean rank's tokens, or the WAN links' resource bound: tokens of both phases (both
    passes when training), one sync per (expert, remote DC) (in-DC replicas add none) and
    the copies from ``previous`` into a DC that held none of that expert (whatever ranks
    they land on, each crosses from its master's DC in ``previous``); no port and no late
    copy (each only adds). A few array passes instead of a
    :func:`~expertmesh.planner.hybrid.compose`."""
    if inp.cfg.inside != "quota":
        return -np.inf
    topology, model, cost = inp.topology, inp.model, inp.cfg.cost
    load = inp.load
    rank_dc, num_dcs = topology.rank_dc, topology.num_dcs
    routing = _routing(holds, rank_dc)  # memoized: compose of this candidate reuses it
    if routing.orphan.size and load[:, routing.orphan].any():
        return -np.inf  # an expert with load and no copy: compose says why
    pair = np.bincount(routing.pair_key, weights=load.ravel(), minlength=num_dcs**2).reshape(
        num_dcs, num_dcs
    )  # [D, D] assignments from DC a to copies in DC b (a's own copies on the diagonal)
    np.fill_diagonal(pair, 0.0)
    a, b = np.nonzero(pair > 0)
    k = model.top_k
    if cost.hierarchical and k > 1:
        dc_tokens = np.bincount(rank_dc, weights=load.sum(axis=1), minlength=num_dcs) / k
        x = expected_crossings(dc_tokens[a], pair[a, b], k)
    else:
        x = pair[a, b]
    nbytes = x * float(model.token_bytes)
    mean = float(load.sum()) / topology.num_ranks
    chain = chain_floor((a, b, nbytes), mean, topology, model, cost)
    crossing = np.zeros((num_dcs, num_dcs))
    crossing[a, b] = nbytes
    link = (2.0 if model.training else 1.0) * (crossing + crossing.T)
    if model.training:  # replica sync: weights out of the master's DC, gradients back
        mdc = master_dc
        d, ex = np.nonzero(holds & (np.arange(num_dcs)[:, None] != mdc[None, :]))
        per = float(cost.microbatches_per_update)
        enc = inp.cfg.encoding
        np.add.at(link, (mdc[ex], d), enc.refresh_bytes(model) / per)
        np.add.at(link, (d, mdc[ex]), enc.gradient_bytes(model) / per)
    if inp.previous is not None:  # what copy_streams charges across DCs, at least
        src = rank_dc[inp.previous.master_rank()]  # [E] the master's DC in previous
        d, ex = np.nonzero(holds & ~dc_holds(inp.previous, topology))
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


def chain_floor(
    pairs: tuple[np.ndarray, np.ndarray, np.ndarray],
    tokens: float,
    topology: Topology,
    model: ModelSpec,
    cost: CostSettings,
) -> float:
    """A floor of the chain of :func:`~expertmesh.planner.costmodel.step_cost`: dispatch and
    combine at their busiest WAN link plus the message overhead, compute at ``tokens``
    on the busiest rank, no port and no replica gradient on the tail; times ``1 - 1e-9``
    for rounding. ``pairs``: ``(src DC, dst DC, bytes)`` [P] each, the token bytes that
    cross each ordered DC pair in one phase (one row per pair)."""
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
        chain += _pipe_floor((disp, 2.0 * fwd, comb), chunks)
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
