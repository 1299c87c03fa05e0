"""Faults of the SPMD data plane: a dead worker, and the expert checkpoint on disk.

A worker that dies mid-step takes its process group down with it: the survivors' next
collective fails (a closed connection, or the group's timeout), each undoes the step it
was in (:class:`~expertmesh.workers.spmd.RankSnapshot`) and returns. The driver then
(:meth:`SpmdFaults.recover`) finds the dead ranks by ping, starts a replacement for each in
its DC (the same ``worker-<rank>`` name), re-forms the process groups with every rank,
and the replacement takes a live rank's dense state and plan; its expert copies come from
the nearest live holder over the new group, and what no live rank holds (an expert whose
every copy died, the Adam state of a master that died) from the newest checkpoint on disk.
Then the failed step runs again. The committed plan does not change: the replacement
holds exactly what the dead rank held, so no token is routed differently.

The checkpoint is written by the driver between chunks of ``checkpoint_every`` steps
(every master's weights and Adam state, gathered through Ray off the data path, and what a
new driver needs to resume the run: :mod:`expertmesh.runtime.resume`), and once before the
first step, so a death in step 0 recovers like any other.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import numpy as np
import ray

from expertmesh.planner import Placement, Topology
from expertmesh.runtime.checkpoint import CheckpointDir, CheckpointError
from expertmesh.runtime.resume import resume_payload

__all__ = ["PING_TIMEOUT_S", "SpmdFaults", "WorkersFailed"]

log = logging.getLogger(__name__)
PING_TIMEOUT_S = 5.0  # a worker that does not answer a ping in this time is taken for dead
NAME_WAIT_S = 60.0  # wait this long for Ray to release a dead worker's name


class WorkersFailed(RuntimeError):
    """A step failed on some ranks (``failed_at``: the step to run again)."""

    def __init__(self, failed_at: int, detail: str) -> None:
        super().__init__(f"step {failed_at} failed: {detail}")
        self.failed_at = failed_at


class SpmdFaults:
    """Mixin of :class:`~expertmesh.runtime.spmd.SpmdRuntime`."""

    settings: Any
    topology: Topology
    workers: list[Any]
    controller: Any
    step: int
    checkpoints: CheckpointDir | None
    checkpoint_log: list[dict[str, Any]]
    recoveries: list[dict[str, Any]]
    run_id: str

    def _spawn(self, rank: int) -> Any:
        raise NotImplementedError

    def members(self) -> list[int]:
        raise NotImplementedError

    def _form_group(self) -> None:
        raise NotImplementedError

    def live_workers(self) -> list[Any]:
        """The workers of the ranks taking part (a paused one's masters are stale)."""
        return self.workers

    def take_checkpoint(self, ends: list[dict[str, Any]] | None = None) -> None:
        """Every master's weights and Adam state to the checkpoint directory (a failed
        gather or write keeps the previous one). ``ends``: what the workers returned at
        the end of the chunk just run (``SpmdWorker.run``: every worker's masters, one's
        dense state and plan, taken at that step boundary); None: gathered from them now
        (they must not be training)."""
        if self.checkpoints is None:
            return
        t0 = time.perf_counter()
        if ends is not None:
            state = next(e["state"] for e in ends if "state" in e)
            parts = [e["masters"] for e in ends]
        else:
            try:
                live = self.live_workers()
                state = ray.get(live[0].export_state.remote())  # dense, plan, counters
                parts = ray.get([w.masters.remote() for w in live])
            except ray.exceptions.RayActorError:
                log.warning("checkpoint after step %d skipped: a worker died", self.step)
                return
        experts: dict[tuple[int, int], Any] = {}
        for part in parts:
            experts.update(part)
        extra, arrays = resume_payload(state, self.settings, self.members())
        t1 = time.perf_counter()
        try:
            ck = self.checkpoints.write(
                experts, step=self.step, plan_version=int(state["version"]), run=self.run_id,
                extra=extra, arrays=arrays,
            )  # fmt: skip
        except OSError as err:
            log.error("checkpoint after step %d not written: %s", self.step, err)
            return
        self.checkpoint_log.append({
            "step": self.step, "path": str(ck.path), "bytes": ck.nbytes,
            "gather_seconds": t1 - t0, "write_seconds": time.perf_counter() - t1,
        })  # fmt: skip

    def dead_workers(self, among: Any = None) -> list[int]:
        raise NotImplementedError  # SpmdMembership: pings the members

    def recover(self, failed: WorkersFailed) -> dict[str, Any]:
        """Replace the dead workers and refill them (module docstring); the step to run
        again is ``failed.failed_at``."""
        t0 = time.perf_counter()
        dead = self.dead_workers()
        if not dead:
            raise RuntimeError(f"step {failed.failed_at} failed with every worker alive: {failed}")
        live = [r for r in range(self.topology.num_ranks) if r not in dead]
        for r in dead:
            ray.kill(self.workers[r], no_restart=True)
        for r in dead:
            self.workers[r] = self._spawn_named(r)
        self._form_group()
        state = ray.get(self.workers[live[0]].export_state.remote())
        placements = [Placement(np.asarray(p), np.asarray(m)) for p, m, _ in state["layers"]]
        transfers, seeds, info = self._refill_plan(placements, dead, live)
        refs = [
            w.refill.remote(
                transfers, state if r in dead else None, seeds.get(r) if r in dead else None
            )
            for r, w in enumerate(self.workers)
        ]
        ray.get(refs)
        ray.get(self.controller.replace_workers.remote(self.workers, dead))
        rec = {
            "failed_step": failed.failed_at,
            "dead": dead,
            "seconds": time.perf_counter() - t0,
            "copies_from_live": len(transfers),
            **info,
        }
        self.recoveries.append(rec)
        log.warning("recovered from the death of ranks %s at step %d", dead, failed.failed_at)
        return rec

    def _spawn_named(self, rank: int) -> Any:
        deadline = time.monotonic() + NAME_WAIT_S
        while True:
            try:
                return self._spawn(rank)
            except ValueError:  # the dead actor's name is not released yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _refill_plan(
        self, placements: list[Placement], dead: list[int], live: list[int]
    ) -> tuple[list[tuple[int, int, int, int, str]], dict[int, dict[Any, Any]], dict[str, Any]]:
        """Copies for the replacements from the nearest live holder, the rest (and the Adam
        state of masters on dead ranks) from the newest checkpoint."""
        transfers: list[tuple[int, int, int, int, str]] = []
        need: dict[int, list[tuple[int, int, bool]]] = {}  # rank -> (layer, e, weights too)
        alive = np.zeros(self.topology.num_ranks, bool)
        alive[live] = True
        for layer, p in enumerate(placements):
            holds, master = p.holds(), p.master_rank()
            for r in dead:
                for e in np.flatnonzero(holds[r]).tolist():
                    src = np.flatnonzero(holds[:, e] & alive)
                    if src.size:
                        near = src[np.argmin(self.topology.distance(src, np.full_like(src, r)))]
                        transfers.append((layer, e, int(near), r, "w"))
                    if master[e] == r or not src.size:
                        need.setdefault(r, []).append((layer, e, not src.size))
        seeds: dict[int, dict[Any, Any]] = {}
        info: dict[str, Any] = {"checkpoint_step": None, "restored_from_checkpoint": 0}
        if need:
            if self.checkpoints is None:
                raise RuntimeError("ranks died holding masters and there is no checkpoint")
            try:
                ck = self.checkpoints.load_latest(run=self.run_id)
            except CheckpointError as err:
                raise RuntimeError(f"no usable checkpoint to restore from: {err}") from err
            info["checkpoint_step"] = ck.step
            for r, keys in need.items():
                for layer, e, whole in keys:
                    if (layer, e) not in ck.experts:
                        raise ValueError(f"expert {layer}/{e}: no live copy and no checkpoint")
                    seeds.setdefault(r, {})[(layer, e)] = ck.experts[(layer, e)]
                    info["restored_from_checkpoint"] += int(whole)
        return transfers, seeds, info


def new_run_id() -> str:
    return uuid.uuid4().hex
