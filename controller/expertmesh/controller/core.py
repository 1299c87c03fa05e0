"""The controller's decision core: triggers, plan versions, lifecycle, over the load windows.

A plain class with no Ray, gRPC or HTTP in it, unit-testable with a fake
clock. The Ray actor (``controller/actor.py``), the REST app and the gRPC
service are thin wrappers that gather inputs, call it and apply the result.

Flow, per layer: reports (per rank, whole layers, or DC window sums) make complete
``[R, E]`` loads in the layer's window (``controller/ingest.py``, :class:`LoadWindows`,
reached here as ``core.loads`` and through the ``report_*`` forwards).
:meth:`ControllerCore.maybe_plan` asks the trigger whether to re-plan; if so it
runs the policy on every layer and returns a new :class:`PlanVersion` in state
``PREPARED``. The runtime moves weights, then calls :meth:`commit` (or
:meth:`rollback`). Versions only grow; a commit of anything but the newest
prepared version is refused. The policy itself runs through a planner
(``controller/planning.py``): in the calling thread, or in separate planner
processes when :class:`PlannerSettings` ``process`` is set (``expertmesh serve``).

Thread-safe: every public method takes one lock, so REST and gRPC threads may
call in while the control loop runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from expertmesh.controller.ingest import BatchReportError, LoadWindows, StaleReportError
from expertmesh.controller.planning import (
    LayerJob,
    Planner,
    PlannerError,
    PlannerSettings,
    make_planner,
    plan_jobs,
    static_rank_tokens,
)
from expertmesh.controller.windows import WindowAssembler
from expertmesh.planner import (
    LayerPlan,
    ModelSpec,
    PolicyContext,
    Topology,
    check_load,
    imbalance,
    make_policy,
)
from expertmesh.planner.costmodel import TransferEncoding
from expertmesh.planner.policy import Policy
from expertmesh.planner.window import WindowBlock, WindowReport

__all__ = [
    "BatchReportError",
    "ControllerCore",
    "ControllerSettings",
    "LayerStats",
    "PlanState",
    "PlanStore",
    "PlanVersion",
    "PlannerError",
    "PlannerSettings",
    "StaleReportError",
    "Trigger",
]

log = logging.getLogger(__name__)


class Trigger(BaseModel):
    """When the controller re-plans."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["every_step", "every_n", "threshold"] = Field(
        default="every_n",
        description="every step, every `every` steps, or when imbalance > threshold",
    )
    every: int = Field(default=10, ge=1, le=1_000_000, description="steps between plans (every_n)")
    threshold: float = Field(
        default=1.2,
        ge=1.0,
        le=1e6,
        description="max/mean imbalance of the newest load that triggers",
    )


class ControllerSettings(BaseModel):
    """The controller's policy and loop settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str = Field(default="static", description="registered policy name")
    policy_settings: dict[str, Any] = Field(
        default_factory=dict, description="the policy's settings"
    )
    trigger: Trigger = Trigger()
    window: int = Field(default=16, ge=1, le=4096, description="complete loads kept per layer")
    max_pending_steps: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="incomplete steps kept per layer while their reports arrive; past this the "
        "oldest is dropped and counted (ranks of one EP group run in lock-step, so a few suffice)",
    )


class PlanState(StrEnum):
    PREPARED = "prepared"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled_back"


# The plan lifecycle: the only legal transitions.
LEGAL_TRANSITIONS: dict[PlanState, frozenset[PlanState]] = {
    PlanState.PREPARED: frozenset({PlanState.COMMITTED, PlanState.ROLLED_BACK}),
    PlanState.COMMITTED: frozenset(),
    PlanState.ROLLED_BACK: frozenset(),
}


@dataclass(eq=False)
class PlanVersion:
    """One versioned plan: a :class:`LayerPlan` per layer, planned at ``step``.

    ``imbalance_before``/``imbalance_after``: [L] max/mean of the newest load under
    the previous committed placement and under this plan.
    """

    version: int
    step: int
    policy: str
    layers: list[LayerPlan]
    imbalance_before: list[float]
    imbalance_after: list[float]
    state: PlanState = PlanState.PREPARED
    created_at: float = 0.0
    committed_at: float | None = None
    #: how the plan's expert weights and gradients travel (the policy's; not stored: a
    #: plan recovered from the store takes the recovered policy's)
    encoding: TransferEncoding = field(default_factory=TransferEncoding)

    @property
    def migration_bytes(self) -> int:
        return sum(p.migration.nbytes for p in self.layers)

    @property
    def solve_seconds(self) -> float:
        return float(sum(p.solve_seconds for p in self.layers))


@dataclass(frozen=True)
class LayerStats:
    """Statistics of one layer's load window."""

    layer: int
    loads: int  # complete loads in the window
    newest_step: int | None
    expert_load: np.ndarray = field(repr=False)  # [E] mean tokens per microbatch over the window
    rank_load: np.ndarray = field(repr=False)  # [R] mean tokens sent per source rank
    imbalance: float  # newest load under the committed placement


class PlanStore(Protocol):
    """Where committed plans persist (SQLite in ``controller/store.py``)."""

    def save(self, plan: PlanVersion) -> None: ...


class ControllerCore:
    """Load windows per layer, trigger, plan versions. See the module docstring."""

    MAX_STEP = LoadWindows.MAX_STEP
    # Finished plans (committed before the current one, rolled back) kept in memory.
    KEEP_VERSIONS = 2

    def __init__(
        self,
        topology: Topology,
        model: ModelSpec,
        settings: ControllerSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
        store: PlanStore | None = None,
        planner: PlannerSettings | None = None,
    ) -> None:
        self.topology = topology
        self.model = model
        self._clock = clock
        self._store = store
        self.planner_settings = planner or PlannerSettings()
        self._planner: Planner = make_planner(topology, model, self.planner_settings)
        self._lock = threading.RLock()
        self._settings = ControllerSettings()
        self._policy = make_policy("static")
        self.loads = LoadWindows(
            topology.num_ranks,
            model.num_layers,
            model.num_experts,
            WindowAssembler(topology, model.num_layers, model.num_experts),
            window=self._settings.window,
            max_pending=self._settings.max_pending_steps,
            lock=self._lock,
            clock=clock,
        )
        self.configure(settings or ControllerSettings())
        self._versions: dict[int, PlanVersion] = {}
        self._committed: PlanVersion | None = None
        self._last_plan_step: int | None = None
        self._issued = 0  # versions up to this were handed out elsewhere (reserve_versions)
        self._fresh = False  # membership changed: the next plan ignores the previous one
        self.listeners: list[Callable[[str, PlanVersion], None]] = []

    def close(self) -> None:
        """Stop the planner processes, if any (idempotent; a later plan starts them again)."""
        self._planner.close()

    # ---- settings ----

    @property
    def settings(self) -> ControllerSettings:
        return self._settings

    def configure(self, settings: ControllerSettings) -> None:
        """Switch policy / trigger / window. ``ValueError`` (and nothing changes) if the policy
        is bad. A new window length keeps the newest complete loads."""
        policy = make_policy(settings.policy, settings.policy_settings)
        with self._lock:
            self._policy, self._settings = policy, settings
            loads = getattr(self, "loads", None)  # None while __init__ runs
            if loads is not None:
                loads.resize(settings.window, settings.max_pending_steps)

    @property
    def store(self) -> PlanStore | None:
        return self._store

    def attach_store(self, store: PlanStore | None) -> None:
        """Save every commit from now on to ``store`` (replaces any previous one; None: no
        store)."""
        with self._lock:
            self._store = store

    # ---- membership ----

    @property
    def dead_ranks(self) -> tuple[int, ...]:
        """Ranks the plans leave out (dead workers, DCs cut off)."""
        return tuple(np.flatnonzero(self.loads.dead).tolist())

    def set_dead_ranks(self, ranks: list[int] | tuple[int, ...]) -> None:
        """Plan without ``ranks`` from now on (every other rank's report completes a step);
        partial loads being assembled are dropped. After a change the next plan is made
        afresh (not from the previous placement, which a policy might keep: ranks that
        rejoin would get nothing). ``ValueError`` on an unknown rank or all."""
        dead = np.zeros(self.topology.num_ranks, bool)
        for r in ranks:
            if not 0 <= int(r) < self.topology.num_ranks:
                raise ValueError(f"unknown rank {r}; the topology has {self.topology.num_ranks}")
            dead[int(r)] = True
        if dead.all():
            raise ValueError("every rank would be dead")
        with self._lock:
            self._fresh = self._fresh or not np.array_equal(dead, self.loads.dead)
            self.loads.set_dead(dead)

    # ---- load reports (controller/ingest.py) ----

    @property
    def reports_received(self) -> int:
        return self.loads.reports_received

    @property
    def reports_rejected(self) -> int:
        return self.loads.reports_rejected

    @property
    def pending_dropped(self) -> int:
        """Incomplete steps dropped past ``max_pending_steps``."""
        return self.loads.pending_dropped

    @property
    def windows_in(self) -> WindowAssembler:
        """DC window reports (hierarchical aggregation): pending windows and their counts."""
        return self.loads.windows_in

    def report_load(self, step: int, layer: int, rank: int, load: np.ndarray) -> bool:
        """:meth:`LoadWindows.report_load`: one rank's [E] counts of a step and layer."""
        return self.loads.report_load(step, layer, rank, load)

    def report_batch(
        self, steps: np.ndarray, layers: np.ndarray, ranks: np.ndarray, loads: np.ndarray
    ) -> tuple[int, int]:
        """:meth:`LoadWindows.report_batch`: ``K`` per-rank reports, checks vectorized."""
        return self.loads.report_batch(steps, layers, ranks, loads)

    def report_windows(self, reports: Sequence[WindowReport | WindowBlock]) -> tuple[int, int]:
        """:meth:`LoadWindows.report_windows`: DC window reports and blocks."""
        return self.loads.report_windows(reports)

    def report_layer(self, step: int, layer: int, load: np.ndarray) -> None:
        """:meth:`LoadWindows.report_layer`: a whole [R, E] load at once."""
        self.loads.report_layer(step, layer, load)

    def last_reports(self) -> np.ndarray:
        """:meth:`LoadWindows.last_reports`."""
        return self.loads.last_reports()

    def reject_report(self, count: int = 1, *, windows: bool = False) -> None:
        """:meth:`LoadWindows.reject_report`: a report a surface refused before the core."""
        self.loads.reject_report(count, windows=windows)

    # ---- windows ----

    def window(self, layer: int) -> np.ndarray:
        """[W, R, E] complete loads of ``layer``, oldest first."""
        self._check_layer(layer)
        return self.loads.window(layer)

    def layer_stats(self, layer: int) -> LayerStats:
        with self._lock:
            win = self.window(layer)
            newest = self.loads.newest(layer)
            imb = self._imbalance_under_committed(layer, newest[1]) if newest else 1.0
            return LayerStats(
                layer=layer,
                loads=len(win),
                newest_step=newest[0] if newest else None,
                expert_load=win.sum(axis=1).mean(axis=0)
                if len(win)
                else np.zeros(self.model.num_experts),
                rank_load=win.sum(axis=2).mean(axis=0)
                if len(win)
                else np.zeros(self.topology.num_ranks),
                imbalance=imb,
            )

    def layer_newest_step(self, layer: int) -> int | None:
        """Step of ``layer``'s newest complete load, or None (cheap: no copies)."""
        self._check_layer(layer)
        return self.loads.newest_step(layer)

    def newest_rank_tokens(self, layer: int, *, static: bool = False) -> np.ndarray | None:
        """[R] tokens each rank computes for ``layer``'s newest complete load under the
        committed plan (or under static EP when ``static`` or nothing is committed);
        None before any complete load."""
        with self._lock:
            self._check_layer(layer)
            newest = self.loads.newest(layer)
            if newest is None:
                return None
            step, load = newest
            if static or self._committed is None:
                return static_rank_tokens(load, self.topology)
            ctx = self._context(layer, load, step)
            return self._policy_route(ctx, self._committed.layers[layer])

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.model.num_layers:
            raise ValueError(f"unknown layer {layer}; the model has {self.model.num_layers}")

    def _imbalance_under_committed(self, layer: int, load: np.ndarray) -> float:
        if self._committed is None:
            # before any plan, ranks compute the experts of the static placement
            return _static_imbalance(load, self.topology)
        prev = self._committed.layers[layer]
        ctx = self._context(layer, load, self._committed.step)
        return imbalance(self._policy_route(ctx, prev))

    # ---- planning ----

    def should_plan(self, step: int) -> bool:
        """Whether the trigger fires at ``step`` (needs a complete load for every layer)."""
        with self._lock:
            if not self.loads.complete():
                return False
            if self._committed is None:
                return True
            trig = self._settings.trigger
            if trig.mode == "every_step":
                return self._last_plan_step is None or step > self._last_plan_step
            if trig.mode == "every_n":
                return self._last_plan_step is None or step - self._last_plan_step >= trig.every
            worst = max(self.layer_stats(layer).imbalance for layer in range(self.model.num_layers))
            return worst > trig.threshold

    def maybe_plan(self, step: int) -> PlanVersion | None:
        """Plan if the trigger fires; returns the new PREPARED version or None."""
        return self.plan(step) if self.should_plan(step) else None

    def plan(self, step: int) -> PlanVersion:
        """Run the policy on every layer's window now; returns a PREPARED version.

        The inputs are taken under the lock, the policy runs outside it (reports, queries
        and commits go on meanwhile; in a planner process when ``PlannerSettings.process``),
        and the version is numbered under the lock again. :class:`PlannerError` if the
        planner process failed (nothing changes; the next plan gets a new one)."""
        # the window means the jobs read, made before the lock (seconds at 1,000 DCs)
        self.loads.make_means(self._policy.history_window())
        with self._lock:
            policy, policy_name, committed = self._policy, self._settings.policy, self._committed
            hw = policy.history_window()
            jobs = []
            for layer in range(self.model.num_layers):
                newest = self.loads.newest(layer)
                if newest is None and not self.loads.dead.any():
                    raise ValueError(f"layer {layer} has no complete load yet")
                # a recovery before any complete load plans on an empty one
                load = (
                    newest[1]
                    if newest is not None
                    else np.zeros((self.topology.num_ranks, self.model.num_experts), np.int64)
                )
                jobs.append(self._job(layer, step, load, self._history(layer, hw), committed))
            fresh, self._fresh = self._fresh, False
        try:
            results = self._planner.run(policy, jobs)
        except BaseException:
            with self._lock:
                self._fresh = self._fresh or fresh  # the next plan must still start afresh
            raise
        with self._lock:
            version = max(max(self._versions, default=0), self._issued) + 1
            pv = PlanVersion(
                version=version,
                step=step,
                policy=policy_name,
                layers=[r.plan for r in results],
                imbalance_before=[r.imbalance_before for r in results],
                imbalance_after=[r.imbalance_after for r in results],
                created_at=self._clock(),
                encoding=_encoding(policy),
            )
            self._versions[version] = pv
            self._last_plan_step = step
            self._prune()
            self._notify("prepared", pv)
            return pv

    # The step a what-if plans at: one where every periodic policy re-plans (eplb and hybrid
    # re-plan at step 1 whatever their period, on the history they are given).
    WHAT_IF_STEP = 1

    def what_if(
        self,
        load: np.ndarray,
        *,
        layer: int = 0,
        policy: str | None = None,
        policy_settings: dict[str, Any] | None = None,
        from_committed: bool = True,
    ) -> tuple[LayerPlan, float, float]:
        """Plan ``load`` [R, E] for ``layer`` with ``policy`` (default: the active one), applying
        nothing. Returns (plan, imbalance before, imbalance after); "before" is the load under
        the committed placement (static EP when there is none or ``from_committed`` is False).

        The job is the one :meth:`plan` would make if ``load`` were the layer's newest complete
        load (it joins the window's history, as in :meth:`plan`), at a step where periodic
        policies re-plan (:attr:`WHAT_IF_STEP`): a history-based policy (eplb, hybrid) plans
        on the load sent rather than ignoring it. ``ValueError`` on a bad load, layer or
        policy."""
        full = check_load(load, self.topology.num_ranks, self.model.num_experts)
        if full.size and full.max() > 2**40:
            raise ValueError("load count is implausibly large (> 2**40)")
        with self._lock:
            self._check_layer(layer)
            if policy is None and not policy_settings:
                pol = self._policy
            else:
                pol = make_policy(policy or self._settings.policy, policy_settings)
            history = self._history(layer, pol.history_window(), newest=full)
            committed = self._committed if from_committed else None
            job = self._job(layer, self.WHAT_IF_STEP, full, history, committed)
        # in this thread: a what-if must not queue behind (or delay) the controller's plans
        (res,) = plan_jobs(pol, self.topology, self.model, [job])
        return res.plan, res.imbalance_before, res.imbalance_after

    def _job(
        self,
        layer: int,
        step: int,
        load: np.ndarray,
        history: np.ndarray,
        committed: PlanVersion | None,
    ) -> LayerJob:
        """The planning job of ``layer`` (caller holds the lock): :meth:`plan` and
        :meth:`what_if` both build theirs here. ``load`` [R, E] (rows of dead ranks are
        zeroed), ``history`` [W, R, E]; ``committed``: the plan the job starts from."""
        return LayerJob(
            layer=layer,
            step=step,
            committed_step=committed.step if committed is not None else step,
            load=np.where(self.loads.dead[:, None], 0, load),
            history=history,
            committed=committed.layers[layer].placement if committed is not None else None,
            fresh=self._fresh,
            dead_ranks=self.dead_ranks,
        )

    def _history(self, layer: int, hw: int, newest: np.ndarray | None = None) -> np.ndarray:
        """[W, R, E] the newest ``hw`` complete loads of ``layer`` (caller holds the lock),
        with ``newest`` [R, E] appended as the newest one when given (a what-if's load).

        History-based policies plan on the window up to and including the newest complete
        load: by the time a plan applies, that microbatch is history too."""
        return self.loads.history(layer, hw, newest)

    def _context(self, layer: int, load: np.ndarray, step: int) -> PolicyContext:
        return PolicyContext(
            topology=self.topology,
            model=self.model,
            step=step,
            layer=layer,
            load=load,
            history=self._history(layer, self._policy.history_window()),
            previous=self._committed.layers[layer] if self._committed else None,
            dead_ranks=self.dead_ranks,
        )

    def _policy_route(self, ctx: PolicyContext, prev: LayerPlan) -> np.ndarray:
        route = self._policy.route(ctx, prev.placement)
        return np.bincount(route[:, 2], weights=route[:, 3], minlength=self.topology.num_ranks)

    # ---- lifecycle ----

    def _transition(self, version: int, to: PlanState) -> PlanVersion:
        pv = self._versions.get(version)
        if pv is None:
            raise ValueError(f"unknown plan version {version}")
        if pv.state == to:
            return pv  # idempotent
        if to not in LEGAL_TRANSITIONS[pv.state]:
            raise ValueError(f"plan {version} is {pv.state}; cannot become {to}")
        return pv

    def commit(self, version: int) -> PlanVersion:
        """PREPARED -> COMMITTED. Idempotent. Refuses versions older than the committed one."""
        with self._lock:
            pv = self._transition(version, PlanState.COMMITTED)
            if pv.state == PlanState.COMMITTED:
                return pv
            if self._committed is not None and version < self._committed.version:
                raise ValueError(
                    f"plan {version} is older than committed plan {self._committed.version}"
                )
            pv.state, pv.committed_at = PlanState.COMMITTED, self._clock()
            # older prepared versions can never commit now
            for other in self._versions.values():
                if other.state == PlanState.PREPARED and other.version < version:
                    other.state = PlanState.ROLLED_BACK
            self._committed = pv
            if self._store is not None:
                self._store.save(pv)
            self._prune()
            self._notify("committed", pv)
            return pv

    def rollback(self, version: int) -> PlanVersion:
        """PREPARED -> ROLLED_BACK. Idempotent."""
        with self._lock:
            pv = self._transition(version, PlanState.ROLLED_BACK)
            if pv.state != PlanState.ROLLED_BACK:
                pv.state = PlanState.ROLLED_BACK
                self._notify("rolled_back", pv)
            return pv

    def restore(self, pv: PlanVersion) -> None:
        """Adopt a committed plan recovered from the store (after a controller restart)."""
        with self._lock:
            if pv.state != PlanState.COMMITTED:
                raise ValueError("only committed plans can be restored")
            if pv.policy == self._settings.policy:
                pv.encoding = _encoding(self._policy)
            self._versions[pv.version] = pv
            if self._committed is None or pv.version > self._committed.version:
                self._committed = pv
                self._last_plan_step = pv.step
            self._prune()

    def reserve_versions(self, upto: int) -> None:
        """Versions up to ``upto`` were handed out before (by this controller before a
        restart): later plans are numbered above them, so no version is reused."""
        with self._lock:
            self._issued = max(self._issued, int(upto))

    def adopt(self, pv: PlanVersion) -> None:
        """A PREPARED plan this core did not make (one the workers were offered before a
        controller restart): it can then commit like any other."""
        with self._lock:
            if pv.state != PlanState.PREPARED or pv.version in self._versions:
                raise ValueError(f"plan {pv.version} cannot be adopted")
            self._versions[pv.version] = pv
            self._issued = max(self._issued, pv.version)

    # ---- queries ----

    @property
    def committed(self) -> PlanVersion | None:
        # one attribute read is atomic: no lock, so readers never wait for a plan or a batch
        return self._committed

    def _prune(self) -> None:
        # caller holds the lock. Plans are large (routes of ~R * E rows per layer): keep the
        # committed one, every prepared one and the newest KEEP_VERSIONS others in memory;
        # older ones are read from the plan store.
        done = [
            v
            for v, pv in self._versions.items()
            if pv.state != PlanState.PREPARED and pv is not self._committed
        ]
        for v in sorted(done)[: max(0, len(done) - self.KEEP_VERSIONS)]:
            del self._versions[v]

    def get(self, version: int) -> PlanVersion:
        with self._lock:
            pv = self._versions.get(version)
            if pv is None:
                raise ValueError(f"unknown plan version {version}")
            return pv

    def versions(self) -> list[PlanVersion]:
        """The versions kept in memory (prepared, committed, the newest KEEP_VERSIONS others),
        oldest first; older ones are in the plan store."""
        with self._lock:
            return [self._versions[v] for v in sorted(self._versions)]

    def _notify(self, event: str, pv: PlanVersion) -> None:
        # A listener (metrics, plan stream) must not break the lifecycle: log and go on.
        for listener in list(self.listeners):
            try:
                listener(event, pv)
            except Exception:
                log.exception(
                    "plan listener %r failed on %s of plan %d", listener, event, pv.version
                )


def _encoding(policy: Policy) -> TransferEncoding:
    """The transfer encoding ``policy`` plans with (float32 unless it has one)."""
    enc = getattr(policy, "transfer_encoding", None)
    return enc if isinstance(enc, TransferEncoding) else TransferEncoding()


def _static_imbalance(load: np.ndarray, topology: Topology) -> float:
    return imbalance(static_rank_tokens(load, topology))
