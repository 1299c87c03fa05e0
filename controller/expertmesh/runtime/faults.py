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
masters they held from a live replica (exact weights) or from the newest usable expert
checkpoint on disk (weights and Adam state, written by the driver every
``checkpoint_every`` steps: :mod:`expertmesh.runtime.checkpoint`), and the step runs again
(:attr:`retried_steps`). A paused DC's ranks are never a source during a cut (their link is
down), so their masters are restored the same way as a dead rank's. A dead rank gets a new
worker actor in its DC (``replace_dead_workers``), which rejoins like a paused DC after a
heal (:meth:`Membership.start_replacements`, :meth:`Membership.finish_replacements`).

Which links work is the shaper's record (cuts made through it) and, on a real network,
what the DCs find by probing each other (:meth:`Membership.probe_links`: each DC's
:class:`~expertmesh.runtime.actors.LinkProbe` opens a TCP connection to every other DC's
node, at the port that carries packets between nodes). A real cut makes nothing fail: a
packet that cannot cross waits for ever, so a step is bounded (``step_deadline_s``); when
it is late, or fails, the runtime probes; a cut found there ends the step, which goes
through :meth:`Membership.recover` like a cut made through the shaper. While a probed cut
lasts, the links are probed again before every step; when they work again the paused DCs
rejoin. The driver is taken to run in the controller's DC (DC 0): a DC whose probe does
not answer the driver counts as cut from DC 0.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import numpy as np
import ray

from expertmesh.planner.membership import connected_dcs
from expertmesh.planner.topology import Topology
from expertmesh.runtime.actors import LinkProbe, RayExecutor, StepStalled
from expertmesh.runtime.checkpoint import CheckpointDir, CheckpointError
from expertmesh.workers.engine import step_deadline_seconds

__all__ = ["NAME_WAIT_S", "PING_TIMEOUT_S", "PROBE_SLACK_S", "REPLACE_TIMEOUT_S", "Membership"]

log = logging.getLogger(__name__)
PING_TIMEOUT_S = 5.0  # a worker that does not answer a ping in this time is taken for dead
REPLACE_TIMEOUT_S = 120.0  # a replacement worker that is not up in this time is given up
NAME_WAIT_S = 30.0  # at a step's end, wait this long for Ray to release a dead worker's name
PROBE_SLACK_S = 5.0  # a probe's answer may take this long beyond its connect timeout


class Membership:
    """Mixin of :class:`~expertmesh.runtime.cluster.Runtime`: dead workers, DC cuts, heals,
    the expert checkpoint on disk and replacement workers."""

    settings: Any
    topology: Topology
    workers: list[Any]
    nodes: list[Any]
    controller: Any
    executor: RayExecutor
    shaper: Any
    step: int
    live: np.ndarray  # [R] bool: taking part
    dead: np.ndarray  # [R] bool: the worker died
    paused: np.ndarray  # [R] bool: in a DC cut off from the controller's
    retried_steps: list[int]
    recoveries: list[dict[str, Any]]
    checkpoints: CheckpointDir | None
    checkpoint_log: list[dict[str, Any]]  # every checkpoint written: step, bytes, timings
    run_id: str
    replacements: list[dict[str, Any]]  # every replacement worker started, and how it went
    _starting: dict[int, tuple[Any, Any, float]]  # rank -> (actor, its ping, start clock)
    _rank_bytes: np.ndarray  # [R, K, D, D] bytes each rank's workers counted, cumulative
    _rank_base: np.ndarray  # [R, K, D, D] of those, by the workers a rank had before
    layout: Any  # StepLayout | None: the rounds the committed plan needs (None: every one)
    probes: dict[int, Any]  # DC -> its LinkProbe actor
    probe_targets: dict[int, tuple[str, int]]  # DC -> (address, port) of a node there
    probe_timeout_s: float
    probed_up: np.ndarray  # [D, D] bool: links found working by the last probe
    step_deadline_s: float

    def _start_probes(self) -> None:
        """A :class:`LinkProbe` per DC, and per DC the object manager of its first worker's
        node (what the other DCs' probes connect to)."""
        probe_cls = ray.remote(num_cpus=0)(LinkProbe)
        info = {n["NodeID"]: n for n in ray.nodes()}
        for d, dc in enumerate(self.topology.dcs):
            self.probes[d] = probe_cls.options(label_selector={"dc": dc.name}).remote()
            node = info[self.nodes[int(np.flatnonzero(self.topology.rank_dc == d)[0])]["node"]]
            self.probe_targets[d] = (
                str(node["NodeManagerAddress"]),
                int(node["ObjectManagerPort"]),
            )
        # up before any cut: a probe's first call waits for its actor to start (seconds here)
        ray.get([p.probe.remote({}, 0.1) for p in self.probes.values()])

    def links_up(self) -> np.ndarray:
        """[D, D] bool: links neither cut in the shaper nor found down by a probe."""
        up = np.asarray(self.probed_up, bool).copy()
        if self.shaper is not None:
            up &= self.shaper.links_up()
        return up

    def probe_links(self) -> np.ndarray:
        """[D, D] bool, symmetric: which DC pairs can open a TCP connection right now (both
        ways); a DC whose probe does not answer the driver counts as cut from DC 0."""
        d = self.topology.num_dcs
        up = np.ones((d, d), bool)
        if not self.probes:
            return up
        t0 = time.perf_counter()
        refs = {
            a: p.probe.remote(
                {b: t for b, t in self.probe_targets.items() if b != a}, self.probe_timeout_s
            )
            for a, p in self.probes.items()
        }
        ray.wait(list(refs.values()), num_returns=len(refs),
                 timeout=self.probe_timeout_s + PROBE_SLACK_S, fetch_local=False)  # fmt: skip
        for a, ref in refs.items():
            try:
                got = ray.get(ref, timeout=0)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
                up[a, 0] = up[0, a] = a == 0
                continue
            for b, ok in got.items():
                up[a, int(b)] &= bool(ok)
        up &= up.T
        np.fill_diagonal(up, True)
        log.info("links probed in %.2f s: %s", time.perf_counter() - t0, up.astype(int).tolist())
        return up

    def stall_found_cut(self) -> bool:
        """A step is late: probe the links; True when a cut changes who trains (the step
        then ends and :meth:`recover` runs), False to keep waiting."""
        self.probed_up = self.probe_links()
        keep = connected_dcs(self.links_up(), home=0)
        paused = ~keep[self.topology.rank_dc] & ~self.dead
        return not np.array_equal(paused, self.paused)

    def probe_before_step(self) -> dict[str, Any] | None:
        """While a probed cut lasts: probe again; a link back (or newly down) changes the
        membership (:meth:`recover`, no step to undo). The recovery, or None."""
        if self.probed_up.all():
            return None
        up = self.probe_links()
        if np.array_equal(up, self.probed_up):
            return None
        healed = bool((up & ~self.probed_up).any())
        self.probed_up = up
        return self.recover(
            rollback=False, reason="heal" if healed else "cut", required=False, probe=False
        )

    def _spawn_worker(self, rank: int) -> Any:
        raise NotImplementedError

    def _take_checkpoint(self, version: int) -> None:
        """Write every master (weights, Adam state) of the live workers to the checkpoint
        directory. A worker that died or a failed write skips it (the previous one stays)."""
        if self.checkpoints is None:
            return
        t0 = time.perf_counter()
        try:
            parts = self.executor.call_all("checkpoint")
        except ray.exceptions.RayActorError:  # a worker died: keep the last; the step notices
            log.warning("checkpoint after step %d skipped: a worker died", self.step)
            return
        experts: dict[tuple[int, int], Any] = {}
        for part in parts:
            experts.update(part)
        t1 = time.perf_counter()
        try:
            ck = self.checkpoints.write(
                experts, step=self.step, plan_version=version, run=self.run_id
            )
        except OSError as err:  # e.g. disk full: training goes on; recovery uses an older one
            log.error("checkpoint after step %d not written: %s", self.step, err)
            return
        self.checkpoint_log.append({
            "step": self.step, "path": str(ck.path), "bytes": ck.nbytes,
            "gather_seconds": t1 - t0, "write_seconds": time.perf_counter() - t1,
        })  # fmt: skip

    def _load_checkpoint(self) -> tuple[dict[tuple[int, int], Any], dict[str, Any]]:
        """The newest usable checkpoint of this run on disk (a refused one is logged and the
        previous one used): its experts and ``{"checkpoint_step", "checkpoint", ...}``."""
        if self.checkpoints is None:
            return {}, {"checkpoint_step": None, "checkpoint": None}
        t0 = time.perf_counter()
        try:
            ck = self.checkpoints.load_latest(run=self.run_id)
        except CheckpointError as err:
            log.error("recovery without a checkpoint: %s", err)
            return {}, {"checkpoint_step": None, "checkpoint": None, "checkpoint_error": str(err)}
        info = {"checkpoint_step": ck.step, "checkpoint": ck.path.name,
                "checkpoint_load_seconds": time.perf_counter() - t0}  # fmt: skip
        return dict(ck.experts), info

    def dead_workers(self, among: np.ndarray | None = None) -> list[int]:
        """Live workers (``among`` [R] bool, if given) that no longer answer a ping (within
        ``PING_TIMEOUT_S``)."""
        ask = self.live if among is None else self.live & among
        refs = {r: self.workers[r].ping.remote() for r in np.flatnonzero(ask).tolist()}
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
        self,
        *,
        rollback: bool = True,
        reason: str = "dead",
        required: bool = True,
        probe: bool = True,
    ) -> dict[str, Any] | None:
        """Bring the run to the current membership: find dead workers, pause DCs cut off,
        let healed DCs rejoin; undo the current step on the ranks that go on (``rollback``;
        off between steps), and have the controller plan for the live ranks and restore
        the masters of those that left (from a live replica, else from the newest usable
        checkpoint on disk). Returns what the controller did, with ``seconds``; None when nothing
        changed (``required``: RuntimeError instead, the failure was something else).
        ``probe``: probe the links first (:meth:`probe_links`)."""
        t0 = time.perf_counter()
        if probe:
            self.probed_up = self.probe_links()
        keep = connected_dcs(self.links_up(), home=0)
        # a worker in a DC cut off from the controller's cannot answer a ping: paused, not dead
        dead = self.dead_workers(among=keep[self.topology.rank_dc])
        self.dead[dead] = True
        paused = ~keep[self.topology.rank_dc] & ~self.dead
        live = ~self.dead & ~paused
        rejoin = live & ~self.live
        self.paused = paused
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
        self.live = live
        self.layout = None  # every round until the controller reports the new plan's
        self.executor = self._executor(live)
        self.executor.call_all("set_live", live.tolist())
        excluded = np.flatnonzero(~live).tolist()
        experts, ck_info = self._load_checkpoint()
        out = dict(ray.get(self.controller.recover.remote(excluded, int(steps.pop()) + 1, experts)))
        out.update(ck_info)
        out.update(
            reason=reason,
            step=self.step,
            dead=np.flatnonzero(self.dead).tolist(),
            paused=np.flatnonzero(paused).tolist(),
            rejoined=np.flatnonzero(rejoin).tolist(),
            links_up=self.links_up().astype(int).tolist(),
            seconds=time.perf_counter() - t0,
        )
        self.recoveries.append(out)
        return out

    def start_replacements(self, wait: float = 0.0) -> list[int]:
        """Start a new ``worker-<rank>`` actor, pinned to the rank's DC, for every dead rank
        not being replaced yet (``settings.replace_dead_workers``; only when the DC still
        has an alive node). While Ray still holds the dead actor's name, retry for up to
        ``wait`` seconds (else at the next call). They join at :meth:`finish_replacements`.
        Returns the ranks started."""
        if not self.settings.replace_dead_workers:
            return []
        tried = {int(x["rank"]) for x in self.replacements if x.get("error")}
        todo = [r for r in np.flatnonzero(self.dead).tolist()
                if r not in self._starting and r not in tried]  # fmt: skip
        started: list[int] = []
        deadline = time.monotonic() + wait
        while todo:
            r = todo.pop(0)
            dc = self.topology.dcs[int(self.topology.rank_dc[r])].name
            if not _dc_has_node(dc):
                log.warning("rank %d not replaced: DC %s has no alive node", r, dc)
                self.replacements.append({"rank": r, "step": self.step, "error": "no node"})
                continue
            try:
                actor = self._spawn_worker(r)
            except ValueError as err:  # the dead actor's name is not released yet
                with contextlib.suppress(Exception):
                    ray.kill(self.workers[r], no_restart=True)
                if time.monotonic() < deadline:
                    todo.append(r)
                    time.sleep(0.2)
                else:
                    log.warning("rank %d not replaced yet: %s", r, err)
                continue
            self._starting[r] = (actor, actor.ping.remote(), time.perf_counter())
            started.append(r)
        return started

    def finish_replacements(self) -> dict[str, Any] | None:
        """Wait (up to ``REPLACE_TIMEOUT_S``) for the replacement workers started; those up
        rejoin like a paused DC after a heal (a live rank's dense state and plan, then a plan
        made afresh that gives them copies and masters). Returns the recovery, or None."""
        ready = []
        for r, (actor, ping, t0) in list(self._starting.items()):
            del self._starting[r]
            try:
                node = ray.get(ping, timeout=REPLACE_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                log.error("replacement of rank %d failed: %s", r, err)
                self.replacements.append({"rank": r, "step": self.step, "error": str(err)[:200]})
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
                continue
            self.workers[r], self.nodes[r] = actor, node
            ray.get(self.controller.replace_worker.remote(r, actor))
            self._rank_base[r] = self._rank_bytes[r]  # the old worker's bytes stay counted
            self.dead[r] = False
            self.replacements.append(
                {"rank": r, "step": self.step, "start_seconds": time.perf_counter() - t0}
            )
            ready.append(r)
        if not ready:
            return None
        return self.recover(rollback=False, reason="replace", required=False)

    def _executor(self, live: np.ndarray | None = None) -> RayExecutor:
        """The step executor over the ``live`` ranks, bounded by the step deadline."""
        return RayExecutor(
            self.workers, live, deadline_s=self.step_deadline_s, on_stall=self.stall_found_cut
        )

    def _init_links(self, settings: Any) -> None:
        """Every link taken for working; the step deadline (derived when not set)."""
        d = self.topology.num_dcs
        self.probed_up = np.ones((d, d), bool)
        self.probe_timeout_s = settings.probe_timeout_s
        self.step_deadline_s = settings.step_deadline_s or step_deadline_seconds(
            self.topology, settings.lm
        )

    def recover_step(self, err: BaseException) -> dict[str, Any] | None:
        """The current step failed (``err``) or stalled on a cut (:class:`StepStalled`, the
        links just probed): :meth:`recover` with the step undone. None: nothing changed."""
        stalled = isinstance(err, StepStalled)
        reason = "step stalled" if stalled else "step failed"
        return self.recover(rollback=True, reason=reason, required=False, probe=not stalled)

    def inject_worker_exit(self, rank: int, step: int, phase: str) -> None:
        """Fault injection: worker ``rank`` exits when ``phase`` of ``step`` starts."""
        ray.get(self.workers[rank].inject_exit.remote(step, phase))

    def expert_weights(self, rank: int, layer: int, expert: int) -> list[np.ndarray] | None:
        """Rank ``rank``'s copy of ``expert`` of ``layer``, or None."""
        w = ray.get(self.workers[rank].call.remote("expert_weights", layer, expert))
        return None if w is None else list(w)


def _dc_has_node(name: str) -> bool:
    """Whether an alive Ray node is labeled ``dc=<name>``."""
    return any(n.get("Alive") and n.get("Labels", {}).get("dc") == name for n in ray.nodes())
