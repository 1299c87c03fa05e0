"""The controller's side of a membership change on the SPMD data plane.

When ranks leave (a dead worker not replaced, a DC cut off and paused) or come back (a
paused DC after the heal), the driver re-forms the process groups over the ranks that
take part (the *members*) and asks the controller for a plan on them
(:meth:`MembershipSteps.membership_plan`): the core plans afresh with the others marked
dead (no copy on them, no route to them, one master per expert on a member), and
:func:`~expertmesh.planner.rounds.source_rounds` says how the members get there from the committed plan. Only
ranks that trained until now (the *sources*) send: a rejoining rank's copies are stale. A
copy no source holds, and the Adam state of a master whose old master left, come from the
newest checkpoint on disk (the ``restore`` list; the driver loads it). Once every member
applied the plan (:meth:`~expertmesh.runtime.worker.SpmdWorker.reshape`), the controller
commits it and records steps over the new members
(:meth:`MembershipSteps.membership_done`).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from expertmesh.controller.core import ControllerCore
from expertmesh.planner import Placement, Topology
from expertmesh.planner.rounds import source_rounds

__all__ = ["MembershipSteps"]


class MembershipSteps:
    """Mixin of :class:`~expertmesh.runtime.controller.ControllerActor` (module docstring)."""

    core: ControllerCore
    topology: Topology
    placements: list[Placement]
    telemetry: Any
    workers: list[Any]
    live: np.ndarray
    _spmd_lock: threading.Lock
    _offered: Any
    _members: list[int]
    _spmd_workers: list[Any]
    _reports: dict[int, dict[int, dict[str, Any]]]
    _results: list[dict[str, Any]]
    _next_step: int | None
    _membership: Any = None
    loads: Any  # runtime/loads.py: LoadIngest

    def membership_plan(
        self, members: list[int], sources: list[int], step: int, version: int
    ) -> dict[str, Any]:
        """A plan for ``members`` to train step ``step`` on (prepared, not committed);
        ``sources``: the members that trained until now, on committed plan ``version``.
        A plan on offer is committed if the workers switched to it, else dropped."""
        with self._spmd_lock:
            off, self._offered = self._offered, None
            if off is not None and off.version == version:
                self.core.commit(version)
                self.placements = [lp.placement for lp in off.layers]
            elif off is not None:
                self.core.rollback(off.version)
            c = self.core.committed
            if (c.version if c is not None else 0) != version:
                raise RuntimeError(
                    f"the workers are on plan {version}, the controller on "
                    f"{c.version if c is not None else 0}"
                )
            live = np.zeros(self.topology.num_ranks, bool)
            live[list(members)] = True
            self.core.set_dead_ranks(np.flatnonzero(~live).tolist())
        pv = self.core.plan(step)
        new = [lp.placement for lp in pv.layers]
        src = np.zeros(self.topology.num_ranks, bool)
        src[list(sources)] = True
        rounds, restore = source_rounds(self.placements, new, src, self.topology)
        self._membership = pv
        return {
            "version": pv.version,
            "layers": [
                (p.phy2log, p.master, lp.route) for p, lp in zip(new, pv.layers, strict=True)
            ],
            "rounds": rounds,
            "restore": restore,
            "encoding": pv.encoding,
        }

    def membership_done(
        self, version: int, members: list[int], workers: list[Any], step: int
    ) -> None:
        """Every member applied plan ``version``: commit it; steps from ``step`` on are
        recorded once every member's report is in (reports of a failed attempt dropped)."""
        pv = self._membership
        if pv is None or pv.version != version:
            raise ValueError(f"plan {version} is not the membership plan on offer")
        with self._spmd_lock:
            self.core.commit(version)
            self.placements = [lp.placement for lp in pv.layers]
            self._membership = None
            self._members = sorted(members)
            self.loads.gone([r for r in range(self.topology.num_ranks) if r not in members])
            self._spmd_workers = self.workers = list(workers)
            self.live = np.zeros(self.topology.num_ranks, bool)
            self.live[self._members] = True
            for r in range(self.topology.num_ranks):
                self.telemetry.set_worker_state(r, bool(self.live[r]))
            for s in [s for s in self._reports if s >= step]:
                del self._reports[s]
            self._results = [r for r in self._results if r["step"] < step]
            if self._next_step is not None:
                self._drain()
            self._next_step = step

    def _drain(self) -> None:
        raise NotImplementedError
