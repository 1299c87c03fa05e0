"""The fast loop inside one DC: every microbatch, every layer, on the exact counts (UltraEP).

The slow loop's plan fixes which experts each DC holds and where their weights live.
:class:`DomainBase` turns a committed plan into one DC's *base*: each expert the DC holds
has one *home* copy (its master when the master is in the DC, else, of its copies in the
DC, the one on the rank with the fewest homes so far, so that the free slots spread over
the ranks: a rank full of homes cannot take a replica); every other slot is free for this microbatch's replicas (a free slot that
already holds an expert's weights, a slow-loop copy, serves that expert's replica
without any transfer).

:func:`solve` is pure and deterministic: every rank of the DC calls it on the same
all-gathered counts and gets the same answer, with no round trip to the controller. It is
the planner's quota rule (:func:`~expertmesh.planner.quota.balance_demand`: the smallest
``T`` so that no rank computes more than ``T``, replicas of overloaded experts on ranks
with spare slots) and its route (:func:`~expertmesh.planner.routing.route_locality`: a
copy first takes its own rank's tokens, the rest by largest remainder), over the DC's
held experts as the domain's experts; then, where the rule left a rank above another,
tokens shift along chains of copies (:func:`~expertmesh.planner.chains.relieve`: the
rule only lets ranks below ``T`` receive, which with one spare slot per rank strands
the excess of a second overloaded rank).

Shapes: ``Rd`` ranks of the DC (local index ``i`` is ``ranks[i]``), ``S`` slots, ``E``
experts, ``V`` experts the DC holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from expertmesh.planner.chains import relieve
from expertmesh.planner.fastquota import DEFAULTS, BalanceSettings, balance_domain, route_rows
from expertmesh.planner.plan import Placement

__all__ = ["DomainBase", "DomainStep", "solve"]


@dataclass(frozen=True, eq=False)
class DomainBase:
    """One DC's base under a committed plan.

    - ``ranks``: [Rd] the DC's live ranks (ascending);
    - ``experts``: [V] the experts the DC holds (ascending);
    - ``home``: [V] local index of each held expert's home rank;
    - ``masters``: virtual placement [Rd, S] (``-1`` free) whose expert ``v`` is
      ``experts[v]``, one copy each, at its home;
    - ``resident``: [Rd, E] bool, which ranks hold which experts' weights already.
    """

    ranks: np.ndarray
    experts: np.ndarray
    home: np.ndarray
    masters: Placement
    resident: np.ndarray

    @classmethod
    def of(cls, placement: Placement, ranks: np.ndarray) -> DomainBase:
        """The base of the DC whose live ranks are ``ranks`` under ``placement``."""
        ranks = np.sort(np.asarray(ranks, dtype=np.int64))
        p2l = placement.phy2log[ranks]  # [Rd, S]
        holds = placement.holds()[ranks]  # [Rd, E]
        master = placement.master_rank()
        experts = np.flatnonzero(holds.any(axis=0))
        local = {int(r): i for i, r in enumerate(ranks.tolist())}
        home = np.full(experts.size, -1, np.int64)
        homes = np.zeros(ranks.size, np.int64)  # homes per rank so far
        for v, e in enumerate(experts.tolist()):  # masters and single copies first
            m, at = int(master[e]), np.flatnonzero(holds[:, e])
            if m in local or at.size == 1:
                home[v] = local[m] if m in local else int(at[0])
                homes[home[v]] += 1
        for v in np.flatnonzero(home < 0).tolist():  # then, of several copies, the one on
            at = np.flatnonzero(holds[:, experts[v]])  # the rank with fewest homes: every
            home[v] = int(at[np.argmin(homes[at])])  # rank keeps free slots for replicas
            homes[home[v]] += 1
        num_slots = p2l.shape[1]
        v_p2l = np.full(p2l.shape, -1, np.int32)
        v_master = np.empty(experts.size, np.int64)
        for v, e in enumerate(experts.tolist()):
            s = int(np.flatnonzero(p2l[home[v]] == e)[0])  # its first slot on the home rank
            v_p2l[home[v], s] = v
            v_master[v] = home[v] * num_slots + s
        return cls(ranks, experts, home, Placement(v_p2l, v_master), holds)


@dataclass(frozen=True, eq=False)
class DomainStep:
    """One microbatch's decision for a DC.

    - ``route``: [N, 4] ``(src_local, expert, dst_local, tokens)``: every count routed in
      full, only to the expert's home or this step's replicas;
    - ``replicas``: [K, 2] ``(local_rank, expert)`` copies this microbatch adds;
    - ``fetch``: [F, 3] ``(src_local, dst_local, expert)`` weights that must move for them
      (a replica on a rank without the expert's weights gets them from the home);
    - ``quota``: the ``T`` reached (max tokens a rank computes).
    """

    route: np.ndarray
    replicas: np.ndarray
    fetch: np.ndarray
    quota: int


def solve(
    counts: np.ndarray,
    base: DomainBase,
    *,
    replicate: bool = True,
    settings: BalanceSettings = DEFAULTS,
) -> DomainStep:
    """Balance ``counts`` [Rd, E] (assignments each rank of the DC holds for each expert
    after the cross-DC dispatch) over ``base``. ``replicate=False``: homes only.
    ``settings``: the replica economy (:mod:`expertmesh.planner.fastquota`: a quota within
    ``tolerance`` of the smallest with fewer replicas, none below ``min_replica_share``)
    and ``chains``: then tokens shift along chains of copies where the rule left a rank
    above another (:mod:`expertmesh.planner.chains`; no new replica below the minimum);
    with chains and an economy, the result is never above the exact rule's with chains
    (whose busiest rank is taken instead when lower).
    ``ValueError`` if a count names an expert the DC does not hold."""
    step = _solve(counts, base, replicate, settings)
    economy = settings.tolerance or settings.min_replica_share or settings.min_tokens_per_replica
    if replicate and settings.chains and economy and step.quota > 0:
        # the economy weighs replicas against the rule's own T, which the rule may leave far
        # above what its chains reach (one spare slot per rank); the exact rule with the
        # chains is the planner's level: never end above it
        exact = settings.model_copy(
            update={"tolerance": 0.0, "min_replica_share": 0.0, "min_tokens_per_replica": 0}
        )
        alt = _solve(counts, base, replicate, exact)
        if alt.quota < step.quota:
            return alt
    return step


def _solve(
    counts: np.ndarray, base: DomainBase, replicate: bool, settings: BalanceSettings
) -> DomainStep:
    """:func:`solve` under one rule (its checks first)."""
    counts = np.asarray(counts, dtype=np.int64)
    rd, num_experts = base.resident.shape
    if counts.shape != (rd, num_experts):
        raise ValueError(f"counts must be [{rd}, {num_experts}], got {counts.shape}")
    held = np.zeros(num_experts, bool)
    held[base.experts] = True
    if counts[:, ~held].any():
        raise ValueError("tokens for an expert this DC does not hold")
    sub = counts[:, base.experts]  # [Rd, V]
    if replicate and base.experts.size:
        sol = balance_domain(sub, base.masters.phy2log, settings)
        rows = route_rows(sol, sub)  # [M, 4] (src_local, v, dst_local, tokens)
        rep_rank, rep_v = sol.replicas[:, 0].astype(np.int64), sol.replicas[:, 2].astype(np.int64)
    else:  # every expert computes at its home
        src, v = np.nonzero(sub)
        rows = np.stack([src, v, base.home[v], sub[src, v]], axis=1).astype(np.int64)
        rep_rank = rep_v = np.zeros(0, np.int64)
    rows = rows[rows[:, 3] > 0]
    if replicate and settings.chains and base.experts.size and rows.size:
        rows, rep_rank, rep_v = _chains(rows, sub, base, rep_rank, settings)
    rows[:, 1] = base.experts[rows[:, 1]]
    rep_e = base.experts[rep_v]
    replicas = np.stack([rep_rank, rep_e], axis=1).astype(np.int64).reshape(-1, 2)
    need = ~base.resident[rep_rank, rep_e]
    fetch = np.stack([base.home[rep_v][need], rep_rank[need], rep_e[need]], axis=1)
    per_rank = np.bincount(rows[:, 2], weights=rows[:, 3], minlength=rd)
    return DomainStep(
        route=rows.astype(np.int64),
        replicas=replicas,
        fetch=fetch.astype(np.int64).reshape(-1, 3),
        quota=int(per_rank.max(initial=0)),
    )


def _chains(
    rows: np.ndarray,
    sub: np.ndarray,
    base: DomainBase,
    rep_rank: np.ndarray,
    settings: BalanceSettings,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rule's ``rows`` [M, 4] ``(src, v, dst, tokens)`` over ``sub`` [Rd, V] evened out
    along chains of copies (:func:`~expertmesh.planner.chains.relieve`); returns the new
    rows and the replicas' ``(rank, v)`` (every copy with tokens but the home)."""
    rd, num_v = sub.shape
    comp = np.zeros((rd, num_v), np.int64)
    np.add.at(comp, (rows[:, 2], rows[:, 1]), rows[:, 3])
    free = (base.masters.phy2log < 0).sum(axis=1) - np.bincount(rep_rank, minlength=rd)
    least = max(
        settings.min_tokens_per_replica,
        math.ceil(settings.min_replica_share * sub.sum() / rd),
        1,
    )
    new = relieve(comp, base.home, np.maximum(free, 0), least=least)
    changed = np.flatnonzero((new != comp).any(axis=0))
    if changed.size:
        keep = rows[~np.isin(rows[:, 1], changed)]
        rows = np.concatenate(
            [keep, *(_rows_of(v, new[:, v], sub[:, v]) for v in changed.tolist())]
        )
        rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
    is_rep = new > 0
    is_rep[base.home, np.arange(num_v)] = False
    rep_rank, rep_v = np.nonzero(is_rep)
    return rows, rep_rank.astype(np.int64), rep_v.astype(np.int64)


def _rows_of(v: int, copies: np.ndarray, sources: np.ndarray) -> np.ndarray:
    """Rows ``(src, v, dst, tokens)`` giving each copy ``copies[q]`` tokens of ``sources``
    [Rd] (sums equal): a copy first takes its own rank's tokens, the rest in rank order."""
    want = copies.astype(np.int64).copy()
    have = sources.astype(np.int64).copy()
    out = []
    own = np.minimum(want, have)
    for q in np.flatnonzero(own).tolist():
        out.append((q, v, q, int(own[q])))
    want -= own
    have -= own
    q = 0
    for src in np.flatnonzero(have).tolist():
        x = int(have[src])
        while x > 0:
            while want[q] == 0:
                q += 1
            y = min(x, int(want[q]))
            out.append((src, v, q, y))
            want[q] -= y
            x -= y
    return np.asarray(out, np.int64).reshape(-1, 4)
