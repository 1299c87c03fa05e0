"""A DC's load aggregator: its ranks' per-layer load summed over windows of microbatches.

Hierarchical load aggregation (``docs/architecture.md``): instead of every rank's ``[E]``
counts of every layer every step (464,000 reports a step at 1,000 DCs x 8 ranks x 58
layers), each DC sends the controller one
:class:`~expertmesh.planner.window.WindowReport` per layer per window of ``window``
microbatches. Windows are aligned (``[w * window, (w + 1) * window - 1]``), so every
DC's window ``w`` of a layer lines up at the controller.

A plain class (no Ray, no network): the SPMD runtime hosts it in a DC's lead rank
(``expertmesh.runtime.loads``), a trainer outside Ray in one of its processes, and sends
what :meth:`DcAggregator.add` / :meth:`DcAggregator.add_rows` return
(``ControllerCore.report_windows`` in process, or ``ExpertMeshClient.report_windows`` over
gRPC). Not thread-safe: one caller at a time.

A window of a layer closes when every live rank of the DC has reported each of its
steps from ``first_step`` on (an aggregator started mid-window, e.g. on a replacement of a
dead lead, expects nothing before it); a report for a step ``max_open`` windows past the
oldest open one closes that one as it is (a rank fell silent); :meth:`set_live_ranks` (a
rank died) and :meth:`flush` (end of training) close what is complete or everything. A
closed window's ``steps`` counts the microbatches any rank reported in it.

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
    """Window ``w``'s sums for every layer (a layer's part is gone once ``done``)."""

    sum: np.ndarray  # [n, L, E] int64 per-rank sums (the DC's sum is the sum over n)
    seen: np.ndarray  # [n, L, window] bool: rank i reported layer l at step first + j
    reports: np.ndarray  # [L] int64 reports summed per layer
    done: np.ndarray  # [L] bool: the layer's window was emitted


class DcAggregator:
    """Sums one DC's ranks' load reports per layer over aligned windows.

    - ``dc``: the DC's index in the topology; ``ranks``: its global rank ids (the rows of
      a per-rank report, in this order).
    - ``num_layers``, ``num_experts``: the model's MoE layers and experts per layer.
    - ``window``: microbatches per window (the slow loop's: e.g. its re-plan period).
    - ``per_rank``: send ``[n, E]`` sums per rank instead of the DC's ``[E]`` (for
      policies that need ranks apart inside a DC; ``n`` times the bytes).
    - ``max_open``: open windows per layer before the oldest is closed as it is.
    - ``first_step``: the first step this aggregator sums (earlier ones are refused, and its
      first window expects nothing before it).
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
        first_step: int = 0,
    ) -> None:
        if dc < 0 or not ranks or num_layers < 1 or num_experts < 1:
            raise ValueError("dc >= 0, at least one rank, num_layers >= 1 and num_experts >= 1")
        if len(set(ranks)) != len(ranks) or min(ranks) < 0:
            raise ValueError(f"ranks must be distinct and >= 0, got {list(ranks)}")
        if not 1 <= window <= 1_000_000 or max_open < 1:
            raise ValueError("window must be in [1, 1e6] and max_open >= 1")
        if not 0 <= first_step < 2**62:
            raise ValueError(f"first_step must be in [0, 2**62), got {first_step}")
        self.dc, self.ranks = dc, [int(r) for r in ranks]
        self.num_layers, self.num_experts, self.window = num_layers, num_experts, window
        self.per_rank, self.max_open, self.first_step = per_rank, max_open, first_step
        self._row = {r: i for i, r in enumerate(self.ranks)}
        self._live = np.ones(len(self.ranks), bool)
        self._open: dict[int, _Open] = {}  # window index -> sums
        # per layer: windows below this are closed (or before first_step)
        self._closed_below = np.full(num_layers, first_step // window, np.int64)
        self.received = self.rejected = 0
        self.reports_sent = self.windows_sent = 0

    # ---- accounting ----

    @property
    def applied(self) -> int:
        return self.received - self.rejected

    @property
    def pending_reports(self) -> int:
        """Reports summed into windows not emitted yet."""
        return int(sum(o.reports[~o.done].sum() for o in self._open.values()))

    def counters(self) -> dict[str, int]:
        """``received``, ``rejected``, ``applied``, ``sent`` (rank reports in emitted windows),
        ``pending`` and ``windows_sent`` as plain ints."""
        return {
            "received": self.received,
            "rejected": self.rejected,
            "applied": self.applied,
            "sent": self.reports_sent,
            "pending": self.pending_reports,
            "windows_sent": self.windows_sent,
        }

    # ---- input ----

    def add(self, step: int, layer: int, rank: int, load: np.ndarray) -> list[WindowReport]:
        """Add ``load`` [E] (tokens ``rank`` sent to each expert in ``step`` of ``layer``);
        returns the windows this closed (send them). ``ValueError`` (counted as rejected,
        nothing changes) on an unknown layer or rank, a wrong shape, negative, fractional
        or implausibly large counts, a duplicate, or a step of a closed window."""
        self.received += 1
        try:
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"unknown layer {layer}; the model has {self.num_layers}")
            rows = self._rows([rank])
            w, j = self._step(step, [layer])
            counts = _counts(load, (self.num_experts,))
            o = self._open.get(w)
            if o is not None and o.seen[rows[0], layer, j]:
                raise ValueError(f"rank {rank} already reported layer {layer} step {step}")
        except ValueError:
            self.rejected += 1
            raise
        out, o = self._get(w)
        o.sum[rows[0], layer] += counts
        o.seen[rows[0], layer, j] = True
        o.reports[layer] += 1
        return out + self._close_complete(w, [layer])

    def add_rows(self, step: int, ranks: Sequence[int], loads: np.ndarray) -> list[WindowReport]:
        """``loads`` [n', L, E]: every layer's counts of each of ``ranks`` (ranks of this DC)
        at ``step``, at once (what a DC's lead holds after its DC's collective). All or
        nothing: a bad row refuses every report of the call (``len(ranks) * L`` counted as
        rejected, nothing changes). Returns the windows this closed."""
        num = len(ranks) * self.num_layers
        self.received += num
        try:
            rows = self._rows(ranks)
            w, j = self._step(step, range(self.num_layers))
            counts = _counts(loads, (len(rows), self.num_layers, self.num_experts))
            o = self._open.get(w)
            if o is not None and o.seen[rows, :, j].any():
                raise ValueError(f"ranks {list(ranks)} already reported step {step}")
        except ValueError:
            self.rejected += num
            raise
        out, o = self._get(w)
        o.sum[rows] += counts
        o.seen[rows, :, j] = True
        o.reports += len(rows)
        return out + self._close_complete(w, range(self.num_layers))

    def add_step(self, step: int, rank: int, loads: np.ndarray) -> list[WindowReport]:
        """``loads`` [L, E]: ``rank``'s counts of every layer at ``step`` (one call per step,
        as a rank has them). All or nothing, as :meth:`add_rows`."""
        arr = np.asarray(loads)
        if arr.ndim != 2:
            self.received += self.num_layers
            self.rejected += self.num_layers
            raise ValueError(f"loads must be [{self.num_layers}, E], got shape {arr.shape}")
        return self.add_rows(step, [rank], arr[None])

    def _rows(self, ranks: Sequence[int]) -> np.ndarray:
        rows = []
        for r in ranks:
            i = self._row.get(int(r))
            if i is None:
                raise ValueError(f"rank {r} is not in DC {self.dc}")
            if not self._live[i]:
                raise ValueError(f"rank {r} is not live")
            rows.append(i)
        if len(set(rows)) != len(rows):
            raise ValueError(f"ranks must be distinct, got {list(ranks)}")
        return np.asarray(rows, np.int64)

    def _step(self, step: int, layers: Sequence[int]) -> tuple[int, int]:
        if not self.first_step <= step < 2**62:
            raise ValueError(f"step must be in [{self.first_step}, 2**62), got {step}")
        w, j = divmod(int(step), self.window)
        for layer in layers:
            if w < self._closed_below[layer]:
                raise ValueError(f"layer {layer} step {step}: its window was already sent")
        return w, j

    # ---- windows ----

    def _get(self, w: int) -> tuple[list[WindowReport], _Open]:
        """Window ``w``, opened if new; a window too far ahead closes, per layer, the oldest
        open ones as they are (they will not complete)."""
        o = self._open.get(w)
        if o is not None:
            return [], o
        n, nl = len(self.ranks), self.num_layers
        o = self._open[w] = _Open(
            np.zeros((n, nl, self.num_experts), np.int64),
            np.zeros((n, nl, self.window), bool),
            np.zeros(nl, np.int64),
            np.zeros(nl, bool),
        )
        out: list[WindowReport] = []
        for layer in range(nl):
            opened = sorted(k for k, x in self._open.items() if not x.done[layer])
            for k in opened[: max(len(opened) - self.max_open, 0)]:
                out.append(self._close(k, layer))
        return sorted(out, key=_order), o

    def _expected(self, w: int) -> np.ndarray:
        """[window] bool: the steps of window ``w`` this aggregator expects."""
        return np.arange(w * self.window, (w + 1) * self.window) >= self.first_step

    def _close_complete(self, w: int, layers: Sequence[int] | range) -> list[WindowReport]:
        """Close window ``w`` of each of ``layers`` that every live rank has reported
        (and, first, older open windows of the layer, as they are)."""
        o = self._open.get(w)
        if o is None:
            return []
        seen = o.seen[self._live][:, :, self._expected(w)]  # [n_live, L, steps expected]
        full: np.ndarray = np.asarray(seen.all(axis=(0, 2)))  # [L]
        out: list[WindowReport] = []
        for layer in layers:
            if full[layer] and not o.done[layer]:
                out += self._close_through(w, layer)
        return sorted(out, key=_order)

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
        for w in sorted(self._open):
            out += self._close_complete(w, range(self.num_layers))
        return sorted(out, key=_order)

    def flush(self) -> list[WindowReport]:
        """Close every open window as it is (end of training, or before a hand-over)."""
        out = [
            self._close(w, layer)
            for w in sorted(self._open)
            for layer in range(self.num_layers)
            if not self._open[w].done[layer]
        ]
        return sorted(out, key=_order)

    def _close_through(self, w: int, layer: int) -> list[WindowReport]:
        """Close window ``w`` of ``layer`` and, first, any older open one of the layer (as
        it is: reports for it could no longer be sent once a newer window is)."""
        older = sorted(k for k, o in self._open.items() if k <= w and not o.done[layer])
        return [self._close(k, layer) for k in older]

    def _close(self, w: int, layer: int) -> WindowReport:
        o = self._open[w]
        o.done[layer] = True
        self._closed_below[layer] = max(int(self._closed_below[layer]), w + 1)
        steps = int(o.seen[:, layer].any(axis=0).sum())
        part = o.sum[:, layer]  # [n, E]
        load = part.copy() if self.per_rank else part.sum(axis=0)
        reports = int(o.reports[layer])
        if o.done.all():
            del self._open[w]
        self.windows_sent += 1
        self.reports_sent += reports
        return WindowReport(
            first_step=w * self.window,
            last_step=(w + 1) * self.window - 1,
            layer=layer,
            dc=self.dc,
            steps=max(steps, 1),
            reports=reports,
            load=load,
        )


def _order(rep: WindowReport) -> tuple[int, int]:
    return rep.first_step, rep.layer


def _counts(load: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``load`` as int64 of ``shape``; ``ValueError`` unless it holds integer counts in
    ``[0, MAX_COUNT]``."""
    arr = np.asarray(load)
    if arr.shape != shape:
        raise ValueError(f"load must be {list(shape)}, got shape {list(arr.shape)}")
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all() or (arr != np.round(arr)).any():
            raise ValueError("load counts must be finite integers")
    elif arr.dtype.kind not in "iu":
        raise ValueError(f"load counts must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > MAX_COUNT):
        raise ValueError("load counts must be in [0, 2**40]")
    return arr.astype(np.int64)
