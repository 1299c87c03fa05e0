"""Who trains on the SPMD data plane: dead workers left out, DCs cut off and healed.

A rank takes part (is a *member*) unless its worker died and is not replaced
(``replace_dead_workers`` off: ``demo --no-replace``) or its DC is *paused*. DC pairs are
cut through the link shaper (:meth:`SpmdMembership.cut` / :meth:`SpmdMembership.heal`),
or in the network itself: a collective across a real cut waits, and fails at the process
groups' timeout; a cut only in the shaper's file fails the sender at once
(:class:`~expertmesh.workers.shaper.LinkDown`). Which links work is the shaper's record
AND what the DCs find by probing each other (each DC's worker opens a TCP connection to
every other DC's node, at Ray's object manager port; a DC that does not answer the
driver counts as cut from DC 0). The DCs that keep training are
:func:`~expertmesh.planner.membership.connected_dcs` of those links from the controller's
DC (dense gradients cross between every pair of DC leaders); the others pause: their
workers keep their state, compute nothing and are out of the process groups.

Every change of members (:meth:`SpmdMembership.change_members`) runs the same way: the
ranks that leave leave their groups (the dead ones are killed), the members form new ones
(world, DC, aux and leader groups over the members only), rejoining ranks take a live
rank's dense state, counters and committed plan (their expert copies are stale and
dropped), and the controller plans for the members and commits once every member applied
the plan (:mod:`expertmesh.runtime.membership`): copies from ranks that trained until
now, what none of them holds from the newest checkpoint on disk. A step that failed runs
again. While a probed cut lasts, the links are probed again before every chunk of steps;
when they work again the paused DCs rejoin. Every wait is bounded.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import ray

from expertmesh.planner import Topology
from expertmesh.planner.membership import connected_dcs
from expertmesh.runtime.checkpoint import CheckpointDir, CheckpointError
from expertmesh.runtime.spmd_faults import PING_TIMEOUT_S, SpmdFaults, WorkersFailed
from expertmesh.workers.shaper import LinkShaper

__all__ = ["PROBE_SLACK_S", "SpmdMembership"]

log = logging.getLogger(__name__)
PROBE_SLACK_S = 5.0  # a probe's answer may take this long beyond its connect timeout
CALL_WAIT_S = 30.0  # a control call to a worker (leave, where) that takes longer is given up


class SpmdMembership:
    """Mixin of :class:`~expertmesh.runtime.spmd.SpmdRuntime` (module docstring)."""

    settings: Any
    topology: Topology
    workers: list[Any]
    nodes: list[Any]
    controller: Any
    step: int
    checkpoints: CheckpointDir | None
    recoveries: list[dict[str, Any]]
    retried_steps: list[int]
    run_id: str
    group_timeout_s: float
    _shaper: str | None

    def _form_group(self, members: list[int] | None = None) -> None:
        raise NotImplementedError

    def _init_members(self) -> None:
        r, d = self.topology.num_ranks, self.topology.num_dcs
        self.live = np.ones(r, bool)  # [R] taking part
        self.dead = np.zeros(r, bool)  # [R] the worker died (and was not replaced)
        self.paused = np.zeros(r, bool)  # [R] in a DC cut off from the controller's
        self.probed_up = np.ones((d, d), bool)
        self.links = (
            LinkShaper.from_topology(self.topology, path=self._shaper) if self._shaper else None
        )
        info = {n["NodeID"]: n for n in ray.nodes()}
        self.probe_targets: dict[int, tuple[str, int]] = {}
        for dc in range(d):
            node = info[self.nodes[int(np.flatnonzero(self.topology.rank_dc == dc)[0])]["node"]]
            self.probe_targets[dc] = (
                str(node["NodeManagerAddress"]),
                int(node["ObjectManagerPort"]),
            )

    def members(self) -> list[int]:
        return np.flatnonzero(self.live).tolist()

    def live_workers(self) -> list[Any]:
        return [self.workers[r] for r in self.members()]

    def dense(self, rank: int) -> list[np.ndarray]:
        """Rank ``rank``'s dense weights (numpy)."""
        return list(ray.get(self.workers[rank].dense.remote(), timeout=CALL_WAIT_S))

    # ---- links ----

    def links_up(self) -> np.ndarray:
        """[D, D] bool: links neither cut in the shaper nor found down by a probe."""
        up = self.probed_up.copy()
        if self.links is not None:
            up &= self.links.links_up()
        return up

    def probe_links(self) -> np.ndarray:
        """[D, D] bool, symmetric: which DC pairs open a TCP connection now (both ways).
        Every worker not known dead probes from its DC (bounded); a worker found dead on
        the way is marked so; a DC none of whose workers answers counts as cut from DC 0."""
        d = self.topology.num_dcs
        up = np.ones((d, d), bool)
        timeout = float(self.settings.probe_timeout_s)
        refs: dict[int, list[tuple[int, Any]]] = {}
        for r in np.flatnonzero(~self.dead).tolist():
            a = int(self.topology.rank_dc[r])
            targets = {b: t for b, t in self.probe_targets.items() if b != a}
            refs.setdefault(a, []).append((r, self.workers[r].probe.remote(targets, timeout)))
        every = [ref for rs in refs.values() for _, ref in rs]
        ray.wait(every, num_returns=len(every), timeout=timeout * d + PROBE_SLACK_S)
        for a, rs in refs.items():
            got = None
            for r, ref in rs:
                try:
                    got = ray.get(ref, timeout=0)
                    break
                except ray.exceptions.RayActorError:
                    self.dead[r] = True
                except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
                    pass
            if got is None:
                up[a, 0] = up[0, a] = a == 0 or not rs
                continue
            for b, ok in got.items():
                up[a, int(b)] &= bool(ok)
        up &= up.T
        np.fill_diagonal(up, True)
        return up

    def cut(self, a: int, b: int) -> dict[str, Any] | None:
        """Cut the link between DCs ``a`` and ``b`` in the shaper (both ways) and pause the
        DCs that can no longer train with the controller's; the change, or None."""
        if self.links is None:
            raise ValueError("the runtime has no link shaper (settings.shaper off)")
        self.links.cut(a, b)
        return self.change_members(reason="cut")

    def heal(self, a: int, b: int) -> dict[str, Any] | None:
        """Heal the link between DCs ``a`` and ``b``: paused DCs that can train again
        rejoin. The change, or None."""
        if self.links is None:
            raise ValueError("the runtime has no link shaper (settings.shaper off)")
        self.links.heal(a, b)
        return self.change_members(reason="heal")

    def probe_before_chunk(self) -> dict[str, Any] | None:
        """While a probed cut lasts: probe again; a link back (or newly down) changes the
        members. The change, or None."""
        if self.probed_up.all():
            return None
        up = self.probe_links()
        if np.array_equal(up, self.probed_up):
            return None
        healed = bool((up & ~self.probed_up).any())
        self.probed_up = up
        return self.change_members(reason="heal" if healed else "cut", probe=False)

    # ---- members ----

    def dead_workers(self, among: np.ndarray | None = None) -> list[int]:
        """Workers (``among`` [R] bool; default: the members) that do not answer a ping
        within ``PING_TIMEOUT_S``."""
        ask = self.live if among is None else among
        refs = {r: self.workers[r].ping.remote() for r in np.flatnonzero(ask).tolist()}
        dead = []
        for r, ref in refs.items():
            try:
                ray.get(ref, timeout=PING_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(r)
        return dead

    def who_trains(self, *, probe: bool = True) -> tuple[np.ndarray, list[int]]:
        """[R] bool the ranks that can train now, and the ranks found dead (probing the links
        first when ``probe``)."""
        known = self.dead.copy()
        if probe:
            self.probed_up = self.probe_links()  # marks workers found dead on the way
        keep = connected_dcs(self.links_up(), home=0)[self.topology.rank_dc]
        self.dead[self.dead_workers(among=keep & ~self.dead)] = True
        return keep & ~self.dead, np.flatnonzero(self.dead & ~known).tolist()

    def recover(self, failed: WorkersFailed) -> dict[str, Any]:
        """A step failed (``failed``: :class:`~expertmesh.runtime.spmd_faults.WorkersFailed`):
        find out who can train now. Dead workers are replaced when asked to and no DC is
        paused (:meth:`SpmdFaults.recover`); otherwise the members change."""
        t0 = time.perf_counter()
        live, dead = self.who_trains(probe=True)
        if dead and self.settings.replace_dead_workers and (live | self.dead).all():
            self.dead[dead] = False
            return SpmdFaults.recover(self, failed)  # type: ignore[arg-type]
        if np.array_equal(live, self.live):
            raise RuntimeError(f"step {failed.failed_at} failed with every member alive: {failed}")
        reason = "dead" if dead else "cut"
        return self._reshape(live, dead, reason, int(failed.failed_at), t0)

    def change_members(
        self, *, reason: str, failed_at: int | None = None, probe: bool = True
    ) -> dict[str, Any] | None:
        """Bring the run to the ranks that can train now (module docstring). ``failed_at``:
        the step that failed on the members (to run again; their state is that of the step
        before). The record of the change, or None when the members stay the same."""
        t0 = time.perf_counter()
        live, dead = self.who_trains(probe=probe)
        if np.array_equal(live, self.live):
            return None
        return self._reshape(live, dead, reason, failed_at, t0)

    def _reshape(
        self, live: np.ndarray, dead: list[int], reason: str, failed_at: int | None, t0: float
    ) -> dict[str, Any]:
        stay = live & self.live
        if not stay.any():
            raise RuntimeError("no rank that trained until now is left to train")
        rejoin, members = live & ~self.live, np.flatnonzero(live).tolist()
        log.warning(
            "step %d: members change (%s): dead %s, paused %s, rejoining %s",
            self.step + 1, reason, dead, np.flatnonzero(~live & ~self.dead).tolist(),
            np.flatnonzero(rejoin).tolist(),
        )  # fmt: skip
        for r in dead:
            ray.kill(self.workers[r], no_restart=True)
        leave = [
            self.workers[r].leave.remote() for r in np.flatnonzero(self.live & ~live & ~self.dead)
        ]
        ray.wait(leave, num_returns=len(leave), timeout=CALL_WAIT_S)
        sources = np.flatnonzero(stay).tolist()
        at = ray.get([self.workers[r].where.remote() for r in sources], timeout=CALL_WAIT_S)
        if len({(w["step"], w["version"]) for w in at}) != 1:
            raise RuntimeError(f"the ranks that go on disagree on step and plan: {at}")
        step, version = int(at[0]["step"]), int(at[0]["version"])
        if step != self.step:
            raise RuntimeError(f"the ranks that go on trained to step {step}, not {self.step}")
        self._form_group(members)
        t1 = time.perf_counter()
        plan = ray.get(
            self.controller.membership_plan.remote(members, sources, step + 1, version),
            timeout=CALL_WAIT_S * 4,
        )
        seeds, ck_step = self._seeds(plan["restore"])
        state = None
        if rejoin.any():  # a live rank's dense state, counters and committed plan
            state = ray.get(self.workers[sources[0]].export_state.remote(), timeout=CALL_WAIT_S)
        refs = [
            self.workers[r].reshape.remote(plan, seeds.get(r, {}), state if rejoin[r] else None)
            for r in members
        ]
        sent = np.sum(ray.get(refs, timeout=self.group_timeout_s * 2), axis=0)
        ray.get(
            self.controller.membership_done.remote(
                plan["version"], members, self.workers, step + 1
            ),
            timeout=CALL_WAIT_S,
        )
        self.paused = ~live & ~self.dead
        self.live = live
        rec = {
            "reason": reason,
            "step": step + 1,
            "failed_step": failed_at,
            "dead": np.flatnonzero(self.dead).tolist(),
            "paused": np.flatnonzero(self.paused).tolist(),
            "rejoined": np.flatnonzero(rejoin).tolist(),
            "members": members,
            "links_up": self.links_up().astype(int).tolist(),
            "version": plan["version"],
            "copies_from_live": sum(len(r) for r in plan["rounds"]),
            "restored_from_checkpoint": sum(1 for x in plan["restore"] if x[3] == "w"),
            "adam_from_checkpoint": sum(1 for x in plan["restore"] if x[3] == "opt"),
            "checkpoint_step": ck_step,
            "migration_bytes": np.asarray(sent).tolist(),
            "plan_seconds": time.perf_counter() - t1,
            "seconds": time.perf_counter() - t0,
        }
        self.recoveries.append(rec)
        return rec

    def _seeds(
        self, restore: list[tuple[int, int, int, str]]
    ) -> tuple[dict[int, dict[tuple[int, int], tuple[Any, Any]]], int | None]:
        """Per rank, what ``restore`` asks of the newest usable checkpoint on disk:
        ``(layer, expert) -> (weights | None, (m, v) | None)``; and its step."""
        if not restore:
            return {}, None
        if self.checkpoints is None:
            raise RuntimeError("members left holding what no live rank has, and no checkpoint")
        try:
            ck = self.checkpoints.load_latest(run=self.run_id)
        except CheckpointError as err:
            raise RuntimeError(f"no usable checkpoint to restore from: {err}") from err
        seeds: dict[int, dict[tuple[int, int], tuple[Any, Any]]] = {}
        for layer, e, r, kind in restore:
            if (layer, e) not in ck.experts:
                raise ValueError(f"expert {layer}/{e}: no live copy and no usable checkpoint")
            w, m, v = ck.experts[(layer, e)]
            old_w, old_mv = seeds.setdefault(r, {}).get((layer, e), (None, None))
            seeds[r][(layer, e)] = (w, old_mv) if kind == "w" else (old_w, (m, v))
        return seeds, ck.step
