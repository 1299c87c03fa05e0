"""Transfer rounds that take the ranks from one placement to another.

A round is a list of moves ``(layer, expert, src_rank, dst_rank, kind)``, kind ``"w"``
(the expert's weights) or ``"opt"`` (a moving master's Adam state); the workers run
each round as one all-to-all (:meth:`expertmesh.workers.experts.ExpertParallel.apply_plan`).

- :func:`migration_rounds`: a plan switch. It keeps the planner's transfers
  (:mod:`expertmesh.planner.migration`) where their source holds the expert when its
  round starts and adds what they miss, so a commit never finds a rank without its
  weights.
- :func:`recovery_rounds`: after ranks died. Copies come from the nearest live holder;
  what no live rank holds is listed for the checkpoint.
"""

from __future__ import annotations

import numpy as np

from expertmesh.planner.plan import Migration, Placement
from expertmesh.planner.topology import Topology

__all__ = ["Move", "migration_rounds", "recovery_rounds", "source_rounds"]

Move = tuple[int, int, int, int, str]  # (layer, expert, src_rank, dst_rank, "w" | "opt")


def migration_rounds(
    old: list[Placement],
    new: list[Placement],
    migrations: list[Migration],
    topology: Topology,
) -> list[list[Move]]:
    """Rounds of transfers that turn ``old`` into ``new`` (one entry per layer each).

    The planner's transfers are kept in their rounds (relays included) when their
    source holds the expert by then; every copy they do not deliver is sent from the
    nearest holder of the old placement in one more round; a master that moves gets
    its Adam state from the old master in that round too.
    """
    if not (len(old) == len(new) == len(migrations)):
        raise ValueError("old, new and migrations need one entry per layer")
    rounds: dict[int, list[Move]] = {}
    extra: list[Move] = []
    for layer, (a, b, mig) in enumerate(zip(old, new, migrations, strict=True)):
        have = a.holds().copy()  # [R, E]
        want = b.holds()
        for k in sorted({t.round for t in mig.transfers}):
            batch = [t for t in mig.transfers if t.round == k]
            ok = [t for t in batch if have[t.src_rank, t.expert] and not have[t.dst_rank, t.expert]]
            for t in ok:
                rounds.setdefault(k, []).append((layer, t.expert, t.src_rank, t.dst_rank, "w"))
            for t in ok:
                have[t.dst_rank, t.expert] = True
        old_holders = a.holds()
        for r, e in zip(*np.nonzero(want & ~have), strict=True):
            src = np.flatnonzero(old_holders[:, e])
            near = src[np.argmin(topology.distance(src, np.full_like(src, r)))]
            extra.append((layer, int(e), int(near), int(r), "w"))
        moved = np.flatnonzero(a.master_rank() != b.master_rank())
        for e in moved.tolist():
            extra.append((layer, e, int(a.master_rank()[e]), int(b.master_rank()[e]), "opt"))
    out = [rounds[k] for k in sorted(rounds)]
    if extra:
        out.append(extra)
    return out


def recovery_rounds(
    old: list[Placement], new: list[Placement], live: np.ndarray, topology: Topology
) -> tuple[list[list[Move]], list[tuple[int, int, int, str]]]:
    """The transfers that turn ``old`` into ``new`` after the ranks not ``live`` [R] died:
    :func:`source_rounds` with the live ranks as sources, refusing a ``new`` with copies on
    dead ranks."""
    live = np.asarray(live, dtype=bool)
    for layer, b in enumerate(new):
        if (b.phy2log[~live] >= 0).any():
            raise ValueError(f"layer {layer}: the new placement has copies on dead ranks")
    return source_rounds(old, new, live, topology)


def source_rounds(
    old: list[Placement], new: list[Placement], sources: np.ndarray, topology: Topology
) -> tuple[list[list[Move]], list[tuple[int, int, int, str]]]:
    """Transfers that turn ``old`` into ``new`` when only ``sources`` [R] bool may send (the
    ranks that trained until now: after deaths, a pause or a rejoin).

    A copy ``new`` places on a rank that does not hold it as a source comes from the
    nearest source holding it in ``old`` (exact weights); a master that moves, or stays on
    a rank that is not a source, gets its Adam state from its old master when that is a
    source. What no source has is listed as ``(layer, expert, rank, "w" | "opt")`` for the
    checkpoint. Returns ``(rounds, restore)`` (at most one round)."""
    if len(old) != len(new):
        raise ValueError("old and new need one entry per layer")
    sources = np.asarray(sources, dtype=bool)
    transfers: list[Move] = []
    restore: list[tuple[int, int, int, str]] = []
    for layer, (a, b) in enumerate(zip(old, new, strict=True)):
        have = a.holds() & sources[:, None]  # [R, E]
        for r, e in zip(*np.nonzero(b.holds() & ~have), strict=True):
            src = np.flatnonzero(have[:, e])
            if src.size:
                near = src[np.argmin(topology.distance(src, np.full_like(src, r)))]
                transfers.append((layer, int(e), int(near), int(r), "w"))
            else:
                restore.append((layer, int(e), int(r), "w"))
        am, bm = a.master_rank(), b.master_rank()
        for e in np.flatnonzero((am != bm) | ~sources[am]).tolist():
            if sources[am[e]]:
                transfers.append((layer, e, int(am[e]), int(bm[e]), "opt"))
            else:
                restore.append((layer, e, int(bm[e]), "opt"))
    return ([transfers] if transfers else []), restore
