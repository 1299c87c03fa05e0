"""planner/dcsplit.py's split by DC: its hand-written pour + augmenting path vs scipy's max-flow.

``split_dcs`` runs every microbatch on every rank (the fast loop's split by DC). Its
``_fill`` pours each group of crossing tokens into its candidate DCs to even levels,
within the per-DC room of the exact level, and moves what does not fit along
breadth-first augmenting paths (one max-flow step at a time). Two scipy variants
(``scipy.sparse.csgraph.maximum_flow``) are measured against it in the same run, on the
same cases:

- ``maxflow``: the whole ``_fill`` replaced by one max-flow (source -> group: its
  crossing tokens; group -> candidate DC: unbounded; DC -> sink: its room);
- ``pour+maxflow``: the pour kept, the augmenting paths replaced by one max-flow on the
  residual network (the pour's allocation, earlier groups' tokens movable to their
  other candidates).

Printed per size: the share of cases with the same ``tokens`` [R, E, D] and the same
``floor`` as the current code, the cases that needed an augmenting path at all, and the
median seconds per call with each variant's ratio to the current code (> 1: slower).

``.venv/bin/python bench/bench_dcsplit_flow.py [--cases N]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from expertmesh.planner import dcsplit

_INT32 = (1 << 31) - 1
Fill = Callable[..., list[list[int]]]
_REAL_AUGMENT = dcsplit._augment
_AUGMENTS = [0]


def _counted_augment(*a: object, **k: object) -> tuple[int, int]:
    _AUGMENTS[0] += 1
    return _REAL_AUGMENT(*a, **k)  # type: ignore[arg-type]


def _case(
    rng: np.random.Generator, dcs: int, per_dc: int, experts: int, tokens: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Skewed counts [R, E] (top-8 of ``tokens`` per rank); each DC holds a random half of
    the experts (every expert somewhere), as a slow-loop placement with replicas does."""
    rank_dc = np.repeat(np.arange(dcs), per_dc)
    holds = rng.random((dcs, experts)) < 0.5
    for e in np.flatnonzero(~holds.any(axis=0)):
        holds[rng.integers(dcs), e] = True
    pop = rng.gamma(0.4, 1.0, experts)
    counts = np.stack([rng.multinomial(tokens * 8, pop / pop.sum()) for _ in rank_dc])
    return counts.astype(np.int64), holds, rank_dc


def _flow(
    demand: list[int],
    cand: list[list[int]],
    room: list[int],
    alloc: list[list[int]] | None,
    g_new: list[int],
) -> list[list[int]]:
    """One max-flow from a source through the groups ``g_new`` (``demand`` each) and
    every group's candidates to a sink (``room`` per DC); with ``alloc`` (the groups' tokens
    already placed), those tokens may move to another of their group's candidates
    (DC -> group edges). Returns the new allocation [G][D]."""
    num_g, num_d = len(demand), len(room)
    src, sink = num_g + num_d, num_g + num_d + 1
    rows: list[int] = []
    cols: list[int] = []
    caps: list[int] = []

    def edge(a: int, b: int, c: int) -> None:
        if c > 0:
            rows.append(a)
            cols.append(b)
            caps.append(min(c, _INT32))

    total = sum(demand[g] for g in g_new)
    for g in g_new:
        edge(src, g, demand[g])
    for g in range(num_g):
        for b in cand[g]:
            edge(g, num_g + b, total)
            if alloc is not None:
                edge(num_g + b, g, alloc[g][b])
    for b in range(num_d):
        edge(num_g + b, sink, min(max(room[b], 0), total))
    n = num_g + num_d + 2
    graph = csr_matrix((caps, (rows, cols)), shape=(n, n), dtype=np.int32)
    flow = maximum_flow(graph, src, sink).flow.tocoo()
    out = [list(r) for r in alloc] if alloc is not None else [[0] * num_d for _ in demand]
    for a, b, f in zip(flow.row.tolist(), flow.col.tolist(), flow.data.tolist(), strict=True):
        if f <= 0:
            continue
        if a < num_g and b >= num_g and b < src:  # group -> DC
            out[a][b - num_g] += f
        elif a >= num_g and a < src and b < num_g:  # DC -> group: moved off that DC
            out[b][a - num_g] -= f
    # a group -> DC edge and its reverse both carrying flow net out in ``out``
    return out


def fill_maxflow(
    demand: list[int], masks: list[int], home: np.ndarray, ranks: np.ndarray, room: list[int]
) -> list[list[int]]:
    """The whole fill as one max-flow (no pour)."""
    num_dcs = ranks.size
    cand = [[b for b in range(num_dcs) if m >> b & 1] for m in masks]
    out = _flow(demand, cand, list(room), None, list(range(len(demand))))
    if [sum(r) for r in out] != demand:
        raise RuntimeError("max-flow short of the demand under feasible capacities")
    return out


def fill_pour_maxflow(
    demand: list[int], masks: list[int], home: np.ndarray, ranks: np.ndarray, room: list[int]
) -> list[list[int]]:
    """The current pour, then one max-flow on the residual network for each group that
    does not fit (instead of breadth-first augmenting paths)."""
    num_dcs = ranks.size
    load = [int(x) for x in home]
    room = list(room)
    alloc = [[0] * num_dcs for _ in demand]
    cand = [[b for b in range(num_dcs) if m >> b & 1] for m in masks]
    for g, x in enumerate(demand):
        give = dcsplit._pour(x, cand[g], load, [int(n) for n in ranks], room)
        for b, y in zip(cand[g], give, strict=True):
            alloc[g][b] += y
            load[b] += y
            room[b] -= y
        left = x - sum(give)
        if left > 0:
            part = [0] * len(demand)
            part[g] = left
            new = _flow(part, cand, room, alloc, [g])
            for b in range(num_dcs):
                got = sum(new[h][b] for h in range(len(demand))) - sum(
                    alloc[h][b] for h in range(len(demand))
                )
                load[b] += got
                room[b] -= got
            alloc = new
            if sum(alloc[g]) != x:
                raise RuntimeError("max-flow short of the demand under feasible capacities")
    return alloc


def _time(fn: Callable[[], object], reps: int) -> float:
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t0)
    return statistics.median(best)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=30, help="random cases per size")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per case and variant")
    args = ap.parse_args(argv)
    sizes = [(2, 4, 64), (4, 4, 128), (8, 4, 256), (8, 8, 256), (16, 4, 512), (32, 4, 1024)]
    current: Fill = dcsplit._fill
    variants: dict[str, Fill] = {"maxflow": fill_maxflow, "pour+maxflow": fill_pour_maxflow}
    print(
        f"{'DCs':>4} {'ranks':>5} {'E':>5} {'augment':>8} {'current s':>10}"
        + "".join(f" {n + ' same':>18} {n + ' x':>14}" for n in variants)
    )
    rng = np.random.default_rng(0)
    for dcs, per_dc, experts in sizes:
        aug = 0
        t_cur: list[float] = []
        same = {n: 0 for n in variants}
        same_floor = {n: 0 for n in variants}
        ratio: dict[str, list[float]] = {n: [] for n in variants}
        for _ in range(args.cases):
            case = _case(rng, dcs, per_dc, experts, tokens=int(rng.integers(256, 4096)))
            _AUGMENTS[0] = 0
            dcsplit._augment = _counted_augment
            try:
                ref = dcsplit.split_dcs(*case)
            finally:
                dcsplit._augment = _REAL_AUGMENT
            aug += _AUGMENTS[0] > 0
            tc = _time(partial(dcsplit.split_dcs, *case), args.reps)
            t_cur.append(tc)
            for name, fill in variants.items():
                dcsplit._fill = fill
                try:
                    got = dcsplit.split_dcs(*case)
                    tv = _time(partial(dcsplit.split_dcs, *case), args.reps)
                finally:
                    dcsplit._fill = current
                same[name] += bool(np.array_equal(got.tokens, ref.tokens))
                same_floor[name] += got.floor == ref.floor
                ratio[name].append(tv / tc)
        cols = "".join(
            f" {f'{same[n]}/{args.cases} fl {same_floor[n]}/{args.cases}':>18}"
            f" {statistics.median(ratio[n]):>14.2f}"
            for n in variants
        )
        print(
            f"{dcs:>4} {dcs * per_dc:>5} {experts:>5} {f'{aug}/{args.cases}':>8}"
            f" {statistics.median(t_cur):>10.2e}{cols}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
