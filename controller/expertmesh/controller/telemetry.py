"""Telemetry: Prometheus metrics and the recent history the dashboard draws.

One :class:`Telemetry` per controller, with its own ``CollectorRegistry`` (no
global metric objects; nothing is built at import). The runtime calls
:meth:`Telemetry.record_step` once per training step and
:meth:`Telemetry.set_worker_state` when a worker comes up or goes down; plan
events arrive through ``core.listeners``. ``/metrics`` serves
:meth:`Telemetry.render`.

Metric names follow Prometheus conventions: ``expertmesh_`` prefix, the unit
as suffix, ``_total`` on counters. Label sets are bounded: ``layer`` by the
model's layers, ``rank`` by the topology's ranks (capped by
``TelemetrySettings.max_rank_series``; ranks beyond it only count in totals),
``src_dc``/``dst_dc`` by the topology's DCs (pairs beyond
``max_dc_pair_series`` are summed into ``other``/``other``), ``kind`` in
{tokens, weights}, ``when`` in {before, after}.

No data is not a value: a gauge with nothing to report yet is absent from ``/metrics``
(``expertmesh_step_loss`` until a step with a loss is recorded, which ``expertmesh serve``
never does; ``expertmesh_step`` until a step is; a layer's imbalance and balancedness until
the layer has a complete load), rather than a 0 or a 1.0 that reads as "perfect". Counters
start at 0 (nothing counted is a value); the ``*_created`` timestamps prometheus_client
adds to counters and histograms are left out. The migration counters start at 0 for every
DC pair when the pairs fit ``max_dc_pair_series``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from pydantic import BaseModel, ConfigDict, Field

from expertmesh.controller.balance import BalanceMetrics, BalanceRecord
from expertmesh.controller.core import ControllerCore, PlanVersion
from expertmesh.planner import balancedness_stats, imbalance

__all__ = ["CONTENT_TYPE", "BalanceRecord", "StepRecord", "Telemetry", "TelemetrySettings"]

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OTHER = "other"
SOLVE_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
STEP_BUCKETS = (1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TelemetrySettings(BaseModel):
    """Bounds on what telemetry keeps and exports."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    history: int = Field(default=512, ge=1, le=100_000, description="steps kept for the dashboard")
    plan_history: int = Field(
        default=256, ge=1, le=100_000, description="plan events kept for the dashboard"
    )
    max_rank_series: int = Field(
        default=1024, ge=0, le=65_536, description="ranks exported with a `rank` label"
    )
    max_dc_pair_series: int = Field(
        default=1024, ge=0, le=1_000_000, description="DC pairs exported with their own labels"
    )


@dataclass(frozen=True)
class StepRecord:
    """One training step as the runtime saw it. ``imbalance``: max/mean of tokens per rank."""

    step: int
    seconds: float
    loss: float | None
    imbalance: float
    tokens: int
    at: float


@dataclass(frozen=True)
class PlanEvent:
    """A plan event (prepared, committed, rolled_back) for the dashboard's timeline."""

    event: str
    version: int
    step: int
    policy: str
    imbalance_before: float  # max over layers
    imbalance_after: float  # max over layers
    migrations: int
    migration_bytes: int
    solve_seconds: float
    at: float


class Telemetry:
    """Metrics and recent history for one :class:`ControllerCore`. Thread-safe."""

    def __init__(
        self,
        core: ControllerCore,
        settings: TelemetrySettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.core = core
        self.settings = settings or TelemetrySettings()
        self._clock = clock
        self._lock = threading.Lock()
        topo = core.topology
        self._dc_names = [d.name for d in topo.dcs]
        self._num_dcs = topo.num_dcs
        self._num_ranks = topo.num_ranks
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        self.solve_seconds = Histogram(
            "expertmesh_planner_solve_seconds",
            "Planner solve time of one layer",
            buckets=SOLVE_BUCKETS,
            registry=r,
        )
        self.plan_version = Gauge(
            "expertmesh_plan_version", "Version of the committed plan (0: none)", registry=r
        )
        self.plan_prepared_version = Gauge(
            "expertmesh_plan_prepared_version", "Newest prepared plan version", registry=r
        )
        self.plan_commits = Counter(
            "expertmesh_plan_commits", "Plans committed", registry=r
        )  # exported as expertmesh_plan_commits_total
        self.plan_rollbacks = Counter("expertmesh_plan_rollbacks", "Plans rolled back", registry=r)
        self.plan_imbalance = Gauge(
            "expertmesh_plan_imbalance_ratio",
            "Max/mean tokens per rank of the committed plan's load, before and after it",
            ["layer", "when"],
            registry=r,
        )
        self.migrations = Counter(
            "expertmesh_migrations",
            "Expert copies moved by committed plans, per DC pair",
            ["src_dc", "dst_dc"],
            registry=r,
        )
        self.migration_bytes = Counter(
            "expertmesh_migration_bytes",
            "Bytes moved by committed plans' migrations, per DC pair",
            ["src_dc", "dst_dc"],
            registry=r,
        )
        self.cross_dc_bytes = Counter(
            "expertmesh_cross_dc_bytes",
            "Bytes that crossed a DC pair, as tokens (activations) or as weights",
            ["src_dc", "dst_dc", "kind"],
            registry=r,
        )
        self.step_seconds = Histogram(
            "expertmesh_step_seconds", "Training step time", buckets=STEP_BUCKETS, registry=r
        )
        # expertmesh_step and expertmesh_step_loss: _CoreCollector, once there is a value
        self._last_step: int | None = None
        self._last_loss: float | None = None
        self.rank_tokens = Gauge(
            "expertmesh_rank_tokens",
            "Tokens computed by each rank in the newest step",
            ["rank"],
            registry=r,
        )
        self.tokens = Counter("expertmesh_tokens", "Tokens computed by all ranks", registry=r)
        self.worker_up = Gauge(
            "expertmesh_worker_up", "1 if the worker of a rank is up, else 0", ["rank"], registry=r
        )
        self.registry.register(_CoreCollector(self))
        # measured balance of the SPMD data plane's fast loop (controller/balance.py)
        self.balance = BalanceMetrics(r, core.model.num_layers, self.settings.history)

        self._steps: deque[StepRecord] = deque(maxlen=self.settings.history)
        self._plans: deque[PlanEvent] = deque(maxlen=self.settings.plan_history)
        self._last_tokens = np.zeros(self._num_ranks, np.int64)
        self._cross = np.zeros((2, self._num_dcs, self._num_dcs), np.float64)  # [kind, D, D]
        self._workers: dict[int, tuple[bool, float]] = {}
        self._pair_labels: dict[tuple[int, int], tuple[str, str]] = {}
        self._imb_cache: tuple[Any, list[float | None]] | None = None
        core.listeners.append(self._on_plan)
        if core.committed is not None:
            self.plan_version.set(core.committed.version)
        num_pairs = self._num_dcs * (self._num_dcs - 1)
        if 0 < num_pairs <= self.settings.max_dc_pair_series:  # 0 moved so far, per DC pair
            for a in range(self._num_dcs):
                for b in range(self._num_dcs):
                    if a != b:
                        src, dst = self._pair(a, b)
                        self.migrations.labels(src_dc=src, dst_dc=dst)
                        self.migration_bytes.labels(src_dc=src, dst_dc=dst)

    def close(self) -> None:
        """Stop following the core's plan events (idempotent)."""
        if self._on_plan in self.core.listeners:
            self.core.listeners.remove(self._on_plan)

    # ---- inputs from the runtime ----

    def record_step(
        self,
        step: int,
        seconds: float,
        loss: float | None,
        tokens_per_rank: np.ndarray,
        *,
        cross_dc_token_bytes: np.ndarray | None = None,
        cross_dc_weight_bytes: np.ndarray | None = None,
    ) -> None:
        """Record one training step.

        - ``tokens_per_rank``: [R] tokens each rank computed in this step.
        - ``cross_dc_token_bytes`` / ``cross_dc_weight_bytes``: [D, D] bytes sent from DC ``a``
          to DC ``b`` in this step as tokens (activations, both directions of dispatch and
          combine) and as expert weights or gradients; the diagonal is ignored.

        Raises ``ValueError`` on a wrong shape, negative or non-finite values.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not (np.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"step seconds must be finite and >= 0, got {seconds}")
        if loss is not None and not np.isfinite(loss):
            loss = None  # a diverged loss is still a step; it just has no loss to plot
        tpr = _check_vector(tokens_per_rank, self._num_ranks, "tokens_per_rank")
        mats = [
            _check_matrix(m, self._num_dcs, name)
            for m, name in (
                (cross_dc_token_bytes, "cross_dc_token_bytes"),
                (cross_dc_weight_bytes, "cross_dc_weight_bytes"),
            )
        ]
        rec = StepRecord(
            step=int(step),
            seconds=float(seconds),
            loss=None if loss is None else float(loss),
            imbalance=imbalance(tpr),
            tokens=int(tpr.sum()),
            at=self._clock(),
        )
        with self._lock:
            self._steps.append(rec)
            self._last_tokens = tpr.astype(np.int64)
            self.step_seconds.observe(rec.seconds)
            self._last_step = rec.step
            if rec.loss is not None:
                self._last_loss = rec.loss
            self.tokens.inc(rec.tokens)
            for r in range(min(self._num_ranks, self.settings.max_rank_series)):
                self.rank_tokens.labels(rank=str(r)).set(float(tpr[r]))
            for k, (kind, m) in enumerate(zip(("tokens", "weights"), mats, strict=True)):
                if m is None:
                    continue
                self._cross[k] += m
                for a, b in zip(*np.nonzero(m), strict=True):
                    if a == b:
                        continue
                    src, dst = self._pair(int(a), int(b))
                    self.cross_dc_bytes.labels(src_dc=src, dst_dc=dst, kind=kind).inc(
                        float(m[a, b])
                    )

    def record_balance(
        self,
        step: int,
        *,
        imbalance: float,
        imbalance_static: float,
        balancedness: list[float],
        replicas: int,
        fanout_bytes: int,
        balance_seconds: float,
        seconds: float,
        microbatches: Sequence[Sequence[float]] = (),
        within_dc: Sequence[Sequence[float]] = (),
        floor: Sequence[Sequence[float]] = (),
        planner: Sequence[Sequence[float]] = (),
    ) -> BalanceRecord:
        """Record what the fast loop did in one SPMD step (measured from the tokens each rank
        computed; see :mod:`expertmesh.controller.balance`): ``microbatches``, ``within_dc``,
        ``floor`` [k][L] per microbatch and layer, and ``planner`` [k][L], the planner's
        level on the same counts (empty: not solved). ``ValueError`` on bad values."""
        return self.balance.record(
            step, imbalance=imbalance, imbalance_static=imbalance_static,
            balancedness=balancedness, replicas=replicas, fanout_bytes=fanout_bytes,
            balance_seconds=balance_seconds, seconds=seconds, at=self._clock(),
            microbatches=microbatches, within_dc=within_dc, floor=floor, planner=planner,
        )  # fmt: skip

    def set_worker_state(self, rank: int, up: bool) -> None:
        """Mark the worker of ``rank`` up or down. ``ValueError`` for an unknown rank."""
        if not 0 <= rank < self._num_ranks:
            raise ValueError(f"unknown rank {rank}; the topology has {self._num_ranks}")
        with self._lock:
            prev = self._workers.get(rank)
            if prev is None or prev[0] != up:
                self._workers[rank] = (bool(up), self._clock())
            if rank < self.settings.max_rank_series:
                self.worker_up.labels(rank=str(rank)).set(1.0 if up else 0.0)

    # ---- plan events ----

    def _on_plan(self, event: str, pv: PlanVersion) -> None:
        # Called under the core's lock: only bookkeeping here, no calls back into the core.
        moves = _migration_pairs(pv, self.core.topology.rank_dc)
        ev = PlanEvent(
            event=event,
            version=pv.version,
            step=pv.step,
            policy=pv.policy,
            imbalance_before=max(pv.imbalance_before, default=1.0),
            imbalance_after=max(pv.imbalance_after, default=1.0),
            migrations=sum(c for c, _ in moves.values()),
            migration_bytes=sum(b for _, b in moves.values()),
            solve_seconds=pv.solve_seconds,
            at=self._clock(),
        )
        with self._lock:
            self._plans.append(ev)
            if event == "prepared":
                self.plan_prepared_version.set(pv.version)
                for lp in pv.layers:
                    self.solve_seconds.observe(lp.solve_seconds)
            elif event == "committed":
                self.plan_commits.inc()
                self.plan_version.set(pv.version)
                for layer, (b, a) in enumerate(
                    zip(pv.imbalance_before, pv.imbalance_after, strict=True)
                ):
                    self.plan_imbalance.labels(layer=str(layer), when="before").set(b)
                    self.plan_imbalance.labels(layer=str(layer), when="after").set(a)
                for (sa, sb), (count, nbytes) in moves.items():
                    src, dst = self._pair(sa, sb)
                    self.migrations.labels(src_dc=src, dst_dc=dst).inc(count)
                    self.migration_bytes.labels(src_dc=src, dst_dc=dst).inc(nbytes)
            elif event == "rolled_back":
                self.plan_rollbacks.inc()

    def _pair(self, a: int, b: int) -> tuple[str, str]:
        # caller holds self._lock
        got = self._pair_labels.get((a, b))
        if got is not None:
            return got
        if len(self._pair_labels) < self.settings.max_dc_pair_series:
            got = (self._dc_names[a], self._dc_names[b])
        else:
            got = (OTHER, OTHER)
        self._pair_labels[(a, b)] = got
        return got

    # ---- reads ----

    def layer_imbalance(self) -> list[float | None]:
        """[L] max/mean of each layer's newest load under the committed placement (cached);
        None for a layer without a complete load yet."""
        core = self.core
        committed = core.committed
        key = (
            committed.version if committed else 0,
            tuple(core.layer_newest_step(layer) for layer in range(core.model.num_layers)),
        )
        cached = self._imb_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        values: list[float | None] = [
            None if newest is None else core.layer_stats(layer).imbalance
            for layer, newest in enumerate(key[1])
        ]
        self._imb_cache = (key, values)
        return values

    def steps(self) -> list[StepRecord]:
        with self._lock:
            return list(self._steps)

    def plan_events(self) -> list[PlanEvent]:
        with self._lock:
            return list(self._plans)

    def last_tokens_per_rank(self) -> np.ndarray:
        """[R] tokens each rank computed in the newest recorded step."""
        with self._lock:
            return self._last_tokens.copy()

    def cross_dc_totals(self) -> np.ndarray:
        """[2, D, D] bytes sent between DCs since start: [0] as tokens, [1] as weights."""
        with self._lock:
            return self._cross.copy()

    def workers(self) -> dict[int, tuple[bool, float]]:
        """rank -> (up, since) for every rank whose state was ever set."""
        with self._lock:
            return dict(self._workers)

    def step_values(self) -> tuple[int | None, float | None]:
        """(newest step recorded, newest loss recorded), None where there is none yet."""
        with self._lock:
            return self._last_step, self._last_loss

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (no ``*_created`` samples)."""
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """A registry view without the ``<name>_created`` samples (each counter's and histogram's
    creation time, which prometheus_client adds and nobody queries)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for metric in self._registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class _CoreCollector:
    """Metrics read from the core at scrape time (counters it owns, per-layer imbalance)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self._t = telemetry

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        core = self._t.core
        received = CounterMetricFamily(
            "expertmesh_load_reports_received", "Load reports received (REST, gRPC, actors)"
        )
        received.add_metric([], float(core.reports_received))
        rejected = CounterMetricFamily(
            "expertmesh_load_reports_rejected", "Load reports rejected as invalid"
        )
        rejected.add_metric([], float(core.reports_rejected))
        imb = GaugeMetricFamily(
            "expertmesh_layer_imbalance_ratio",
            "Max/mean tokens per rank of the layer's newest load under the committed placement",
            labels=["layer"],
        )
        bal = GaugeMetricFamily(
            "expertmesh_layer_balancedness_ratio",
            "1 / imbalance of the layer's newest load under the committed placement",
            labels=["layer"],
        )
        try:
            values = self._t.layer_imbalance()
        except Exception:  # a scrape must not fail because one read did
            log.exception("layer imbalance for /metrics failed")
            values = []
        per_layer: list[float] = []  # mean / max tokens per rank, as vLLM's
        for layer, v in enumerate(values):
            if v is None:  # no complete load yet: no value (1.0 would read as balanced)
                continue
            imb.add_metric([str(layer)], v)
            per_layer.append(1.0 / v if v > 0 else 0.0)
            bal.add_metric([str(layer)], per_layer[-1])
        # vLLM's summary over layers (vllm:eplb_balancedness_{min,p50,p90,avg}), one series
        # per statistic: one Grafana panel plots both engines (docs/engines.md)
        summary = GaugeMetricFamily(
            "expertmesh_eplb_balancedness_ratio",
            "Balancedness (mean/max tokens per rank) over the MoE layers: min (worst layer), "
            "p50, p90 (reached by 90% of layers: the 10th percentile), avg",
            labels=["stat"],
        )
        if per_layer:
            for stat, b in balancedness_stats(np.array(per_layer)).items():
                summary.add_metric([stat], b)
        out: list[Metric] = [received, rejected, imb, bal, summary]
        step, loss = self._t.step_values()
        if step is not None:
            last = GaugeMetricFamily("expertmesh_step", "Newest step recorded")
            last.add_metric([], float(step))
            out.append(last)
        if loss is not None:
            gauge = GaugeMetricFamily("expertmesh_step_loss", "Loss of the newest step")
            gauge.add_metric([], loss)
            out.append(gauge)
        return out


def _check_vector(x: Any, n: int, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.shape != (n,):
        raise ValueError(f"{name} must be [{n}], got shape {arr.shape}")
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}")
    if not np.isfinite(arr).all() or (arr.size and arr.min() < 0):
        raise ValueError(f"{name} must be finite and >= 0")
    return arr


def _check_matrix(x: Any, d: int, name: str) -> np.ndarray | None:
    if x is None:
        return None
    arr = np.asarray(x)
    if arr.shape != (d, d):
        raise ValueError(f"{name} must be [{d}, {d}], got shape {arr.shape}")
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}")
    if not np.isfinite(arr).all() or (arr.size and arr.min() < 0):
        raise ValueError(f"{name} must be finite and >= 0")
    return arr.astype(np.float64)


def _migration_pairs(pv: PlanVersion, rank_dc: np.ndarray) -> dict[tuple[int, int], list[int]]:
    """(src DC, dst DC) -> [copies, bytes] over every layer's migration transfers."""
    out: dict[tuple[int, int], list[int]] = {}
    for lp in pv.layers:
        for t in lp.migration.transfers:
            key = (int(rank_dc[t.src_rank]), int(rank_dc[t.dst_rank]))
            acc = out.setdefault(key, [0, 0])
            acc[0] += 1
            acc[1] += int(t.nbytes)
    return out
