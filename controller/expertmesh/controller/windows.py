"""Assembles the DCs' window reports into one load per layer per window (controller side of
hierarchical load aggregation; the DC side is ``expertmesh.workers.aggregate``).

A window ``[first_step, last_step]`` of a layer is complete once every DC with a live rank
has sent its :class:`~expertmesh.planner.window.WindowReport`; its mean load per microbatch
(:func:`~expertmesh.planner.window.window_mean`, ``[R, E]``) then enters the layer's load
window in :class:`~expertmesh.controller.core.ControllerCore` like one microbatch's load.
Not thread-safe on its own: the core calls it under its lock. Every check runs before
anything changes, so a refused report leaves the state as it was.

Accounting: ``received == applied + rejected`` (window reports), and ``rank_reports`` sums
the per-rank reports the applied ones stand for, so a DC aggregator's ``applied`` count can
be reconciled with what reached the controller; ``dropped_rank_reports`` counts those of
them in pending windows dropped before they completed (membership changed, too many
pending, a newer window completed first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from expertmesh.planner.topology import Topology
from expertmesh.planner.window import WindowBlock, WindowReport, spread_table, window_mean

__all__ = ["LayerWindow", "WindowAssembler", "WindowSums", "layer_windows"]


@dataclass(frozen=True, slots=True)
class LayerWindow:
    """One layer of a :class:`WindowBlock`, as a :class:`WindowReport` reads (the block
    checked its values already; nothing is checked again)."""

    first_step: int
    last_step: int
    layer: int
    dc: int
    steps: int
    reports: int
    load: np.ndarray  # [E] or [n, E]

    @property
    def per_rank(self) -> bool:
        return self.load.ndim == 2


def layer_windows(item: WindowReport | WindowBlock) -> list[WindowReport] | list[LayerWindow]:
    """The per-layer windows ``item`` stands for (a report: itself)."""
    if isinstance(item, WindowReport):
        return [item]
    cols = zip(item.layers.tolist(), item.steps.tolist(), item.reports.tolist(), strict=True)
    return [
        LayerWindow(item.first_step, item.last_step, layer, item.dc, st, rp, item.load[i])
        for i, (layer, st, rp) in enumerate(cols)
    ]


@dataclass
class _Pending:
    last_step: int
    dc_sum: np.ndarray  # [D, E] int64
    seen: np.ndarray  # [D] bool
    steps: np.ndarray  # [D] int64
    per_rank: np.ndarray  # [D] bool
    missing: int  # DCs that must still report
    rank_sum: np.ndarray | None = None  # [R, E] int64, made when a DC sends its ranks apart
    reports: int = 0


@dataclass(frozen=True)
class WindowSums:
    """The exact sums of a layer's newest complete window: ``dc_sum`` [D, E] tokens per DC
    and expert over ``steps`` [D] microbatches, ``reports`` per-rank reports in them."""

    first_step: int
    last_step: int
    steps: np.ndarray = field(repr=False)
    dc_sum: np.ndarray = field(repr=False)
    reports: int = 0


class WindowAssembler:
    """Pending windows per ``(first_step, layer)``; see the module docstring."""

    def __init__(self, topology: Topology, num_layers: int, num_experts: int) -> None:
        self.topology, self.num_layers, self.num_experts = topology, num_layers, num_experts
        # per layer: first step of the window -> what has arrived
        self._pending: list[dict[int, _Pending]] = [{} for _ in range(num_layers)]
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
        for pending in self._pending:
            self.pending_dropped += len(pending)
            self.dropped_rank_reports += sum(p.reports for p in pending.values())
            pending.clear()

    def newest(self, layer: int) -> WindowSums | None:
        """Exact sums of ``layer``'s newest complete window, or None."""
        return self._newest.get(layer)

    def check(self, rep: WindowReport | LayerWindow) -> None:
        """``ValueError`` unless ``rep`` fits the topology, the model and the pending windows
        (the caller has checked that ``first_step`` is newer than the layer's complete loads)."""
        topo = self.topology
        if not 0 <= rep.layer < self.num_layers:
            raise ValueError(f"unknown layer {rep.layer}; the model has {self.num_layers}")
        if not 0 <= rep.dc < topo.num_dcs:
            raise ValueError(f"unknown DC {rep.dc}; the topology has {topo.num_dcs}")
        n = topo.dcs[rep.dc].num_ranks
        if rep.load.shape not in ((self.num_experts,), (n, self.num_experts)):
            raise ValueError(
                f"load of DC {rep.dc} must be [{self.num_experts}] or [{n}, {self.num_experts}]"
                f", got shape {rep.load.shape}"
            )
        if not self._needed[rep.dc]:
            raise ValueError(f"DC {rep.dc} has no live rank")
        pending = self._pending[rep.layer].get(rep.first_step)
        if pending is not None:
            if pending.last_step != rep.last_step:
                raise ValueError(
                    f"layer {rep.layer} window from step {rep.first_step} ends at step "
                    f"{pending.last_step}, not {rep.last_step}"
                )
            if pending.seen[rep.dc]:
                raise ValueError(
                    f"DC {rep.dc} already reported layer {rep.layer} window "
                    f"[{rep.first_step}, {rep.last_step}]"
                )
        for first, p in self._pending[rep.layer].items():
            overlap = first <= rep.last_step and rep.first_step <= p.last_step
            if first != rep.first_step and overlap:
                raise ValueError(
                    f"layer {rep.layer} window [{rep.first_step}, {rep.last_step}] overlaps "
                    f"pending window [{first}, {p.last_step}]"
                )

    def add(
        self, rep: WindowReport | LayerWindow, max_pending: int
    ) -> tuple[int, np.ndarray] | None:
        """Add a checked report; when it completes its window: (last step, ``[R, E]`` mean
        load per microbatch), and pending windows of the layer up to it are dropped."""
        pending = self._pending[rep.layer]
        p = pending.get(rep.first_step)
        if p is None:
            if len(pending) >= max_pending:
                self.dropped_rank_reports += pending.pop(min(pending)).reports
                self.pending_dropped += 1
            d = self.topology.num_dcs
            p = pending[rep.first_step] = _Pending(
                last_step=rep.last_step,
                dc_sum=np.zeros((d, self.num_experts), np.int64),
                seen=np.zeros(d, bool),
                steps=np.zeros(d, np.int64),
                per_rank=np.zeros(d, bool),
                missing=int(self._needed.sum()),
            )
        p.seen[rep.dc], p.steps[rep.dc] = True, rep.steps
        p.missing -= 1
        p.reports += rep.reports
        self.rank_reports += rep.reports
        if rep.per_rank:
            if p.rank_sum is None:
                p.rank_sum = np.zeros((self.topology.num_ranks, self.num_experts), np.int64)
            ranks = self.topology.dc_ranks[rep.dc]
            p.rank_sum[ranks] = rep.load
            p.dc_sum[rep.dc] = rep.load.sum(axis=0)
            p.per_rank[rep.dc] = True
        else:
            p.dc_sum[rep.dc] = rep.load
        if p.missing:
            return None
        for first in [f for f in pending if f <= rep.last_step]:
            if first != rep.first_step:
                self.pending_dropped += 1
                self.dropped_rank_reports += pending[first].reports
            del pending[first]
        self.completed += 1
        self._newest[rep.layer] = WindowSums(
            rep.first_step, rep.last_step, p.steps, p.dc_sum, p.reports
        )
        mean = window_mean(
            self.topology,
            self._live,
            steps=p.steps,
            dc_sum=p.dc_sum,
            rank_sum=p.rank_sum,
            per_rank=p.per_rank,
            table=self._table,
        )
        return rep.last_step, mean
