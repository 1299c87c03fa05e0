"""The controller actor: a thin Ray wrapper over :class:`ControllerCore`.

It records the workers' steps and offers them plans (:mod:`expertmesh.runtime.steps`),
changes members (:mod:`expertmesh.runtime.membership`), re-attaches to the workers after
Ray restarted it (:mod:`expertmesh.runtime.reattach`), records every step in
:class:`Telemetry`, keeps plans in SQLite and hosts the control-plane :class:`Surfaces`
(REST, dashboard, ``/metrics``, gRPC) when asked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import ray

from expertmesh.controller.core import ControllerCore, ControllerSettings
from expertmesh.controller.telemetry import Telemetry
from expertmesh.planner import Topology
from expertmesh.runtime.membership import MembershipSteps
from expertmesh.runtime.reattach import Reattach
from expertmesh.runtime.settings import RuntimeSettings, initial_placements
from expertmesh.runtime.steps import SpmdSteps

__all__ = ["ControllerActor"]

log = logging.getLogger(__name__)


class ControllerActor(Reattach, SpmdSteps, MembershipSteps):
    """Thin actor over :class:`ControllerCore`: gather, call the core, apply the result.
    After Ray restarted it, it re-attaches to the workers
    (:mod:`expertmesh.runtime.reattach`) before serving any call."""

    def __init__(self, settings: RuntimeSettings, store_path: str | None = None) -> None:
        self.workers: list[Any] = []
        self.surfaces: Any = None  # expertmesh.controller.server.Surfaces while serving
        if store_path is None:  # on the controller's node; the job id survives restarts
            job = ray.get_runtime_context().get_job_id()
            store_path = os.path.join(tempfile.gettempdir(), f"expertmesh-{job}", "plans.sqlite")
        self.store_path = store_path
        self.store: Any = None
        self._crash_at: str | None = None
        self.restarted = False
        self.reattached_spmd: dict[str, Any] | None = None
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.reset(settings, recover=restarted)
        if restarted:
            try:
                self.reattach()
            except Exception:  # records nothing (the driver's wait for steps times out)
                self.errors += 1
                log.exception("re-attaching to the workers after a restart failed")
                if not hasattr(self, "_spmd_lock"):
                    self.spmd_reset([], [], "")
        if restarted and settings.surfaces is not None:
            try:  # the dead process's ports are free again (port 0: new ones, see Runtime)
                self.start_surfaces()
            except Exception:
                log.exception("restarting the control-plane surfaces failed")

    def reset(self, settings: RuntimeSettings, *, recover: bool = False) -> None:
        """A fresh core (no plans, empty windows) for ``settings``; not while serving.

        ``recover`` (after Ray restarted this actor): the core takes the newest committed
        plan and the policy settings from the SQLite store (the workers may have moved on
        since: :meth:`reattach` learns it from them)."""
        if self.surfaces is not None:
            raise ValueError("stop the surfaces before resetting the controller")
        self.settings = settings
        self.topology = Topology.from_dict(settings.topology)
        self.core = ControllerCore(
            self.topology,
            settings.lm.spec(),
            ControllerSettings(
                policy=settings.policy,
                policy_settings=settings.policy_settings,
                trigger=settings.trigger,
            ),
        )
        self.telemetry = Telemetry(self.core)
        self.errors = 0
        self.placements = initial_placements(self.topology, settings.lm, settings.layout)
        self.live = np.ones(self.topology.num_ranks, bool)
        from expertmesh.controller.store import SqlitePlanStore

        if self.store is not None:
            self.store.close()
        if not recover:
            for suffix in ("", "-wal", "-shm"):
                Path(self.store_path + suffix).unlink(missing_ok=True)
        self.store = SqlitePlanStore(self.store_path)
        if recover:
            pv = self.store.recover(self.core)
            if pv is not None:
                self.placements = [lp.placement for lp in pv.layers]
            self.restarted = True
            log.warning("controller restarted; recovered plan %s", pv and pv.version)
        else:
            self.store.save_settings(self.core.settings)
        self.core.attach_store(self.store)

    def attach(self, workers: list[Any]) -> int:
        self.workers = workers
        for r in range(len(workers)):
            self.telemetry.set_worker_state(r, True)
        return len(workers)

    def drop_store(self) -> None:
        """Close the plan store and delete its files (the run is over)."""
        if self.store is not None:
            self.store.close()
            self.store = None
        for suffix in ("", "-wal", "-shm"):
            Path(self.store_path + suffix).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            Path(self.store_path).parent.rmdir()

    def inject_crash(self, at: str) -> None:
        """Fault injection: exit the process (as a crash would) at the next plan, ``at``
        ``"offered"`` (half the workers have the offer) or ``"applied"`` (the workers
        switched to it, the store does not have it yet)."""
        if at not in ("offered", "applied"):
            raise ValueError(f"unknown crash point {at!r}")
        self._crash_at = at

    def _maybe_crash(self, at: str) -> None:
        if self._crash_at == at:
            log.error("injected crash at %s", at)
            os._exit(1)

    def start_surfaces(self) -> dict[str, str]:
        """Start REST/dashboard/metrics and gRPC (``settings.surfaces``); their addresses."""
        from expertmesh.controller.server import Surfaces  # uvicorn, gRPC: only when serving

        if self.surfaces is None:
            if self.settings.surfaces is None:
                raise ValueError("no surface settings")
            self.surfaces = Surfaces(self.core, self.settings.surfaces, telemetry=self.telemetry)
            self.surfaces.start()
        return {"rest_url": self.surfaces.rest_url, "grpc_target": self.surfaces.grpc_target}

    def stop_surfaces(self) -> None:
        if self.surfaces is not None:
            self.surfaces.stop()
            self.surfaces = None

    def committed_plan(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
        """Per layer ``(phy2log [R, S], master [E], route [N, 4])`` of the committed plan."""
        c = self.core.committed
        if c is None:
            return None
        return [(lp.placement.phy2log, lp.placement.master, lp.route) for lp in c.layers]

    def metrics(self) -> bytes:
        """The Prometheus exposition of the telemetry (what ``/metrics`` serves)."""
        return self.telemetry.render()

    def status(self) -> dict[str, Any]:
        c = self.core.committed
        return {
            "version": c.version if c else 0,
            "policy": self.core.settings.policy,
            "errors": self.errors,
            "reports_received": self.core.reports_received,
            "reports_rejected": self.core.reports_rejected,
            "loads": loads.accounting() if (loads := getattr(self, "loads", None)) else None,
            "restarted": self.restarted,
            "reattached": self.reattached_spmd,
        }
