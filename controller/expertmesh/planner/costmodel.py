"""Stream-based cost model of one step of one MoE layer (equations: docs/cost-model.md).

A step is a chain of phases: dispatch, expert compute, combine (forward) and,
when training, combine backward, expert compute backward, dispatch backward
(with the replica gradients returning to their masters on the same links).
Every link runs its streams in parallel and a communication phase ends when
its slowest link drains (latency + bytes / bandwidth); a compute phase ends
when the busiest rank is done. Expert streams that need not wait for the chain
(replica weight refresh, migrations) run in the background; they slow the step
only when a link's total bytes over the step exceed what it can carry in the
chain's time. The step time is the larger of the chain and that busiest link:
the slowest path.

Links: one per ordered DC pair (its own bandwidth and latency, per-pair
overrides included), and per rank two full-duplex ports: the node fabric
(intra-node link) and the NIC (intra-DC link) that carries everything leaving
the node, cross-DC traffic included. Nothing here builds an ``[R, R]`` array.

Public entry: :func:`step_cost`; inputs :class:`~expertmesh.planner.traffic.TokenTraffic`
(token streams) and :class:`ExpertStreams` (built by :func:`replica_streams` and
:func:`migration_streams`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import Placement
from expertmesh.planner.topology import Topology
from expertmesh.planner.traffic import Domain, TokenTraffic, _sorted_unique, even_traffic
from expertmesh.planner.trafficbase import _rank_shell as _shell
from expertmesh.planner.trafficbase import _remember

__all__ = [
    "PHASES",
    "CostSettings",
    "ExpertStreams",
    "StepCost",
    "TransferEncoding",
    "copy_streams",
    "crossings",
    "expected_crossings",
    "migration_streams",
    "modeled_step",
    "pair_links",
    "placement_cost",
    "replica_streams",
    "step_cost",
    "step_costs",
    "transfer_seconds",
]

PHASES = ("dispatch", "compute_fwd", "combine", "combine_bwd", "compute_bwd", "dispatch_bwd")
# port columns: node fabric out/in, NIC out/in (bytes)
_NODE_OUT, _NODE_IN, _NIC_OUT, _NIC_IN = range(4)


class CostSettings(BaseModel):
    """Knobs of the cost model that are not in the topology or the model."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    flops_per_second: float = Field(
        default=4e14, gt=0, description="sustained expert FLOP/s of one rank (H100 bf16 ~40% MFU)"
    )
    pipeline_chunks: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="chunks that dispatch, compute and combine are pipelined in (1: no overlap)",
    )
    microbatches_per_update: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="microbatches (trace steps) per optimizer step; replicas exchange weights "
        "and gradients once per update",
    )
    hierarchical: bool = Field(
        default=True,
        description="a token crosses a DC pair once however many of its experts are there "
        "(False: once per top-k assignment)",
    )
    solve_on_critical_path: bool = Field(
        default=True,
        description="the simulator charges a per-microbatch policy's measured solve CPU time "
        "(with its replica fan-out) where dispatch does not hide it (False: fan-out only, "
        "deterministic)",
    )
    message_seconds: float = Field(
        default=0.0,
        ge=0,
        le=60,
        description="fixed software time of one communication phase (dispatch, combine and "
        "their backward), per pipeline chunk, whatever it carries (0: hardware-bound "
        "transport; the runtime benchmark calibrates it)",
    )


class TransferEncoding(BaseModel):
    """How expert weights and gradients travel (parameter-efficient migration settings)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    weight_bytes: float | None = Field(
        default=None, gt=0, le=8, description="bytes per weight on the wire (None: the model's)"
    )
    grad_bytes: float | None = Field(
        default=None, gt=0, le=8, description="bytes per gradient on the wire (None: the model's)"
    )
    changed_fraction: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="share of a replica's weights that changed since its last copy (one update "
        "earlier); below 1 the refresh sends only those plus a 1-bit-per-weight mask",
    )

    def refresh_bytes(self, model: ModelSpec) -> float:
        """Bytes of one replica refresh (weights out, master -> replica)."""
        wb = model.weight_bytes if self.weight_bytes is None else self.weight_bytes
        if self.changed_fraction >= 1.0:
            return float(model.expert_params * wb)
        return float(model.expert_params * (self.changed_fraction * wb + 1.0 / 8.0))

    def gradient_bytes(self, model: ModelSpec) -> float:
        """Bytes of one replica gradient (replica -> master)."""
        gb = model.grad_bytes if self.grad_bytes is None else self.grad_bytes
        return float(model.expert_params * gb)

    def copy_bytes(self, model: ModelSpec, master: bool, changed: float = 1.0) -> float:
        """Bytes to place a copy: weights (only the ``changed`` share plus the mask when the
        receiver held an older copy), plus full-precision optimizer state for a master."""
        wb = model.weight_bytes if self.weight_bytes is None else self.weight_bytes
        weights = model.expert_params * (wb if changed >= 1.0 else changed * wb + 1.0 / 8.0)
        return float(weights + (model.expert_params * model.optimizer_bytes if master else 0))


@dataclass(frozen=True, eq=False)
class ExpertStreams:
    """Expert bytes of one layer at one step.

    - ``pair_src``, ``pair_dst``: [Q] int64 DC indices; ``pair_tail``: [Q] bytes that
      must cross on the backward tail (replica gradients); ``pair_background``: [Q] bytes
      streamed in the background (weight refresh, migrations).
    - ``port_tail``, ``port_background``: [R, 4] bytes per rank port: node fabric out, in,
      NIC out, in.
    """

    pair_src: np.ndarray
    pair_dst: np.ndarray
    pair_tail: np.ndarray
    pair_background: np.ndarray
    port_tail: np.ndarray
    port_background: np.ndarray

    @classmethod
    def empty(cls, num_ranks: int) -> ExpertStreams:
        z = np.zeros(0)
        zi = np.zeros(0, dtype=np.int64)
        return cls(zi, zi, z, z, np.zeros((num_ranks, 4)), np.zeros((num_ranks, 4)))

    def __add__(self, other: ExpertStreams) -> ExpertStreams:
        return ExpertStreams(
            np.concatenate([self.pair_src, other.pair_src]),
            np.concatenate([self.pair_dst, other.pair_dst]),
            np.concatenate([self.pair_tail, other.pair_tail]),
            np.concatenate([self.pair_background, other.pair_background]),
            self.port_tail + other.port_tail,
            self.port_background + other.port_background,
        )

    @property
    def cross_dc_bytes(self) -> float:
        return float(self.pair_tail.sum() + self.pair_background.sum())


@dataclass(frozen=True)
class StepCost:
    """Modeled time of one step of one layer and what it is made of (seconds, bytes)."""

    seconds: float
    chain_seconds: float
    resource_seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    imbalance: float = 1.0
    cross_dc_token_bytes: float = 0.0
    cross_dc_weight_bytes: float = 0.0
    bottleneck: str = ""


def replica_streams(
    placement: Placement,
    topology: Topology,
    model: ModelSpec,
    settings: CostSettings | None = None,
    encoding: TransferEncoding | None = None,
) -> ExpertStreams:
    """Per-step streams that keep replicas in sync with their masters (training only).

    Each replica receives the master's weights (background) and returns its gradient
    (on the backward tail when ``microbatches_per_update == 1``, else in the background),
    once per update, amortized over ``microbatches_per_update`` trace steps. Copies of one
    expert in one remote DC share one WAN crossing per direction (the first relays the
    others inside the DC); every participant's port carries one copy per direction.
    Memoized by value, read-only: the same streams for the same experts on each rank,
    whatever their slots, and the same master ranks (a policy's model and the simulator
    cost the same placement, slots permuted by the alignment).
    """
    settings = settings or CostSettings()
    encoding = encoding or TransferEncoding()
    num_ranks = placement.num_ranks
    if not model.training:
        return ExpertStreams.empty(num_ranks)
    per = float(settings.microbatches_per_update)
    w = encoding.refresh_bytes(model) / per
    g = encoding.gradient_bytes(model) / per
    p2l = placement.phy2log
    mrank = placement.master_rank()
    # what the streams depend on: each rank's experts (not their slots: every port bin sums
    # copies of one value, the WAN keys are sorted), the masters' ranks, the bytes
    key = (w, g, settings.microbatches_per_update == 1, p2l.shape, p2l.dtype.str,
           np.sort(p2l, axis=1).tobytes(), mrank.dtype.str, mrank.tobytes())  # fmt: skip
    memo = _SYNCS.get(topology)
    if memo is None:
        memo = _SYNCS[topology] = {}
    got = memo.get(key)
    if got is None:
        got = _replica_streams(placement, mrank, topology, settings, (w, g))
        for a in (got.pair_src, got.pair_dst, got.pair_tail, got.pair_background,
                  got.port_tail, got.port_background):  # fmt: skip
            a.flags.writeable = False  # shared by every caller with these copies
        _remember(memo, key, got, _SYNCS_KEPT)
    return got


#: per topology, :func:`replica_streams` of the last few placements by value (the
#: simulator asks again for the placement a policy's own model costed, slots permuted)
_SYNCS: weakref.WeakKeyDictionary[Topology, dict[tuple[object, ...], ExpertStreams]] = (
    weakref.WeakKeyDictionary()
)
_SYNCS_KEPT = 8


def _replica_streams(
    placement: Placement,
    mrank: np.ndarray,
    topology: Topology,
    settings: CostSettings,
    sizes: tuple[float, float],
) -> ExpertStreams:
    """:func:`replica_streams` of ``placement`` (masters on ranks ``mrank`` [E]) when
    training, with ``sizes``: the weight and gradient bytes of one sync per step."""
    w, g = sizes
    num_ranks = placement.num_ranks
    flat = placement.phy2log.ravel()
    slot = np.flatnonzero(flat >= 0)  # every copy, rank by rank
    cr = slot // placement.slots_per_rank
    ce = flat[slot].astype(np.int64)
    m = mrank[ce]
    keep = cr != m  # replicas on another rank than their master
    if not keep.any():
        return ExpertStreams.empty(num_ranks)
    cr, ce, m = cr[keep], ce[keep], m[keep]
    shell = _shell(topology, cr, m)  # 1 node, 2 DC, 3 other DC (never 0: another rank)
    nic = shell >= 2
    # [R, 4] port bytes, one bincount over (rank, column) bins per direction of the sync.
    # Every bin adds copies of one value (w or g), so its sum depends on its count alone.
    # Replica side: weights in (node or NIC in), gradient out; master side: once per expert
    # and fabric it uses, weights out, gradient in.
    num_experts = placement.master.size
    used = _sorted_unique(ce * 2 + nic, 2 * num_experts)  # (expert, NIC?) pairs
    into_rep = cr * 4 + (2 * nic + _NODE_IN)  # the replica's in column (NODE_IN / NIC_IN)
    out_mst = mrank[used >> 1] * 4 + 2 * (used & 1)  # the master's out column (NODE/NIC_OUT)
    # a bin's out and in columns differ by one: the gradient swaps them
    w_bins = np.concatenate([into_rep, out_mst])
    g_bins = w_bins ^ 1
    n = w_bins.size
    w_port = np.bincount(w_bins, np.full(n, w), minlength=4 * num_ranks).reshape(num_ranks, 4)
    g_port = np.bincount(g_bins, np.full(n, g), minlength=4 * num_ranks).reshape(num_ranks, 4)
    tail: np.ndarray
    back: np.ndarray
    if settings.microbatches_per_update == 1:
        tail, back = g_port, w_port
    else:  # each column holds a weight sum and a gradient sum, one of them 0
        tail, back = np.zeros((num_ranks, 4)), w_port + g_port
    # WAN: one crossing per (expert, remote DC)
    remote = shell == 3
    num_dcs = topology.num_dcs
    key = _sorted_unique(ce[remote] * num_dcs + topology.rank_dc[cr[remote]], num_experts * num_dcs)
    e, x = key // num_dcs, key % num_dcs
    mdc = topology.rank_dc[mrank[e]]
    src, dst = np.concatenate([mdc, x]), np.concatenate([x, mdc])  # weights out, grads back
    k = e.size
    ptail, pback = np.zeros(2 * k), np.empty(2 * k)
    pback[:k] = w
    if settings.microbatches_per_update == 1:
        ptail[k:] = g
        pback[k:] = 0.0
    else:
        pback[k:] = g
    return ExpertStreams(src, dst, ptail, pback, tail, back)


def migration_streams(
    src_rank: np.ndarray,
    dst_rank: np.ndarray,
    nbytes: np.ndarray,
    topology: Topology,
    scale: float = 1.0,
) -> ExpertStreams:
    """Background streams of expert transfers ``src_rank -> dst_rank`` of ``nbytes`` (all
    [M]), multiplied by ``scale`` (the share of the transfer streamed during this step)."""
    src_rank = np.asarray(src_rank, dtype=np.int64)
    dst_rank = np.asarray(dst_rank, dtype=np.int64)
    nb = np.asarray(nbytes, dtype=np.float64) * scale
    num_ranks = topology.num_ranks
    if src_rank.size == 0:
        return ExpertStreams.empty(num_ranks)
    shell = _shell(topology, src_rank, dst_rank)
    # one bincount over (rank, column) bins, 5 a rank: the 4 port columns and one for a
    # transfer within its rank (no port); each bin adds its transfers in order
    bins = np.concatenate([src_rank * 5 + _OUT_COL[shell], dst_rank * 5 + _IN_COL[shell]])
    sums = np.bincount(bins, np.concatenate([nb, nb]), minlength=5 * num_ranks)
    back = np.zeros((num_ranks, 4))
    back += sums.reshape(num_ranks, 5)[:, :4]
    remote = shell == 3
    return ExpertStreams(
        topology.rank_dc[src_rank[remote]],
        topology.rank_dc[dst_rank[remote]],
        np.zeros(int(remote.sum())),
        nb[remote],
        np.zeros((num_ranks, 4)),
        back,
    )


#: per shell (0 same rank, 1 node, 2 DC, 3 other DC): the sender's and the receiver's port
#: column (4: none)
_OUT_COL = np.array([4, _NODE_OUT, _NIC_OUT, _NIC_OUT])
_IN_COL = np.array([4, _NODE_IN, _NIC_IN, _NIC_IN])


def transfer_seconds(streams: ExpertStreams, topology: Topology) -> float:
    """Seconds until every byte of ``streams`` (tail and background alike) has arrived when
    they all start together: the slowest DC pair (``L_ab + bytes / B_ab``, pairs summed by
    key) or rank port (full duplex, node fabric and NIC). What a microbatch waits for when
    its replicas' weights must land before their tokens compute (docs/cost-model.md)."""
    num_dcs = topology.num_dcs
    t = 0.0
    if streams.pair_src.size:
        key = streams.pair_src * num_dcs + streams.pair_dst
        pair_bytes = streams.pair_tail + streams.pair_background
        if num_dcs * num_dcs <= _DENSE_PAIRS:  # every pair its own slot (absent ones carry 0)
            _, _, bw, lat = _dense_links(topology)
            nb = np.bincount(key, weights=pair_bytes, minlength=num_dcs * num_dcs)
        else:
            keys, inv = _index(key, num_dcs * num_dcs)
            nb = np.bincount(inv, weights=pair_bytes)
            a, b = keys // num_dcs, keys % num_dcs
            bw = topology.dc_gbps[a, b] * 1e9 / 8.0
            lat = topology.dc_latency_ms[a, b] / 1e3
        t = float(np.max(lat + nb / bw, where=nb > 0, initial=0.0))
    ports = streams.port_tail + streams.port_background  # [R, 4]
    if ports.shape[0]:  # the busiest port of each fabric from its columns' largest bytes
        col = ports.max(axis=0).tolist()
        node, nic = topology.intra_node, topology.intra_dc
        busy_node = max(col[_NODE_OUT], col[_NODE_IN])
        busy_nic = max(col[_NIC_OUT], col[_NIC_IN])
        if busy_node > 0:
            t = max(t, node.latency_s + busy_node / node.bytes_per_second)
        if busy_nic > 0:
            t = max(t, nic.latency_s + busy_nic / nic.bytes_per_second)
    return t


def crossings(traffic: TokenTraffic, top_k: int, hierarchical: bool = True) -> np.ndarray:
    """[P] tokens that cross each DC pair of ``traffic`` in one direction of one phase.

    Flat all-to-all (``hierarchical=False``): one crossing per assignment. Hierarchical: exact
    when the traffic carries ``pair_crossings``, else the expected number of distinct tokens
    under independent top-k draws: ``n_s * (1 - (1 - a / (n_s * k)) ** k)`` for ``a``
    assignments of the ``n_s`` tokens of the source DC (docs/cost-model.md).
    """
    a = traffic.pair_tokens
    if not hierarchical:  # flat all-to-all: every assignment crosses on its own
        return a
    if traffic.pair_crossings is not None:
        return traffic.pair_crossings
    if top_k == 1:
        return a
    return expected_crossings(traffic.dc_tokens[traffic.pair_src], a, top_k)


def expected_crossings(n: np.ndarray, a: np.ndarray, top_k: int) -> np.ndarray:
    """Expected distinct tokens among ``n`` tokens of top-``top_k`` that carry ``a``
    assignments to one place, under independent draws: ``n * (1 - (1 - a/(n k))^k)``,
    clipped to ``[a / k, min(a, n)]``. ``n``, ``a``: broadcastable float arrays."""
    n = np.asarray(n, dtype=np.float64)
    a = np.asarray(a, dtype=np.float64)
    if n.shape != a.shape:
        n, a = np.broadcast_arrays(n, a)
    has = n > 0
    p = np.zeros(n.shape)
    np.divide(a, n * top_k, out=p, where=has)  # 0 where there are no tokens
    p = np.minimum(np.maximum(p, 0.0), 1.0)
    x = n * -np.expm1(top_k * np.log1p(-np.minimum(p, 1 - 1e-15)))
    x = np.where(p >= 1.0, n, x)
    return np.minimum(np.maximum(x, a / top_k), np.minimum(a, np.where(has, n, a)))


def _index(keys: np.ndarray, space: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_inverse=True)`` for int keys in ``[0, space)``; a dense
    table when ``space`` is small (4M: 2,000 DCs), a sort otherwise."""
    if space > 4_000_000:
        return np.unique(keys, return_inverse=True)
    present = np.zeros(space, bool)
    present[keys] = True
    uniq = np.flatnonzero(present)
    pos = np.zeros(space, np.int64)
    pos[uniq] = np.arange(uniq.size)
    return uniq, pos[keys]


def _pipe(parts: tuple[float, ...], chunks: int) -> float:
    """Phases that pipeline over ``chunks`` chunks: the longest plus 1/chunks of the rest."""
    longest = max(parts)
    return longest + (sum(parts) - longest) / chunks


def _dense_links(topology: Topology) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per topology: ``(src, dst, bytes/s, latency s)`` of every ordered DC pair, flat over
    the key ``src * D + dst`` (the values :func:`step_cost` reads per key, the same floats)."""
    got = _LINKS.get(topology)
    if got is None:
        d = topology.num_dcs
        key = np.arange(d * d)
        got = (key // d, key % d, topology.dc_gbps.reshape(-1) * 1e9 / 8.0,
               topology.dc_latency_ms.reshape(-1) / 1e3)  # fmt: skip
        for a in got:
            a.flags.writeable = False
        _LINKS[topology] = got
    return got


def pair_links(topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    """[D, D] bytes per second and latency in seconds of every ordered DC pair (read-only
    views of :func:`_dense_links`' arrays, once per topology: the floats of
    ``dc_gbps * 1e9 / 8.0`` and ``dc_latency_ms / 1e3``)."""
    d = topology.num_dcs
    _, _, bw, lat = _dense_links(topology)
    return bw.reshape(d, d), lat.reshape(d, d)


#: per topology: :func:`_dense_links`
_LINKS: weakref.WeakKeyDictionary[
    Topology, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
] = weakref.WeakKeyDictionary()
#: DC pairs at most for the dense per-pair arrays of :func:`step_cost` (64 DCs), else a sort
_DENSE_PAIRS = 4096
#: port columns swapped: out <-> in of each fabric
_SWAP = np.array([_NODE_IN, _NODE_OUT, _NIC_IN, _NIC_OUT])


def _empty_streams(num_ranks: int) -> ExpertStreams:
    """A shared read-only :meth:`ExpertStreams.empty` (what ``step_cost`` uses for ``None``)."""
    got = _EMPTY.get(num_ranks)
    if got is None:
        got = ExpertStreams.empty(num_ranks)
        for a in (got.pair_src, got.pair_tail, got.port_tail, got.port_background):
            a.flags.writeable = False
        _EMPTY[num_ranks] = got
    return got


_EMPTY: dict[int, ExpertStreams] = {}


def step_cost(
    topology: Topology,
    model: ModelSpec,
    traffic: TokenTraffic,
    streams: ExpertStreams | None = None,
    settings: CostSettings | None = None,
    *,
    cross: np.ndarray | None = None,
) -> StepCost:
    """Modeled seconds of one step of one layer (docs/cost-model.md has the equations).

    ``traffic``: token streams; ``streams``: expert streams (replica sync, migrations) or
    ``None`` for none. Training or forward-only follows ``model.training``. ``cross``:
    ``crossings(traffic, model.top_k, settings.hierarchical)`` when the caller has it.
    """
    settings = settings or CostSettings()
    num_ranks, num_dcs = topology.num_ranks, topology.num_dcs
    if traffic.num_ranks != num_ranks:
        raise ValueError(f"traffic has {traffic.num_ranks} ranks, the topology {num_ranks}")
    no_streams = streams is None
    streams = _empty_streams(num_ranks) if streams is None else streams
    if streams.port_tail.shape != (num_ranks, 4):
        raise ValueError(f"expert streams must have ports [{num_ranks}, 4]")
    tb = float(model.token_bytes)
    train = model.training

    # ---- ordered DC pairs: token crossings and expert bytes, summed by key ----
    x = crossings(traffic, model.top_k, settings.hierarchical) if cross is None else cross
    src, dst = traffic.pair_src, traffic.pair_dst
    fwd_key = src * num_dcs + dst  # dispatch direction
    rev_key = dst * num_dcs + src  # combine direction
    q = streams.pair_src.size
    exp_key = streams.pair_src * num_dcs + streams.pair_dst if q else src[:0]
    if num_dcs * num_dcs <= _DENSE_PAIRS:  # every pair its own slot (absent ones carry 0)
        ksrc, kdst, bw, lat = _dense_links(topology)
        inv_f, inv_r, inv_e, nkeys = fwd_key, rev_key, exp_key, num_dcs * num_dcs
    else:  # the pairs present, sorted (the same order as the dense slots)
        keys, inv = _index(np.concatenate([fwd_key, rev_key, exp_key]), num_dcs * num_dcs)
        p, nkeys = fwd_key.size, keys.size
        inv_f, inv_r, inv_e = inv[:p], inv[p : 2 * p], inv[2 * p :]
        ksrc, kdst = keys // num_dcs, keys % num_dcs
        bw = topology.dc_gbps[ksrc, kdst] * 1e9 / 8.0  # [K] bytes/s
        lat = topology.dc_latency_ms[ksrc, kdst] / 1e3
    xb = x * tb
    disp = np.bincount(inv_f, weights=xb, minlength=nkeys)  # bytes per key, dispatch phase
    comb = np.bincount(inv_r, weights=xb, minlength=nkeys)  # bytes per key, combine phase

    if q:
        gtail = np.bincount(inv_e, weights=streams.pair_tail, minlength=nkeys)
        gback = np.bincount(inv_e, weights=streams.pair_background, minlength=nkeys)
    # each phase's busiest loaded pair: max over nbytes > 0 of lat + nbytes / bw (0 if
    # none), in one pass: dispatch, combine and (training, with expert bytes) dispatch
    # backward, combine's links plus the replica gradients
    rows = 3 if train and q else 2
    phase_bytes = np.empty((rows, nkeys))
    phase_bytes[0] = disp
    phase_bytes[1] = comb
    if rows == 3:
        np.add(comb, gtail, out=phase_bytes[2])
    busiest = np.max(lat + phase_bytes / bw, axis=1, where=phase_bytes > 0, initial=-np.inf)
    links = [t if t > -np.inf else 0.0 for t in busiest.tolist()]

    # ---- rank ports [R, 4] (tokens in bytes per phase): node out, in, NIC out, in ----
    out_t, in_t = traffic.rank_out * tb, traffic.rank_in * tb  # [R, 3]
    assign_out = np.bincount(src, weights=traffic.pair_tokens, minlength=num_dcs)
    cross_out = np.bincount(src, weights=x, minlength=num_dcs)
    dedup = np.ones(num_dcs)  # [D]
    np.divide(cross_out, assign_out, out=dedup, where=assign_out > 0)
    tok = np.empty((num_ranks, 4))
    tok[:, _NODE_OUT] = out_t[:, 0]
    tok[:, _NODE_IN] = in_t[:, 0]
    np.multiply(out_t[:, 2], dedup[topology.rank_dc], out=tok[:, _NIC_OUT])
    tok[:, _NIC_OUT] += out_t[:, 1]
    np.add(in_t[:, 1], in_t[:, 2], out=tok[:, _NIC_IN])
    node, nic = topology.intra_node, topology.intra_dc
    bw_node, lat_node = node.bytes_per_second, node.latency_s
    bw_nic, lat_nic = nic.bytes_per_second, nic.latency_s

    def port_phase(most: list[float]) -> float:
        # the busiest rank port from each column's largest bytes (``most``, [4])
        busy_node = max(most[_NODE_OUT], most[_NODE_IN])
        busy_nic = max(most[_NIC_OUT], most[_NIC_IN])
        return max(
            lat_node + busy_node / bw_node if busy_node > 0 else 0.0,
            lat_nic + busy_nic / bw_nic if busy_nic > 0 else 0.0,
        )

    pt, pb = streams.port_tail, streams.port_background
    chunks = settings.pipeline_chunks
    msg = settings.message_seconds * chunks  # every communication phase pays it
    # a port's time is its busier direction's, so dispatch and combine load the ports alike
    ports = port_phase(tok.max(axis=0).tolist()) if num_ranks else 0.0
    comb_link = links[1]
    dispatch = max(links[0], ports) + msg
    combine = max(comb_link, ports) + msg

    # ---- compute ----
    rank_tokens = traffic.rank_tokens
    most_tokens = float(rank_tokens.max(initial=0.0))
    compute_fwd = most_tokens * (2.0 * model.expert_params)
    compute_fwd /= settings.flops_per_second
    # the mean as np.mean computes it (pairwise sum, then / count), without its overhead
    size = rank_tokens.size
    mean_tokens = float(rank_tokens.sum()) / size if size else 0.0
    imbalance = most_tokens / mean_tokens if mean_tokens > 0 else 1.0

    phases = {"dispatch": dispatch, "compute_fwd": compute_fwd, "combine": combine}
    chain = _pipe((dispatch, compute_fwd, combine), chunks)
    swapped = tok[:, _SWAP]  # [R, 4] each port column's opposite direction
    if train:
        compute_bwd = 2.0 * compute_fwd
        # dispatch backward runs the combine direction; replica gradients share its links
        # and the ports carry the combine (each port's opposite direction) plus the tail
        tail_link = links[2] if q else comb_link  # + 0.0: the same bytes
        tail_ports = ports
        if not no_streams and num_ranks:
            tail_ports = port_phase((swapped + pt).max(axis=0).tolist())
        tail = msg + max(tail_link, tail_ports)
        phases |= {"combine_bwd": dispatch, "compute_bwd": compute_bwd, "dispatch_bwd": tail}
        chain += _pipe((dispatch, compute_bwd, combine), chunks) + (tail - combine)
        crossings_per_step = 2.0
    else:
        crossings_per_step = 1.0

    # ---- resource bound: every byte a link carries in the step ----
    link_total = crossings_per_step * (disp + comb)
    if q:
        link_total += gtail
        link_total += gback
    # a pair's time is its bytes / bandwidth (0 if it carries none)
    link_most = float(np.max(link_total / bw, where=link_total > 0, initial=0.0))
    # per port column: both directions' token bytes, then the expert bytes
    port_total = crossings_per_step * (tok + swapped) + pt
    port_total += pb
    if num_ranks:
        col = port_total.max(axis=0).tolist()  # dividing by a bandwidth keeps the order
        port_most = max(
            max(col[_NODE_OUT], col[_NODE_IN]) / bw_node,
            max(col[_NIC_OUT], col[_NIC_IN]) / bw_nic,
            0.0,
        )
    else:
        port_most = 0.0
    resource = max(link_most, port_most)

    if resource > chain:
        if link_most >= port_most:
            link_busy = np.where(link_total > 0, link_total / bw, 0.0)
            k = int(np.argmax(link_busy))
            a, b = topology.dcs[int(ksrc[k])].name, topology.dcs[int(kdst[k])].name
            bottleneck = f"link {a}->{b}"
        else:
            port_busy = np.maximum(
                np.maximum(port_total[:, 0], port_total[:, 1]) / bw_node,
                np.maximum(port_total[:, 2], port_total[:, 3]) / bw_nic,
            )
            bottleneck = f"port of rank {int(np.argmax(port_busy))}"
    else:
        bottleneck = "chain: " + max(phases, key=lambda k: phases[k])
    return StepCost(
        seconds=max(chain, resource),
        chain_seconds=chain,
        resource_seconds=resource,
        phases=phases,
        imbalance=imbalance,
        cross_dc_token_bytes=2.0 * crossings_per_step * float(x.sum()) * tb,
        cross_dc_weight_bytes=0.0 if no_streams else streams.cross_dc_bytes,
        bottleneck=bottleneck,
    )


def step_costs(
    topology: Topology,
    model: ModelSpec,
    traffics: Sequence[TokenTraffic],
    streams: Sequence[ExpertStreams],
    settings: CostSettings | None = None,
) -> list[StepCost]:
    """:func:`step_cost` of ``traffics[i]`` with ``streams[i]`` for every ``i``, each on its
    own copy of ``topology`` (the simulator's EP groups: one step of one policy in every
    group), in one pass of array operations over all of them instead of one per item.

    The same numbers as ``step_cost`` item by item (:func:`step_cost` is its reference):
    each item's link bytes are summed by ``bincount`` in the same order, and its maxima
    taken over its own links and ranks.
    """
    from expertmesh.planner.stepbatch import batch_step_costs

    return batch_step_costs(topology, model, traffics, streams, settings)


def modeled_step(
    topology: Topology,
    model: ModelSpec,
    traffic: TokenTraffic,
    placement: Placement,
    *,
    settings: CostSettings | None = None,
    encoding: TransferEncoding | None = None,
    extra: ExpertStreams | None = None,
    cross: np.ndarray | None = None,
) -> StepCost:
    """:func:`step_cost` of ``traffic`` on ``placement``: its replica sync streams
    (:func:`replica_streams`) plus ``extra`` streams (e.g. :func:`copy_streams`). The one
    "modeled time of a placement" of every policy that searches with the model. ``cross``:
    the traffic's :func:`crossings` when the caller has them."""
    streams = replica_streams(placement, topology, model, settings, encoding)
    if extra is not None:
        streams = streams + extra
    return step_cost(topology, model, traffic, streams, settings, cross=cross)


def copy_streams(
    previous: Placement,
    placement: Placement,
    topology: Topology,
    model: ModelSpec,
    *,
    encoding: TransferEncoding | None = None,
    scale: float = 1.0,
) -> ExpertStreams:
    """Background streams of the copies ``placement`` holds and ``previous`` does not (rank
    by rank), each sent from its expert's master rank in ``previous`` (a master with its
    optimizer state), times ``scale`` (the share streamed during one step)."""
    encoding = encoding or TransferEncoding()
    before = previous.holds()
    r, s = np.nonzero(placement.phy2log >= 0)
    e = placement.phy2log[r, s].astype(np.int64)
    new = ~before[r, e]
    if not new.any():
        return ExpertStreams.empty(placement.num_ranks)
    is_master = (r * placement.slots_per_rank + s) == placement.master[e]
    nbytes = np.where(
        is_master[new], encoding.copy_bytes(model, True), encoding.copy_bytes(model, False)
    )
    src = previous.master_rank()[e[new]]
    return migration_streams(src, r[new], nbytes, topology, scale=scale)


def placement_cost(
    topology: Topology,
    model: ModelSpec,
    load: np.ndarray,
    placement: Placement,
    *,
    domain: Domain,
    remote: Literal["spread", "master"],
    settings: CostSettings | None = None,
    encoding: TransferEncoding | None = None,
) -> StepCost:
    """:func:`step_cost` of ``placement`` routing ``load`` [R, E] by the even split
    (:func:`~expertmesh.planner.traffic.even_traffic` with ``domain`` and ``remote``), with
    its replica sync streams and no migration. What policies minimize."""
    traffic = even_traffic(load, placement, topology, model.top_k, domain=domain, remote=remote)
    return modeled_step(topology, model, traffic, placement, settings=settings, encoding=encoding)
