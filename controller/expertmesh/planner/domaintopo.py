"""What :mod:`expertmesh.planner.domainquota` derives once per topology or keeps between
calls: the domains of consecutive DCs (:func:`merge_dcs`, :func:`domain_sizes`), the sums
of a load by node and DC, and whether an array can still change (moved out of
``domainquota``, which re-exports the public names; whether a topology's nodes are its DCs
and the memo eviction are ``trafficbase``'s, shared with the traffic views)."""

from __future__ import annotations

import weakref

import numpy as np

from expertmesh.planner.topology import DC, Topology
from expertmesh.planner.traffic import level_sums
from expertmesh.planner.trafficbase import _remember, _whole_runs

__all__ = ["domain_sizes", "merge_dcs"]


def _in_order(group: np.ndarray, num_groups: int) -> bool:
    """Whether ``group`` [R] is ``num_groups`` groups of one size, in order (a topology's
    ``rank_dc``), memoized by value."""
    key = (num_groups, group.dtype.str, group.tobytes())
    got = _IN_ORDER.get(key)
    if got is None:
        num_rows = group.size
        got = bool(num_groups and num_rows % num_groups == 0) and bool(
            np.array_equal(group, np.repeat(np.arange(num_groups), num_rows // num_groups))
        )
        _remember(_IN_ORDER, key, got, 16)
    return got


_IN_ORDER: dict[tuple[object, ...], bool] = {}


def _frozen(a: np.ndarray) -> bool:
    """Whether ``a`` can no longer change: read-only and owning its data (not a view)."""
    return not a.flags.writeable and a.base is None


def _level_sums(left: np.ndarray, topology: Topology, *, exact: bool) -> list[np.ndarray]:
    """:func:`~expertmesh.planner.traffic.level_sums` of ``left`` [R, E] (its [R, E], node
    and DC entries). ``exact``: ``left`` holds integers, so its sums are exact in any order
    (the same floats): with every node of the same ranks and every DC of the same nodes,
    consecutive (:func:`~expertmesh.planner.trafficbase._whole_runs`), one reshaped sum per
    level."""
    runs = _whole_runs(topology) if exact else None
    if runs is None:
        return level_sums(left, topology)[:3]
    per_node, per_dc = runs  # per_dc 0: each node a DC
    node = left.reshape(-1, per_node, left.shape[1]).sum(axis=1)
    dc = node if per_dc <= 1 else node.reshape(-1, per_dc, node.shape[1]).sum(axis=1)
    return [left, node, dc]


def merge_dcs(topology: Topology, size: int) -> Topology | None:
    """``topology`` with every ``size`` consecutive DCs merged into one domain (a DC of the
    returned topology; the same ranks, nodes and numbering), or ``None`` when ``size`` does
    not divide the DC count or the DCs of a domain have different ranks per node. What
    :func:`domain_quota` balances inside when the domain is a group of DCs; links are those
    of ``topology`` (the caller costs traffic on ``topology`` itself). Built once per
    topology and size (a frozen topology: its derived arrays are computed once too)."""
    if size == 1:
        return topology
    known = _MERGED.get(topology)
    if known is None:
        known = _MERGED[topology] = {}
    if size not in known:
        known[size] = _merged(topology, size)
    return known[size]


#: :func:`merge_dcs` of every topology alive, by size
_MERGED: weakref.WeakKeyDictionary[Topology, dict[int, Topology | None]] = (
    weakref.WeakKeyDictionary()
)


def _merged(topology: Topology, size: int) -> Topology | None:
    num_dcs = topology.num_dcs
    if size < 1 or num_dcs % size:
        return None
    merged = []
    for i in range(0, num_dcs, size):
        group = topology.dcs[i : i + size]
        if len({d.ranks_per_node for d in group}) != 1:
            return None
        nodes = sum(d.nodes for d in group)
        merged.append(DC(f"domain{i // size:04d}", nodes, group[0].ranks_per_node))
    return Topology(
        tuple(merged), topology.masters_per_rank, topology.spare_per_rank,
        topology.intra_node, topology.intra_dc, topology.inter_dc,
    )  # fmt: skip


def domain_sizes(topology: Topology) -> list[int]:
    """Candidate domain sizes in DCs: 1, 2, 4, ... and every DC, those :func:`merge_dcs`
    can build."""
    n = topology.num_dcs
    sizes = sorted({*(2**i for i in range(n.bit_length()) if 2**i <= n), n})
    return [k for k in sizes if merge_dcs(topology, k) is not None]
