"""``quota`` inside every DC on the holder sets of a cross-DC plan (``hybrid``'s microbatch step).

The slow loop (:mod:`expertmesh.planner.hybrid`) decides which experts each DC holds:
``H[d, e]``, with exactly one copy of every held ``(d, e)`` in a slot of a rank of
``d`` (its *home*; in the master's DC, the master). That is the *base* placement.
Every microbatch, on the exact ``load`` [R, E]:

1. **DC-level route, fixed by H.** A source rank's tokens for ``e`` stay in its DC when
   the DC holds ``e``; else they go whole to one of the ``h`` DCs that hold ``e``, by
   rotation (:func:`remote_holder`): the ``k``-th source rank without ``e`` in its DC (in
   rank order) sends to holder ``(k + e) mod h`` in DC order, so every holder serves the
   same number of source ranks, give or take one, and a route has one row per
   ``(source, expert)`` at most (an even split over every holder would have ``h``: 2M x
   hundreds of rows at 1,000 DCs). Balancing never moves a token across a DC.
2. **Virtual experts.** Each held ``(d, e)`` is one expert of domain ``d``, mastered at
   its home, with demand = d's own tokens for ``e`` + the tokens sent in (step 1).
3. **quota per DC** (:func:`~expertmesh.planner.quota.balance_demand`, domain = DC): the
   smallest ``T`` per DC, replicas on the DC's free slots (whatever the base leaves).
4. **Route** (:func:`domain_route`): per virtual expert the rule of
   :func:`~expertmesh.planner.routing.route_locality` (own rank first, then proportional,
   largest remainder; the home takes the rest). :func:`domain_traffic` is the cost
   model's view of it without rows.

:func:`rehome` turns the previous microbatch's placement back into a base: masters stay,
and each held ``(d, e)`` keeps one of the copies ``d`` has (no weights move), chosen
heaviest first onto the least-loaded of its holders. ``refs.domain_quota_ref`` is steps
1-4 in plain loops.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from expertmesh.planner.domaintopo import _frozen, _in_order, _level_sums, domain_sizes, merge_dcs
from expertmesh.planner.plan import Placement, check_load
from expertmesh.planner.quota import balance_demand
from expertmesh.planner.routing import route_locality
from expertmesh.planner.topology import Topology
from expertmesh.planner.traffic import TokenTraffic
from expertmesh.planner.trafficbase import _node_is_dc, _remember

__all__ = [
    "DomainSolution",
    "HolderRouting",
    "at_home",
    "dc_holds",
    "domain_quota",
    "domain_route",
    "domain_sizes",
    "domain_traffic",
    "holder_routing",
    "merge_dcs",
    "rehome",
    "remote_holder",
    "remote_inflow",
    "sum_rows",
]


@dataclass(frozen=True, eq=False)
class DomainSolution:
    """One microbatch of :func:`domain_quota` (``V`` held ``(DC, expert)`` pairs, sorted by
    expert then DC; ``N`` replicas).

    - ``placement``: the base plus this microbatch's replicas (real expert ids).
    - ``holds``: [D, E] bool, the base's holder sets ``H``.
    - ``v_dc``, ``v_expert``, ``home``: [V] DC, expert and home rank of each virtual expert.
    - ``demand``: [V] int tokens each computes; ``inflow``: [V] int of them sent in from DCs
      without a copy (step 1 of the module doc).
    - ``quota``: [D] the smallest ``T`` of each DC (max tokens on one of its ranks);
      ``lower_bound``: [D] the DC's ceiling mean (or an expert split over every rank).
    - ``replicas``: ``(v, rank, tokens)`` each [N], in quota's line order.
    - ``to_v``: [R, E] the virtual expert source rank ``r``'s tokens for ``e`` go to: its
      own DC's copy, else :func:`remote_holder`'s (-1 where nobody holds ``e``).
    - ``local``: [D, E] int each DC's own tokens for each expert (the load summed by DC).
    """

    placement: Placement
    holds: np.ndarray
    v_dc: np.ndarray
    v_expert: np.ndarray
    home: np.ndarray
    demand: np.ndarray
    inflow: np.ndarray
    quota: np.ndarray
    lower_bound: np.ndarray
    replicas: tuple[np.ndarray, np.ndarray, np.ndarray]
    to_v: np.ndarray
    local: np.ndarray


def dc_holds(placement: Placement, topology: Topology) -> np.ndarray:
    """[D, E] bool: DC ``d`` holds a copy of ``e`` in ``placement``."""
    r, s = np.nonzero(placement.phy2log >= 0)
    out = np.zeros((topology.num_dcs, int(placement.master.size)), dtype=bool)
    out[topology.rank_dc[r], placement.phy2log[r, s]] = True
    return out


def _virtual(holds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Virtual experts of ``holds`` [D, E]: ``v_dc``, ``v_expert`` [V] (by expert, then DC),
    ``vid`` [D, E] (-1 where not held), ``first`` [E + 1] where each expert's holders start."""
    v_expert, v_dc = np.nonzero(holds.T)
    vid = np.full(holds.shape, -1, np.int64)
    vid[v_dc, v_expert] = np.arange(v_dc.size)
    first = np.searchsorted(v_expert, np.arange(holds.shape[1] + 1))
    return v_dc, v_expert, vid, first


def _scatter(
    rows: np.ndarray, cols: np.ndarray, values: np.ndarray, shape: tuple[int, int]
) -> np.ndarray:
    """[shape] float64 with ``values`` [N] summed into ``(rows, cols)`` (``np.add.at``,
    by ``np.bincount``: several times faster)."""
    flat = np.bincount(rows * shape[1] + cols, weights=values, minlength=shape[0] * shape[1])
    return flat.reshape(shape)


def sum_rows(x: np.ndarray, group: np.ndarray, num_groups: int) -> np.ndarray:
    """[num_groups, E] float64: rows of ``x`` [R, E] summed by ``group`` [R]. Integer and
    bool rows of groups in order, each of the same size (a topology's DCs), are summed as
    integers (exact, so the same floats in any order) over a [G, size, E] view."""
    got = _ordered_int_sums(x, group, num_groups)
    if got is not None:
        return got.astype(np.float64)
    num_cols = x.shape[1]
    keys = (group[:, None] * num_cols + np.arange(num_cols)[None, :]).ravel()
    flat = np.bincount(keys, weights=x.ravel().astype(np.float64), minlength=num_groups * num_cols)
    return flat.reshape(num_groups, num_cols)


def _int_rows(x: np.ndarray, group: np.ndarray, num_groups: int) -> np.ndarray:
    """:func:`sum_rows` of integer ``x`` as int64 (the same integers, without the round
    trip through floats where the groups are in order)."""
    got = _ordered_int_sums(x, group, num_groups)
    return got if got is not None else sum_rows(x, group, num_groups).astype(np.int64)


def _ordered_int_sums(x: np.ndarray, group: np.ndarray, num_groups: int) -> np.ndarray | None:
    """[num_groups, E] int64 sums of integer or bool rows ``x`` [R, E] whose ``group`` [R]
    is in order, groups of one size (a [G, size, E] view); else ``None``."""
    num_rows, num_cols = x.shape
    if x.dtype.kind in "biu" and group.size == num_rows and _in_order(group, num_groups):
        return x.reshape(num_groups, num_rows // num_groups, num_cols).sum(axis=1, dtype=np.int64)
    return None


def remote_holder(holds: np.ndarray, rank_dc: np.ndarray) -> np.ndarray:
    """[R, E] the virtual expert (:func:`_virtual` order) that receives source rank ``r``'s
    tokens for ``e`` when ``r``'s DC lacks ``e`` (step 1 of the module doc), -1 where the DC
    holds ``e`` or nobody does. ``holds``: [D, E] bool; ``rank_dc``: [R]. The ``k``-th rank
    without ``e`` (rank order) gets holder ``(k + e) mod h``: ranks of a DC spread over
    consecutive holders, every holder of ``e`` gets ``floor`` or ``ceil`` of (ranks without
    ``e``) / ``h``, and the ``+ e`` turns which holders get the extra one from expert to
    expert."""
    key = (holds.shape, holds.tobytes(), rank_dc.tobytes())
    hit = _HOLDERS.get(key)
    if hit is not None:  # the holder sets stay fixed between re-plans: one per holds
        return hit
    first = _virtual(holds)[3]
    h = np.diff(first)  # [E] holders of each expert
    away = ~holds[rank_dc]  # [R, E] the source's DC lacks e
    k = _ordinal(holds, rank_dc, away)  # [R, E] ordinal among the ranks without e
    e = np.arange(holds.shape[1])
    j = (k + e[None, :]) % np.maximum(h, 1)[None, :]
    out = np.where(away & (h > 0)[None, :], first[:-1][None, :] + j, -1)
    out.setflags(write=False)  # shared by every caller with these holder sets
    if _HOLDERS_KEPT > 0:
        if len(_HOLDERS) >= _HOLDERS_KEPT:
            del _HOLDERS[next(iter(_HOLDERS))]  # the oldest
        _HOLDERS[key] = out
    return out


def _ordinal(holds: np.ndarray, rank_dc: np.ndarray, away: np.ndarray) -> np.ndarray:
    """[R, E] ranks before ``r`` (rank order) whose DC lacks ``e``, where ``away``: with
    each DC's ranks consecutive, the ranks of the DCs before ``r``'s that lack ``e`` plus
    ``r``'s place in its DC (the same integers as ``cumsum(away, axis=0) - 1`` from
    ``[D, E]`` sums instead of ``[R, E]``); else that cumsum."""
    if rank_dc.size and np.any(rank_dc[1:] < rank_dc[:-1]):
        return np.cumsum(away, axis=0) - 1
    sizes = np.bincount(rank_dc, minlength=holds.shape[0])
    lacking = np.where(holds, 0, sizes[:, None])  # [D, E] ranks of d without e
    before = np.cumsum(lacking, axis=0) - lacking  # [D, E] in the DCs before d
    place = np.arange(rank_dc.size) - np.searchsorted(rank_dc, rank_dc)  # [R] in its DC
    return before[rank_dc] + place[:, None]


#: :func:`remote_holder` of the last few holder sets (a pure function of its inputs,
#: memoized: the microbatch step asks for the same holder sets until the next re-plan; 0:
#: none kept)
_HOLDERS: dict[tuple[object, ...], np.ndarray] = {}
_HOLDERS_KEPT = 16


def remote_inflow(
    load: np.ndarray, holds: np.ndarray, rank_dc: np.ndarray, target: np.ndarray | None = None
) -> np.ndarray:
    """[V] int tokens each held ``(d, e)`` receives from sources whose DC lacks ``e``
    (step 1 of the module doc, :func:`remote_holder`), ``V`` in :func:`_virtual` order.
    ``load``: [R, E]; ``holds``: [D, E] bool, every expert with load held somewhere;
    ``target``: ``remote_holder(holds, rank_dc)`` when the caller has it. ``O(R E)``."""
    num_v = int(holds.sum())
    target = remote_holder(holds, rank_dc) if target is None else target
    return _sent_in(load, ~holds[rank_dc], target, num_v)


def _inflow(load: np.ndarray, routing: HolderRouting, local: np.ndarray) -> np.ndarray:
    """:func:`remote_inflow` from a :class:`HolderRouting` and ``local`` [D, E] (``load``
    summed by DC, int): the one holder of an expert gets every other DC's tokens (from
    ``local``, no [R, E] pass); only the source cells of experts held more than once go
    one by one. Sums of integers: the same as :func:`_sent_in`'s."""
    num_v = routing.v_dc.size
    if routing.orphan.size:
        return _sent_in(load, routing.away, routing.remote, num_v)  # raises if they have load
    one_v, one_e = routing.one_v, routing.one_e
    inflow = np.zeros(num_v, np.int64)
    inflow[one_v] = local.sum(axis=0)[one_e] - local[routing.v_dc[one_v], one_e]
    if routing.many_cells.size:
        sums = np.bincount(
            routing.many_bins, weights=load.ravel()[routing.many_cells], minlength=num_v
        )
        inflow += sums.astype(np.int64)
    return inflow


def _sent_in(load: np.ndarray, away: np.ndarray, target: np.ndarray, num_v: int) -> np.ndarray:
    """[V] tokens of ``load`` [R, E] where ``away`` [R, E] summed into ``target`` [R, E]."""
    sent = away & (load > 0)
    if (target[sent] < 0).any():
        e = np.nonzero(sent & (target < 0))[1]
        raise ValueError(f"experts with load but no copy: {np.unique(e)[:8].tolist()}")
    return np.bincount(target[sent], weights=load[sent], minlength=num_v).astype(np.int64)


class HolderRouting(NamedTuple):
    """What the DC-level route (step 1 of the module doc) takes from the holder sets
    ``holds`` [D, E] and ``rank_dc`` [R] alone, each read-only: the virtual experts
    (:func:`_virtual`), ``here`` [R, E] (the source's DC holds ``e``) and ``away``
    (``~here``), ``remote`` (:func:`remote_holder`), ``to_v`` [R, E] (the own DC's copy,
    else ``remote``), ``pair_key`` [R * E] (source DC * D + the DC of ``to_v``),
    ``orphan`` (the experts
    nobody holds); ``one_v`` and ``one_e`` [V1]: the virtual experts of the experts held
    in one DC, and those experts; ``one_cells`` and ``one_keys``: every [D, E] cell (flat)
    of a DC lacking such an expert and its ``pair_key`` (the DC * D + the holder's DC);
    ``many_cells`` [R * E] (flat) of a source lacking an expert held in more than one DC,
    with its ``remote`` (``many_bins``) and its ``pair_key`` (``many_keys``)."""

    v_dc: np.ndarray
    v_expert: np.ndarray
    vid: np.ndarray
    here: np.ndarray
    away: np.ndarray
    remote: np.ndarray
    to_v: np.ndarray
    pair_key: np.ndarray
    orphan: np.ndarray
    one_v: np.ndarray
    one_e: np.ndarray
    one_cells: np.ndarray
    one_keys: np.ndarray
    many_cells: np.ndarray
    many_bins: np.ndarray
    many_keys: np.ndarray


def holder_routing(holds: np.ndarray, rank_dc: np.ndarray) -> HolderRouting:
    """:class:`HolderRouting` of ``holds`` [D, E] and ``rank_dc`` [R], memoized: the holder
    sets stay fixed between re-plans, so every microbatch's :func:`domain_quota` and
    :func:`domain_traffic` until the next one share them (a pure function of its inputs,
    keyed by their bytes)."""
    last = _LAST_ROUTING[0]
    if last is not None and last[0] is holds and last[1] is rank_dc:
        return last[2]  # the same read-only holder sets as last time (a base's)
    key = (holds.shape, holds.tobytes(), rank_dc.tobytes())
    hit = _ROUTINGS.get(key)
    if hit is not None:
        if _frozen(holds):
            _LAST_ROUTING[0] = (holds, rank_dc, hit)
        return hit
    v_dc, v_expert, vid, first = _virtual(holds)
    here = holds[rank_dc]  # [R, E]
    remote = remote_holder(holds, rank_dc)
    own = vid[rank_dc]  # [R, E] the source's own DC's copy
    to_v = np.where(own >= 0, own, remote)
    num_dcs = holds.shape[0]
    pair_key = (rank_dc[:, None] * num_dcs + v_dc[to_v]).ravel()  # where nobody holds e: any
    orphan = np.flatnonzero(~holds.any(axis=0))
    num_experts = holds.shape[1]
    h = np.diff(first)
    one_e = np.flatnonzero(h == 1)
    one_v = first[one_e]
    a, c = np.nonzero(~holds[:, one_e])  # [D, E1] the DCs without each
    one_cells = a * num_experts + one_e[c]
    one_keys = a * num_dcs + v_dc[one_v[c]]
    many = np.flatnonzero(h > 1)
    r, c = np.nonzero(~here[:, many])  # [R, M] the sources without each
    many_cells = r * num_experts + many[c]
    many_bins = remote.ravel()[many_cells]
    many_keys = rank_dc[r] * num_dcs + v_dc[many_bins]
    out = HolderRouting(
        v_dc, v_expert, vid, here, ~here, remote, to_v, pair_key, orphan,
        one_v, one_e, one_cells, one_keys, many_cells, many_bins, many_keys,
    )  # fmt: skip
    for a in out:
        a.setflags(write=False)
    _remember(_ROUTINGS, key, out, _ROUTINGS_KEPT)
    if _frozen(holds):
        _LAST_ROUTING[0] = (holds, rank_dc, out)
    return out


#: the last frozen holder sets :func:`holder_routing` saw, with ``rank_dc`` and routing
_LAST_ROUTING: list[tuple[np.ndarray, np.ndarray, HolderRouting] | None] = [None]


#: :func:`holder_routing` of the last few holder sets (0: none kept)
_ROUTINGS: dict[tuple[object, ...], HolderRouting] = {}
_ROUTINGS_KEPT = 4


def domain_quota(
    load: np.ndarray, base: Placement, topology: Topology, *, replicate: bool = True
) -> DomainSolution:
    """Balance ``load`` [R, E] inside every DC over ``base``'s holder sets (module doc).

    ``base``: masters plus exactly one copy of every ``(d, e)`` it holds, on ``topology``.
    ``replicate=False``: no replicas (every virtual expert computes at its home), the
    same routes across DCs. ``ValueError`` if the base holds an expert twice in a DC or
    an expert with load nowhere.
    """
    num_ranks = base.phy2log.shape[0]
    num_experts = int(base.master.size)
    load = check_load(load, num_ranks, num_experts)
    if num_ranks != topology.num_ranks:
        raise ValueError(f"base has {num_ranks} ranks, the topology {topology.num_ranks}")
    rank_dc = topology.rank_dc
    holds, routing, home, vmasters, v_expert_or_empty = _base_parts(base, topology)
    v_dc, v_expert = routing.v_dc, routing.v_expert
    local = _int_rows(load, rank_dc, topology.num_dcs)  # [D, E] d's tokens
    inflow = _inflow(load, routing, local)
    to_v = routing.to_v  # [R, E] the own DC's copy, else the remote holder's
    demand = local[v_dc, v_expert] + inflow
    if replicate:
        sol = balance_demand(demand, vmasters, rank_dc)
        rep, v_out, lower = sol.replicas, sol.placement.phy2log, sol.lower_bound
        quota = sol.quota
    else:
        z = np.zeros(0, np.int64)
        rep, v_out = (z, z, z), vmasters.phy2log
        quota = _home_quota(home, demand, topology)
        lower = quota.copy()
    phy2log = v_expert_or_empty[v_out]  # -1 (the last entry) where the slot is empty
    return DomainSolution(
        placement=Placement(phy2log, base.master.copy()),
        holds=holds,
        v_dc=v_dc,
        v_expert=v_expert,
        home=home,
        demand=demand,
        inflow=inflow,
        quota=quota,
        lower_bound=lower,
        replicas=rep,
        to_v=to_v,
        local=local,
    )


def _base_parts(
    base: Placement, topology: Topology
) -> tuple[np.ndarray, HolderRouting, np.ndarray, Placement, np.ndarray]:
    """What :func:`domain_quota` takes from ``base`` alone (read-only, memoized: between
    re-plans every microbatch's base is the same): the holder sets [D, E], their
    :func:`holder_routing`, each virtual expert's ``home`` rank [V], the virtual masters
    (each virtual expert in its home's slot) and ``v_expert`` with -1 appended, int32 (the
    expert of a virtual expert, -1 for an empty slot). ``ValueError`` if the base holds an
    expert twice in a DC."""
    rank_dc = topology.rank_dc
    p2l, master = base.phy2log, base.master
    last = _LAST_BASE[0]
    if last is not None and last[0] is base and last[1] is rank_dc:
        return last[2]  # the same frozen base (its arrays read-only, their own) as last time
    key = (
        p2l.shape,
        p2l.dtype.str,
        p2l.tobytes(),
        master.dtype.str,
        master.tobytes(),
        rank_dc.tobytes(),
    )
    hit = _BASES.get(key)
    if hit is not None:
        _note_base(base, rank_dc, hit)
        return hit
    num_slots = base.phy2log.shape[1]
    num_experts = int(base.master.size)
    r, s = np.nonzero(base.phy2log >= 0)
    e = base.phy2log[r, s].astype(np.int64)
    holds = np.zeros((topology.num_dcs, num_experts), bool)  # dc_holds(base, topology)
    holds[rank_dc[r], e] = True
    routing = holder_routing(holds, rank_dc)
    v = routing.vid[rank_dc[r], e]
    if np.bincount(v, minlength=routing.v_dc.size).max(initial=1) > 1:
        raise ValueError("the base holds an expert more than once in a DC")
    home = np.zeros(routing.v_dc.size, np.int64)
    home[v] = r
    v_p2l = np.full(base.phy2log.shape, -1, np.int64)
    v_p2l[r, s] = v
    v_master = home * num_slots + s[np.argsort(v)]
    v_expert = np.append(routing.v_expert, -1).astype(np.int32)
    out = (holds, routing, home, Placement(v_p2l, v_master), v_expert)
    for a in (holds, home, v_p2l, v_master, v_expert):
        a.setflags(write=False)
    _remember(_BASES, key, out, _BASES_KEPT)
    _note_base(base, rank_dc, out)
    return out


def _note_base(
    base: Placement,
    rank_dc: np.ndarray,
    parts: tuple[np.ndarray, HolderRouting, np.ndarray, Placement, np.ndarray],
) -> None:
    """Remember ``parts`` as :func:`_base_parts` of ``base`` by identity when ``base``
    cannot change (:func:`_frozen` arrays, ``rank_dc`` a topology's cached one)."""
    if _frozen(base.phy2log) and _frozen(base.master):
        _LAST_BASE[0] = (base, rank_dc, parts)


#: the last frozen base :func:`_base_parts` saw, with its ``rank_dc`` and parts
_LAST_BASE: list[
    tuple[
        Placement, np.ndarray, tuple[np.ndarray, HolderRouting, np.ndarray, Placement, np.ndarray]
    ]
    | None
] = [None]


#: :func:`_base_parts` of the last few bases (a pure function of its inputs)
_BASES: dict[
    tuple[object, ...], tuple[np.ndarray, HolderRouting, np.ndarray, Placement, np.ndarray]
] = {}
_BASES_KEPT = 8


def _home_quota(home: np.ndarray, demand: np.ndarray, topology: Topology) -> np.ndarray:
    """[D] the busiest rank of each DC when every virtual expert computes at its home."""
    work = np.bincount(home, weights=demand, minlength=topology.num_ranks).astype(np.int64)
    quota = np.zeros(topology.num_dcs, np.int64)
    np.maximum.at(quota, topology.rank_dc, work)
    return quota


def at_home(sol: DomainSolution, base: Placement, topology: Topology) -> DomainSolution:
    """``sol`` (of :func:`domain_quota` on ``base``) without its replicas: every virtual
    expert computes at its home; the same as ``domain_quota(..., replicate=False)``
    without solving again."""
    quota = _home_quota(sol.home, sol.demand, topology)
    z = np.zeros(0, np.int64)
    return dataclasses.replace(
        sol,
        placement=Placement(base.phy2log.astype(np.int32), base.master.copy()),
        quota=quota,
        lower_bound=quota.copy(),
        replicas=(z, z, z),
    )


def _virtual_load(
    load: np.ndarray, sol: DomainSolution
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every nonzero ``(source rank, virtual expert, tokens)`` of step 1, each [M]: one row
    per nonzero ``load[r, e]``."""
    flat = np.flatnonzero(load)  # row-major: the order of np.nonzero
    return flat // load.shape[1], sol.to_v.ravel()[flat], load.ravel()[flat]


#: cells of one ``route_locality`` block in :func:`domain_route` (sources x hot copies)
_ROUTE_CELLS = 1 << 22


def domain_route(load: np.ndarray, sol: DomainSolution, topology: Topology) -> np.ndarray:
    """Route [N, 4] ``(src_rank, expert, dst_rank, tokens)`` of ``load`` [R, E] under
    ``sol`` (step 4 of the module doc): every virtual expert without replicas whole to its
    home, the others by :func:`~expertmesh.planner.routing.route_locality`, over blocks of
    DCs and only the sources that send to them (no ``[R, V]`` array: at most
    ``_ROUTE_CELLS`` cells at a time). At most one row per nonzero ``load[r, e]`` and copy.
    ``load`` holds whole tokens (an integer array; a float one is refused, not truncated)."""
    if not np.issubdtype(load.dtype, np.integer):
        raise ValueError(f"domain_route needs integer token counts, got {load.dtype}")
    src, v, tok = _virtual_load(load, sol)
    rep_v = sol.replicas[0]
    is_hot = np.zeros(sol.v_dc.size, bool)
    is_hot[rep_v] = True
    hot_rows = is_hot[v]
    cold = ~hot_rows
    src_c, v_c, tok_c = src[cold], v[cold], tok[cold]
    src, v, tok = src[hot_rows], v[hot_rows], tok[hot_rows]
    blocks = []
    hot = np.unique(rep_v)  # [K] by expert, then DC: sorted by DC for the blocks
    hot = hot[np.argsort(sol.v_dc[hot], kind="stable")]
    per_block = max(1, _ROUTE_CELLS // max(1, load.shape[0]))
    bounds = np.append(np.flatnonzero(np.diff(sol.v_dc[hot])) + 1, hot.size)  # DC ends
    start = 0
    while start < hot.size:  # whole DCs, up to per_block hot copies (one DC at least)
        ends = bounds[bounds > start]
        fit = ends[ends - start <= per_block]
        stop = int(fit[-1]) if fit.size else int(ends[0])
        blocks.append(_route_block(hot[start:stop], (src, v, tok), sol))
        start = stop
    out = np.empty((v_c.size + sum(b.shape[0] for b in blocks), 4), np.int64)
    out[: v_c.size, 0] = src_c  # the cold rows first, then the blocks'
    out[: v_c.size, 1] = sol.v_expert[v_c]
    out[: v_c.size, 2] = sol.home[v_c]
    out[: v_c.size, 3] = tok_c
    at = v_c.size
    for b in blocks:
        out[at : at + b.shape[0]] = b
        at += b.shape[0]
    return out


def _route_block(
    block: np.ndarray, pairs: tuple[np.ndarray, np.ndarray, np.ndarray], sol: DomainSolution
) -> np.ndarray:
    """Route rows of the hot virtual experts ``block`` [K] (every copy of each in its own
    DC): ``route_locality`` over the sources that send to them, in rank order (its
    tie-breaks go to the lower rank, so a subset of sources routes as all of them would)."""
    src, v, tok = pairs
    num_v = sol.v_dc.size
    col = np.full(num_v, -1, np.int64)
    col[block] = np.arange(block.size)
    mine = col[v] >= 0
    rep_v, rep_rank, rep_tokens = sol.replicas
    rep = col[rep_v] >= 0
    ranks = np.unique(np.concatenate([src[mine], rep_rank[rep], sol.home[block]]))  # [R']
    cell = np.searchsorted(ranks, src[mine]) * block.size + col[v[mine]]
    sub = np.bincount(cell, weights=tok[mine], minlength=ranks.size * block.size)  # np.add.at's
    sub = sub.astype(np.int64).reshape(ranks.size, block.size)  # [R', K] (integers: exact)
    rows = route_locality(
        sub,
        np.searchsorted(ranks, sol.home[block]),
        (col[rep_v[rep]], np.searchsorted(ranks, rep_rank[rep]), rep_tokens[rep]),
    )
    rows[:, 0] = ranks[rows[:, 0]]
    rows[:, 1] = sol.v_expert[block[rows[:, 1]]]
    rows[:, 2] = ranks[rows[:, 2]]
    return rows[rows[:, 3] > 0]


def domain_traffic(
    load: np.ndarray, sol: DomainSolution, topology: Topology, top_k: int
) -> TokenTraffic:
    """The cost model's view of :func:`domain_route` without its rows, in fractions: tokens
    sent in to the holder of :func:`remote_holder` (exact), then inside a DC quota's rule
    (own rank first, then every copy in proportion to what each source has left). Per-rank
    tokens and DC pairs are exact; the rest equals ``traffic_from_route(domain_route(...))``
    up to the rounding of the split inside DCs. ``O(R E + V)``, no ``[R, R]`` array."""
    num_ranks, num_experts = load.shape
    rank_dc, holds = topology.rank_dc, sol.holds
    num_dcs = holds.shape[0]
    routing = holder_routing(holds, rank_dc)
    if load.dtype.kind in "iub":  # token counts (>= 0): no float copy of the whole load
        lf = load  # _pairs' bincounts take its weights as floats
        left = np.multiply(load, routing.here, dtype=np.float64)  # where(here, load, 0.0)
    else:
        lf = load.astype(np.float64)
        left = np.where(routing.here, lf, 0.0)  # [R, E] tokens for a copy in the source's DC
    # tokens each rank sends out of its DC (sums of integers: exact, in any order)
    sent = lf.sum(axis=1) - left.sum(axis=1)
    # copies: homes (they compute what the replicas leave) and replicas
    rep_v, rep_rank, rep_tokens = sol.replicas
    given = np.bincount(rep_v, weights=rep_tokens, minlength=sol.v_dc.size)
    c_v = np.concatenate([np.arange(sol.v_dc.size), rep_v])
    c_rank = np.concatenate([sol.home, rep_rank])
    c_amount = np.concatenate([sol.demand - given, rep_tokens]).astype(np.float64)
    c_exp, c_dc = sol.v_expert[c_v], sol.v_dc[c_v]
    c_inflow = sol.inflow[c_v].astype(np.float64)  # tokens sent in to its DC from DCs without e
    # each copy's [R, E], node and DC cells, flat (one 1-D gather each, read once)
    cell = c_rank * num_experts + c_exp
    node = topology.rank_node[c_rank]
    flat = left.reshape(-1)  # a view: writes go to left
    own = np.minimum(c_amount, flat[cell])  # own rank's tokens first
    flat[cell] = flat[cell] - own  # a rank holds one copy of e at most (as left[...] -= own)
    lsum = _level_sums(left, topology, exact=load.dtype.kind in "iub")  # what sources have left
    at_rank = flat[cell]
    at_node = lsum[1].reshape(-1)[node * num_experts + c_exp]
    at_dc = lsum[2].reshape(-1)[c_dc * num_experts + c_exp]
    total = at_dc + c_inflow
    w = np.where(total > 0, (c_amount - own) / np.where(total > 0, total, 1.0), 0.0)  # [C]
    shells = (  # [C] tokens each copy takes from its node, its DC, DCs without e
        w * (at_node - at_rank),
        w * (at_dc - at_node),
        w * c_inflow,
    )
    rank_tokens = np.bincount(c_rank, weights=c_amount, minlength=num_ranks)
    rank_in = np.empty((num_ranks, 3))  # np.stack of the shells' sums, without its overhead
    for i, x in enumerate(shells):
        rank_in[:, i] = np.bincount(c_rank, weights=x, minlength=num_ranks)
    # what each local source sends: the weights of its DC's copies by shell
    g_rank = np.bincount(cell, weights=w, minlength=num_ranks * num_experts)
    g_rank = g_rank.reshape(num_ranks, num_experts)  # _scatter(c_rank, c_exp, w, ...)
    g_node = _scatter(node, c_exp, w, (topology.num_nodes, num_experts))
    reach_rank = np.einsum("re,re->r", left, g_rank)
    reach_node = np.einsum("re,re->r", left, g_node[topology.rank_node])
    if _node_is_dc(topology):  # one node per DC: the same floats
        reach_dc = reach_node
    else:
        g_dc = _scatter(c_dc, c_exp, w, (num_dcs, num_experts))
        reach_dc = np.einsum("re,re->r", left, g_dc[rank_dc])
    rank_out = np.empty((num_ranks, 3))  # np.stack of the three, without its overhead
    np.subtract(reach_node, reach_rank, out=rank_out[:, 0])
    np.subtract(reach_dc, reach_node, out=rank_out[:, 1])
    rank_out[:, 2] = sent
    pair = _pairs(lf, sol, routing, rank_dc)
    flat = np.flatnonzero(pair)
    ps, pd = np.divmod(flat, num_dcs)
    dc_tokens = sol.local.sum(axis=1) / top_k  # sums of integers: exact, in any order
    return TokenTraffic(
        rank_tokens, rank_out, rank_in, ps.astype(np.int64), pd.astype(np.int64),
        pair[flat], dc_tokens,
    )  # fmt: skip


def _pairs(
    lf: np.ndarray, sol: DomainSolution, routing: HolderRouting, rank_dc: np.ndarray
) -> np.ndarray:
    """[D * D] tokens from DC ``a`` to DC ``b`` (``a * D + b``) of the route of ``sol`` on
    ``lf`` [R, E] (its integer load, or floats of it): an expert held in one DC gets every other
    DC's tokens (``sol.local``, no [R, E] pass), one held in more goes source by source.
    Sums of integers: exact in any order (the same floats as summing every cell)."""
    num_dcs = sol.holds.shape[0]
    dd = num_dcs * num_dcs
    if routing.to_v is not sol.to_v:  # another route than this routing's: every cell
        to_dc = sol.v_dc[sol.to_v]  # [R, E] (where nobody holds e, nothing is sent)
        key = (rank_dc[:, None] * num_dcs + to_dc).ravel()
        away = np.where(routing.here, 0.0, lf)
        return np.bincount(key, weights=away.ravel(), minlength=dd)
    pair = np.bincount(routing.one_keys, weights=sol.local.ravel()[routing.one_cells], minlength=dd)
    if routing.many_cells.size:
        more = np.bincount(routing.many_keys, weights=lf.ravel()[routing.many_cells], minlength=dd)
        pair = pair + more
    return pair.astype(np.float64, copy=False)  # empty weights count in int64


def rehome(
    placement: Placement, load: np.ndarray, topology: Topology, reserve: int = 0
) -> Placement:
    """The base of a placement that may hold some ``(d, e)`` more than once (last
    microbatch's replicas): masters stay in their slots, every other held ``(d, e)`` keeps
    exactly one of its copies in ``d``, in its slot. Copies are kept heaviest first (on
    ``load`` [R, E]: the DC's own tokens plus an even share of the tokens of DCs without
    ``e``) on the holder with the least work so far; masters count first. ``reserve``:
    a holder whose kept copies would leave fewer than ``reserve`` free slots is passed
    over while another holder has room (the fast loop's spare slots stay spread over the
    ranks: a rank full of cold experts cannot take a replica of a hot one). Nothing
    moves."""
    num_ranks, num_slots = placement.phy2log.shape
    num_experts = int(placement.master.size)
    rank_dc, num_dcs = topology.rank_dc, topology.num_dcs
    # every (rank, expert) held, in the order of np.nonzero(placement.holds()), from the
    # slots (not an [R, E] pass), and the copies of each expert in each DC
    rs, ss = np.nonzero(placement.phy2log >= 0)
    mrank = placement.master_rank()
    if _masters_dcs_only(placement, rs, ss, mrank, rank_dc):
        return _masters_kept(placement)
    cr, ce = np.divmod(np.unique(rs * num_experts + placement.phy2log[rs, ss]), num_experts)
    cd = rank_dc[cr]
    count = np.bincount(cd * num_experts + ce, minlength=num_dcs * num_experts)
    count = count.reshape(num_dcs, num_experts)  # [D, E] ranks of d holding e
    holds = count > 0  # dc_holds(placement, topology)
    local = sum_rows(load, rank_dc, num_dcs)
    h = holds.sum(axis=0)
    sent = np.where(holds, 0.0, local).sum(axis=0) / np.maximum(h, 1)  # [E] to each holder
    weight = np.where(holds, local + sent[None, :], 0.0)  # [D, E]
    mdc = rank_dc[mrank]
    work = np.bincount(mrank, weights=weight[mdc, np.arange(num_experts)], minlength=num_ranks)
    home = np.full(holds.shape, -1, np.int64)  # [D, E]
    home[mdc, np.arange(num_experts)] = mrank
    single = (home[cd, ce] < 0) & (count[cd, ce] == 1)
    home[cd[single], ce[single]] = cr[single]
    np.add.at(work, cr[single], weight[cd[single], ce[single]])
    kept = np.bincount(mrank, minlength=num_ranks) + np.bincount(cr[single], minlength=num_ranks)
    d, e = np.nonzero((home < 0) & holds)  # held more than once, home not chosen yet
    if d.size:
        holds_r = np.zeros((num_ranks, num_experts), bool)  # [R, E]
        holds_r[cr, ce] = True
        sizes = np.bincount(rank_dc, minlength=num_dcs)
        width = int(sizes.max())
        start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        valid = np.arange(width)[None, :] < sizes[:, None]
        ranks = np.where(valid, start[:, None] + np.arange(width)[None, :], 0)  # [D, width]
        order = np.lexsort((e, -weight[d, e], d))
        d, e = d[order], e[order]
        pos = np.arange(d.size) - np.searchsorted(d, d, "left")
        for i in range(int(pos.max()) + 1):
            dd, ee = d[pos == i], e[pos == i]
            rr = ranks[dd]  # [n, width]
            ok = valid[dd] & holds_r[rr, ee[:, None]]
            roomy = ok & (kept[rr] < num_slots - reserve)
            ok = np.where(roomy.any(axis=1)[:, None], roomy, ok)
            col = np.argmin(np.where(ok, work[rr], np.inf), axis=1)
            chosen = rr[np.arange(dd.size), col]
            home[dd, ee] = chosen
            np.add.at(work, chosen, weight[dd, ee])
            np.add.at(kept, chosen, 1)
    keep = np.zeros((num_ranks, num_slots), bool)
    keep.reshape(-1)[placement.master] = True
    d, e = np.nonzero(home >= 0)
    hr = home[d, e]
    slot = np.argmax(placement.phy2log[hr] == e[:, None], axis=1)
    keep[hr, slot] = True
    return Placement(np.where(keep, placement.phy2log, -1).astype(np.int32), placement.master)


def _masters_dcs_only(
    placement: Placement, rs: np.ndarray, ss: np.ndarray, mrank: np.ndarray, rank_dc: np.ndarray
) -> bool:
    """Whether every copy of ``placement`` (in slots ``(rs, ss)``) lies in its master's DC,
    and none but the master on the master's rank: then :func:`rehome` keeps the masters
    alone (each held ``(d, e)`` is a master's), whatever the load."""
    e = placement.phy2log[rs, ss]
    mr = mrank[e]
    if not np.array_equal(rank_dc[rs], rank_dc[mr]):
        return False
    on_master = rs == mr
    flat = rs[on_master] * placement.phy2log.shape[1] + ss[on_master]
    return bool(np.array_equal(flat, placement.master[e[on_master]]))


def _masters_kept(placement: Placement) -> Placement:
    """``placement`` with every slot but the masters' emptied (what :func:`rehome` keeps
    when :func:`_masters_dcs_only`), read-only and memoized by what it is made of (the
    masters' slots and what they hold): between re-plans every microbatch's base is the
    same object, which :func:`_base_parts` and :func:`holder_routing` know at once."""
    p2l, master = placement.phy2log, placement.master
    key = (p2l.shape, p2l.dtype.str, master.dtype.str, master.tobytes(),
           p2l.reshape(-1)[master].tobytes())  # fmt: skip
    got = _KEPT.get(key)
    if got is None:
        keep = np.zeros(p2l.shape, bool)
        keep.reshape(-1)[master] = True
        got = Placement(np.where(keep, p2l, -1).astype(np.int32), master.copy())
        got.phy2log.setflags(write=False)
        got.master.setflags(write=False)
        _remember(_KEPT, key, got, _KEPT_KEPT)
    return got


#: :func:`_masters_kept` of the last few placements
_KEPT: dict[tuple[object, ...], Placement] = {}
_KEPT_KEPT = 8
