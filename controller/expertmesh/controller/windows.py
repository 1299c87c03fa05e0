"""Assembles the DCs' window reports into one load per layer per window (controller side of
hierarchical load aggregation; the DC side is ``expertmesh.workers.aggregate``).

A window ``[first_step, last_step]`` of a layer is complete once every DC with a live rank
has sent its :class:`~expertmesh.planner.window.WindowReport` (or its layer of a
:class:`~expertmesh.planner.window.WindowBlock`); its mean load per microbatch
(:func:`~expertmesh.planner.window.window_mean`, ``[R, E]``) then enters the layer's load
window in :class:`~expertmesh.controller.ingest.LoadWindows` like one microbatch's load, as a
:class:`WindowMean`: computed when something asks for it (a plan, a query), not at every
report, and kept once computed.

Vectorized over a DC's layers: the pending windows that start at one step hold every layer
(``[L, D, E]`` sums, pages touched only for the layers reported), so a block of ``K``
layers is checked and added with a few numpy calls, not ``K`` rounds of Python. Not
thread-safe on its own: the ingest calls it under its lock. Every check runs before
anything changes, so a refused block leaves the state as it was.

Accounting: ``received == applied + rejected`` (window reports; a block counts as its
layers), and ``rank_reports`` sums the per-rank reports the applied ones stand for, so a DC
aggregator's ``applied`` count can be reconciled with what reached the controller;
``dropped_rank_reports`` counts those of them in pending windows dropped before they
completed (membership changed, too many pending, a newer window completed first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import numpy as np

from expertmesh.planner.topology import Topology
from expertmesh.planner.window import WindowBlock, WindowReport, spread_table, window_mean

__all__ = ["WindowAssembler", "WindowMean", "WindowSums"]


@dataclass(frozen=True)
class WindowSums:
    """The exact sums of a layer's newest complete window: ``dc_sum`` [D, E] tokens per DC
    and expert over ``steps`` [D] microbatches, ``reports`` per-rank reports in them."""

    first_step: int
    last_step: int
    steps: np.ndarray = field(repr=False)
    dc_sum: np.ndarray = field(repr=False)
    reports: int = 0


class WindowMean:
    """A complete window's ``[R, E]`` mean load per microbatch, made on first use
    (:meth:`array`) from sums that no longer change, then kept. Two threads asking at
    once both compute the same array; either result is kept."""

    __slots__ = ("_args", "_array")

    def __init__(self, topology: Topology, live: np.ndarray, table: tuple, **sums: object):
        self._args: tuple | None = (topology, live, table, sums)
        self._array: np.ndarray | None = None

    def array(self) -> np.ndarray:
        args, out = self._args, self._array  # in this order: see below
        if out is not None:
            return out
        if args is None:  # another thread made it: it sets _array before it drops _args
            return cast(np.ndarray, self._array)
        topology, live, table, sums = args
        out = self._array = window_mean(topology, live, table=table, **sums)
        self._args = None  # the sums are no longer needed by this window
        return out


@dataclass(eq=False)
class _Pending:
    """The pending windows of every layer that start at one step (a layer takes part while
    ``last_step[l] >= 0``)."""

    last_step: np.ndarray  # [L] int64, -1: no window of the layer starts here
    dc_sum: np.ndarray  # [L, D, E] int64
    seen: np.ndarray  # [L, D] bool
    steps: np.ndarray  # [L, D] int64
    per_rank: np.ndarray  # [L, D] bool
    missing: np.ndarray  # [L] int64: DCs that must still report
    reports: np.ndarray  # [L] int64
    used: np.ndarray  # [L] bool: the layer's slices were written (zero them to reopen)
    rank_sum: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [R, E]


class WindowAssembler:
    """Pending windows by first step, for every layer; see the module docstring."""

    def __init__(self, topology: Topology, num_layers: int, num_experts: int) -> None:
        self.topology, self.num_layers, self.num_experts = topology, num_layers, num_experts
        self._sizes = np.array([d.num_ranks for d in topology.dcs])
        self._pending: dict[int, _Pending] = {}  # first step -> every layer's window
        self._newest: dict[int, WindowSums] = {}
        self.received = self.rejected = self.completed = self.rank_reports = 0
        self.pending_dropped = self.dropped_rank_reports = 0
        self.set_live(np.ones(topology.num_ranks, bool))

    @property
    def applied(self) -> int:
        return self.received - self.rejected

    def set_live(self, live: np.ndarray) -> None:
        """Ranks taking part from now on; pending windows are dropped (their DC sets changed)
        and counted (``pending_dropped`` windows, ``dropped_rank_reports`` in them)."""
        self._live = np.asarray(live, bool).copy()
        self._table = spread_table(self.topology, self._live, self.num_experts)
        self._needed = self._table[0] > 0  # [D] DCs that must report
        for p in self._pending.values():
            open_ = p.last_step >= 0
            self.pending_dropped += int(open_.sum())
            self.dropped_rank_reports += int(p.reports[open_].sum())
        self._pending.clear()

    def newest(self, layer: int) -> WindowSums | None:
        """Exact sums of ``layer``'s newest complete window, or None."""
        return self._newest.get(layer)

    def check(self, item: WindowReport | WindowBlock) -> None:
        """``ValueError`` unless every layer of ``item`` fits the topology, the model and the
        pending windows (the caller has checked that ``first_step`` is newer than the
        layers' complete loads)."""
        layers, dc, first, last = _layers(item), item.dc, item.first_step, item.last_step
        if layers.min() < 0 or layers.max() >= self.num_layers:
            bad = layers[(layers < 0) | (layers >= self.num_layers)][0]
            raise ValueError(f"unknown layer {bad}; the model has {self.num_layers}")
        if not 0 <= dc < self.topology.num_dcs:
            raise ValueError(f"unknown DC {dc}; the topology has {self.topology.num_dcs}")
        n, e = int(self._sizes[dc]), self.num_experts
        shape = item.load.shape[1:] if isinstance(item, WindowBlock) else item.load.shape
        if shape not in ((e,), (n, e)):
            raise ValueError(f"load of DC {dc} must be [{e}] or [{n}, {e}], got shape {shape}")
        if not self._needed[dc]:
            raise ValueError(f"DC {dc} has no live rank")
        p = self._pending.get(first)
        if p is not None:
            ends = p.last_step[layers]  # [K]
            wrong = (ends >= 0) & (ends != last)
            if wrong.any():
                i = int(np.argmax(wrong))
                raise ValueError(
                    f"layer {layers[i]} window from step {first} ends at step {ends[i]}, not {last}"
                )
            twice = p.seen[layers, dc] & (ends >= 0)
            if twice.any():
                raise ValueError(
                    f"DC {dc} already reported layer {layers[np.argmax(twice)]} window "
                    f"[{first}, {last}]"
                )
        for other, q in self._pending.items():
            if other == first or other > last:
                continue
            ends = q.last_step[layers]
            hit = (ends >= 0) & (first <= ends)
            if hit.any():
                i = int(np.argmax(hit))
                raise ValueError(
                    f"layer {layers[i]} window [{first}, {last}] overlaps pending window "
                    f"[{other}, {ends[i]}]"
                )

    def add(
        self, item: WindowReport | WindowBlock, max_pending: int
    ) -> list[tuple[int, int, WindowMean]]:
        """Add a checked report or block; returns (layer, last step, ``[R, E]`` mean load) of
        each window it completed (pending windows of that layer up to it are dropped)."""
        layers, first, last, dc = _layers(item), item.first_step, item.last_step, item.dc
        block = isinstance(item, WindowBlock)
        load = item.load if block else item.load[None]  # [K, E] or [K, n, E]
        p = self._pending.get(first)
        if p is None:
            p = self._pending[first] = self._new()
        new = layers[p.last_step[layers] < 0]
        if new.size:
            self._open(p, first, last, new, max_pending)
        per_rank = load.ndim == 3
        p.dc_sum[layers, dc] = load.sum(axis=1) if per_rank else load
        p.seen[layers, dc] = True
        p.steps[layers, dc] = item.steps
        p.reports[layers] += item.reports
        p.missing[layers] -= 1
        self.rank_reports += int(np.sum(item.reports))
        if per_rank:
            ranks = self.topology.dc_ranks[dc]
            num = (self.topology.num_ranks, self.num_experts)
            for i, layer in enumerate(layers.tolist()):
                p.rank_sum.setdefault(layer, np.zeros(num, np.int64))[ranks] = load[i]
            p.per_rank[layers, dc] = True
        done = layers[p.missing[layers] == 0]
        return [self._complete(first, p, layer) for layer in done.tolist()]

    def _new(self) -> _Pending:
        nl, d, e = self.num_layers, self.topology.num_dcs, self.num_experts
        return _Pending(
            last_step=np.full(nl, -1, np.int64),
            dc_sum=np.zeros((nl, d, e), np.int64),  # pages are touched per layer reported
            seen=np.zeros((nl, d), bool),
            steps=np.zeros((nl, d), np.int64),
            per_rank=np.zeros((nl, d), bool),
            missing=np.zeros(nl, np.int64),
            reports=np.zeros(nl, np.int64),
            used=np.zeros(nl, bool),
        )

    def _open(self, p: _Pending, first: int, last: int, new: np.ndarray, cap: int) -> None:
        """Open the windows of ``new`` layers at ``p``, first dropping each layer's oldest
        pending window where it already has ``cap``."""
        count = sum((q.last_step[new] >= 0).astype(np.int64) for q in self._pending.values())
        for layer in new[count >= cap].tolist():
            oldest = min(f for f, q in self._pending.items() if q.last_step[layer] >= 0)
            self._drop(oldest, layer)
        reused = new[p.used[new]]
        if reused.size:  # a window of these layers started here before and was dropped
            for a in (p.dc_sum, p.seen, p.steps, p.per_rank):
                a[reused] = 0
            for layer in reused.tolist():
                p.rank_sum.pop(layer, None)
        p.last_step[new] = last
        p.missing[new] = int(self._needed.sum())
        p.reports[new] = 0
        p.used[new] = True

    def _drop(self, first: int, layer: int) -> None:
        """Drop ``layer``'s pending window at ``first`` before it completed (counted)."""
        p = self._pending[first]
        self.pending_dropped += 1
        self.dropped_rank_reports += int(p.reports[layer])
        self._close(first, p, layer)

    def _close(self, first: int, p: _Pending, layer: int) -> None:
        p.last_step[layer] = -1
        if (p.last_step < 0).all():
            del self._pending[first]

    def _complete(self, first: int, p: _Pending, layer: int) -> tuple[int, int, WindowMean]:
        last = int(p.last_step[layer])
        for other in [f for f, q in self._pending.items() if f <= last and q.last_step[layer] >= 0]:
            if other != first:
                self._drop(other, layer)  # older windows of the layer will not complete now
        self._close(first, p, layer)
        self.completed += 1
        reports = int(p.reports[layer])
        self._newest[layer] = WindowSums(first, last, p.steps[layer], p.dc_sum[layer], reports)
        mean = WindowMean(
            self.topology,
            self._live,
            self._table,
            steps=p.steps[layer],
            dc_sum=p.dc_sum[layer],
            rank_sum=p.rank_sum.get(layer),
            per_rank=p.per_rank[layer],
        )
        return layer, last, mean


def _layers(item: WindowReport | WindowBlock) -> np.ndarray:
    """[K] the layers ``item`` stands for."""
    if isinstance(item, WindowBlock):
        return item.layers
    return np.array([item.layer], np.int64)
