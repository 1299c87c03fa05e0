"""``even_dcs``: which experts each DC holds, evened out for the split by DC (the floor).

Every microbatch the fast loop keeps a token in its DC when the DC holds its expert and
spreads the others over the DCs that hold theirs (:func:`~expertmesh.planner.dcsplit.split_dcs`);
how even the DCs' tokens per rank can get is the *floor*: ``max_d dc_tokens[d] / n_d``
over the global mean. It is set by the holder sets, i.e. by the slow loop: an expert
that one DC alone holds brings that DC every token of every DC for it, so hot experts
held once each, in the same DC, leave that DC above the others whatever the split does.
``hybrid`` chooses the holder sets for WAN traffic (copy into a DC the experts it sends
most); nothing in its modeled step sees the floor where compute is cheap against the
links.

:func:`even_dcs` moves copies (never masters) between DCs while that lowers the floor on
the estimate and never raises its crossing assignments (tokens of a DC for experts it
lacks), so it costs no modeled WAN tokens: each round takes the busiest DC of the
split, and for one of its most used experts that another DC lacks, gives that DC a copy,
in a free holding if it has one, else in place of one of its copies; the move that
lowers the floor most (ties: fewest crossings) is kept, until none lowers it. A move
is split only where :func:`floor_bound` (what every split leaves in each DC: its own
tokens for experts it holds, and all tokens of experts only it holds) is no higher than
the best move's floor so far and low enough to be kept: the move it skips is never the
one kept, so the answer is the one splitting every move gives. Pure and deterministic.

Shapes: ``R`` ranks, ``E`` experts, ``D`` DCs.
"""

from __future__ import annotations

import numpy as np

from expertmesh.planner.dcsplit import split_dcs

__all__ = ["crossing_assignments", "even_dcs", "floor_bound"]


def crossing_assignments(load: np.ndarray, holds: np.ndarray, rank_dc: np.ndarray) -> int:
    """Assignments of ``load`` [R, E] whose source DC lacks their expert under ``holds``
    [D, E] (they cross the WAN whichever holder computes them); ``rank_dc`` [R]."""
    return _crossings(_dc_load(load, rank_dc, holds.shape[0]), holds)


def _dc_load(load: np.ndarray, rank_dc: np.ndarray, num_dcs: int) -> np.ndarray:
    """[D, E] int64: ``load`` [R, E] summed by each rank's DC."""
    out = np.zeros((num_dcs, load.shape[1]), np.int64)
    np.add.at(out, rank_dc, np.asarray(load, np.int64))
    return out


def _crossings(dc_load: np.ndarray, holds: np.ndarray) -> int:
    """:func:`crossing_assignments` from the load summed by DC, ``dc_load`` [D, E]."""
    return int(dc_load[~holds].sum())


def floor_bound(dc_load: np.ndarray, holds: np.ndarray, ranks: np.ndarray) -> float:
    """A lower bound of ``split_dcs(load, holds, rank_dc).floor`` from ``dc_load`` [D, E]
    (``load`` summed by DC) and ``ranks`` [D] per DC: every split leaves DC ``d`` at least
    its own tokens for the experts it holds plus every DC's tokens for the experts only it
    holds (tokens stay where their expert is; one holder takes all that cross to it), and
    the floor is computed from these integers the same way (IEEE division is monotone)."""
    total = int(dc_load.sum())
    active = ranks > 0
    if total == 0 or not active.any():
        return 1.0
    alone = holds & (holds.sum(axis=0) == 1)[None, :]  # [D, E] the only holder
    least = np.where(holds, dc_load, 0).sum(axis=1) + np.where(
        alone, dc_load.sum(axis=0)[None, :] - dc_load, 0
    ).sum(axis=1)  # [D] tokens every split leaves in each DC
    per = least[active] / ranks[active]
    return float(per.max() / (total / ranks.sum()))


def even_dcs(
    load: np.ndarray,
    holds: np.ndarray,
    master_dc: np.ndarray,
    capacity: np.ndarray,
    rank_dc: np.ndarray,
    *,
    candidates: int = 6,
    rounds: int = 32,
    min_gain: float = 1e-3,
) -> np.ndarray:
    """Holder sets [D, E] bool with a floor no higher than ``holds``' on ``load`` and no more
    crossing assignments.

    - ``load``: [R, E] int estimated tokens (top-k assignments) per rank and expert;
    - ``holds``: [D, E] bool, DC ``d`` holds a copy of ``e`` (every expert held somewhere);
    - ``master_dc``: [E] DC of each expert's master (its holding never moves);
    - ``capacity``: [D] experts each DC may hold (its slots outside the fast loop's
      reserve; a DC holding more already keeps its count);
    - ``rank_dc``: [R] DC of each rank (every DC with a holding has ranks);
    - ``candidates``: the busiest DC's most used experts tried per round;
    - ``rounds``: at most this many moves; ``min_gain``: a move must lower the floor by
      at least this much.

    ``ValueError`` on bad shapes, a master's DC not holding it, or an expert held nowhere."""
    load = np.asarray(load)
    holds = np.asarray(holds)
    master_dc = np.asarray(master_dc, dtype=np.int64)
    rank_dc = np.asarray(rank_dc, dtype=np.int64)
    if load.ndim != 2 or not np.issubdtype(load.dtype, np.integer) or (load < 0).any():
        raise ValueError(f"load must be a non-negative integer [R, E] array, got {load.shape}")
    num_ranks, num_experts = load.shape
    if holds.dtype != bool or holds.ndim != 2 or holds.shape[1] != num_experts:
        raise ValueError(f"holds must be a bool [D, {num_experts}] array, got {holds.shape}")
    num_dcs = holds.shape[0]
    if rank_dc.shape != (num_ranks,) or rank_dc.min(initial=0) < 0 or rank_dc.max() >= num_dcs:
        raise ValueError(f"rank_dc must be [{num_ranks}] DCs in [0, {num_dcs})")
    if master_dc.shape != (num_experts,) or not holds[master_dc, np.arange(num_experts)].all():
        raise ValueError("master_dc must be [E] and every master's DC must hold its expert")
    cap = np.maximum(np.asarray(capacity, dtype=np.int64).reshape(num_dcs), holds.sum(axis=1))
    ranks = np.bincount(rank_dc, minlength=num_dcs)
    is_master = np.zeros_like(holds)
    is_master[master_dc, np.arange(num_experts)] = True
    used = load.sum(axis=0)  # [E] every DC's tokens per expert
    dc_load = _dc_load(load, rank_dc, num_dcs)
    best = holds.copy()
    split = split_dcs(load, best, rank_dc)
    cross = _crossings(dc_load, best)
    for _ in range(rounds):
        busiest = int(np.argmax(np.where(ranks > 0, split.dc_tokens / np.maximum(ranks, 1), -1)))
        order = np.lexsort((np.arange(num_experts), -used))
        tried = [e for e in order.tolist() if best[busiest, e]][:candidates]
        move: tuple[tuple[float, int], np.ndarray] | None = None
        for e in tried:
            for d in range(num_dcs):
                if d == busiest or best[d, e] or ranks[d] == 0:
                    continue
                out = [None] if best[d].sum() < cap[d] else np.flatnonzero(best[d] & ~is_master[d])
                for x in out:
                    h = best.copy()
                    h[d, e] = True
                    if x is not None:
                        h[d, x] = False
                    c = _crossings(dc_load, h)
                    if c > cross:
                        continue
                    # a floor above the best move's, or too high to be kept, is not split:
                    # the move is never chosen (nor ties), or no move is kept either way
                    low = round(floor_bound(dc_load, h, ranks), 9)
                    if low > split.floor - min_gain or (move is not None and low > move[0][0]):
                        continue
                    key = (round(split_dcs(load, h, rank_dc).floor, 9), c)
                    if move is None or key < move[0]:
                        move = (key, h)
        if move is None or move[0][0] > split.floor - min_gain:
            break
        best = move[1]
        split = split_dcs(load, best, rank_dc)
        cross = move[0][1]
    return best
