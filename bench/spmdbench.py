"""Shared parts of the SPMD-plane benchmarks (bench_runtime.py, bench_balance_train.py).

- :class:`SharedCluster`: one local Ray cluster (a node labeled ``dc=<name>`` per DC of ``Topology.generate``) that
  every runtime of a benchmark joins in turn, so a row costs its workers' start, not a
  whole cluster's (~45 s here). The runtimes still start it themselves as far as they
  know: the cluster class their module uses is swapped for a handle whose ``shutdown``
  leaves it up, so the link shaper stays on (it is off when a runtime joins an address).
- :func:`run_spmd`: one ``SpmdRuntime`` run: its :class:`StepResult` rows, and the
  ``trace.npz`` and ``plans.npz`` it wrote (``expertmesh.runtime.trace``).
- :func:`calibrate` and :func:`predict`: the SPMD step model on a run, as ``expertmesh sim
  replay`` computes it from the run's trace and plans (``expertmesh.sim.replay``), with
  two machine constants from static EP on free links at two batch sizes.
- :func:`check_calibration`: whether a calibration's own runs are sane (the full batch
  clearly slower than the quarter batch, before and after runs that agree).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
import yaml
from ray.cluster_utils import Cluster

from expertmesh.formats import read_plan, read_trace
from expertmesh.planner import Topology
from expertmesh.runtime import spmd as spmd_module
from expertmesh.runtime.settings import RuntimeSettings, StepResult, source_roots
from expertmesh.runtime.spmd import SpmdRuntime
from expertmesh.sim.replay import Calibration as Constants
from expertmesh.sim.replay import Replay, RuntimeMeta, fit_copy_constants, replay

INLINE_BYTES = 4 << 20  # objects travel inline up to this (Ray's setting, as the runtime's)


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
        self._saved.append((spmd_module, spmd_module.Cluster))
        spmd_module.Cluster = lambda *_, **__: handle  # type: ignore[assignment,misc]
        return self

    def __exit__(self, *exc: object) -> None:
        for mod, cls in self._saved:
            mod.Cluster = cls
        self._saved = []
        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None


@dataclasses.dataclass
class SpmdRun:
    """One runtime's training: its steps and where it wrote what it trained on."""

    settings: RuntimeSettings
    steps: list[StepResult]
    trace_dir: Path  # trace.npz, plans.npz
    start_seconds: float  # workers and controller up, process groups formed
    train_seconds: float  # the driver's wall time around train()
    driver_cpu_seconds: float = 0.0  # the driver process's CPU time during train()

    def measured(self, skip: int = 1) -> list[StepResult]:
        """The steps a median uses: the first ``skip`` (fresh workers) left out."""
        return self.steps[skip:]

    def median(self, field: str, skip: int = 1) -> float:
        return statistics.median(float(getattr(s, field) or 0.0) for s in self.measured(skip))


def temporary_trace_dir() -> Path:
    """A fresh directory for a run's trace that the caller may still read after the run;
    removed when the bench process exits (a bench makes dozens of runs)."""
    where = Path(tempfile.mkdtemp(prefix="expertmesh-trace-"))
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    return where


def run_spmd(
    settings: RuntimeSettings, steps: int, trace_dir: Path | None = None, attempts: int = 3
) -> SpmdRun:
    """Train ``steps`` steps on a fresh :class:`SpmdRuntime` (on the shared cluster); its
    trace goes to ``trace_dir`` (None: a new temporary directory)."""
    where = trace_dir or temporary_trace_dir()
    settings = settings.model_copy(update={"trace_dir": str(where)})
    for attempt in range(attempts):
        try:
            return _run_once(settings, steps, where)
        except ValueError as err:  # the last runtime's named actors are still going away
            if "already" not in str(err) or attempt == attempts - 1:
                raise
            time.sleep(2.0)
    raise AssertionError("unreachable")


def _run_once(settings: RuntimeSettings, steps: int, where: Path) -> SpmdRun:
    t0 = time.perf_counter()
    with SpmdRuntime(settings) as rt:
        t1, c1 = time.perf_counter(), time.process_time()
        rows = rt.train(steps)
        t2, c2 = time.perf_counter(), time.process_time()
    return SpmdRun(settings, rows, where, t1 - t0, t2 - t1, c2 - c1)


# ---- the cost model of a run's steps (expertmesh.sim.replay) ----


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The machine constants: ``a`` and ``c`` from static EP on free links at two batch
    sizes, and ``h`` (per expert copy a rank holds) from a layout with more copies."""

    seconds_per_token: float
    collective_seconds: float
    full_median: float  # measured median step, full batch
    small_median: float  # measured median step, the smaller batch
    collectives: int  # collectives of one static step
    ranks: int  # of the runs it was measured on
    copy_seconds: float = 0.0  # h (0: no replicated run)
    copies: float = 0.0  # copies per rank of the static layout (all layers)
    replicated_median: float | None = None  # measured median step of the replicated layout
    replicated_collectives: int = 0
    replicated_copies: float = 0.0
    fit: str = "static only"  # how c and h were fitted (calibrate)
    exact_collective_seconds: float | None = None  # the exact solve, when it was negative
    exact_copy_seconds: float | None = None

    def constants(self) -> Constants:
        return Constants(
            seconds_per_token=self.seconds_per_token,
            collective_seconds=self.collective_seconds,
            copy_seconds=self.copy_seconds,
            ranks=self.ranks,
        )

    def scaled(self, factor: float) -> Calibration:
        """The constants times ``factor`` (the machine ``factor`` times as slow as when
        they were measured: its CPU time per token, per collective and per copy alike)."""
        return dataclasses.replace(
            self,
            seconds_per_token=self.seconds_per_token * factor,
            collective_seconds=self.collective_seconds * factor,
            copy_seconds=self.copy_seconds * factor,
        )

    def write(self, path: Path) -> None:
        """The constants as ``expertmesh sim replay --calibration`` reads them."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.constants().model_dump()))


Run = SpmdRun | Path  # a run, or the directory it wrote its trace.npz and plans.npz to


def _trace_dir(run: Run) -> Path:
    return run.trace_dir if isinstance(run, SpmdRun) else Path(run)


def _meta(run: Run) -> RuntimeMeta:
    return RuntimeMeta(**read_trace(_trace_dir(run) / "trace.npz").meta)


def replay_run(run: Run, constants: Constants, skip: int | None = 1) -> Replay:
    """``expertmesh sim replay`` of ``run``'s trace.npz and plans.npz (``skip=None``: its
    medians from the first step on a plan the controller made, as the CLI's)."""
    where = _trace_dir(run)
    trace = read_trace(where / "trace.npz")
    plan = read_plan(where / "plans.npz")
    if isinstance(run, SpmdRun) and trace.load.shape[0] != len(run.steps):
        raise ValueError(f"{where}: {trace.load.shape[0]} steps, the run {len(run.steps)}")
    assert plan.master is not None
    mig = {int(v): c for v, c in plan.meta["migration_collectives"].items()}
    return replay(
        trace.load, RuntimeMeta(**trace.meta), plan.phy2log, plan.master, plan.route,
        migration=mig, calibration=constants, skip=skip,
    )  # fmt: skip


def tokens_per_rank(settings: RuntimeSettings) -> int:
    return int(settings.lm.tokens_per_rank * settings.lm.microbatches)


def _tokens(run: Run) -> int:
    """Tokens a rank trains per step (of the settings, or the trace's meta)."""
    if isinstance(run, SpmdRun):
        return tokens_per_rank(run.settings)
    meta = _meta(run)
    return int(meta.tokens_per_rank * meta.microbatches)


def _ranks(run: Run) -> int:
    topo = run.settings.topology if isinstance(run, SpmdRun) else _meta(run).topology
    return Topology.from_dict(topo).num_ranks


def _seconds(run: Run, skip: int) -> list[float]:
    """The end-to-end seconds of the measured steps (the first ``skip`` left out)."""
    if isinstance(run, SpmdRun):
        return [float(s.seconds or 0.0) for s in run.measured(skip)]
    return [float(x) for x in _meta(run).step_seconds[skip:]]


def predict(run: SpmdRun, cal: Calibration) -> list[float]:
    """Modeled seconds of every step of ``run``."""
    return [float(x) for x in replay_run(run, cal.constants()).predicted]


def residual(runs: Sequence[Run], skip: int = 1) -> tuple[float, float, int]:
    """Of ``runs`` (static on one layout) pooled: ``(median step, median step less its
    modeled links, collectives of a step)``; on free links the two medians nearly agree."""
    med, rest, colls, _ = _residual(runs, skip)
    return med, rest, colls


def _residual(runs: Sequence[Run], skip: int = 1) -> tuple[float, float, int, float]:
    """:func:`residual` and the runs' median copies per rank (all layers)."""
    zero = Constants(seconds_per_token=0.0, collective_seconds=0.0, ranks=_ranks(runs[0]))
    steps, rest, colls, copies = [], [], [], []
    for run in runs:
        res = replay_run(run, zero, skip)  # latency and transfer only
        seconds = _seconds(run, skip)
        steps += seconds
        rest += [x - float(p) for x, p in zip(seconds, res.predicted[skip:], strict=True)]
        colls += res.counts["collectives"][skip:].tolist()
        copies += res.counts["copies"][skip:].tolist()
    return (
        statistics.median(steps),
        statistics.median(rest),
        int(statistics.median(colls)),
        float(statistics.median(copies)),
    )


def calibrate(
    full: Run | Sequence[Run],
    small: Run | Sequence[Run],
    skip: int = 1,
    replicated: Run | Sequence[Run] | None = None,
) -> Calibration:
    """``a`` and ``c`` from static runs on free links that differ only in batch size:
    ``T = a * tokens + c * collectives + links`` at both sizes (same collectives). Several
    runs of a size (``bench_runtime.py``: one before and one after a group of rows, so
    that the machine's drift over the group hits the constants as it hits the rows) pool
    their measured steps: the median step of each size over all of its runs. A run is an
    :class:`SpmdRun` or the directory its trace was written to (``--repredict``).

    ``replicated``: full-batch runs on free links of the layout that fills every DC's
    spare slots with copies (``RuntimeSettings.layout``); then ``c`` and ``h`` (per copy
    a rank holds) fit ``T - a * tokens = c * collectives + h * copies`` on both layouts
    (``a`` as above: the batch sizes share the layout): two equations, two unknowns,
    solved exactly when the solution is non-negative. Neither constant can be negative
    (a collective or a copy held never makes a step faster); when the exact solution has
    one (the two layouts' residuals differ by less than the machine's noise), the fit is
    the non-negative least-squares one (``scipy.optimize.nnls``: the constant at its bound
    0, the other the best fit to both layouts), and ``fit`` says so with the exact
    solution kept beside it (``expertmesh.sim.replay.fit_copy_constants``)."""
    fulls = list(full) if isinstance(full, Sequence) else [full]
    smalls = list(small) if isinstance(small, Sequence) else [small]
    ranks = _ranks(fulls[0])
    full_median, tf, n, k = _residual(fulls, skip)
    small_median, ts, _, _ = _residual(smalls, skip)
    tokens = _tokens(fulls[0])
    dt = tokens - _tokens(smalls[0])
    a = max((tf - ts) / dt, 0.0)
    c = max((tf - a * tokens) / n, 0.0)
    cal = Calibration(a, c, full_median, small_median, n, ranks, copies=k)
    if replicated is None:
        return cal
    reps = list(replicated) if isinstance(replicated, Sequence) else [replicated]
    rep_median, tr, nr, kr = _residual(reps, skip)
    return dataclasses.replace(
        cal,
        **fit_copy_constants((n, k, tf - a * tokens), (nr, kr, tr - a * tokens)),
        replicated_median=rep_median,
        replicated_collectives=nr,
        replicated_copies=kr,
    )


# ---- the calibration's sanity check (on the calibration runs alone, never on a row) ----

# Thresholds from the five healthy groups recorded in docs/results/bench-runtime-runs/
# br-b..br-e (br-a's and br-f's 2-DC 1 Gbit/s groups are the broken ones): there the full batch's median step
# was 1.30-1.72 times the quarter batch's in each of the before and after runs (1.27-1.51
# pooled), and a batch size's before and after runs were 1.06-1.28x apart (full) and
# 1.03-1.24x (quarter). br-f's group: 0.94x before, 1.11x after, 1.06x pooled; full
# batch 0.149 s before against 0.238 s after (1.60x apart).
MIN_BATCH_RATIO = 1.15  # full batch over quarter batch: each side and pooled, at least this
MAX_DRIFT = 1.40  # a batch size's before and after medians: the larger over the smaller, at most


def calibration_faults(
    full_medians: Sequence[float],
    small_medians: Sequence[float],
    full_pooled: float,
    small_pooled: float,
) -> list[str]:
    """Why a group's calibration is invalid, from its calibration runs' median steps
    (``[before, after]`` of the full and the quarter batch, and the pooled medians the
    constants were fitted on); empty: it passes. Invalid when the full batch is not
    :data:`MIN_BATCH_RATIO` times as slow as the quarter batch (before, after or pooled:
    four times the tokens must cost clearly more, or ``a`` is noise and the step's cost
    goes to the per-collective and per-copy constants), or when a batch size's before and
    after runs differ by more than :data:`MAX_DRIFT` (the machine changed under the
    group, so the pooled medians mix two machines)."""
    faults = []
    sides = [*zip(("before", "after"), full_medians, small_medians, strict=True)]
    for which, f, s in [*sides, ("pooled", full_pooled, small_pooled)]:
        if f < MIN_BATCH_RATIO * s:
            faults.append(
                f"{which}: full batch {f:.3f} s is {f / s:.3f}x the quarter batch's "
                f"{s:.3f} s (< {MIN_BATCH_RATIO:g}x)"
            )
    for kind, meds in (("full", full_medians), ("quarter", small_medians)):
        lo, hi = min(meds), max(meds)
        if hi > MAX_DRIFT * lo:
            faults.append(
                f"{kind} batch before {meds[0]:.3f} s, after {meds[1]:.3f} s: "
                f"{hi / lo:.3f}x apart (> {MAX_DRIFT:g}x)"
            )
    return faults


def check_calibration(
    before: Sequence[Run], after: Sequence[Run], cal: Calibration, skip: int = 1
) -> dict[str, Any]:
    """The check of a group's calibration as a record keeps it: ``passed``, ``faults``
    (:func:`calibration_faults` of its runs, ``(full, small, replicated)`` before and
    after the group as :func:`calibrate` took them, and of ``cal``) and the thresholds."""

    def med(run: Run) -> float:
        return statistics.median(_seconds(run, skip))

    faults = calibration_faults(
        [med(before[0]), med(after[0])],
        [med(before[1]), med(after[1])],
        cal.full_median,
        cal.small_median,
    )
    return {
        "passed": not faults,
        "faults": faults,
        "min_batch_ratio": MIN_BATCH_RATIO,
        "max_drift": MAX_DRIFT,
    }


def run_bench(
    args: Any,
    bench: Callable[[Any], dict[str, Any]],
    markdown: Callable[[dict[str, Any]], str],
    annotate: Callable[[dict[str, Any], str], None] | None = None,
) -> int:
    """A bench's ``main`` after its flags: run ``bench(args)``, add the wall seconds, the load
    average at start and end, the flags and (``annotate(result, started_utc)``) anything the
    bench records besides; print the markdown table and write ``--json``."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    logging.basicConfig(level=logging.WARNING)
    t0, load0 = time.perf_counter(), os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    result = bench(args)
    result["seconds"] = time.perf_counter() - t0
    result["load_avg"] = [list(load0), list(os.getloadavg())]
    result["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    if annotate is not None:
        annotate(result, started)
    result["markdown"] = markdown(result)
    print()
    print(result["markdown"])
    print(
        f"total {result['seconds']:.0f}s; load average {load0[0]:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end ({os.cpu_count()} cores)"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0
