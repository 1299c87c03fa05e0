"""Where the controller computes its plans: in its own process or in planner processes.

:meth:`ControllerCore.plan <expertmesh.controller.core.ControllerCore.plan>` takes its
inputs under its lock as one :class:`LayerJob` per layer, then hands them to a
:class:`Planner`. :func:`plan_jobs` is the pure part (the policy on each layer plus the
imbalance before and after); it runs either right here (:class:`InProcessPlanner`) or in
a pool of separate processes (:class:`ProcessPlanner`), chosen by
:class:`PlannerSettings`.

Why a separate process: a plan of ``eplb`` at 1,000 ranks x 256 experts takes ~2 s of
Python and numpy. In the server's process it competes with the REST and gRPC threads for
the interpreter lock, and REST latency suffers while it runs. In a planner process it only
competes for the cores, and it runs at a lower CPU priority (``nice``) so request serving
wins them.

The pool is started on the first plan (``spawn``: a fresh interpreter, no copy of the
server's threads or sockets), reused for every later plan and shut down by
:meth:`ProcessPlanner.close`. Jobs and results travel over the pool's private pipes
(pickled by ``concurrent.futures``, between this process and its own children only:
nothing from the network is unpickled). A planner process that dies or overruns
``timeout_seconds`` fails that plan with :class:`PlannerError`; the pool is replaced on the
next plan and the server keeps serving. An exception raised by the policy itself (a
``ValueError`` on a bad setting, say) comes back unchanged, as it would in process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from expertmesh.planner import (
    LayerPlan,
    ModelSpec,
    Placement,
    Policy,
    PolicyContext,
    PolicySettings,
    Topology,
    imbalance,
    plan_layer,
)
from expertmesh.planner.static import static_placement

__all__ = [
    "InProcessPlanner",
    "LayerJob",
    "LayerResult",
    "Planner",
    "PlannerError",
    "PlannerSettings",
    "ProcessPlanner",
    "compact_ints",
    "make_planner",
    "plan_jobs",
    "static_rank_tokens",
]

log = logging.getLogger(__name__)


class PlannerSettings(BaseModel):
    """Where the controller's policy runs (a property of the deployment, not of the policy:
    neither stored with the plans nor changed over REST)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    process: bool = Field(
        default=False,
        description="plan in separate planner processes (started on the first plan, reused) "
        "instead of the controller's own; `expertmesh serve` turns it on",
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="planner processes; the layers of one plan are planned in parallel",
    )
    nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="niceness added to the planner processes, so request serving wins the cores",
    )
    timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="a plan running longer fails and its planner processes are replaced",
    )


class PlannerError(RuntimeError):
    """The planner process failed (died, overran its time); the plan was not made."""


@dataclass(frozen=True, eq=False)
class LayerJob:
    """Everything one layer's plan needs, as plain data (it may cross to another process).

    - ``load``: [R, E] the layer's newest complete load (rows of dead ranks zeroed).
    - ``history``: [W, R, E] the window the policy asked for, oldest first (W may be 0).
    - ``committed``: the placement of the layer's committed plan, or None (then "before" is
      static EP). The policy sees it as ``ctx.previous`` with an empty route and no
      migration (no policy reads those; the route alone can be ~R * E rows).
    - ``fresh``: plan afresh (membership changed), not from ``committed``.
    - ``dead_ranks``: ranks planned out.
    """

    layer: int
    step: int
    committed_step: int
    load: np.ndarray
    history: np.ndarray
    committed: Placement | None
    fresh: bool
    dead_ranks: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class LayerResult:
    """One layer's new plan and the max/mean imbalance of its load before and after it."""

    plan: LayerPlan
    imbalance_before: float
    imbalance_after: float


def static_rank_tokens(load: np.ndarray, topology: Topology) -> np.ndarray:
    """[R] tokens per rank of ``load`` [R, E] when every expert runs on its static master."""
    num_experts = load.shape[1]
    p = static_placement(
        topology.num_ranks, topology.slots_per_rank, num_experts, topology.masters_per_rank
    )
    return np.bincount(p.master_rank(), weights=load.sum(axis=0), minlength=topology.num_ranks)


def plan_jobs(
    policy: Policy, topology: Topology, model: ModelSpec, jobs: Sequence[LayerJob]
) -> list[LayerResult]:
    """Plan every job with ``policy`` (pure: the same result in any process).

    Per job: the new plan is :func:`plan_layer` from the committed plan (or afresh); the
    imbalance before is the load routed over the committed placement (static EP when there
    is none), after is the load under the new plan. With nothing committed the ranks hold
    the static placement (workers start from it), so the first plan is aligned to it and
    its migration moves from it, as every later plan's does from the committed one.
    """
    out = []
    static = None
    for job in jobs:
        committed = None
        if job.committed is not None:
            committed = LayerPlan(placement=job.committed, route=np.zeros((0, 4), np.int64))
        ctx = PolicyContext(
            topology=topology,
            model=model,
            step=job.step,
            layer=job.layer,
            load=job.load,
            history=job.history,
            previous=None if job.fresh else committed,
            dead_ranks=job.dead_ranks,
        )
        origin = None
        if job.committed is None and not job.fresh:
            if static is None:
                static = static_placement(
                    topology.num_ranks,
                    topology.slots_per_rank,
                    model.num_experts,
                    topology.masters_per_rank,
                )
            origin = static
        lp = plan_layer(policy, ctx, origin=origin)
        if job.committed is None:
            before = imbalance(static_rank_tokens(job.load, topology))
        else:
            before_ctx = replace(ctx, step=job.committed_step, previous=committed)
            route = policy.route(before_ctx, job.committed)
            before = imbalance(
                np.bincount(route[:, 2], weights=route[:, 3], minlength=topology.num_ranks)
            )
        out.append(LayerResult(lp, before, imbalance(lp.rank_tokens())))
    return out


class Planner(Protocol):
    """Runs :func:`plan_jobs` somewhere."""

    def run(self, policy: Policy, jobs: Sequence[LayerJob]) -> list[LayerResult]: ...

    def close(self) -> None: ...


class InProcessPlanner:
    """:func:`plan_jobs` in the calling thread (unit tests, small topologies, Ray actors)."""

    def __init__(self, topology: Topology, model: ModelSpec) -> None:
        self.topology, self.model = topology, model

    def run(self, policy: Policy, jobs: Sequence[LayerJob]) -> list[LayerResult]:
        return plan_jobs(policy, self.topology, self.model, jobs)

    def close(self) -> None:
        pass


def compact_ints(arr: np.ndarray) -> np.ndarray:
    """``arr`` (integers) in the smallest integer dtype that holds its values exactly (other
    arrays unchanged): token counts and rank numbers fit in 16 bits, so jobs, results and
    stored routes take a quarter of their int64 bytes."""
    if arr.dtype.kind not in "iu" or not arr.size:
        return arr
    dtype = np.result_type(np.min_scalar_type(arr.min()), np.min_scalar_type(arr.max()))
    return arr.astype(dtype) if dtype.itemsize < arr.dtype.itemsize else arr


def _widen(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return arr if arr.dtype == dtype else arr.astype(dtype)


def _pack_job(job: LayerJob) -> LayerJob:
    return replace(job, load=compact_ints(job.load), history=compact_ints(job.history))


def _unpack_job(job: LayerJob, dtype: np.dtype) -> LayerJob:
    return replace(job, load=_widen(job.load, dtype), history=_widen(job.history, dtype))


def _pack_result(res: LayerResult) -> LayerResult:
    return replace(res, plan=replace(res.plan, route=compact_ints(res.plan.route)))


def _unpack_result(res: LayerResult) -> LayerResult:
    route = _widen(res.plan.route, np.dtype(np.int64))
    return replace(res, plan=replace(res.plan, route=route))


def _worker_init(nice: int) -> None:
    # runs once in each planner process
    if nice:
        try:
            os.nice(nice)
        except OSError as err:  # not permitted here: plan at normal priority
            log.warning("planner process could not lower its priority: %s", err)


def _worker_plan(
    policy_cls: type[Policy],
    policy_settings: PolicySettings,
    topology: Topology,
    model: ModelSpec,
    jobs: Sequence[tuple[LayerJob, np.dtype]],
) -> list[LayerResult]:
    # runs in a planner process: the policy is rebuilt from its class and settings, the
    # arrays get back the dtypes they had in the controller
    full = [_unpack_job(job, dtype) for job, dtype in jobs]
    return [_pack_result(r) for r in plan_jobs(policy_cls(policy_settings), topology, model, full)]


def _pid_of_worker(_: int) -> int:
    return os.getpid()


class ProcessPlanner:
    """:func:`plan_jobs` in a pool of ``settings.workers`` planner processes. Thread-safe.

    Started lazily (:meth:`start` or the first :meth:`run`), reused, replaced after a
    failure, shut down by :meth:`close` (idempotent; a later :meth:`run` starts it again).
    """

    def __init__(self, topology: Topology, model: ModelSpec, settings: PlannerSettings) -> None:
        self.topology, self.model, self.settings = topology, model, settings
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self.restarts = 0  # pools replaced after a failure

    def start(self) -> None:
        """Start the planner processes now (otherwise the first plan does)."""
        pool = self._get_pool()
        list(pool.map(_pid_of_worker, range(self.settings.workers)))

    def pids(self) -> list[int]:
        """Process ids of the running planner processes (empty before the first plan)."""
        with self._lock:
            pool = self._pool
        procs = getattr(pool, "_processes", None) or {}
        return sorted(int(p) for p in procs)

    def _get_pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    max_workers=self.settings.workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_worker_init,
                    initargs=(self.settings.nice,),
                )
            return self._pool

    def _discard(self, pool: ProcessPoolExecutor, *, kill: bool) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
                self.restarts += 1
        if kill:
            # a planner stuck in a plan is ended; the executor has no public call for it
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def run(self, policy: Policy, jobs: Sequence[LayerJob]) -> list[LayerResult]:
        pool = self._get_pool()
        # one task per group of layers: with several workers the layers plan in parallel
        groups = [list(jobs[i :: self.settings.workers]) for i in range(self.settings.workers)]
        groups = [g for g in groups if g]
        cls, cfg = type(policy), policy.settings
        try:
            futures: list[Future[list[LayerResult]]] = [
                pool.submit(
                    _worker_plan,
                    cls,
                    cfg,
                    self.topology,
                    self.model,
                    [(_pack_job(job), job.load.dtype) for job in g],
                )
                for g in groups
            ]
        except (BrokenProcessPool, RuntimeError) as err:  # broken, or shut down meanwhile
            self._discard(pool, kill=True)
            raise PlannerError(f"the planner processes are unavailable ({err}); retry") from None
        done, pending = wait(
            futures, timeout=self.settings.timeout_seconds, return_when=FIRST_EXCEPTION
        )
        failed = [f for f in futures if f in done and f.exception() is not None]
        if failed:
            if isinstance(failed[0].exception(), BrokenProcessPool):
                self._discard(pool, kill=True)
                raise PlannerError(
                    "a planner process died while planning (killed, or out of memory); "
                    "a new one starts with the next plan"
                ) from None
            for f in pending:
                f.cancel()
            failed[0].result()  # the policy's own error, raised as it would be in process
        if pending:
            self._discard(pool, kill=True)
            raise PlannerError(
                f"the plan took longer than {self.settings.timeout_seconds:g} s; its planner "
                "processes were stopped and will be replaced"
            )
        by_job: dict[int, LayerResult] = {}
        for g, fut in zip(groups, futures, strict=True):
            for job, res in zip(g, fut.result(), strict=True):
                by_job[id(job)] = _unpack_result(res)
        return [by_job[id(job)] for job in jobs]

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def make_planner(topology: Topology, model: ModelSpec, settings: PlannerSettings) -> Planner:
    """The planner ``settings`` ask for."""
    if settings.process:
        return ProcessPlanner(topology, model, settings)
    return InProcessPlanner(topology, model)
