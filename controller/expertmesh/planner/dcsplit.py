"""``split_dcs``: which DC computes each token that must cross the WAN, every microbatch.

The fast loop balances inside each DC (:mod:`expertmesh.planner.fastquota`); how many
tokens each DC gets is decided before that. A token whose DC holds its expert stays home
(moving it would cost WAN bytes). A token whose DC lacks its expert must cross to a DC
that holds it, and it costs the same bytes whichever holder it goes to (where the
topology's links cost the same), so its destination can follow the exact counts of this
microbatch instead of a slow-loop route: :func:`split_dcs` spreads the crossing tokens
over the holders so that the busiest DC's tokens per rank are as low as they can be (the
*floor* of the within-DC balance, ``max_b dc_tokens[b] / n_b`` over the global mean).

Every rank calls it on the same all-gathered counts and gets the same answer (integer
arithmetic, IEEE basic operations on doubles, ties broken by index; no randomness).

**The level.** With crossing demand grouped by expert and candidate DCs, the smallest
reachable max over DCs of ``tokens / ranks`` is, by the supply-demand theorem (Gale,
Hall), the max over sets ``S`` of DCs of ``(home tokens in S + crossing tokens that can
only go to S) / (ranks in S)``; the integer one is the smallest ``k / n_b`` whose
per-DC capacities ``floor(k n_c / n_b) - home_c`` pass the same test. Up to
``MAX_EXACT_DCS`` DCs the sets are enumerated; above, the split is the greedy pour alone
(``exact=False``).

**The split.** Groups, most constrained first (fewest candidates, then the largest), are
poured into their candidates to even levels within those capacities; what does not fit
moves earlier groups' tokens along an augmenting path (a max-flow step), which always
succeeds under capacities that pass the test. Each group's tokens per DC are then split
over its source ranks in rank order (north-west corner: few (rank, expert, DC) streams).

**Why the augmenting path is hand-written, not scipy's max-flow.** Measured with
``bench/bench_dcsplit_flow.py --cases 15 --reps 3`` (load average 5.9 before, 6.5 after,
beside the SPMD suite; ratios against this code in the same run, median per size):
one ``scipy.sparse.csgraph.maximum_flow`` for the whole fill (no pour) is 0.56-1.00x
the time (2 to 32 DCs, 64 to 1,024 experts) but never gives the same ``tokens`` beyond
2 DCs (0/15 cases at 4 DCs and above: a max-flow fills DCs to their capacity in its own
order instead of evening the levels below it), and above ``MAX_EXACT_DCS`` a worse
floor (0/15 equal at 16 and 32 DCs: without exact capacities nothing bounds a DC). The
pour kept and only the augmenting paths replaced by one max-flow on the residual network
gives the same ``tokens`` in every case (90/90; 28 of them needed a path) at 0.98-1.13x
the time (1.11x at 4 DCs and 1.13x at 8 DCs x 32 ranks x 256 experts, where paths are
needed), with int32 capacities and a graph to build for ~30 lines saved. This runs
every microbatch, so it stays.

Shapes: ``R`` ranks, ``E`` experts, ``D`` DCs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["MAX_EXACT_DCS", "DcSplit", "can_spread", "split_dcs"]

# up to this many DCs (with ranks) the level is exact (2^D sets of DCs enumerated)
MAX_EXACT_DCS = 12

# two links cost the same when within this relative difference
_COST_RTOL = 1e-9


def can_spread(held: np.ndarray) -> bool:
    """Whether the split by DC has a choice to make on a layer: ``held`` [D, E] bool, which
    DCs (those taking part) hold a copy of each expert; true when an expert is held by two
    or more DCs and lacked by some (else each crossing token has one holding DC, as the
    route names). The workers' fast loop (``workers.dcspread``) and the replay's count of
    its collectives (``sim.replay``) both ask this."""
    held = np.asarray(held, bool)
    return bool(((held.sum(axis=0) >= 2) & ~held.all(axis=0)).any())


@dataclass(frozen=True, eq=False)
class DcSplit:
    """One microbatch's destinations by DC.

    - ``tokens``: [R, E, D] int64, tokens of ``counts[r, e]`` that DC ``d`` computes (rows
      sum to ``counts``; ``d`` holds ``e``; a DC holding ``e`` keeps its own ranks' tokens);
    - ``dc_tokens``: [D] tokens each DC computes;
    - ``floor``: max over DCs with ranks of ``dc_tokens / ranks`` over the global mean per
      rank (1.0 without tokens): what balancing inside each DC can reach at best;
    - ``exact``: whether the floor is the smallest any split of these counts reaches.
    """

    tokens: np.ndarray
    dc_tokens: np.ndarray
    floor: float
    exact: bool


def _check(
    counts: np.ndarray, holds: np.ndarray, rank_dc: np.ndarray, cost: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    counts = np.asarray(counts)
    holds = np.asarray(holds)
    rank_dc = np.asarray(rank_dc)
    if counts.ndim != 2 or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(f"counts must be a 2-D integer array [R, E], got {counts.shape}")
    if (counts < 0).any():
        raise ValueError("counts must be >= 0")
    r, e = counts.shape
    if holds.ndim != 2 or holds.shape[1] != e or holds.dtype != bool:
        raise ValueError(f"holds must be a bool [D, {e}] array, got {holds.shape} {holds.dtype}")
    d = holds.shape[0]
    if rank_dc.shape != (r,) or not np.issubdtype(rank_dc.dtype, np.integer):
        raise ValueError(f"rank_dc must be an integer [{r}] array")
    if (rank_dc >= d).any() or (rank_dc < -1).any():
        raise ValueError(f"rank_dc must be -1 (not taking part) or a DC in [0, {d})")
    if counts[rank_dc < 0].any():
        raise ValueError("a rank not taking part has tokens")
    ranks = np.bincount(rank_dc[rank_dc >= 0], minlength=d)
    if holds[ranks == 0].any():
        raise ValueError("a DC without ranks holds an expert")
    need = counts.sum(axis=0) > 0
    if (need & ~holds.any(axis=0)).any():
        raise ValueError(
            f"experts {np.flatnonzero(need & ~holds.any(axis=0)).tolist()} have no holder"
        )
    if cost is not None:
        cost = np.asarray(cost, dtype=np.float64)
        if cost.shape != (d, d) or not np.isfinite(cost).all() or (cost < 0).any():
            raise ValueError(f"cost must be a finite, non-negative [{d}, {d}] array")
    return counts.astype(np.int64), holds, rank_dc.astype(np.int64), cost


def split_dcs(
    counts: np.ndarray,
    holds: np.ndarray,
    rank_dc: np.ndarray,
    cost: np.ndarray | None = None,
) -> DcSplit:
    """Spread the crossing tokens of ``counts`` over the DCs that hold their experts.

    - ``counts``: [R, E] tokens (top-k assignments) each rank's gate sends to each expert
      this microbatch (the world's, all-gathered); zero for ranks not taking part;
    - ``holds``: [D, E] bool, DC ``d`` has a live copy of ``e``;
    - ``rank_dc``: [R] DC of each rank, ``-1`` for a rank not taking part;
    - ``cost``: [D, D] cost per byte of a token from DC ``a`` to DC ``b`` (e.g. the inverse
      bandwidth); a crossing token goes only to the holders that are cheapest from its DC.
      ``None``: every DC pair costs the same.

    ``ValueError`` on bad shapes, negative counts, tokens of a rank not taking part or of
    an expert no DC holds."""
    counts, holds, rank_dc, cost = _check(counts, holds, rank_dc, cost)
    num_ranks, num_experts = counts.shape
    num_dcs = holds.shape[0]
    ranks = np.bincount(rank_dc[rank_dc >= 0], minlength=num_dcs)  # [D]
    out = np.zeros((num_ranks, num_experts, num_dcs), np.int64)
    live = np.flatnonzero(rank_dc >= 0)
    home = holds[rank_dc[live]]  # [R_live, E] my DC holds e
    out[live[:, None], np.arange(num_experts)[None, :], rank_dc[live][:, None]] = np.where(
        home, counts[live], 0
    )
    home_tokens = out.sum(axis=(0, 1))  # [D]
    # crossing demand per (source DC, expert) -> groups (expert, candidate mask)
    onehot = np.zeros((num_dcs, num_ranks), np.int64)
    onehot[rank_dc[live], live] = 1
    away = onehot @ np.where(holds[np.maximum(rank_dc, 0)] & (rank_dc >= 0)[:, None], 0, counts)
    holders = [np.flatnonzero(holds[:, e]).tolist() for e in range(num_experts)]
    groups: dict[tuple[int, int], list[int]] = {}  # (e, mask) -> source DCs
    need: dict[tuple[int, int], int] = {}  # (e, mask) -> crossing tokens
    src_dc, src_e = np.nonzero(away)
    for a, e, x in zip(src_dc.tolist(), src_e.tolist(), away[src_dc, src_e].tolist(), strict=True):
        cand = holders[e]
        if cost is not None:
            c = [cost[a, b] for b in cand]
            cand = [b for b, cb in zip(cand, c, strict=True) if cb <= min(c) * (1 + _COST_RTOL)]
        key = (e, sum(1 << b for b in cand))
        groups.setdefault(key, []).append(a)
        need[key] = need.get(key, 0) + x
    keys = sorted(groups, key=lambda k: (bin(k[1]).count("1"), -need[k], k))
    demand = [need[k] for k in keys]
    masks = [k[1] for k in keys]
    active = [b for b in range(num_dcs) if ranks[b] > 0]
    exact = len(active) <= MAX_EXACT_DCS
    room = _capacities(demand, masks, home_tokens, ranks, active) if exact else [1 << 62] * num_dcs
    alloc = _fill(demand, masks, home_tokens, ranks, room)
    members = [np.flatnonzero(rank_dc == d).tolist() for d in range(num_dcs)]
    for (e, _), srcs, row in zip(keys, (groups[k] for k in keys), alloc, strict=True):
        src = [r for a in sorted(srcs) for r in members[a]]
        _corner(out, e, src, counts[src, e].tolist(), row)
    dc_tokens = out.sum(axis=(0, 1))
    total = int(dc_tokens.sum())
    if total == 0 or not active:
        floor = 1.0
    else:
        per = dc_tokens[active] / ranks[active]
        floor = float(per.max() / (total / ranks.sum()))
    return DcSplit(out, dc_tokens, floor, exact)


def _capacities(
    demand: list[int], masks: list[int], home: np.ndarray, ranks: np.ndarray, active: list[int]
) -> list[int]:
    """Per DC: crossing tokens it may take at the smallest integer level (``floor(k n_c /
    n_b)`` total tokens for ``k / n_b`` the level) that every set of DCs can serve."""
    num_dcs = ranks.size
    subsets = np.zeros(0, np.int64)
    for b in active:  # every non-empty set of active DCs, as bit masks
        subsets = np.concatenate([subsets, subsets | (1 << b), [1 << b]])
    bits = (subsets[:, None] >> np.arange(num_dcs)[None, :]) & 1  # [P, D]
    m = np.asarray(masks, np.int64)
    only = (m[None, :] & ~subsets[:, None]) == 0  # [P, G] group can only go into the set
    need = bits @ home + only @ np.asarray(demand, np.int64)  # [P] tokens the set must take
    size = bits @ ranks  # [P] ranks of the set
    # the fractional level need / size at its largest (a float argmax can only start the
    # search at or below it); then the smallest integer level that passes, exactly
    p = int(np.argmax(need / np.maximum(size, 1)))
    num, den = int(need[p]), int(size[p])
    ks = {b: -((-num * int(ranks[b])) // den) for b in active}  # ceil(level n_b)
    while True:
        b = min(active, key=lambda x: (ks[x] / ranks[x], x))  # the next candidate level
        k, nb = ks[b], int(ranks[b])
        caps = np.array([(k * int(ranks[c])) // nb for c in range(num_dcs)], np.int64)
        if (bits @ caps >= need).all():
            return (caps - home).tolist()
        ks[b] = k + 1


def _fill(
    demand: list[int], masks: list[int], home: np.ndarray, ranks: np.ndarray, room: list[int]
) -> list[list[int]]:
    """Pour each group (in order) into its candidates within ``room`` (crossing tokens each
    DC may still take), to even levels; what does not fit goes along augmenting paths.
    Returns [G][D] tokens per group and DC."""
    num_dcs = ranks.size
    load = [int(x) for x in home]
    room = list(room)
    alloc = [[0] * num_dcs for _ in demand]
    cand = [[b for b in range(num_dcs) if m >> b & 1] for m in masks]
    for g, x in enumerate(demand):
        give = _pour(x, cand[g], load, [int(n) for n in ranks], room)
        for b, y in zip(cand[g], give, strict=True):
            alloc[g][b] += y
            load[b] += y
            room[b] -= y
        left = x - sum(give)
        while left > 0:
            moved, b = _augment(g, left, cand, alloc, room)
            if moved == 0:
                raise RuntimeError("no augmenting path under feasible capacities")
            load[b] += moved
            left -= moved
    return alloc


def _pour(x: int, cand: list[int], load: list[int], ranks: list[int], room: list[int]) -> list[int]:
    """``x`` tokens into DCs ``cand`` so their levels ``load / ranks`` even out, at most
    ``room`` each; [len(cand)] integers summing to ``min(x, total room)``."""
    rm = [max(room[b], 0) for b in cand]
    if x >= sum(rm):
        return rm
    n = [ranks[b] for b in cand]
    lo = [load[b] / n[i] for i, b in enumerate(cand)]
    hi = [(load[b] + rm[i]) / n[i] for i, b in enumerate(cand)]

    def poured(w: float) -> float:
        return sum(min(max(w * n[i] - load[b], 0.0), rm[i]) for i, b in enumerate(cand))

    pts = sorted(set(lo + hi))
    prev = pts[0]
    for w in pts[1:]:
        if poured(w) >= x:
            break
        prev = w
    slope = sum(n[i] for i in range(len(cand)) if lo[i] <= prev < hi[i])
    level = prev + (x - poured(prev)) / slope if slope else prev
    want = [min(max(level * n[i] - load[b], 0.0), float(rm[i])) for i, b in enumerate(cand)]
    give = [min(int(v), rm[i]) for i, v in enumerate(want)]
    left = x - sum(give)
    order = sorted(range(len(cand)), key=lambda i: (-(want[i] - give[i]), lo[i], cand[i]))
    while left > 0:  # the remainder by largest fraction, where room is left
        for i in order:
            if left and give[i] < rm[i]:
                give[i] += 1
                left -= 1
    return give


def _augment(
    g: int, left: int, cand: list[list[int]], alloc: list[list[int]], room: list[int]
) -> tuple[int, int]:
    """Move up to ``left`` more tokens of group ``g`` in: breadth-first over DCs from its
    candidates, through earlier groups' tokens that can shift to another of their
    candidates, to a DC with room. Returns the tokens moved (0: no path) and that DC."""
    parent: dict[int, tuple[int, int] | None] = {b: None for b in cand[g]}
    queue = list(cand[g])
    while queue:
        b = queue.pop(0)
        if room[b] > 0:
            path, at = [], b
            while parent[at] is not None:
                prev, h = parent[at]  # type: ignore[misc]
                path.append((h, prev, at))
                at = prev
            delta = min([left, room[b]] + [alloc[h][p] for h, p, _ in path])
            for h, p, q in path:
                alloc[h][p] -= delta
                alloc[h][q] += delta
            alloc[g][at] += delta
            room[b] -= delta
            return delta, b
        for h in range(len(alloc)):
            if h == g or alloc[h][b] == 0:
                continue
            for q in cand[h]:
                if q not in parent:
                    parent[q] = (b, h)
                    queue.append(q)
    return 0, -1


def _corner(out: np.ndarray, e: int, src: list[int], have: list[int], per_dc: list[int]) -> None:
    """Split one group's ``per_dc`` [D] tokens over its source ranks ``src`` (holding
    ``have`` tokens each) in order: north-west corner, into ``out[r, e, d]``."""
    d = 0
    left = list(per_dc)
    for r, x in zip(src, have, strict=True):
        rest = x
        while rest > 0:
            while left[d] == 0:
                d += 1
            y = min(rest, left[d])
            out[r, e, d] += y
            left[d] -= y
            rest -= y
