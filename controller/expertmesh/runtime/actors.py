"""The worker actor (one rank over :class:`RankState`) and the Ray executor of a step.

Split from :mod:`expertmesh.runtime.cluster` (which re-exports both): packets between
workers travel as object refs, so a whole step is submitted at once.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import ray

from expertmesh.planner import Placement, Topology
from expertmesh.workers.model import Corpus
from expertmesh.workers.rank import RankState
from expertmesh.workers.shaper import LinkShaper

__all__ = ["REPORT_TIMEOUT_S", "RayExecutor", "WorkerActor"]

log = logging.getLogger(__name__)
REPORT_TIMEOUT_S = 30.0  # a worker waits this long for a restarting controller to take a report


class WorkerActor:
    """One rank: a thin wrapper over :class:`RankState`."""

    def __init__(
        self,
        rank: int,
        settings: Any,
        placements: list[tuple[np.ndarray, np.ndarray]],
        shaper_path: str,
        controller: Any,
    ) -> None:
        self.rank = rank
        self.controller = controller
        self.shaper_path = shaper_path
        self._report_ref: Any = None
        self.shaper: LinkShaper | None = None
        self._exit_at: tuple[int, str] | None = None
        self.reset(settings, placements)

    def reset(self, settings: Any, placements: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """A fresh rank (initial weights, plan version 0) for ``settings``."""
        topo = Topology.from_dict(settings.topology)
        corpus = Corpus.load(settings.corpus, settings.corpus_bytes)
        if self.shaper is not None:
            self.shaper.close()
        # the shared bucket file exists only where the runtime emulates DCs on one machine
        path = self.shaper_path if settings.shaper else None
        self.shaper = LinkShaper.from_topology(topo, enabled=True, path=path)
        self._loads: dict[int, np.ndarray] = {}
        num_layers = settings.lm.num_layers

        def report(step: int, layer: int, rank: int, load: np.ndarray) -> None:
            # one message per step with every layer's load (not one per layer)
            self._loads[layer] = load
            if len(self._loads) == num_layers:
                rows = np.stack([self._loads[i] for i in range(num_layers)])  # [L, E]
                self._report_ref = self.controller.report_loads.remote(step, rank, rows)
                self._loads = {}

        self.state = RankState(
            self.rank,
            topo,
            settings.lm,
            corpus,
            [Placement(p, m) for p, m in placements],
            reserve=self.shaper.reserve if settings.shaper else None,
            report=report,
        )

    def inject_exit(self, step: int, phase: str) -> None:
        """Fault injection: exit the process (as a crash would) when phase ``phase`` of
        step ``step`` starts (e.g. ``red3``: after other ranks sent their gradients, so the
        survivors have begun updating weights when they notice)."""
        self._exit_at = (step, phase)

    def phase(self, name: str, layer: int, *inbox: Any, arg: Any = None) -> Any:
        if self._exit_at == (self.state.step, name):
            log.error("rank %d: injected exit at step %d phase %s", self.rank, *self._exit_at)
            os._exit(1)
        out = self.state.phase(name, layer, list(inbox), arg)
        if name.endswith("red5") and self._report_ref is not None:
            try:  # the step's load reached the controller before stats
                ray.get(self._report_ref, timeout=REPORT_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                # the controller died or is restarting: this step's load is lost, the step
                # itself is not (training goes on under the committed plan)
                log.warning("rank %d: load report of step %d lost", self.rank, self.state.step)
            self._report_ref = None
        return out if len(out) > 1 else out[0]

    def call(self, method: str, *args: Any) -> Any:
        if method not in (
            "prepare", "prepare_end", "commit", "abort", "stats", "plan_state",
            "rollback_step", "set_live", "checkpoint", "expert_weights", "seed",
            "export_dense", "adopt",
        ):  # fmt: skip
            raise ValueError(f"unknown worker method {method!r}")
        return getattr(self.state, method)(*args)

    def ping(self) -> dict[str, Any]:
        return {"rank": self.state.rank, "node": ray.get_runtime_context().get_node_id()}


class RayExecutor:
    """:class:`expertmesh.workers.engine.Executor` over worker actors (packets as refs).

    Ranks not ``live`` (dead, or cut off) are never called; their packets are ``None``."""

    def __init__(self, workers: list[Any], live: np.ndarray | None = None) -> None:
        self.workers = workers
        self.num_ranks = len(workers)
        self.live = np.ones(self.num_ranks, bool) if live is None else np.asarray(live, bool)

    def phase(self, name: str, layer: int, outs: list[list[Any]] | None, arg: Any = None) -> Any:
        n = self.num_ranks
        res: list[list[Any]] = []
        for q, w in enumerate(self.workers):
            if not self.live[q]:
                res.append([None] * n)
                continue
            inbox = [outs[p][q] for p in range(n)] if outs else []
            refs = w.phase.options(num_returns=n).remote(name, layer, *inbox, arg=arg)
            res.append(refs if n > 1 else [refs])
        return res

    def call_all(self, method: str, *args: Any) -> list[Any]:
        live = [w for w, ok in zip(self.workers, self.live, strict=True) if ok]
        return list(ray.get([w.call.remote(method, *args) for w in live]))

    def results(self, outs: list[list[Any]]) -> list[Any]:
        return list(ray.get([outs[q][q] for q in range(self.num_ranks) if self.live[q]]))
