"""What every token-traffic view shares: :class:`TokenTraffic` and its helpers.

The cost model never needs who sends to whom rank by rank (an ``[R, R]``
matrix is 64M cells at 8,000 ranks); it needs, per rank, how many top-k
assignments it computes and how many it sends and receives over each fabric,
and, per ordered DC pair, how many assignments cross. :class:`TokenTraffic`
holds exactly that. Its builders live in :mod:`expertmesh.planner.traffic`
(exact from route rows, quota's weighted split) and
:mod:`expertmesh.planner.evensplit` (the even split); this module holds what
they share: per-DC token totals, the memo of a read-only load, DC pairs,
sums by rank / node / DC (:func:`level_sums`) and per-rank shell sums.

Shells: traffic between a rank and a destination is classed by how far apart
they are: 0 same rank, 1 same node, 2 same DC (other node), 3 other DC.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Literal, TypeVar, cast

import numpy as np

from expertmesh.planner.topology import Topology

__all__ = ["Domain", "TokenTraffic", "level_sums"]

Domain = Literal["rank", "node", "dc", "global"]
_LEVEL = {"rank": 0, "node": 1, "dc": 2, "global": 3}


@dataclass(frozen=True, eq=False)
class TokenTraffic:
    """Aggregated token streams of one layer at one step (counts are top-k assignments).

    - ``rank_tokens``: [R] float64 assignments each rank computes.
    - ``rank_out``: [R, 3] float64 assignments each rank sends to other ranks of its node,
      of its DC on other nodes, and of other DCs (shells 1, 2, 3).
    - ``rank_in``: [R, 3] float64 the same, received.
    - ``pair_src``, ``pair_dst``: [P] int64 DC indices (``src != dst``); ``pair_tokens``: [P]
      float64 assignments from DC ``src`` to experts computed in DC ``dst``.
    - ``dc_tokens``: [D] float64 tokens (not assignments) that originate in each DC; the
      cost model's hierarchical-dispatch estimate needs them.
    - ``pair_crossings``: [P] float64 tokens that cross each pair under hierarchical dispatch
      when they are known exactly (a runtime that sees token ids), else ``None`` and the
      cost model estimates them (docs/cost-model.md).
    """

    rank_tokens: np.ndarray
    rank_out: np.ndarray
    rank_in: np.ndarray
    pair_src: np.ndarray
    pair_dst: np.ndarray
    pair_tokens: np.ndarray
    dc_tokens: np.ndarray
    pair_crossings: np.ndarray | None = None

    def __post_init__(self) -> None:
        r = self.rank_tokens.shape[0]
        if self.rank_out.shape != (r, 3) or self.rank_in.shape != (r, 3):
            raise ValueError(f"rank_out and rank_in must be [{r}, 3]")
        p = self.pair_src.shape[0]
        if self.pair_dst.shape != (p,) or self.pair_tokens.shape != (p,):
            raise ValueError("pair_src, pair_dst and pair_tokens must have the same length")
        if self.pair_crossings is not None and self.pair_crossings.shape != (p,):
            raise ValueError("pair_crossings must match pair_tokens")
        if p and (self.pair_src == self.pair_dst).any():
            raise ValueError("a DC pair needs two different DCs")

    @property
    def num_ranks(self) -> int:
        return int(self.rank_tokens.shape[0])

    @property
    def cross_dc_assignments(self) -> float:
        return float(self.pair_tokens.sum())


def _dc_tokens(
    load: np.ndarray, topology: Topology, top_k: int, sums: np.ndarray | None = None
) -> np.ndarray:
    """[D] tokens from each DC (:func:`_dc_sums` / ``top_k``), memoized with a read-only
    load. ``sums``: the caller's [D] assignments from each DC, when it has them (sums of
    whole tokens: the same floats), else summed here."""
    stats = _load_stats(load)
    key = ("dc_tokens", topology, top_k)
    if stats is not None and key in stats.memo:
        return cast(np.ndarray, stats.memo[key])
    out = (_dc_sums(load[None], topology)[0] if sums is None else sums) / top_k
    if stats is not None:
        out.flags.writeable = False
        stats.memo[key] = out
    return out


def _dc_sums(loads: np.ndarray, topology: Topology) -> np.ndarray:
    """[T, D] the assignments from each DC in each step of ``loads`` [T, R, E]: one
    ``bincount`` over (step, DC) bins, each adding its ranks in order (one step's sums are
    those of a ``bincount`` over DCs alone)."""
    num_steps, num_dcs = loads.shape[0], topology.num_dcs
    per_rank = loads.sum(axis=2, dtype=np.float64)  # [T, R]
    key = np.arange(num_steps)[:, None] * num_dcs + topology.rank_dc  # [T, R] (step, DC)
    sums = np.bincount(key.ravel(), weights=per_rank.ravel(), minlength=num_steps * num_dcs)
    return sums.reshape(num_steps, num_dcs)


@dataclass(eq=False)
class _LoadStats:
    """What the traffic functions derive from one read-only load (the simulator's step
    loads, asked for by every policy): ``memo`` maps a key to a read-only result."""

    load: np.ndarray
    memo: dict[tuple[object, ...], object]


#: the last few read-only loads' :class:`_LoadStats` (held, so their ids stay theirs)
_LOADS: list[_LoadStats] = []
_LOADS_KEPT = 4


def _load_stats(load: np.ndarray) -> _LoadStats | None:
    """The memo of ``load`` when it is read-only (a writable load may change between calls:
    nothing is kept), else ``None``."""
    if load.flags.writeable:
        return None
    for st in _LOADS:
        if st.load is load:
            return st
    st = _LoadStats(load, {})
    _LOADS.append(st)
    if len(_LOADS) > _LOADS_KEPT:
        _LOADS.pop(0)
    return st


def _pairs(dense: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nonzero off-diagonal cells of a [D, D] matrix as (src, dst, value), row by row (its
    diagonal is zeroed)."""
    n = dense.shape[0]
    flat = dense.reshape(-1)  # a view of a contiguous matrix, else a copy (the same cells)
    flat[:: n + 1] = 0.0
    at = (flat > 0).nonzero()[0]
    if n > _CELL_INDEX_MAX:
        src, dst = np.divmod(at, n)
        return src.astype(np.int64, copy=False), dst.astype(np.int64, copy=False), flat[at]
    src, dst = _cell_index(n)
    return src[at], dst[at], flat[at]


def _cell_index(n: int) -> tuple[np.ndarray, np.ndarray]:
    """[n * n] int64 row and column of each cell of a C-ordered [n, n] matrix (cached)."""
    got = _CELL_INDEX.get(n)
    if got is None:
        got = _CELL_INDEX[n] = np.divmod(np.arange(n * n, dtype=np.int64), max(n, 1))
        for a in got:
            a.flags.writeable = False
    return got


#: per matrix size up to :data:`_CELL_INDEX_MAX`: :func:`_cell_index`
_CELL_INDEX: dict[int, tuple[np.ndarray, np.ndarray]] = {}
_CELL_INDEX_MAX = 64


def _pairs_steps(dense: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """:func:`_pairs` of each ``dense[t]`` ([T, D, D]): one pass over every step, each
    step's cells a slice of the whole (the same cells and values, in order)."""
    num_steps, n = dense.shape[0], dense.shape[1]
    flat = dense.reshape(num_steps, n * n)  # a view of a contiguous array, else a copy
    flat[:, :: n + 1] = 0.0
    at = np.flatnonzero(flat > 0)
    step, cell = np.divmod(at, max(n * n, 1))
    src, dst = np.divmod(cell, max(n, 1))
    src, dst, val = (
        src.astype(np.int64, copy=False),
        dst.astype(np.int64, copy=False),
        flat.reshape(-1)[at],
    )
    ends = np.searchsorted(step, np.arange(num_steps + 1)).tolist()
    return [(src[a:b], dst[a:b], val[a:b]) for a, b in itertools.pairwise(ends)]


def level_sums(x: np.ndarray, topology: Topology) -> list[np.ndarray]:
    """[R, E] -> sums over rank, node, DC and everything: [R, E], [Nn, E], [D, E], [1, E]."""
    (r_starts, r_at, r_len), (n_starts, n_at, n_len) = _level_index(topology)
    node = np.zeros((topology.num_nodes, x.shape[1]))
    if x.shape[0]:
        node[r_at] += _run_sums(x, r_starts, r_len)
    if n_starts.size == topology.num_dcs == node.shape[0]:
        dc = node.copy()  # one node per DC: 0.0 + (0.0 + s) is 0.0 + s, the same floats
    else:
        dc = np.zeros((topology.num_dcs, x.shape[1]))
        if node.shape[0]:
            dc[n_at] += _run_sums(node, n_starts, n_len)
    return [x, node, dc, dc.sum(axis=0, keepdims=True)]


#: longest run :func:`_run_sums` sums without ``reduceat``: numpy's ``reduceat`` adds a
#: run as ``x[start] + pairwise(rest)``, and its pairwise sum of fewer than 8 numbers
#: is the plain loop a reduction over a middle axis makes
_SHORT_RUN = 8


def _run_sums(x: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """``np.add.reduceat(x, starts, axis=0)`` for ``x`` [N, E] and run ``starts`` [G], the
    same floats. ``length``: the length every run has, when they do (equal nodes), else 0;
    runs of at most 8 are summed as ``x[first] + (x[second] + ...)`` over a [G, p, E]
    view, without ``reduceat``'s column-by-column loop (several times faster)."""
    if not 0 < length <= _SHORT_RUN:
        return np.add.reduceat(x, starts, axis=0)
    v = x.reshape(starts.size, length, x.shape[1])
    if length == 1:
        return v[:, 0].copy()
    out: np.ndarray = v[:, 0] + v[:, 1:].sum(axis=1)
    return out


def _node_is_dc(topology: Topology) -> bool:
    """Every DC is one node and node ``i`` is DC ``i`` (``rank_node`` equals ``rank_dc``):
    sums and counts by node are then those by DC, the same floats."""
    got = _NODE_IS_DC.get(topology)
    if got is None:
        got = _NODE_IS_DC[topology] = topology.num_nodes == topology.num_dcs and bool(
            np.array_equal(topology.rank_node, topology.rank_dc)
        )
    return got


#: per topology: :func:`_node_is_dc`
_NODE_IS_DC: weakref.WeakKeyDictionary[Topology, bool] = weakref.WeakKeyDictionary()


_K = TypeVar("_K")
_V = TypeVar("_V")


def _remember(memo: dict[_K, _V], key: _K, value: _V, kept: int) -> None:
    """Keep ``value`` under ``key`` in ``memo``, at most ``kept`` entries, the oldest
    dropped first (none kept when ``kept`` is 0). ``list()`` copies the keys in one step
    and ``pop`` tolerates a key another thread dropped first: the controller's Solve runs
    planners in threads (``asyncio.to_thread``), so a bare ``pop(next(iter(memo)))``
    could raise there."""
    if kept <= 0:
        return
    for old in list(memo)[: max(0, len(memo) - kept + 1)]:
        memo.pop(old, None)
    memo[key] = value


#: [R] and the one-hot [R, runs] float64 matrix of those runs and its transpose
_GROUPS: weakref.WeakKeyDictionary[
    Topology, tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]
] = weakref.WeakKeyDictionary()


def _groups(topology: Topology) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
    """``(group of each rank, one-hot [R, groups], its transpose)`` of ``topology.rank_node``
    (over every node) and ``rank_dc`` (over every DC, a DC without ranks a zero column),
    made once per topology (the DC's arrays twice, the same objects, when each DC is one
    node); read-only."""
    got = _GROUPS.get(topology)
    if got is None:
        groups = []
        for index, size in ((topology.rank_node, topology.num_nodes),
                            (topology.rank_dc, topology.num_dcs)):  # fmt: skip
            run = np.array(index, dtype=np.int64)
            hot = np.zeros((index.size, size))
            hot[np.arange(index.size), run] = 1.0
            arrays = (run, hot, np.ascontiguousarray(hot.T))
            for a in arrays:
                a.flags.writeable = False
            groups.append(arrays)
        if groups[0][1].shape == groups[1][1].shape and np.array_equal(groups[0][0], groups[1][0]):
            groups[0] = groups[1]
        got = _GROUPS[topology] = tuple(groups)
    return got


def _node_dc(topology: Topology) -> np.ndarray:
    """[Nn] DC of each node."""
    return np.repeat(np.arange(topology.num_dcs), [d.nodes for d in topology.dcs])


#: per topology: the row runs of :func:`level_sums` (rank -> node, node -> DC)
_LEVELS: weakref.WeakKeyDictionary[Topology, tuple[tuple[np.ndarray, np.ndarray, int], ...]] = (
    weakref.WeakKeyDictionary()
)


def _level_index(topology: Topology) -> tuple[tuple[np.ndarray, np.ndarray, int], ...]:
    """``(starts, index[starts], length)`` of the sorted rank -> node and node -> DC indices;
    ``length``: the length of every run when they are equal, else 0."""
    got = _LEVELS.get(topology)
    if got is None:
        runs = []
        for index in (topology.rank_node, _node_dc(topology)):
            starts = np.flatnonzero(np.r_[True, index[1:] != index[:-1]]) if index.size else index
            n = int(index.size)
            p = n // starts.size if starts.size else 0
            even = p > 0 and np.array_equal(starts, np.arange(0, n, p))
            runs.append((starts, index[starts], p if even else 0))
        got = _LEVELS[topology] = tuple(runs)
    return got


def _shell_sums(
    rank: np.ndarray, in_shell: np.ndarray, num_ranks: int, key: np.ndarray | None = None
) -> np.ndarray:
    """[R, 3] what each rank receives over shells 1, 2, 3: the sums of ``in_shell`` [C, 4]
    rows by ``rank`` [C]. One ``bincount`` over (rank, shell) bins, each adding its values
    in row order as one ``bincount`` per shell would (the same floats). ``key``: the
    caller's :func:`_shell_key` of ``rank``, when it keeps one."""
    key = _shell_key(rank) if key is None else key
    sums = np.bincount(key, weights=in_shell.ravel(), minlength=4 * num_ranks)
    return np.ascontiguousarray(sums.reshape(num_ranks, 4)[:, 1:])


def _shell_key(rank: np.ndarray) -> np.ndarray:
    """[C * 4] the (rank, shell) bin of every cell of a [C, 4] array by ``rank`` [C]."""
    out: np.ndarray = ((rank.astype(np.int64) * 4)[:, None] + np.arange(4)).ravel()
    return out


def _whole_runs(topology: Topology) -> tuple[int, int] | None:
    """``(ranks per node, nodes per DC)`` when rank ``r`` lies in node ``r // ranks per
    node`` and node ``n`` in DC ``n // nodes per DC`` (``nodes per DC`` 0: one node per DC,
    node ``i`` is DC ``i``), else ``None``: sums by node and DC are then reshaped sums."""
    if topology not in _RUNS:
        (_, r_at, r_len), (_, n_at, n_len) = _level_index(topology)
        got: tuple[int, int] | None = None
        if r_len and np.array_equal(r_at, np.arange(topology.num_nodes)):
            if _node_is_dc(topology):
                got = (r_len, 0)
            elif n_len and np.array_equal(n_at, np.arange(topology.num_dcs)):
                got = (r_len, n_len)
        _RUNS[topology] = got
    return _RUNS[topology]


#: per topology: :func:`_whole_runs`
_RUNS: weakref.WeakKeyDictionary[Topology, tuple[int, int] | None] = weakref.WeakKeyDictionary()


#: whole-token totals below this are exact in float64 whatever the order of summation
_EXACT = 2**53


def _rank_shell(topology: Topology, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[N] int64 0 same rank, 1 same node, 2 same DC, 3 other DC between rank arrays ``a``
    and ``b`` (the cost model's): read from a per-topology [R, R] table when there are at
    most 1,024 ranks, else the count of differences (a node lies in one DC)."""
    table = _SHELLS.get(topology)
    if table is None and topology.num_ranks <= 1024:
        r = np.arange(topology.num_ranks)
        table = _SHELLS[topology] = _shell_of(topology, r[:, None], r[None, :])
        table.flags.writeable = False
    if table is not None:
        out: np.ndarray = table[a, b]
        return out
    return _shell_of(topology, a, b)


def _shell_of(topology: Topology, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dc, node = topology.rank_dc, topology.rank_node
    out = (dc[a] != dc[b]).astype(np.int64)
    out += node[a] != node[b]
    out += a != b
    return out


#: per topology: :func:`_rank_shell` of every pair of ranks
_SHELLS: weakref.WeakKeyDictionary[Topology, np.ndarray] = weakref.WeakKeyDictionary()
