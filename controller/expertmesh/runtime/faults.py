"""Membership changes of a running :class:`~expertmesh.runtime.cluster.Runtime`: workers that
die, DCs cut off and healed.

A rank takes part (is *live*) unless its worker died or its DC is *paused*: when DC pairs
are cut (:meth:`Membership.cut`, the link shaper drops the pair), the DCs that keep
training are :func:`expertmesh.planner.membership.connected_dcs` of the working links
from the controller's DC (the first); the others pause, keep their state, and rejoin when
the links heal (:meth:`Membership.heal`). Data-parallel dense gradients are summed over
the live DCs only, so the DCs that go on train as one smaller data-parallel group; a paused
DC's dense weights go stale and are replaced on rejoin by a live rank's (weights, Adam
state, step counters).

Every change runs :meth:`Membership.recover`: the survivors undo the step that failed (if
one did), the controller plans with the non-live ranks planned out and restores the
masters they held from a live replica (exact weights) or from the driver's last checkpoint
(weights and Adam state, every ``checkpoint_every`` steps), and the step runs again
(:attr:`retried_steps`). A paused DC's ranks are never a source during a cut (their link is
down), so their masters are restored the same way as a dead rank's.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import ray

from expertmesh.planner.membership import connected_dcs
from expertmesh.planner.topology import Topology
from expertmesh.runtime.actors import RayExecutor

__all__ = ["PING_TIMEOUT_S", "Membership"]

log = logging.getLogger(__name__)
PING_TIMEOUT_S = 5.0  # a worker that does not answer a ping in this time is taken for dead


class Membership:
    """Mixin of :class:`~expertmesh.runtime.cluster.Runtime`: dead workers, DC cuts, heals."""

    topology: Topology
    workers: list[Any]
    controller: Any
    executor: RayExecutor
    shaper: Any
    step: int
    live: np.ndarray  # [R] bool: taking part
    dead: np.ndarray  # [R] bool: the worker died
    paused: np.ndarray  # [R] bool: in a DC cut off from the controller's
    retried_steps: list[int]
    recoveries: list[dict[str, Any]]
    checkpoint: dict[tuple[int, int], Any]
    checkpoint_step: int

    def _take_checkpoint(self) -> None:
        """Copy every master (weights, Adam state) from the live workers to the driver."""
        ckpt: dict[tuple[int, int], Any] = {}
        try:
            parts = self.executor.call_all("checkpoint")
        except ray.exceptions.RayActorError:  # a worker died: keep the last; the step notices
            log.warning("checkpoint after step %d skipped: a worker died", self.step)
            return
        for part in parts:
            ckpt.update(part)
        self.checkpoint, self.checkpoint_step = ckpt, self.step

    def dead_workers(self) -> list[int]:
        """Live workers that no longer answer a ping (within ``PING_TIMEOUT_S``)."""
        refs = {r: self.workers[r].ping.remote() for r in np.flatnonzero(self.live).tolist()}
        dead = []
        for r, ref in refs.items():
            try:
                ray.get(ref, timeout=PING_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(r)
        return dead

    def cut(self, a: int, b: int) -> dict[str, Any] | None:
        """Cut the link between DCs ``a`` and ``b`` (the shaper drops the pair) and pause
        the DCs that can no longer train with the controller's. Returns the recovery, or
        None when every DC still trains."""
        if self.shaper is None:
            raise ValueError("the runtime is not started")
        self.shaper.cut(a, b)
        return self.recover(rollback=False, reason="cut", required=False)

    def heal(self, a: int, b: int) -> dict[str, Any] | None:
        """Heal the link between DCs ``a`` and ``b``; paused DCs that can train again
        rejoin (a live rank's dense state, then a plan that gives them copies)."""
        if self.shaper is None:
            raise ValueError("the runtime is not started")
        self.shaper.heal(a, b)
        return self.recover(rollback=False, reason="heal", required=False)

    def recover(
        self, *, rollback: bool = True, reason: str = "dead", required: bool = True
    ) -> dict[str, Any] | None:
        """Bring the run to the current membership: find dead workers, pause DCs cut off,
        let healed DCs rejoin; undo the current step on the ranks that go on (``rollback``;
        off between steps), and have the controller plan for the live ranks and restore
        the masters of those that left (from a live replica, else from the driver's last
        checkpoint). Returns what the controller did, with ``seconds``; None when nothing
        changed (``required``: RuntimeError instead, the failure was something else)."""
        t0 = time.perf_counter()
        dead = self.dead_workers()
        self.dead[dead] = True
        keep = connected_dcs(self.shaper.links_up(), home=0)
        paused = ~keep[self.topology.rank_dc] & ~self.dead
        live = ~self.dead & ~paused
        rejoin = live & ~self.live
        if np.array_equal(live, self.live):
            if required:
                raise RuntimeError(f"step {self.step} failed but every live worker answers")
            return None
        if not live.any():
            raise RuntimeError("no worker is left to train")
        stay = live & self.live
        log.warning(
            "step %d: membership change (%s): dead %s, paused %s, rejoining %s",
            self.step, reason, dead, np.flatnonzero(paused).tolist(),
            np.flatnonzero(rejoin).tolist(),
        )  # fmt: skip
        stay_ex = RayExecutor(self.workers, stay)
        steps = set(stay_ex.call_all("rollback_step") if rollback else [self.step])
        if len(steps) != 1:
            raise RuntimeError(f"ranks disagree on the last step after rollback: {steps}")
        if rejoin.any():  # a live rank's dense weights, Adam state, counters and plan
            src = self.workers[int(np.flatnonzero(stay)[0])]
            state = ray.get(src.call.remote("export_dense"))
            ray.get([self.workers[r].call.remote("adopt", state) for r in np.flatnonzero(rejoin)])
        self.live, self.paused = live, paused
        self.executor = RayExecutor(self.workers, live)
        self.executor.call_all("set_live", live.tolist())
        excluded = np.flatnonzero(~live).tolist()
        out = dict(
            ray.get(self.controller.recover.remote(excluded, int(steps.pop()) + 1, self.checkpoint))
        )
        out.update(
            reason=reason,
            step=self.step,
            dead=np.flatnonzero(self.dead).tolist(),
            paused=np.flatnonzero(paused).tolist(),
            rejoined=np.flatnonzero(rejoin).tolist(),
            checkpoint_step=self.checkpoint_step,
            seconds=time.perf_counter() - t0,
        )
        self.recoveries.append(out)
        return out

    def inject_worker_exit(self, rank: int, step: int, phase: str) -> None:
        """Fault injection: worker ``rank`` exits when ``phase`` of ``step`` starts."""
        ray.get(self.workers[rank].inject_exit.remote(step, phase))

    def expert_weights(self, rank: int, layer: int, expert: int) -> list[np.ndarray] | None:
        """Rank ``rank``'s copy of ``expert`` of ``layer``, or None."""
        w = ray.get(self.workers[rank].call.remote("expert_weights", layer, expert))
        return None if w is None else list(w)
