"""Measured balance: what the data plane's fast loop did in each training step.

The SPMD runtime measures, per step, the tokens each rank actually computed (after the
per-microbatch quota inside each domain) and records them here through
:meth:`Telemetry.record_balance`. This is the *measured* side; the planned side (the
committed plan's imbalance on the newest load) is ``expertmesh_layer_*`` in
``telemetry.py``.

Series (absent until a step is recorded; no data is not a value):

- ``expertmesh_measured_balancedness_ratio{layer}``: mean/max tokens computed per rank in
  the newest step, per layer (vLLM's ``vllm:eplb_balancedness`` meaning);
- ``expertmesh_measured_imbalance_ratio``: max over microbatches and layers of max/mean
  tokens computed per rank in the newest step;
- ``expertmesh_static_imbalance_ratio``: what static EP would have had on the same tokens;
- per microbatch and layer of the newest step (labels ``microbatch``, ``layer``):
  ``expertmesh_microbatch_imbalance_ratio`` (max/mean tokens computed per rank),
  ``expertmesh_within_dc_imbalance_ratio`` (the worst DC's max/mean over its own ranks: what
  the fast loop, which balances inside each DC, reaches) and
  ``expertmesh_cross_dc_floor_ratio`` (the busiest DC's mean over the global mean: the
  floor under the first that the slow loop's choice of experts per DC sets) and, where the
  runtime solves it (``RuntimeSettings.planner_level``),
  ``expertmesh_planner_microbatch_imbalance_ratio`` (the planner's level: max/mean its own
  split by DC and quota reach on the same exact counts under the same plan);
- ``expertmesh_planner_imbalance_ratio``: the planner's level, max over microbatches and
  layers of the newest step (absent where not solved), beside the measured one.

Counters (0 until counted): ``expertmesh_fast_loop_replicas_total`` (replicas the fast loop
added, summed over layers and domains), ``expertmesh_fast_loop_fanout_bytes_total`` (replica
weights fetched inside domains). Histogram: ``expertmesh_fast_loop_seconds`` (a step's
exposed fast-loop time: counts exchange + quota solve + replica-fetch wait not hidden by
compute, summed over its microbatches, max over ranks).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

__all__ = ["BalanceMetrics", "BalanceRecord"]

FAST_LOOP_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


@dataclass(frozen=True)
class BalanceRecord:
    """One step's measured balance (fields as in the runtime's per-step result)."""

    step: int
    imbalance: float  # measured: max over microbatches and layers of max/mean per rank
    imbalance_static: float  # static EP on the same tokens
    balancedness: tuple[float, ...]  # [L] mean/max tokens computed per rank
    replicas: int  # added by the fast loop, over layers and domains
    fanout_bytes: int  # replica weights fetched inside domains
    balance_seconds: float  # exposed: exchange + solve + fetch wait, max over ranks
    seconds: float  # end-to-end step
    at: float
    # [k][L] per microbatch and layer (empty when the step did not say): measured max/mean,
    # the worst DC's own max/mean, and the busiest DC's mean over the global mean
    microbatches: tuple[tuple[float, ...], ...] = ()
    within_dc: tuple[tuple[float, ...], ...] = ()
    floor: tuple[tuple[float, ...], ...] = ()
    # [k][L] the planner's level on the same exact counts (empty where not solved)
    planner: tuple[tuple[float, ...], ...] = ()


def _ratio(x: float, name: str, lo: float, hi: float) -> float:
    x = float(x)
    if not (math.isfinite(x) and lo <= x <= hi):
        raise ValueError(f"{name} must be finite and in [{lo}, {hi}], got {x}")
    return x


class BalanceMetrics:
    """The measured-balance series on ``registry`` and a bounded history. Thread-safe."""

    def __init__(self, registry: CollectorRegistry, num_layers: int, history: int) -> None:
        self.num_layers = num_layers
        self._lock = threading.Lock()
        self._records: deque[BalanceRecord] = deque(maxlen=history)
        self.replicas = Counter(
            "expertmesh_fast_loop_replicas",
            "Replicas the fast loop added (summed over layers and domains, every step)",
            registry=registry,
        )
        self.fanout_bytes = Counter(
            "expertmesh_fast_loop_fanout_bytes",
            "Bytes of replica weights the fast loop fetched inside domains",
            registry=registry,
        )
        self.seconds = Histogram(
            "expertmesh_fast_loop_seconds",
            "Exposed fast-loop time of a step: counts exchange + quota solve + replica-fetch "
            "wait not hidden by compute, summed over microbatches, max over ranks",
            buckets=FAST_LOOP_BUCKETS,
            registry=registry,
        )
        registry.register(_Collector(self))

    def record(
        self,
        step: int,
        *,
        imbalance: float,
        imbalance_static: float,
        balancedness: Sequence[float],
        replicas: int,
        fanout_bytes: int,
        balance_seconds: float,
        seconds: float,
        at: float,
        microbatches: Sequence[Sequence[float]] = (),
        within_dc: Sequence[Sequence[float]] = (),
        floor: Sequence[Sequence[float]] = (),
        planner: Sequence[Sequence[float]] = (),
    ) -> BalanceRecord:
        """Validate and keep one step; ``ValueError`` (nothing recorded) on bad values.
        ``microbatches``, ``within_dc``, ``floor``, ``planner``: [k][L] ratios >= 1 (or
        empty), the same k; ``imbalance`` is the max of ``microbatches`` when given."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        bal = tuple(float(b) for b in balancedness)
        if len(bal) != self.num_layers:
            raise ValueError(f"balancedness must be [{self.num_layers}], got {len(bal)} values")
        for b in bal:
            _ratio(b, "balancedness", 0.0, 1.0)
        if int(replicas) < 0 or int(fanout_bytes) < 0:
            raise ValueError("replicas and fanout_bytes must be >= 0")
        per = {
            name: self._grid(name, grid)
            for name, grid in (("microbatches", microbatches), ("within_dc", within_dc),
                               ("floor", floor), ("planner", planner))
        }  # fmt: skip
        sizes = {len(g) for g in per.values() if g}
        if len(sizes) > 1:
            raise ValueError(
                "microbatches, within_dc, floor and planner must have the same microbatches"
            )
        mbs = per["microbatches"]
        if mbs and not math.isclose(max(max(r) for r in mbs), float(imbalance), rel_tol=1e-9):
            raise ValueError("imbalance must be the largest of the microbatches' values")
        rec = BalanceRecord(
            step=int(step),
            imbalance=_ratio(imbalance, "imbalance", 1.0, math.inf),
            imbalance_static=_ratio(imbalance_static, "imbalance_static", 1.0, math.inf),
            balancedness=bal,
            replicas=int(replicas),
            fanout_bytes=int(fanout_bytes),
            balance_seconds=_ratio(balance_seconds, "balance_seconds", 0.0, math.inf),
            seconds=_ratio(seconds, "seconds", 0.0, math.inf),
            at=float(at),
            microbatches=mbs,
            within_dc=per["within_dc"],
            floor=per["floor"],
            planner=per["planner"],
        )
        with self._lock:
            self._records.append(rec)
            self.replicas.inc(rec.replicas)
            self.fanout_bytes.inc(rec.fanout_bytes)
            self.seconds.observe(rec.balance_seconds)
        return rec

    def _grid(self, name: str, grid: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
        rows = tuple(tuple(_ratio(x, name, 1.0, math.inf) for x in row) for row in grid)
        if any(len(r) != self.num_layers for r in rows):
            raise ValueError(f"{name} must be [k][{self.num_layers}]")
        return rows

    def records(self, since: int = 0) -> list[BalanceRecord]:
        """Kept records of steps ``>= since``, oldest first."""
        with self._lock:
            return [r for r in self._records if r.step >= since]

    def newest(self) -> BalanceRecord | None:
        with self._lock:
            return self._records[-1] if self._records else None


class _Collector:
    """The newest record's gauges, at scrape time; none before the first record."""

    def __init__(self, metrics: BalanceMetrics) -> None:
        self._m = metrics

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        rec = self._m.newest()
        if rec is None:
            return []
        bal = GaugeMetricFamily(
            "expertmesh_measured_balancedness_ratio",
            "Mean/max tokens computed per rank in the newest step, per layer (measured)",
            labels=["layer"],
        )
        for layer, b in enumerate(rec.balancedness):
            bal.add_metric([str(layer)], b)
        measured = GaugeMetricFamily(
            "expertmesh_measured_imbalance_ratio",
            "Max over microbatches and layers of max/mean tokens computed per rank, newest step",
        )
        measured.add_metric([], rec.imbalance)
        static = GaugeMetricFamily(
            "expertmesh_static_imbalance_ratio",
            "Max/mean tokens per rank static EP would have had on the newest step's tokens",
        )
        static.add_metric([], rec.imbalance_static)
        out = [bal, measured, static]
        if rec.planner:
            level = GaugeMetricFamily(
                "expertmesh_planner_imbalance_ratio",
                "The planner's level on the newest step's exact counts (its split by DC and "
                "quota under the same plan): max over microbatches and layers of max/mean",
            )
            level.add_metric([], max(max(r) for r in rec.planner))
            out.append(level)
        for name, doc, grid in (
            ("expertmesh_microbatch_imbalance_ratio",
             "Max/mean tokens computed per rank, per microbatch and layer of the newest step",
             rec.microbatches),
            ("expertmesh_within_dc_imbalance_ratio",
             "The worst DC's max/mean tokens computed over its own ranks (what the fast loop "
             "reaches), per microbatch and layer of the newest step", rec.within_dc),
            ("expertmesh_cross_dc_floor_ratio",
             "The busiest DC's mean tokens per rank over the global mean (the floor the slow "
             "loop's experts per DC set), per microbatch and layer of the newest step",
             rec.floor),
            ("expertmesh_planner_microbatch_imbalance_ratio",
             "The planner's level: max/mean tokens per rank its own split by DC and quota "
             "reach on the same exact counts, per microbatch and layer of the newest step",
             rec.planner),
        ):  # fmt: skip
            if not grid:
                continue
            g = GaugeMetricFamily(name, doc, labels=["microbatch", "layer"])
            for i, row in enumerate(grid):
                for layer, x in enumerate(row):
                    g.add_metric([str(i), str(layer)], x)
            out.append(g)
        return out
