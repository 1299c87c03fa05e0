"""A DC's load aggregator: its ranks' per-layer load summed over windows of microbatches.

Hierarchical load aggregation (``docs/architecture.md``): instead of every rank's ``[E]``
counts of every layer every step (464,000 reports a step at 1,000 DCs x 8 ranks x 58
layers), each DC sends the controller one
:class:`~expertmesh.planner.window.WindowReport` per layer per window of ``window``
microbatches. Windows are aligned (``[w * window, (w + 1) * window - 1]``), so every
DC's window ``w`` of a layer lines up at the controller.

A plain class (no Ray, no network): the runtime hosts it in a DC's lead rank or in an
actor of its own, a trainer outside Ray in one of its processes, and sends what
:meth:`DcAggregator.add` returns (``ControllerCore.report_windows`` in process, or
``ExpertMeshClient.report_windows`` over gRPC). Not thread-safe: one caller at a time.

A window of a layer closes when every live rank of the DC has reported each of its
steps; a report for a step ``max_open`` windows past the oldest open one closes that one
as it is (a rank fell silent); :meth:`set_live_ranks` (a rank died) and :meth:`flush`
(end of training) close what is complete or everything. A closed window's ``steps``
counts the microbatches any rank reported in it.

Accounting, at all times: ``received == applied + rejected`` and
``applied == reports_sent + pending_reports`` (``reports_sent`` sums the ``reports`` of
every window emitted; the controller counts the same sum as ``rank_reports``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from expertmesh.planner.window import MAX_COUNT, WindowReport

__all__ = ["DcAggregator"]


@dataclass
class _Open:
    sum: np.ndarray  # [n, E] int64 per-rank sums (the DC's sum is its column sum)
    seen: np.ndarray  # [n, window] bool: rank i reported step first + j
    reports: int = 0


class DcAggregator:
    """Sums one DC's ranks' load reports per layer over aligned windows.

    - ``dc``: the DC's index in the topology; ``ranks``: its global rank ids (the rows of
      a per-rank report, in this order).
    - ``num_layers``, ``num_experts``: the model's MoE layers and experts per layer.
    - ``window``: microbatches per window (the slow loop's: e.g. its re-plan period).
    - ``per_rank``: send ``[n, E]`` sums per rank instead of the DC's ``[E]`` (for
      policies that need ranks apart inside a DC; ``n`` times the bytes).
    - ``max_open``: open windows per layer before the oldest is closed as it is.
    """

    def __init__(
        self,
        dc: int,
        ranks: Sequence[int],
        num_layers: int,
        num_experts: int,
        window: int,
        *,
        per_rank: bool = False,
        max_open: int = 2,
    ) -> None:
        if dc < 0 or not ranks or num_layers < 1 or num_experts < 1:
            raise ValueError("dc >= 0, at least one rank, num_layers >= 1 and num_experts >= 1")
        if len(set(ranks)) != len(ranks) or min(ranks) < 0:
            raise ValueError(f"ranks must be distinct and >= 0, got {list(ranks)}")
        if not 1 <= window <= 1_000_000 or max_open < 1:
            raise ValueError("window must be in [1, 1e6] and max_open >= 1")
        self.dc, self.ranks = dc, [int(r) for r in ranks]
        self.num_layers, self.num_experts, self.window = num_layers, num_experts, window
        self.per_rank, self.max_open = per_rank, max_open
        self._row = {r: i for i, r in enumerate(self.ranks)}
        self._live = np.ones(len(self.ranks), bool)
        self._open: dict[tuple[int, int], _Open] = {}  # (window index, layer) -> sums
        self._closed_below = [0] * num_layers  # per layer: windows below this are closed
        self.received = self.rejected = 0
        self.reports_sent = self.windows_sent = 0

    # ---- accounting ----

    @property
    def applied(self) -> int:
        return self.received - self.rejected

    @property
    def pending_reports(self) -> int:
        """Reports summed into windows not emitted yet."""
        return sum(o.reports for o in self._open.values())

    # ---- input ----

    def add(self, step: int, layer: int, rank: int, load: np.ndarray) -> list[WindowReport]:
        """Add ``load`` [E] (tokens ``rank`` sent to each expert in ``step`` of ``layer``);
        returns the windows this closed (send them). ``ValueError`` (counted as rejected,
        nothing changes) on an unknown layer or rank, a wrong shape, negative, fractional
        or implausibly large counts, a duplicate, or a step of a closed window."""
        self.received += 1
        try:
            row, w, j, counts = self._check(step, layer, rank, load)
        except ValueError:
            self.rejected += 1
            raise
        out = []
        key = (w, layer)
        o = self._open.get(key)
        if o is None:
            o = self._open[key] = _Open(
                np.zeros((len(self.ranks), self.num_experts), np.int64),
                np.zeros((len(self.ranks), self.window), bool),
            )
            # a window too far ahead: the oldest open one of the layer will not complete
            while True:
                opened = sorted(k[0] for k in self._open if k[1] == layer)
                if len(opened) <= self.max_open:
                    break
                out.append(self._close((opened[0], layer)))
        o.sum[row] += counts
        o.seen[row, j] = True
        o.reports += 1
        if o.seen[self._live].all():
            out += self._close_through(w, layer)
        return out

    def add_step(self, step: int, rank: int, loads: np.ndarray) -> list[WindowReport]:
        """``loads`` [L, E]: ``rank``'s counts of every layer at ``step`` (one call per step,
        as a rank has them). Layers are added in order; a bad row raises after the rows
        before it were added (each counted)."""
        arr = np.asarray(loads)
        if arr.ndim != 2 or arr.shape[0] != self.num_layers:
            self.received += 1
            self.rejected += 1
            raise ValueError(f"loads must be [{self.num_layers}, E], got shape {arr.shape}")
        out: list[WindowReport] = []
        for layer in range(self.num_layers):
            out += self.add(step, layer, rank, arr[layer])
        return out

    def _check(
        self, step: int, layer: int, rank: int, load: np.ndarray
    ) -> tuple[int, int, int, np.ndarray]:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"unknown layer {layer}; the model has {self.num_layers}")
        row = self._row.get(int(rank))
        if row is None:
            raise ValueError(f"rank {rank} is not in DC {self.dc}")
        if not self._live[row]:
            raise ValueError(f"rank {rank} is not live")
        if not 0 <= step < 2**62:
            raise ValueError(f"step must be in [0, 2**62), got {step}")
        arr = np.asarray(load)
        if arr.shape != (self.num_experts,):
            raise ValueError(f"load must be [{self.num_experts}], got shape {arr.shape}")
        if arr.dtype.kind == "f":
            if not np.isfinite(arr).all() or (arr != np.round(arr)).any():
                raise ValueError("load counts must be finite integers")
        elif arr.dtype.kind not in "iu":
            raise ValueError(f"load counts must be integers, got dtype {arr.dtype}")
        if arr.size and (arr.min() < 0 or arr.max() > MAX_COUNT):
            raise ValueError("load counts must be in [0, 2**40]")
        w, j = divmod(int(step), self.window)
        if w < self._closed_below[layer]:
            raise ValueError(f"layer {layer} step {step}: its window was already sent")
        o = self._open.get((w, layer))
        if o is not None and o.seen[row, j]:
            raise ValueError(f"rank {rank} already reported layer {layer} step {step}")
        return row, w, j, arr.astype(np.int64)

    # ---- closing ----

    def set_live_ranks(self, ranks: Sequence[int]) -> list[WindowReport]:
        """Only ``ranks`` (of this DC) report from now on (a rank died, or rejoined); returns
        the open windows this completes. ``ValueError`` on a rank not in the DC or none."""
        live = np.zeros(len(self.ranks), bool)
        for r in ranks:
            if int(r) not in self._row:
                raise ValueError(f"rank {r} is not in DC {self.dc}")
            live[self._row[int(r)]] = True
        if not live.any():
            raise ValueError("a DC aggregator needs a live rank; drop the aggregator instead")
        self._live = live
        out: list[WindowReport] = []
        for key in sorted(self._open):
            o = self._open.get(key)
            if o is not None and o.seen[live].all():
                out += self._close_through(*key)
        return out

    def flush(self) -> list[WindowReport]:
        """Close every open window as it is (end of training, or before a hand-over)."""
        return [self._close(k) for k in sorted(self._open)]

    def _close_through(self, w: int, layer: int) -> list[WindowReport]:
        """Close window ``w`` of ``layer`` and, first, any older open one of the layer (as
        it is: reports for it could no longer be sent once a newer window is)."""
        older = sorted(k for k in self._open if k[1] == layer and k[0] <= w)
        return [self._close(k) for k in older]

    def _close(self, key: tuple[int, int]) -> WindowReport:
        w, layer = key
        o = self._open.pop(key)
        self._closed_below[layer] = max(self._closed_below[layer], w + 1)
        steps = int(o.seen.any(axis=0).sum())
        load = o.sum.copy() if self.per_rank else o.sum.sum(axis=0)
        self.windows_sent += 1
        self.reports_sent += o.reports
        return WindowReport(
            first_step=w * self.window,
            last_step=(w + 1) * self.window - 1,
            layer=layer,
            dc=self.dc,
            steps=max(steps, 1),
            reports=o.reports,
            load=load,
        )
