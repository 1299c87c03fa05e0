"""Plans: where every expert lives, how tokens are routed, and what moves.

Shapes used throughout (the glossary is in ``expertmesh.planner``):

- ``load``: [R, E] int64, tokens from source rank ``r`` to logical expert ``e``.
- ``phy2log``: [R, S] int32, logical expert in each slot, ``-1`` if empty.
- ``master``: [E] int64, flat slot index ``r * S + s`` of each expert's master.
- ``route``: [N, 4] int64 rows ``(src_rank, expert, dst_rank, tokens)``; for every
  ``(src, e)`` the rows sum to ``load[src, e]`` and every ``dst`` holds ``e``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

__all__ = [
    "ROUTE_COLUMNS",
    "LayerPlan",
    "Migration",
    "Placement",
    "Transfer",
    "TransferKind",
    "check_layer_plan",
    "check_load",
    "check_trace",
    "imbalance",
    "rank_tokens",
    "straggler",
]

ROUTE_COLUMNS = ("src_rank", "expert", "dst_rank", "tokens")


def check_load(
    load: np.ndarray, num_ranks: int | None = None, num_experts: int | None = None
) -> np.ndarray:
    """Validate a [R, E] load and return it as int64. Raises ``ValueError``."""
    load = np.asarray(load)
    if load.ndim != 2:
        raise ValueError(f"load must be [R, E], got shape {load.shape}")
    if load.dtype.kind not in "iu":
        raise ValueError(f"load must hold integer token counts, got dtype {load.dtype}")
    if num_ranks is not None and load.shape[0] != num_ranks:
        raise ValueError(f"load has {load.shape[0]} ranks, the topology has {num_ranks}")
    if num_experts is not None and load.shape[1] != num_experts:
        raise ValueError(f"load has {load.shape[1]} experts, expected {num_experts}")
    if load.size and load.min() < 0:
        raise ValueError("load has negative token counts")
    return load.astype(np.int64, copy=False)


def check_trace(load: np.ndarray) -> np.ndarray:
    """Validate a trace ``load`` [T, L, R, E] of non-negative integers; returns int64."""
    load = np.asarray(load)
    if load.ndim != 4:
        raise ValueError(f"trace load must be [T, L, R, E], got shape {load.shape}")
    if load.dtype.kind not in "iu":
        raise ValueError(f"trace load must be integer, got dtype {load.dtype}")
    if 0 in load.shape:
        raise ValueError(f"trace load is empty, shape {load.shape}")
    if load.min() < 0:
        raise ValueError("trace load has negative token counts")
    return load.astype(np.int64, copy=False)


@dataclass(frozen=True, eq=False)
class Placement:
    """Where copies live. ``phy2log`` [R, S] int32 (-1 empty); ``master`` [E] flat slot index."""

    phy2log: np.ndarray
    master: np.ndarray

    @property
    def num_ranks(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def slots_per_rank(self) -> int:
        return int(self.phy2log.shape[1])

    def logcnt(self, num_experts: int) -> np.ndarray:
        """[E] number of copies of each logical expert."""
        flat = self.phy2log.ravel()
        return np.bincount(flat[flat >= 0], minlength=num_experts)

    def holds(self) -> np.ndarray:
        """[R, E] bool: rank r holds a copy of expert e."""
        num_experts = int(self.master.shape[0])
        out = np.zeros((self.num_ranks, num_experts), dtype=bool)
        r, s = np.nonzero(self.phy2log >= 0)
        out[r, self.phy2log[r, s]] = True
        return out

    def master_rank(self) -> np.ndarray:
        """[E] rank holding each expert's master."""
        return self.master // self.slots_per_rank


class TransferKind(StrEnum):
    REPLICA = "replica"  # copy weights only
    MASTER = "master"  # weights + optimizer state; the source slot gives up mastership


@dataclass(frozen=True)
class Transfer:
    """One expert copy sent over one link in one round.

    ``src_rank`` may be a relay that received the expert in an earlier round.
    """

    expert: int
    src_rank: int
    dst_rank: int
    dst_slot: int
    nbytes: int
    round: int
    kind: TransferKind = TransferKind.REPLICA


@dataclass(frozen=True)
class Migration:
    """The transfers that turn one placement into the next, scheduled in rounds.

    Invariant: inside a round, each link (ordered pair of ranks, and each
    rank's send and receive port) carries at most one transfer.
    ``round_seconds`` [rounds] is the modeled time of each round.
    """

    transfers: tuple[Transfer, ...] = ()
    round_seconds: tuple[float, ...] = ()
    kept: int = 0  # copies that stayed in their slot

    @property
    def num_rounds(self) -> int:
        return len(self.round_seconds)

    @property
    def copies(self) -> int:
        """Transfers whose destination receives a new copy (relay hops count once each)."""
        return len(self.transfers)

    @property
    def nbytes(self) -> int:
        return int(sum(t.nbytes for t in self.transfers))

    @property
    def seconds(self) -> float:
        return float(sum(self.round_seconds))


@dataclass(frozen=True, eq=False)
class LayerPlan:
    """Plan for one layer at one step: placement, route and the migration into it."""

    placement: Placement
    route: np.ndarray  # [N, 4] int64 (src_rank, expert, dst_rank, tokens)
    migration: Migration = field(default_factory=Migration)
    solve_seconds: float = 0.0

    @property
    def phy2log(self) -> np.ndarray:
        return self.placement.phy2log

    def rank_tokens(self) -> np.ndarray:
        """[R] tokens computed by each rank."""
        return rank_tokens(self.route, self.placement.num_ranks)


def rank_tokens(route: np.ndarray, num_ranks: int) -> np.ndarray:
    """[R] tokens each rank computes under ``route`` [N, 4]."""
    return np.bincount(route[:, 2], weights=route[:, 3], minlength=num_ranks).astype(np.int64)


def imbalance(per_rank: np.ndarray) -> float:
    """max / mean of per-rank tokens (1.0 is ideal; 1.0 for an all-zero load)."""
    mean = float(np.mean(per_rank))
    return float(np.max(per_rank)) / mean if mean > 0 else 1.0


def balancedness_stats(balancedness: np.ndarray) -> dict[str, float]:
    """vLLM's summary of per-layer balancedness (``b[l]`` = mean / max tokens per rank of layer
    ``l``, i.e. ``1 / imbalance``), over the layers [L]: ``min`` (the worst layer), ``p50``,
    ``p90`` (the value 90% of layers reach or beat: the 10th percentile) and ``avg``. Linear
    interpolation between layers, as ``np.percentile``; all 1.0 for no layers."""
    b = np.asarray(balancedness, dtype=np.float64)
    if b.size == 0:
        return {"min": 1.0, "p50": 1.0, "p90": 1.0, "avg": 1.0}
    return {
        "min": float(b.min()),
        "p50": float(np.percentile(b, 50)),
        "p90": float(np.percentile(b, 10)),
        "avg": float(b.mean()),
    }


def straggler(per_rank: np.ndarray) -> float:
    """max - mean of per-rank tokens."""
    return float(np.max(per_rank) - np.mean(per_rank))


def check_layer_plan(plan: LayerPlan, load: np.ndarray, slots_per_rank: int | None = None) -> None:
    """Raise ``ValueError`` unless ``plan`` is a valid plan for ``load`` [R, E]:

    - ``phy2log`` is [R, S] with entries in [-1, E) (and ``S`` as given);
    - every logical expert has at least one copy and exactly one master, on a slot holding it;
    - every ``load[r, e]`` is routed in full, only to ranks holding ``e``, no negative rows.
    """
    phy2log, master = plan.placement.phy2log, plan.placement.master
    num_ranks, num_experts = load.shape
    if phy2log.ndim != 2 or phy2log.shape[0] != num_ranks:
        raise ValueError(f"phy2log must be [{num_ranks}, S], got {phy2log.shape}")
    if slots_per_rank is not None and phy2log.shape[1] != slots_per_rank:
        raise ValueError(
            f"phy2log has {phy2log.shape[1]} slots per rank, expected {slots_per_rank}"
        )
    if phy2log.min() < -1 or phy2log.max() >= num_experts:
        raise ValueError("phy2log holds an expert id outside [-1, E)")
    if master.shape != (num_experts,):
        raise ValueError(f"master must be [{num_experts}], got {master.shape}")
    cnt = plan.placement.logcnt(num_experts)
    if (cnt == 0).any():
        raise ValueError(f"experts without a copy: {np.flatnonzero(cnt == 0)[:8].tolist()}")
    flat = phy2log.ravel()
    if master.min() < 0 or master.max() >= flat.size:
        raise ValueError("master slot index out of range")
    if not np.array_equal(flat[master], np.arange(num_experts)):
        raise ValueError("a master slot does not hold its expert")
    if len(np.unique(master)) != num_experts:
        raise ValueError("two experts share a master slot")
    route = plan.route
    if route.ndim != 2 or route.shape[1] != 4:
        raise ValueError(f"route must be [N, 4], got {route.shape}")
    if route.size and route[:, 3].min() < 0:
        raise ValueError("route has negative token counts")
    src, exp, dst, tok = route.T
    if route.size and not plan.placement.holds()[dst, exp].all():
        raise ValueError("route sends tokens to a rank that does not hold the expert")
    routed = np.zeros_like(load, dtype=np.int64)
    np.add.at(routed, (src, exp), tok)
    if not np.array_equal(routed, load):
        raise ValueError("route does not carry every token of the load exactly once")
