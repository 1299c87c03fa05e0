"""Shared parts of the SPMD-plane benchmarks (bench_runtime.py, bench_balance_train.py).

- :class:`SharedCluster`: one local Ray cluster (a node labeled ``dc=<name>`` per DC of ``Topology.generate``) that
  every runtime of a benchmark joins in turn, so a row costs its workers' start, not a
  whole cluster's (~45 s here). The runtimes still start it themselves as far as they
  know: the cluster class their modules use is swapped for a handle whose ``shutdown``
  leaves it up, so the link shaper stays on (it is off when a runtime joins an address).
- :func:`run_spmd`: one ``SpmdRuntime`` run: its :class:`StepResult` rows, and every plan
  version it committed (read from the controller's plan store, for the cost model).
- :func:`calibrate` and :func:`predict`: the SPMD step model
  (``planner.stepmodel.spmd_step_cost``) on a run's steps: the collectives each step
  issued (from the plan it ran on), its bytes between DCs as the workers counted them,
  and two machine constants from static EP on free links at two batch sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.cluster_utils import Cluster

from expertmesh.controller.core import PlanVersion
from expertmesh.controller.store import SqlitePlanStore
from expertmesh.planner import Placement, Topology
from expertmesh.planner.static import static_placement
from expertmesh.planner.stepmodel import SpmdCollectives, spmd_step_cost, sync_hops
from expertmesh.runtime import cluster as old_cluster_module
from expertmesh.runtime import spmd as spmd_module
from expertmesh.runtime.settings import RuntimeSettings, StepResult, source_roots
from expertmesh.runtime.spmd import SpmdRuntime
from expertmesh.workers.engine import migration_rounds
from expertmesh.workers.layer import LayerPlan

INLINE_BYTES = 4 << 20  # the old plane's packets travel inline up to this (its default)


class _Handle:
    """What the runtimes see as their cluster: the shared one, never shut down by them."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self.address = cluster.address

    def add_node(self, **_: Any) -> None:
        return None

    def wait_for_nodes(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


class SharedCluster:
    """``dcs`` nodes labeled as ``Topology.generate`` names DCs (``dc0000``, ...); every
    runtime started inside ``with SharedCluster(n):`` joins it."""

    def __init__(self, dcs: int, cpus_per_dc: float = 1.0) -> None:
        self.dcs, self.cpus = dcs, cpus_per_dc
        self.cluster: Cluster | None = None
        self._saved: list[tuple[Any, Any]] = []

    def __enter__(self) -> SharedCluster:
        names = [dc.name for dc in Topology.generate(self.dcs, 1).dcs]
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ["PYTHONPATH"] = source_roots()  # the nodes' workers import this checkout
        t0 = time.perf_counter()
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": self.cpus,
                "labels": {"dc": names[0]},
                "_system_config": {"max_direct_call_object_size": INLINE_BYTES},
            },
        )
        for name in names[1:]:
            self.cluster.add_node(num_cpus=self.cpus, labels={"dc": name})
        self.cluster.wait_for_nodes()
        self.start_seconds = time.perf_counter() - t0
        handle = _Handle(self.cluster)
        for mod in (spmd_module, old_cluster_module):
            self._saved.append((mod, mod.Cluster))
            mod.Cluster = lambda *_, **__: handle  # type: ignore[attr-defined]
        return self

    def __exit__(self, *exc: object) -> None:
        for mod, cls in self._saved:
            mod.Cluster = cls  # type: ignore[attr-defined]
        self._saved = []
        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None


@dataclasses.dataclass
class SpmdRun:
    """One runtime's training: its steps and the plans they ran on."""

    settings: RuntimeSettings
    steps: list[StepResult]
    plans: dict[int, PlanVersion]  # version -> plan (committed ones)
    start_seconds: float  # workers and controller up, process groups formed
    train_seconds: float  # the driver's wall time around train()
    driver_cpu_seconds: float = 0.0  # the driver process's CPU time during train()

    def measured(self, skip: int = 1) -> list[StepResult]:
        """The steps a median uses: the first ``skip`` (fresh workers) left out."""
        return self.steps[skip:]

    def median(self, field: str, skip: int = 1) -> float:
        return statistics.median(float(getattr(s, field) or 0.0) for s in self.measured(skip))


def run_spmd(settings: RuntimeSettings, steps: int, attempts: int = 3) -> SpmdRun:
    """Train ``steps`` steps on a fresh :class:`SpmdRuntime` (on the shared cluster)."""
    for attempt in range(attempts):
        try:
            return _run_once(settings, steps)
        except ValueError as err:  # the last runtime's named actors are still going away
            if "already" not in str(err) or attempt == attempts - 1:
                raise
            time.sleep(2.0)
    raise AssertionError("unreachable")


def _run_once(settings: RuntimeSettings, steps: int) -> SpmdRun:
    t0 = time.perf_counter()
    with SpmdRuntime(settings) as rt:
        t1, c1 = time.perf_counter(), time.process_time()
        rows = rt.train(steps)
        t2, c2 = time.perf_counter(), time.process_time()
        plans: dict[int, PlanVersion] = {}
        tmp = rt._tmp  # the controller's plan store lives in the runtime's temp dir
        if tmp is not None:
            with contextlib.closing(SqlitePlanStore(Path(tmp) / "plans.sqlite")) as store:
                for v in sorted({r.plan_version for r in rows} - {0}):
                    pv = store.get(v)
                    if pv is not None:
                        plans[v] = pv
    return SpmdRun(settings, rows, plans, t1 - t0, t2 - t1, c2 - c1)


# ---- the cost model of a run's steps (planner.stepmodel.spmd_step_cost) ----


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The two machine constants, from static EP on free links at two batch sizes."""

    seconds_per_token: float
    collective_seconds: float
    full_median: float  # measured median step, full batch
    small_median: float  # measured median step, the smaller batch
    collectives: int  # collectives of one static step


def _placements(run: SpmdRun, version: int) -> tuple[list[Placement], list[np.ndarray]]:
    topo, lm = Topology.from_dict(run.settings.topology), run.settings.lm
    if version == 0 or version not in run.plans:
        p = static_placement(
            topo.num_ranks, topo.slots_per_rank, lm.num_experts, topo.masters_per_rank
        )
        return [p] * lm.num_layers, [np.zeros((0, 4), np.int64)] * lm.num_layers
    layers = run.plans[version].layers
    return [lp.placement for lp in layers], [np.asarray(lp.route) for lp in layers]


def step_collectives(run: SpmdRun, i: int) -> SpmdCollectives:
    """The collectives step ``i`` of ``run`` issued (from its plan, the next step's plan
    for a switch, and whether the fast loop fetched replicas)."""
    topo, s = Topology.from_dict(run.settings.topology), run.settings
    step = run.steps[i]
    placements, routes = _placements(run, step.plan_version)
    rank_dc = np.asarray(topo.rank_dc)
    cross = [LayerPlan(p, r).crosses(rank_dc) for p, r in zip(placements, routes, strict=True)]
    fetch = [step.fanout_bytes > 0] * len(cross)  # per step, not per layer: an upper bound
    migration = migration_cross = 0
    nxt = run.steps[i + 1].plan_version if i + 1 < len(run.steps) else step.plan_version
    if nxt != step.plan_version and nxt in run.plans:
        new = run.plans[nxt].layers
        rounds = migration_rounds(
            placements, [lp.placement for lp in new], [lp.migration for lp in new], topo
        )
        for rnd in rounds:
            for kind in ("w", "opt"):
                part = [t for t in rnd if t[4] == kind]
                if part:
                    migration += 1
                    migration_cross += any(rank_dc[t[2]] != rank_dc[t[3]] for t in part)
    return SpmdCollectives.of(
        cross,
        microbatches=s.lm.microbatches,
        num_dcs=topo.num_dcs,
        balance=s.balance,
        fetch=fetch,
        hops=sync_hops(placements, topo),
        migration=migration,
        migration_cross=migration_cross,
    )


def step_bytes(run: SpmdRun, i: int) -> np.ndarray:
    """[D, D] bytes step ``i`` sent between DCs: its tokens and weights, and the migration
    of the plan switch at its end (which the workers count in the next step's report)."""
    by = np.asarray(run.steps[i].bytes_by_pair, dtype=np.float64)  # [3, D, D]
    mig = (
        np.asarray(run.steps[i + 1].bytes_by_pair, dtype=np.float64)[2]
        if i + 1 < len(run.steps)
        else np.zeros_like(by[2])
    )
    out: np.ndarray = by[0] + by[1] + mig
    return out


def tokens_per_rank(settings: RuntimeSettings) -> int:
    return int(settings.lm.tokens_per_rank * settings.lm.microbatches)


def predict(run: SpmdRun, cal: Calibration) -> list[float]:
    """Modeled seconds of every step of ``run``."""
    topo = Topology.from_dict(run.settings.topology)
    return [
        spmd_step_cost(
            topo,
            step_collectives(run, i),
            step_bytes(run, i),
            tokens_per_rank=tokens_per_rank(run.settings),
            seconds_per_token=cal.seconds_per_token,
            collective_seconds=cal.collective_seconds,
        ).seconds
        for i in range(len(run.steps))
    ]


def calibrate(full: SpmdRun, small: SpmdRun, skip: int = 1) -> Calibration:
    """``a`` and ``c`` from two static runs on free links that differ only in batch size:
    ``T = a * tokens + c * collectives + links`` at both sizes (same collectives)."""
    topo = Topology.from_dict(full.settings.topology)

    def residual(run: SpmdRun) -> tuple[float, int]:
        links = [
            spmd_step_cost(
                topo, step_collectives(run, i), step_bytes(run, i), tokens_per_rank=0,
                seconds_per_token=0.0, collective_seconds=0.0,
            ).seconds
            for i in range(skip, len(run.steps))
        ]  # fmt: skip
        n = statistics.median(step_collectives(run, i).total for i in range(skip, len(run.steps)))
        return run.median("seconds", skip) - statistics.median(links), int(n)

    tf, n = residual(full)
    ts, _ = residual(small)
    dt = tokens_per_rank(full.settings) - tokens_per_rank(small.settings)
    a = max((tf - ts) / dt, 0.0)
    c = max((tf - a * tokens_per_rank(full.settings)) / n, 0.0)
    return Calibration(a, c, full.median("seconds", skip), small.median("seconds", skip), n)
