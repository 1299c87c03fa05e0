"""The fast loop inside one DC: every microbatch, every layer, on the exact counts (UltraEP).

The slow loop's plan fixes which experts each DC holds and where their weights live.
:class:`DomainBase` turns a committed plan into one DC's *base*: each expert the DC holds
has one *home* copy (its master when the master is in the DC, else the DC's lowest rank
holding it); every other slot is free for this microbatch's replicas (a free slot that
already holds an expert's weights, a slow-loop copy, serves that expert's replica
without any transfer).

:func:`solve` is pure and deterministic: every rank of the DC calls it on the same
all-gathered counts and gets the same answer, with no round trip to the controller. It is
the planner's quota rule (:func:`~expertmesh.planner.quota.balance_demand`: the smallest
``T`` so that no rank computes more than ``T``, replicas of overloaded experts on ranks
with spare slots) and its route (:func:`~expertmesh.planner.routing.route_locality`: a
copy first takes its own rank's tokens, the rest by largest remainder), over the DC's
held experts as the domain's experts.

Shapes: ``Rd`` ranks of the DC (local index ``i`` is ``ranks[i]``), ``S`` slots, ``E``
experts, ``V`` experts the DC holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
        home = np.empty(experts.size, np.int64)
        for v, e in enumerate(experts.tolist()):
            m = int(master[e])
            home[v] = local[m] if m in local else int(np.flatnonzero(holds[:, e])[0])
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
    ``tolerance`` of the smallest with fewer replicas, none below ``min_replica_share``).
    ``ValueError`` if a count names an expert the DC does not hold."""
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
