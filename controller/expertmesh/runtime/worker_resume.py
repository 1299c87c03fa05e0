"""The SPMD worker's side of a restarted controller and of a resumed run (a mixin of
:class:`~expertmesh.runtime.worker.SpmdWorker`): what it tells a controller that Ray
restarted (:mod:`expertmesh.runtime.reattach`), the step reports it kept for it, and taking
a checkpoint's state (:mod:`expertmesh.runtime.resume`)."""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

__all__ = ["REPORT_LOG_BYTES", "WorkerResume", "plan_digest"]

REPORT_LOG_BYTES = 64 << 20  # step reports a worker keeps for a restarted controller (about)


def plan_digest(layers: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> str:
    """sha256 over a plan's per-layer (phy2log, master, route)."""
    h = hashlib.sha256()
    for arrays in layers:
        for x in arrays:
            a = np.ascontiguousarray(np.asarray(x, np.int64))
            h.update(str(a.shape).encode())
            h.update(a.tobytes())
    return h.hexdigest()


class WorkerResume:
    """Mixin of :class:`~expertmesh.runtime.worker.SpmdWorker` (module docstring)."""

    rank: int
    topology: Any
    state: Any
    backend: str
    conflicts: int
    _lock: threading.Lock
    _plans: dict[int, tuple[Any, ...]]
    _committed: tuple[int, list[Any]]
    _switching: tuple[int, Any] | None
    _log: deque[dict[str, Any]]

    if TYPE_CHECKING:  # SpmdWorker's

        def refill(
            self,
            transfers: list[tuple[int, int, int, int, str]],
            state: dict[str, Any] | None = None,
            seeds: dict[tuple[int, int], Any] | None = None,
        ) -> None: ...

    def _init_resume(self, settings: Any, placements: list[tuple[np.ndarray, np.ndarray]]) -> None:
        # the committed plan as (version, per layer (phy2log, master, route)), the plan being
        # switched to right now (version, offer) and the newest step reports: what a
        # restarted controller reads back (controller_view)
        self._committed: tuple[int, list[Any]] = (
            0,
            [(p, m, np.zeros((0, 4), np.int64)) for p, m in placements],
        )
        self._switching: tuple[int, Any] | None = None
        self._digests: dict[int, str] = {}  # version -> sha256 of each plan offered here
        self.conflicts = 0
        self._bytes = np.zeros((3, self.topology.num_dcs), np.int64)  # [3, D] its DC's row
        per = 8 * settings.lm.num_layers * settings.lm.num_experts + 4096
        self._log: deque[dict[str, Any]] = deque(maxlen=max(16, min(1024, REPORT_LOG_BYTES // per)))

    def controller_view(self) -> dict[str, Any]:
        """What a restarted controller learns from this worker: the committed plan
        (version, layers), the plan being switched to now, the offers not switched to yet,
        the group (members, backend), the last step and the step reports kept."""
        with self._lock:
            version, layers = self._committed
            offers = dict(self._plans)
            if self._switching is not None:
                v, offer = self._switching
                if offer is not None:
                    offers[v] = offer
            switching = None if self._switching is None else self._switching[0]
            reports = list(self._log)
        st = self.state
        return {
            "rank": self.rank,
            "step": -1 if st is None else st.step,
            "version": version,
            "layers": layers,
            "switching": switching,
            "offers": offers,
            "members": [] if st is None else list(st.comm.world.ranks),
            "backend": self.backend,
            "reports": reports,
            "conflicts": self.conflicts,
        }

    def reports_since(self, step: int) -> list[dict[str, Any]]:
        """The kept step reports from ``step`` on (a controller missing some asks)."""
        with self._lock:
            return [r for r in self._log if r["step"] >= step]

    def resume(self, state: dict[str, Any], seeds: dict[tuple[int, int], Any]) -> None:
        """Take the state of a checkpoint (:class:`~expertmesh.runtime.resume.ResumeState`):
        ``state`` as :meth:`export_state` gives it, ``seeds`` every expert this rank holds
        under its plan; a replica holds its master's weights as the wire rounds them."""
        wire = state["wire"]
        rounded = {}
        for (layer, e), (w, m, v) in seeds.items():
            master = int(state["layers"][layer][1][e]) // self.topology.slots_per_rank
            if master != self.rank:
                w = [torch.as_tensor(np.asarray(t)).to(wire.weights).float().numpy() for t in w]  # noqa: PLW2901
            rounded[(layer, e)] = (w, m, v)
        self.refill([], state, rounded)
        with self._lock:
            self._committed = (int(state["version"]), list(state["layers"]))
