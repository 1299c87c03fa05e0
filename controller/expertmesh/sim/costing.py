"""The simulator's costing of a planned layer-step's weights: a migration's transfers
(:func:`~expertmesh.planner.migration.migration_moves`, memoized by value), their bytes
under a policy's encoding, their background streams and the microbatch's replica fan-out,
and a placement's replica sync streams (:func:`~expertmesh.planner.costmodel.replica_streams`,
memoized by value). Moved out of :mod:`expertmesh.sim.engine`, which calls these for each
planned layer-step; the memo is the engine's ``_World.memo`` (placements keyed by
:func:`_pkey`, once per placement object: ``_Memo.key``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from expertmesh.planner.costmodel import (
    ExpertStreams,
    migration_streams,
    replica_streams,
    transfer_seconds,
)
from expertmesh.planner.migration import migration_moves
from expertmesh.planner.plan import Placement
from expertmesh.planner.policy import Policy

if TYPE_CHECKING:
    from expertmesh.sim.engine import _PolicyState, _World


def _pkey(p: Placement) -> tuple[object, ...]:
    """A placement's identity by value: shapes, dtypes and bytes of ``phy2log`` and ``master``."""
    a, m = p.phy2log, p.master
    return (a.shape, a.dtype.str, a.tobytes(), m.shape, m.dtype.str, m.tobytes())


@dataclass(frozen=True)
class _Moves:
    """The transfers of :func:`plan_migration` from ``old`` to ``new`` as arrays [M], in its
    order: source and destination rank, expert, and whether the transfer moves a master
    (:func:`migration_moves`: what the cost needs, without the :class:`Migration`)."""

    src: np.ndarray
    dst: np.ndarray
    expert: np.ndarray
    master: np.ndarray


def _migration(world: _World, old: Placement, new: Placement) -> _Moves:
    """The transfers of :func:`plan_migration` from ``old`` to ``new`` (placements
    :func:`align_placement` checked), memoized by value."""
    key = ("migration", world.memo.key(old), world.memo.key(new))
    got = world.memo.get(key)
    if got is None:
        moves = migration_moves(old, new, world.topology, world.model)
        got = _Moves(*moves)
        world.memo.put(key, got)
    return got  # type: ignore[return-value]


def _moved(
    world: _World, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, scale: float
) -> ExpertStreams:
    """:func:`migration_streams` of transfers ``src -> dst`` of ``nbytes`` (all [M]) times
    ``scale``, memoized by value (policies that make the same move with the same bytes,
    ``quota`` and ``hybrid`` often do, share it)."""
    key = ("moved", src.tobytes(), dst.tobytes(), nbytes.tobytes(), scale)
    got = world.memo.get(key)
    if got is None:
        got = migration_streams(src, dst, nbytes, world.topology, scale=scale)
        world.memo.put(key, got)
    return cast(ExpertStreams, got)


def _fanout_seconds(
    world: _World, mode: str, policy: Policy, moves: _Moves, nbytes: np.ndarray
) -> float:
    """Seconds the microbatch's new replicas take to arrive, all sent at once (``mode``
    ``"all"``: every replica transfer; ``"in_dc"``: those inside one DC; ``"in_domain"``:
    those inside one domain of the policy's ``copy_domain`` [R]); ``nbytes`` [M] of each
    transfer of ``moves``. Memoized by value (``quota`` and ``hybrid`` often fan out the
    same replicas)."""
    topology, src, dst = world.topology, moves.src, moves.dst
    replica = ~moves.master
    if mode == "in_dc":
        replica &= topology.rank_dc[src] == topology.rank_dc[dst]
    elif mode == "in_domain":
        dom = getattr(policy, "copy_domain", None)
        dom = topology.rank_dc if dom is None else dom
        replica &= dom[src] == dom[dst]
    if not replica.any():
        return 0.0
    if not replica.all():
        src, dst, nbytes = src[replica], dst[replica], nbytes[replica]
    key = ("fanout", src.tobytes(), dst.tobytes(), nbytes.tobytes())
    got = world.memo.get(key)
    if got is None:
        got = transfer_seconds(_moved(world, src, dst, nbytes, 1.0), topology)
        world.memo.put(key, got)
    return cast(float, got)


def _sync_streams(
    st: _PolicyState, world: _World, layer: int, placement: Placement
) -> ExpertStreams:
    cached = st.streams[layer]
    if cached is not None and cached[0] is placement:
        return cached[1]
    key = ("replica_streams", st.encoding, world.memo.key(placement))
    got = world.memo.get(key)
    if got is None:
        got = replica_streams(placement, world.topology, world.model, world.cost, st.encoding)
        world.memo.put(key, got)
    streams = cast(ExpertStreams, got)
    st.streams[layer] = (placement, streams)
    return streams


def _migration_bytes(
    st: _PolicyState, world: _World, at: tuple[int, int], moves: _Moves, old: Placement
) -> np.ndarray:
    """[M] bytes of each transfer of ``moves`` under the policy's encoding: a replica sends
    only what changed since its receiver's last copy (``changed_fraction`` per step since),
    a master moves with its optimizer state. ``at``: (layer, step). With ``changed_fraction``
    1 every replica sends all its weights (``1 - 0 ** n`` is 1): no last copies are kept."""
    layer, t = at
    model, enc = world.model, st.encoding
    wb = model.weight_bytes if enc.weight_bytes is None else enc.weight_bytes
    if enc.changed_fraction >= 1.0:  # every replica sends all its weights, whatever it held
        replica = model.expert_params * np.full(moves.dst.shape, wb, np.float64)
        nbytes = np.where(moves.master, enc.copy_bytes(model, master=True), replica)
        return nbytes.astype(np.float64)
    last = st.last_held[layer]
    if last is None:
        last = np.full((old.num_ranks, old.master.size), -1, np.int64)
        st.last_held[layer] = last
    r, s = np.nonzero(old.phy2log >= 0)
    last[r, old.phy2log[r, s]] = t - 1  # everything held until now was current one step ago
    seen = last[moves.dst, moves.expert]
    f = enc.changed_fraction
    changed = np.where(seen >= 0, 1.0 - (1.0 - f) ** np.maximum(t - seen, 1), 1.0)
    replica = model.expert_params * np.where(changed >= 1.0, wb, changed * wb + 1.0 / 8.0)
    nbytes = np.where(moves.master, enc.copy_bytes(model, master=True), replica)
    return nbytes.astype(np.float64)
