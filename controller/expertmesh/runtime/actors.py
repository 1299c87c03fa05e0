"""The worker actor (one rank over :class:`RankState`), the link probe of a DC and the Ray
executor of a step.

Split from :mod:`expertmesh.runtime.cluster` (which re-exports both): packets between
workers travel as object refs, so a whole step is submitted at once.

A step can be bounded (:attr:`RayExecutor.deadline_s`): when its results are not all in
by then, the executor asks ``on_stall`` (the runtime probes the DC links); when that finds
a cut, :class:`StepStalled` is raised, else the wait goes on, up to ``max_stalls``
deadlines in all. A packet that a rank cannot pull across a real cut never fails: the
rank's task waits for its argument for as long as the cut lasts, and cancelling it does
not work reliably (Ray 2.60: an actor task waiting for several arguments from another
node stayed queued after ``ray.cancel``, and with it every later call to that actor). So
worker actors run their calls out of order (``max_concurrency=WORKER_THREADS``: a task
waiting for its arguments holds no thread and blocks no other call) and one at a time
(a lock); every phase of a step carries the step's *attempt*, and a rank drops a phase of
an attempt that is not its current one (a control call such as ``rollback_step`` ends
the current attempt). A task stuck on a cut therefore does nothing when the link heals
and it finally runs: the step was retried without it.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import ray

from expertmesh.planner import Placement, Topology
from expertmesh.workers.model import Corpus
from expertmesh.workers.rank import RankState
from expertmesh.workers.shaper import LinkShaper

__all__ = [
    "REPORT_TIMEOUT_S",
    "WORKER_THREADS",
    "LinkProbe",
    "RayExecutor",
    "StepStalled",
    "WorkerActor",
]

log = logging.getLogger(__name__)
REPORT_TIMEOUT_S = 30.0  # a worker waits this long for a restarting controller to take a report
WORKER_THREADS = 2  # > 1: Ray runs a worker's calls out of order (a stuck one blocks none)
_ATTEMPTS = itertools.count(1)  # every step attempt of this driver gets its own number


class StepStalled(ConnectionError):
    """A step's results did not come within its deadline (a cut link, found by probing)."""


class LinkProbe:
    """One per DC, beside its workers: can this DC reach the others' nodes right now?

    Its own actor (not a worker's queue, which a step stuck on a cut link blocks)."""

    def probe(self, targets: dict[int, tuple[str, int]], timeout: float) -> dict[int, bool]:
        """``targets``: DC -> (address, port) of a node there (its object manager, which
        carries packets between nodes). True where a TCP connection opens within
        ``timeout`` seconds (a refused one also proves the link works)."""

        def reach(addr: tuple[str, int]) -> bool:
            try:
                socket.create_connection(addr, timeout=timeout).close()
            except ConnectionRefusedError:
                return True
            except OSError:
                return False
            return True

        if not targets:
            return {}
        with ThreadPoolExecutor(max_workers=len(targets)) as pool:
            got = dict(zip(targets, pool.map(reach, targets.values()), strict=True))
        return got


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
        self._lock = threading.Lock()  # one call at a time, whatever Ray's threads
        self.attempt: int | None = None  # the step attempt whose phases run here
        self.reset(settings, placements)

    def reset(self, settings: Any, placements: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """A fresh rank (initial weights, plan version 0) for ``settings``."""
        with self._lock:
            self.attempt = None
            self._reset(settings, placements)

    def _reset(self, settings: Any, placements: list[tuple[np.ndarray, np.ndarray]]) -> None:
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

        self.num_ranks = topo.num_ranks
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

    def phase(
        self, name: str, layer: int, *inbox: Any, arg: Any = None, attempt: int | None = None
    ) -> Any:
        """Phase ``name`` of the current step; ``attempt`` (None outside steps, e.g. a
        migration round): ``begin`` starts it, a phase of any other attempt is dropped
        (it was stuck on a cut link while the step was retried without it)."""
        with self._lock:
            if name == "begin":
                self.attempt = attempt
            elif attempt is not None and attempt != self.attempt:
                log.warning(
                    "rank %d: phase %s of stale attempt %d dropped", self.rank, name, attempt
                )
                return [None] * self.num_ranks if self.num_ranks > 1 else None
            return self._phase(name, layer, inbox, arg)

    def _phase(self, name: str, layer: int, inbox: tuple[Any, ...], arg: Any) -> Any:
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
        with self._lock:
            self.attempt = None  # a control call ends the step attempt (stale phases drop)
            return getattr(self.state, method)(*args)

    def ping(self) -> dict[str, Any]:
        return {"rank": self.state.rank, "node": ray.get_runtime_context().get_node_id()}


class RayExecutor:
    """:class:`expertmesh.workers.engine.Executor` over worker actors (packets as refs).

    Ranks not ``live`` (dead, or cut off) are never called; their packets are ``None``.
    ``deadline_s`` (None: wait for ever) bounds the wait for a step's results; see the
    module docstring."""

    def __init__(
        self,
        workers: list[Any],
        live: np.ndarray | None = None,
        *,
        deadline_s: float | None = None,
        on_stall: Callable[[], bool] | None = None,
        max_stalls: int = 3,
    ) -> None:
        self.workers = workers
        self.num_ranks = len(workers)
        self.live = np.ones(self.num_ranks, bool) if live is None else np.asarray(live, bool)
        self.deadline_s = deadline_s
        self.on_stall = on_stall
        self.max_stalls = max_stalls
        self.attempt: int | None = None  # the step attempt being submitted
        self.stalls = 0  # deadlines missed by the last step

    def phase(self, name: str, layer: int, outs: list[list[Any]] | None, arg: Any = None) -> Any:
        n = self.num_ranks
        if name == "begin":
            self.attempt, self.stalls = next(_ATTEMPTS), 0
        res: list[list[Any]] = []
        for q, w in enumerate(self.workers):
            if not self.live[q]:
                res.append([None] * n)
                continue
            inbox = [outs[p][q] for p in range(n)] if outs else []
            refs = w.phase.options(num_returns=n).remote(
                name, layer, *inbox, arg=arg, attempt=self.attempt
            )
            res.append(refs if n > 1 else [refs])
        return res

    def call_all(self, method: str, *args: Any) -> list[Any]:
        live = [w for w, ok in zip(self.workers, self.live, strict=True) if ok]
        return list(ray.get([w.call.remote(method, *args) for w in live]))

    def results(self, outs: list[list[Any]]) -> list[Any]:
        refs = [outs[q][q] for q in range(self.num_ranks) if self.live[q]]
        if self.deadline_s is None:
            return list(ray.get(refs))
        while True:
            _, rest = ray.wait(refs, num_returns=len(refs), timeout=self.deadline_s)
            if not rest:
                return list(ray.get(refs))
            self.stalls += 1
            cut = self.on_stall is not None and self.on_stall()
            log.warning(
                "step results missing after %d x %.1f s (%d of %d ranks)%s",
                self.stalls, self.deadline_s, len(rest), len(refs),
                ": a link is cut" if cut else "",
            )  # fmt: skip
            if cut or self.stalls >= self.max_stalls:
                self.attempt = None
                raise StepStalled(
                    f"{len(rest)} of {len(refs)} ranks missed the step deadline "
                    f"{self.stalls} x {self.deadline_s:.1f} s"
                    + (" (a DC link is cut)" if cut else "")
                )
