"""Load ingestion: the controller's complete loads per layer, and the reports that make them.

Per layer, ranks report ``load[r, :]`` for ``(step, layer)``; once every live rank of a
step has reported, the full ``[R, E]`` load enters the layer's window of complete loads.
A trainer that gathers counts itself sends the whole ``[R, E]`` at once
(:meth:`LoadWindows.report_layer`); DC aggregators send window sums
(:meth:`LoadWindows.report_windows`, :mod:`expertmesh.controller.windows`), whose mean per
microbatch enters the window as one load, made when first asked for.

The plan lifecycle (:class:`~expertmesh.controller.core.ControllerCore`) reads the windows
(:meth:`newest`, :meth:`history`) and sets the dead ranks; every method here takes the
lock it is given (the core's), so REST and gRPC threads may call in while the control loop
runs. Accounting, at all times: ``reports_received == applied + reports_rejected``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from expertmesh.controller.windows import WindowAssembler, WindowMean
from expertmesh.planner import check_load
from expertmesh.planner.window import WindowBlock, WindowReport

__all__ = ["BatchReportError", "LoadWindows", "StaleReportError"]

# A complete load: an [R, E] array, or a window's mean made when first asked for.
Load = np.ndarray | WindowMean


class BatchReportError(ValueError):
    """A bad report in a batch: ``applied`` reports before it stayed applied."""

    def __init__(self, applied: int, completed: int, message: str) -> None:
        super().__init__(message)
        self.applied, self.completed = applied, completed


class StaleReportError(ValueError):
    """A report for a step older than what the controller already completed."""


def _array(load: Load) -> np.ndarray:
    return load.array() if isinstance(load, WindowMean) else load


class LoadWindows:
    """Complete loads per layer (the newest ``window`` of each), the incomplete steps being
    assembled (at most ``max_pending`` per layer: a partial load costs ``[R, E]`` whatever
    the report size, so steps that never complete, from a dead rank or a hostile client,
    must not grow memory; the oldest is dropped and counted instead), and the counters."""

    # Steps must stay below this (SQLite and the REST schema hold int64; a step near 2**64
    # would make every later step stale).
    MAX_STEP = 2**62

    def __init__(
        self,
        num_ranks: int,
        num_layers: int,
        num_experts: int,
        windows_in: WindowAssembler,
        *,
        window: int,
        max_pending: int,
        lock: threading.RLock,
        clock: Callable[[], float],
    ) -> None:
        self.num_ranks, self.num_layers, self.num_experts = num_ranks, num_layers, num_experts
        self.max_pending = max_pending
        self._lock, self._clock = lock, clock
        self._windows: list[deque[tuple[int, Load]]] = [
            deque(maxlen=window) for _ in range(num_layers)
        ]
        self._newest = np.full(num_layers, -1, np.int64)  # [L] step of the newest, -1: none
        # partial loads being assembled: (step, layer) -> ([R, E] load, [R] reported)
        self._pending: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.dead = np.zeros(num_ranks, bool)  # ranks planned out: no report needed
        # [R] clock time of each rank's newest accepted report (NaN: none yet)
        self._last_report = np.full(num_ranks, np.nan)
        self.reports_received = 0
        self.reports_rejected = 0
        self.pending_dropped = 0  # incomplete steps dropped past max_pending
        self.windows_in = windows_in  # DC window reports (hierarchical aggregation)

    # ---- settings and membership ----

    def resize(self, window: int, max_pending: int) -> None:
        """Keep ``window`` complete loads per layer from now on (the newest ones)."""
        with self._lock:
            self.max_pending = max_pending
            if self._windows and self._windows[0].maxlen != window:
                self._windows = [deque(w, maxlen=window) for w in self._windows]

    def set_dead(self, dead: np.ndarray) -> None:
        """``dead`` [R] bool: ranks that report no more; partial loads being assembled and
        pending windows are dropped."""
        with self._lock:
            self.dead = np.asarray(dead, bool).copy()
            self._pending.clear()
            self.windows_in.set_live(~self.dead)

    # ---- reads (the caller holds the lock or takes what one call returns) ----

    def complete(self) -> bool:
        """Every layer has a complete load."""
        return bool((self._newest >= 0).all())

    def newest(self, layer: int) -> tuple[int, np.ndarray] | None:
        """(step, ``[R, E]`` load) of ``layer``'s newest complete load, or None."""
        with self._lock:
            w = self._windows[layer]
            return (w[-1][0], _array(w[-1][1])) if w else None

    def newest_step(self, layer: int) -> int | None:
        """Step of ``layer``'s newest complete load, or None (cheap: no load is made)."""
        step = int(self._newest[layer])
        return None if step < 0 else step

    def loads(self, layer: int) -> list[Load]:
        """``layer``'s complete loads, oldest first, as kept (resolve with :func:`resolve`
        outside the lock: a window's mean is made on first use)."""
        with self._lock:
            return [x for _, x in self._windows[layer]]

    def make_means(self, newest: int) -> None:
        """Make the window means among each layer's ``newest`` complete loads now, taking
        the lock only to list them (a plan calls this first, so that the lock it then holds
        to read its inputs finds them made)."""
        for layer in range(self.num_layers):
            for x in self.loads(layer)[-max(newest, 1) :]:
                _array(x)

    def window(self, layer: int) -> np.ndarray:
        """[W, R, E] complete loads of ``layer``, oldest first."""
        loads = [_array(x) for x in self.loads(layer)]
        if not loads:
            return np.zeros((0, self.num_ranks, self.num_experts), np.int64)
        return np.stack(loads)

    def history(self, layer: int, hw: int, newest: np.ndarray | None = None) -> np.ndarray:
        """[W, R, E] the newest ``hw`` complete loads of ``layer``, with ``newest`` [R, E]
        appended as the newest one when given (a what-if's load)."""
        loads = self.loads(layer)
        if newest is not None:
            loads.append(newest)
        win = loads[-hw:] if hw else []
        if not win:
            return np.zeros((0, self.num_ranks, self.num_experts), np.int64)
        return np.stack([_array(x) for x in win])

    def last_reports(self) -> np.ndarray:
        """[R] clock time of each rank's newest accepted load report (a whole-layer report
        counts for every rank); NaN where none arrived yet."""
        with self._lock:
            return self._last_report.copy()

    # ---- per-rank reports ----

    def report_load(self, step: int, layer: int, rank: int, load: np.ndarray) -> bool:
        """Record ``load`` [E] sent by ``rank`` in microbatch ``step`` of ``layer``.

        Returns True when this report completed the step's [R, E] load for the layer.
        Raises ``ValueError`` (state unchanged, ``reports_rejected`` incremented) on a bad
        report: unknown layer or rank, wrong length, negative or non-integer counts,
        a duplicate, or a step older than the newest complete one.
        """
        with self._lock:
            self.reports_received += 1
            try:
                row = self._check_report(step, layer, rank, load)
            except ValueError:
                self.reports_rejected += 1
                raise
            self._last_report[rank] = self._clock()
            return self._apply_row(step, layer, rank, row)

    def _apply_row(self, step: int, layer: int, rank: int, row: np.ndarray) -> bool:
        # caller holds the lock and has checked the report
        key = (step, layer)
        pending = self._pending.get(key)
        if pending is None:
            self._make_pending_room(layer)
            pending = self._pending[key] = (
                np.zeros((self.num_ranks, self.num_experts), np.int64),
                np.zeros(self.num_ranks, bool),
            )
        acc, seen = pending
        acc[rank], seen[rank] = row, True
        if not (seen | self.dead).all():
            return False
        del self._pending[key]
        self._append(layer, step, acc)
        return True

    def _append(self, layer: int, step: int, load: Load) -> None:
        """``load`` is ``layer``'s newest complete load; partial loads up to it are dropped
        (their ranks moved on, or a window covers them)."""
        self._windows[layer].append((step, load))
        self._newest[layer] = step
        for k in [k for k in self._pending if k[1] == layer and k[0] <= step]:
            del self._pending[k]

    def report_batch(
        self, steps: np.ndarray, layers: np.ndarray, ranks: np.ndarray, loads: np.ndarray
    ) -> tuple[int, int]:
        """Record ``K`` reports in order, as :meth:`report_load` would one by one, with the
        value checks vectorized (the fast path of the gRPC stream).

        ``steps``, ``layers``, ``ranks``: [K] ints; ``loads``: [K, E] integer counts.
        Returns (applied, completed steps). On the first bad report the ones before it stay
        applied, it and every later one are counted as rejected, and :class:`BatchReportError`
        (a ``ValueError``) names it.
        """
        steps, layers, ranks = (np.asarray(a).reshape(-1) for a in (steps, layers, ranks))
        loads = np.asarray(loads)
        num = int(steps.shape[0])
        with self._lock:
            self.reports_received += num
            first_bad = num
            if (
                layers.shape[0] != num
                or ranks.shape[0] != num
                or (
                    num
                    and (
                        loads.ndim != 2
                        or loads.shape != (num, self.num_experts)
                        or loads.dtype.kind not in "iu"
                    )
                )
            ):
                first_bad = 0
            elif num:
                bad = (
                    (steps < 0)
                    | (layers < 0)
                    | (layers >= self.num_layers)
                    | (ranks < 0)
                    | (ranks >= self.num_ranks)
                    | (loads.min(axis=1) < 0)
                    | (loads.max(axis=1) > 2**40)
                )
                if bad.any():
                    first_bad = int(np.argmax(bad))
            applied = completed = 0
            now = self._clock()
            try:
                for i in range(first_bad):
                    step, layer, rank = int(steps[i]), int(layers[i]), int(ranks[i])
                    self._check_step(step, layer)
                    pending = self._pending.get((step, layer))
                    if pending is not None and pending[1][rank]:
                        raise ValueError(f"rank {rank} already reported layer {layer} step {step}")
                    completed += self._apply_row(step, layer, rank, loads[i].astype(np.int64))
                    self._last_report[rank] = now
                    applied += 1
                if first_bad < num:
                    if loads.ndim == 2 and loads.shape[0] == num and layers.shape[0] == num:
                        self._check_report(
                            int(steps[first_bad]),
                            int(layers[first_bad]),
                            int(ranks[first_bad]),
                            loads[first_bad],
                        )
                    raise ValueError(
                        f"a batch needs [K] steps, layers, ranks and [K, {self.num_experts}]"
                        f" integer loads; got {steps.shape}, {layers.shape}, {ranks.shape}, "
                        f"{loads.shape} {loads.dtype}"
                    )
            except ValueError as err:
                self.reports_rejected += num - applied
                raise BatchReportError(applied, completed, str(err)) from None
            return applied, completed

    def _make_pending_room(self, layer: int) -> None:
        # caller holds the lock and is about to add an incomplete step of ``layer``
        steps = [k[0] for k in self._pending if k[1] == layer]
        if len(steps) >= self.max_pending:
            del self._pending[(min(steps), layer)]
            self.pending_dropped += 1

    def report_layer(self, step: int, layer: int, load: np.ndarray) -> None:
        """Record a whole [R, E] load at once (a trainer that gathers counts itself)."""
        with self._lock:
            self.reports_received += 1
            try:
                self._check_step(step, layer)
                full = check_load(load, self.num_ranks, self.num_experts)
            except ValueError:
                self.reports_rejected += 1
                raise
            self._append(layer, step, full.copy())
            self._last_report[:] = self._clock()

    # ---- DC window reports ----

    def report_windows(self, reports: Sequence[WindowReport | WindowBlock]) -> tuple[int, int]:
        """Record DC window reports in order (hierarchical aggregation: one per DC per layer
        per window, or a :class:`WindowBlock` of one DC's window for several layers, counted
        as its layers; :mod:`expertmesh.controller.windows`). A window complete from every
        DC with a live rank enters the layer's load window as its mean load per microbatch,
        at its last step. Returns (applied, completed windows). On the first bad report (a
        block: all of its layers) the ones before it stay applied, it and every later one
        are counted as rejected, and :class:`BatchReportError` names it.

        Runs of reports of one DC's window (distinct layers, one shape) are checked and
        added as one block; a run with a bad report in it goes one report at a time, so
        the ones before the bad one stay applied as the rule says."""
        with self._lock:
            agg = self.windows_in
            num = sum(len(x) if isinstance(x, WindowBlock) else 1 for x in reports)
            self.reports_received += num
            agg.received += num
            applied = completed = 0
            try:
                for item, merged in _runs(reports):
                    try:
                        self._check_window(item)
                        parts: Sequence[WindowReport | WindowBlock] = [item]
                    except ValueError:
                        if merged is None:
                            raise
                        parts = merged  # find the bad one: those before it apply
                    for part in parts:
                        if part is not item:
                            self._check_window(part)
                        for layer, last, mean in agg.add(part, self.max_pending):
                            completed += 1
                            self._append(layer, last, mean)
                        applied += len(part) if isinstance(part, WindowBlock) else 1
            except ValueError as err:
                self.reports_rejected += num - applied
                agg.rejected += num - applied
                raise BatchReportError(applied, completed, str(err)) from None
            return applied, completed

    def _check_window(self, item: WindowReport | WindowBlock) -> None:
        """``ValueError`` unless every layer of ``item`` is known and newer than the layer's
        complete loads, and the assembler takes it."""
        layers = item.layers if isinstance(item, WindowBlock) else np.array([item.layer])
        known = (layers >= 0) & (layers < self.num_layers)
        if not known.all():
            raise ValueError(f"unknown layer {layers[~known][0]}; the model has {self.num_layers}")
        stale = self._newest[layers] >= item.first_step
        if stale.any():
            i = int(np.argmax(stale))
            raise StaleReportError(
                f"layer {layers[i]} step {item.first_step} is not newer than complete step "
                f"{self._newest[layers[i]]}"
            )
        self.windows_in.check(item)

    # ---- surfaces ----

    def reject_report(self, count: int = 1, *, windows: bool = False) -> None:
        """Count a report that a surface (REST, gRPC) refused before it reached the core
        (malformed body, wrong types): received and rejected both grow by ``count``, nothing
        else changes. ``windows``: they were DC window reports (counted there too)."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        with self._lock:
            self.reports_received += count
            self.reports_rejected += count
            if windows:
                self.windows_in.received += count
                self.windows_in.rejected += count

    def _check_step(self, step: int, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"unknown layer {layer}; the model has {self.num_layers}")
        if not 0 <= step < self.MAX_STEP:
            raise ValueError(f"step must be in [0, 2**62), got {step}")
        newest = int(self._newest[layer])
        if newest >= 0 and step <= newest:
            raise StaleReportError(
                f"layer {layer} step {step} is not newer than complete step {newest}"
            )

    def _check_report(self, step: int, layer: int, rank: int, load: np.ndarray) -> np.ndarray:
        self._check_step(step, layer)
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"unknown rank {rank}; the topology has {self.num_ranks}")
        row = np.asarray(load)
        if row.shape != (self.num_experts,):
            raise ValueError(f"load must be [{self.num_experts}], got shape {row.shape}")
        if row.dtype.kind == "f":
            if not np.isfinite(row).all() or (row != np.round(row)).any():
                raise ValueError("load counts must be finite integers")
        elif row.dtype.kind not in "iu":
            raise ValueError(f"load counts must be integers, got dtype {row.dtype}")
        if row.size and row.min() < 0:
            raise ValueError("load has negative token counts")
        if row.size and row.max() > 2**40:
            raise ValueError("load count is implausibly large (> 2**40)")
        pending = self._pending.get((step, layer))
        if pending is not None and pending[1][rank]:
            raise ValueError(f"rank {rank} already reported layer {layer} step {step}")
        return row.astype(np.int64)


def resolve(load: Load) -> np.ndarray:
    """The ``[R, E]`` array of a complete load (a window's mean is made here, once)."""
    return _array(load)


def _runs(
    items: Sequence[WindowReport | WindowBlock],
) -> Iterator[tuple[WindowReport | WindowBlock, list[WindowReport] | None]]:
    """``items`` in order, each run of consecutive reports of one DC's window (distinct
    layers, one shape) merged into a block: (item or block, the reports it merged or None)."""
    reps: list[WindowReport] = []
    for x in [*items, None]:
        if isinstance(x, WindowReport):
            reps.append(x)
            continue
        at = 0
        for y in WindowBlock.of(reps):
            k = len(y) if isinstance(y, WindowBlock) else 1
            yield y, (reps[at : at + k] if k > 1 else None)
            at += k
        reps = []
        if x is not None:
            yield x, None
