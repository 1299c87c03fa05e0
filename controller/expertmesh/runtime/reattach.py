"""The SPMD plane's controller after Ray restarted it, and the plan of a resumed run.

The workers never wait for the controller: each step's report is fire and forget, so
while the controller actor is down (killed, restarting) they train on, on the plan they
have. When Ray restarts it (``max_restarts``), the new actor (:meth:`Reattach.reattach`,
from its constructor, before it serves any call):

1. recovers the newest committed plan and the policy from its SQLite store
   (:meth:`SqlitePlanStore.recover`, as before);
2. re-attaches to the live workers itself: they are the named actors ``worker-<rank>``
   (a replacement takes the same name), and each tells it what it runs
   (:meth:`SpmdWorker.controller_view`: committed plan, the plan it is switching to, the
   offers it holds, its group, the step reports it kept). The controller does this, not
   the driver: it must happen before the first report is recorded, whatever the driver
   is doing (waiting on the workers, or gone), and everything it needs is on the workers;
3. adopts the plan the workers run when it is newer than the store's (an offer sent
   before the crash and switched to at a boundary the workers agreed on while it was
   down): saved to the store as committed. An offer some workers hold and none switched
   to is offered again to every worker (all switch at one boundary, or none does);
4. numbers its next plan above every version ever handed out (the store notes each
   offer's version before it is sent; the workers' versions), so none is reused;
5. records the steps whose reports the old actor lost from the reports the workers kept
   (``StepResult.recorded == "workers"``); a report lost in the restart's race is asked
   for again when the next step waits for it too long (:meth:`Reattach.results_since`).
   Planning goes on from the replayed loads.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from expertmesh.controller.core import PlanState, PlanVersion
from expertmesh.planner import LayerPlan, Placement, imbalance
from expertmesh.planner.plan import rank_tokens
from expertmesh.runtime.settings import NAMESPACE
from expertmesh.runtime.trace import migration_collectives

__all__ = ["REATTACH_TIMEOUT_S", "Reattach"]

log = logging.getLogger(__name__)
REATTACH_TIMEOUT_S = 30.0  # a worker that does not answer the restarted controller by then
REPAIR_AFTER_S = 2.0  # a step waiting this long for a report asks the workers again


class Reattach:
    """Mixin of :class:`~expertmesh.runtime.controller.ControllerActor` (module docstring)."""

    core: Any
    store: Any
    topology: Any
    settings: Any
    placements: list[Placement]
    live: np.ndarray
    workers: list[Any]
    _spmd_lock: Any
    _offered: Any
    _trace: dict[str, dict[int, Any]]

    if TYPE_CHECKING:  # SpmdSteps' (the actor has both)

        def spmd_reset(self, workers: list[Any], members: list[int], backend: str) -> None:
            raise NotImplementedError

        def step_report(self, rank: int, stats: dict[str, Any]) -> None:
            raise NotImplementedError

    def _plan_version(
        self, version: int, step: int, layers: list[Any], state: PlanState, encoding: Any = None
    ) -> PlanVersion:
        lps = [
            LayerPlan(
                Placement(np.asarray(p), np.asarray(m)), np.asarray(r, np.int64).reshape(-1, 4)
            )
            for p, m, r in layers
        ]
        after = [imbalance(rank_tokens(lp.route, self.topology.num_ranks)) for lp in lps]
        pv = PlanVersion(
            version=version, step=step, policy=self.core.settings.policy, layers=lps,
            imbalance_before=after, imbalance_after=after, state=state, created_at=time.time(),
        )  # fmt: skip
        if encoding is not None:
            pv.encoding = encoding
        return pv

    def resume_plan(self, version: int, layers: list[Any], step: int) -> None:
        """A resumed run's committed plan (from its checkpoint): committed here and in the
        store; the next plan is numbered above it."""
        if version > 0:
            pv = self._plan_version(version, step, layers, PlanState.PREPARED)
            self.core.adopt(pv)
            self.core.commit(version)
            self.placements = [lp.placement for lp in pv.layers]
            self._traced(version, layers, [])
        self.core.reserve_versions(version)

    def _traced(self, version: int, layers: list[Any], rounds: list[Any]) -> None:
        """A plan learned from the workers or a checkpoint joins the run's trace (the
        plans the steps ran on; runtime/trace.py)."""
        with self._spmd_lock:
            self._trace["plans"][version] = (layers, migration_collectives(rounds, self.topology))

    def reattach(self) -> dict[str, Any]:
        """After a restart: re-attach to the workers and learn what they run (module
        docstring). Returns what it did (also in ``status()["reattached"]``)."""
        t0 = time.perf_counter()
        workers, views = _views(self.topology.num_ranks)
        # the members train on; a paused rank's view (its old group, an old step) is stale
        members = sorted(max(views, key=lambda v: v["step"])["members"])
        views = [v for v in views if v["rank"] in members]
        if not members or len(views) != len(members):
            raise RuntimeError(f"members {members}: only ranks {[v['rank'] for v in views]} answer")
        live = np.zeros(self.topology.num_ranks, bool)
        live[members] = True
        if not live.all():
            self.core.set_dead_ranks(np.flatnonzero(~live).tolist())
        self.live = live
        backend = next((v["backend"] for v in views if v["backend"]), "")
        self.spmd_reset(workers, members, backend)
        self.workers = workers
        c = self.core.committed
        stored = c.version if c is not None else 0
        running = max(max(v["version"], v["switching"] or 0) for v in views)
        content = _content(views, running)
        self.core.reserve_versions(max(self.store.issued_version(), stored))
        adopted = None
        if running > stored and content is not None:
            layers, rounds, encoding = content
            step = max(v["step"] for v in views)
            self.core.adopt(self._plan_version(running, step, layers, PlanState.PREPARED, encoding))
            self.core.commit(running)  # saved to the store
            adopted = running
            self._traced(running, layers, rounds)
        elif running < stored:
            log.error("the workers run plan %d, the store has %d", running, stored)
        if self.core.committed is not None:
            self.placements = [lp.placement for lp in self.core.committed.layers]
        offered = self._reoffer(views, workers, max(running, stored))
        replayed = self._replay(views, members)
        out = {
            "store_version": stored,
            "workers_version": running,
            "adopted": adopted,
            "offer": offered,
            "worker_steps": [v["step"] for v in views],
            "replayed_from": replayed,
            "seconds": time.perf_counter() - t0,
        }
        self.reattached_spmd = out
        log.warning("controller re-attached to the workers: %s", out)
        return out

    def _reoffer(self, views: list[dict[str, Any]], workers: list[Any], above: int) -> int | None:
        """The newest offer some worker holds above ``above``, offered again to every
        worker (the same message: plan, migration rounds, encoding)."""
        pending = sorted({k for v in views for k in v["offers"] if k > above})
        if not pending:
            return None
        version = pending[-1]
        layers, rounds, encoding = next(
            v["offers"][version] for v in views if version in v["offers"]
        )
        pv = self._plan_version(
            version, max(v["step"] for v in views), layers, PlanState.PREPARED, encoding
        )
        self.core.adopt(pv)
        self._offered = pv
        self._traced(version, layers, rounds)
        for v in views:
            workers[v["rank"]].offer_plan.remote(version, layers, rounds, encoding)
        return version

    def _replay(self, views: list[dict[str, Any]], members: list[int]) -> int | None:
        """Record the steps every member still has a report of (the old actor's records
        are gone); returns the first one."""
        logs = {v["rank"]: v["reports"] for v in views if v["rank"] in members}
        if not any(logs.values()):
            return None  # no step ended since the workers started: the first report is next
        if all(logs.values()):
            first = max(rep[0]["step"] for rep in logs.values())
        else:  # a replacement that has not ended a step yet: nothing to replay
            first = max(rep[-1]["step"] for rep in logs.values() if rep) + 1
        with self._spmd_lock:
            self._next_step = first
            for r, rep in logs.items():
                mine = [x for x in rep if x["step"] >= first]
                if mine:
                    self._rank_bytes[r] = np.asarray(mine[0]["bytes_before"])
        for r, rep in logs.items():
            for stats in rep:
                if stats["step"] >= first:
                    self.step_report(r, {**stats, "recorded": "workers"})
        return first

    def _maybe_repair(self) -> None:
        """:meth:`repair` when recording has waited :data:`REPAIR_AFTER_S` on one step,
        after a restart only (the driver's polls call it)."""
        if self.reattached_spmd is None:
            return
        now = time.monotonic()
        if self._next_step != self._repair_at[0]:
            self._repair_at = (self._next_step, now)
        elif now - self._repair_at[1] > REPAIR_AFTER_S:
            self._repair_at = (self._next_step, now)
            self.repair()

    def repair(self) -> int:
        """Ask the workers again for the reports of the step recording waits on (lost in a
        restart's race: sent to the old actor after the re-attach read the workers).
        Returns how many arrived."""
        with self._spmd_lock:
            step = self._next_step
            have = set(self._reports.get(step, {})) if step is not None else set()
            missing = [r for r in self._members if r not in have]
        if step is None or not missing:
            return 0
        refs = {r: self._spmd_workers[r].reports_since.remote(step) for r in missing}
        got = 0
        for r, ref in refs.items():
            try:
                reps = ray.get(ref, timeout=REATTACH_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError):
                continue
            for stats in reps:
                self.step_report(r, {**stats, "recorded": "workers"})
                got += 1
        return got

    reattached_spmd: dict[str, Any] | None
    _repair_at: tuple[int | None, float] = (None, 0.0)
    _spmd_workers: list[Any]
    _members: list[int]
    _reports: dict[int, dict[int, dict[str, Any]]]
    _rank_bytes: dict[int, np.ndarray]
    _next_step: int | None


def _views(num_ranks: int) -> tuple[list[Any], list[dict[str, Any]]]:
    """Every rank's worker (None: gone, e.g. dead without replacement) and the views of
    those that answer within :data:`REATTACH_TIMEOUT_S`."""
    workers: list[Any] = []
    for r in range(num_ranks):
        try:
            workers.append(ray.get_actor(f"worker-{r}", namespace=NAMESPACE))
        except ValueError:
            workers.append(None)
    refs = [(r, w.controller_view.remote()) for r, w in enumerate(workers) if w is not None]
    deadline = time.monotonic() + REATTACH_TIMEOUT_S
    views = []
    for r, ref in refs:
        try:
            views.append(ray.get(ref, timeout=max(0.1, deadline - time.monotonic())))
        except (ray.exceptions.RayError, TimeoutError):
            workers[r] = None
    if not views:
        raise RuntimeError("no worker answered the restarted controller")
    return workers, views


def _content(views: list[dict[str, Any]], version: int) -> tuple[list[Any], Any, Any] | None:
    """Per layer (phy2log, master, route), the migration rounds and the encoding of plan
    ``version``, from a worker that holds it (committed, or as the offer it is switching
    to; a committed one's rounds are not kept)."""
    for v in views:
        if version in v["offers"]:
            layers, rounds, encoding = v["offers"][version]
            return layers, rounds, encoding
    for v in views:
        if v["version"] == version:
            return v["layers"], [], None
    return None
