"""The controller actor's side of the SPMD data plane: steps recorded, plans offered.

Step reports stream in from every rank (fire and forget); a step is recorded once every
member's report is in (in step order): its load goes to the core (per DC windows by
default, :mod:`expertmesh.runtime.loads`), the trigger may plan, a new plan is offered to
every worker, and the step whose reports say the workers switched commits it in the core.
A mixin of :class:`~expertmesh.runtime.controller.ControllerActor`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from expertmesh.controller.core import ControllerCore
from expertmesh.controller.telemetry import Telemetry
from expertmesh.planner import Placement, Topology, imbalance
from expertmesh.planner.rounds import migration_rounds
from expertmesh.runtime.loads import LoadIngest
from expertmesh.runtime.settings import RuntimeSettings, initial_placements
from expertmesh.runtime.stepstats import per_microbatch, planner_level, switch_summary
from expertmesh.runtime.trace import migration_collectives

__all__ = ["SpmdSteps"]

log = logging.getLogger(__name__)


class SpmdSteps:
    """The controller's side of the SPMD data plane (a mixin of :class:`ControllerActor`):
    step reports stream in from every rank (fire and forget), a step is recorded once
    every rank's report is in (in step order), the load feeds the core, the trigger may
    plan, and a new plan is offered to every worker; the workers switch at a boundary
    they agree on, and the step whose reports say so commits it in the core."""

    core: ControllerCore
    settings: RuntimeSettings
    telemetry: Telemetry
    topology: Topology
    placements: list[Placement]
    errors: int
    store: Any
    _crash_at: str | None

    if TYPE_CHECKING:  # ControllerActor's and Reattach's (the actor has all three)

        def _maybe_crash(self, at: str) -> None: ...

        def _maybe_repair(self) -> None: ...

    def spmd_reset(self, workers: list[Any], members: list[int], backend: str) -> None:
        self._spmd_workers, self._members, self._backend = workers, sorted(members), backend
        self._reports: dict[int, dict[int, dict[str, Any]]] = {}
        self._results: list[dict[str, Any]] = []
        self._next_step: int | None = None
        self._offered: Any = None  # the plan offered and not yet committed
        self._offer_calls: list[Any] = []  # offer_plan calls not known to have returned
        self._bytes = np.zeros((3, self.topology.num_dcs, self.topology.num_dcs), np.int64)
        self._rank_bytes: dict[int, np.ndarray] = {}
        self._spmd_lock = threading.Lock()
        self._static_owner = initial_placements(
            self.topology, self.settings.lm, self.settings.layout
        )[0].master_rank()
        if not hasattr(self, "_trace"):  # kept across a re-formed group (recovery)
            self._trace: dict[str, dict[int, Any]] = _empty_trace()
        self.loads = LoadIngest(self.core, self.settings)
        for r in range(self.topology.num_ranks):
            self.telemetry.set_worker_state(r, r in self._members)

    def step_report(self, rank: int, stats: dict[str, Any]) -> None:
        """Rank ``rank``'s report of one step (:meth:`SpmdRank.stats` plus timings)."""
        with self._spmd_lock:
            step = int(stats["step"])
            if self._next_step is None:
                self._next_step = step
            if step < self._next_step or rank not in self._members:
                return  # a step already recorded (a failed attempt's), or not a member
            self._reports.setdefault(step, {})[rank] = stats
            self._drain()

    def _drain(self) -> None:
        """Record every step, in order, whose members have all reported (lock held)."""
        assert self._next_step is not None
        while set(self._members) <= set(self._reports.get(self._next_step, {})):
            got = self._reports.pop(self._next_step)
            done = {r: got[r] for r in self._members}
            try:
                self._finish_step(self._next_step, done)
            except Exception:
                self.errors += 1
                log.exception("recording step %d failed", self._next_step)
            self._next_step += 1

    def _finish_step(self, step: int, reports: dict[int, dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        ranks = sorted(reports)
        num_layers = self.settings.lm.num_layers
        self.loads.record(step, reports)  # the DC leads' windows (or every rank's load)
        applied = {(reports[r]["applied"] or {}).get("version") for r in ranks} - {None}
        migration = np.zeros_like(self._bytes[0])
        if applied and self._offered is not None and self._offered.version in applied:
            pv = self._offered
            self._maybe_crash("applied")  # fault injection: the workers run it, the store not
            self.core.commit(pv.version)
            self.placements = [lp.placement for lp in pv.layers]
            self._offered = None
        delta = np.zeros_like(self._bytes)  # [3, D, D]
        rank_dc = self.topology.rank_dc
        for r in ranks:  # cumulative per rank; a replacement worker counts from zero again
            cur = np.asarray(reports[r]["bytes"])  # [3, D]: sent from the rank's DC
            prev = self._rank_bytes.get(r, np.zeros_like(cur))
            delta[:, rank_dc[r]] += cur - prev if (cur >= prev).all() else cur
            self._rank_bytes[r] = cur
        self._bytes += delta
        migration = delta[2]
        computed = np.zeros((self.topology.num_ranks, num_layers), np.int64)
        load = self.loads.world_load(reports)  # [L, E]
        for r in ranks:
            computed[r] = reports[r]["computed"]
        if all("load" in reports[r] for r in ranks):  # rank mode, or a trace_dir asked for it
            per_rank = np.zeros(
                (num_layers, self.topology.num_ranks, self.settings.lm.num_experts), np.int64
            )
            for r in ranks:
                per_rank[:, r] = np.asarray(reports[r]["load"])
            self._trace["load"][step] = per_rank  # runtime/trace.py takes it
        self._trace["counters"][step] = {  # cumulative per rank: collectives, shaper waits, CPU
            r: (
                int(reports[r].get("collectives", 0)),
                float(reports[r].get("shaped_seconds", 0)),
                float(reports[r].get("cpu_seconds", 0)),
            )
            for r in ranks
        }
        self._trace["crossed"][step] = crossed_by_collective(
            {r: reports[r].get("crossed", []) for r in ranks}, self.topology.rank_dc
        )
        static = np.zeros((num_layers, self.topology.num_ranks), np.int64)
        for layer in range(num_layers):
            np.add.at(static[layer], self._static_owner, load[layer])
        alive = np.asarray(ranks)
        seconds = max(float(reports[r]["wall_seconds"]) for r in ranks)
        per_mb = np.stack([np.asarray(reports[r]["computed_mb"]) for r in ranks])  # [R', k, L]
        measured, within, floor = per_microbatch(per_mb, self.topology.rank_dc[alive])
        planner = self._planner_level(reports, ranks)
        loss = float(sum(reports[r]["loss"] for r in ranks))
        self.telemetry.record_step(
            step, seconds, loss, computed.sum(axis=1),
            cross_dc_token_bytes=delta[0], cross_dc_weight_bytes=delta[1] + migration,
        )  # fmt: skip
        out: dict[str, Any] = {}
        if self._offered is None:
            out = self._offer(step)
        self._results.append(
            {
                "step": step,
                "loss": loss,
                "step_seconds": max(float(reports[r]["seconds"]["step"]) for r in ranks),
                "seconds": seconds,
                "control_seconds": time.perf_counter() - t0,
                "imbalance": max(max(row) for row in measured),  # worst microbatch and layer
                "imbalance_microbatches": measured,  # [k][L]
                "imbalance_within_dc": within,  # [k][L]
                "imbalance_floor": floor,  # [k][L]
                "imbalance_static": max(
                    imbalance(static[layer, alive]) for layer in range(num_layers)
                ),
                "imbalance_planner": max(max(row) for row in planner) if planner else None,
                "imbalance_planner_microbatches": planner,  # [k][L] or None
                "plan_version": int(reports[ranks[0]]["version"]),
                "cross_dc_token_bytes": int(delta[0].sum()),
                "cross_dc_weight_bytes": int(delta[1].sum()),
                "cross_dc_migration_bytes": int(migration.sum()),
                "bytes_by_pair": delta.tolist(),
                "tokens_per_rank": computed.sum(axis=1).tolist(),
                "tokens_per_layer_rank": computed.T.tolist(),
                "backend": self._backend,
                "replicas": int(sum(int(np.sum(reports[r]["replicas"])) for r in ranks)),
                "fanout_bytes": int(sum(int(reports[r]["fanout_bytes"]) for r in ranks)),
                "balance_seconds": max(float(reports[r]["balance_seconds"]) for r in ranks),
                "balancedness": [
                    1.0 / imbalance(computed[alive, layer]) for layer in range(num_layers)
                ],
                "ray_seconds": max(float(reports[r].get("ray_seconds", 0.0)) for r in ranks),
                "switch": switch_summary(reports, ranks),
                # measured expert compute per assignment (every rank's expert seconds over
                # the assignments they computed): what a token moved off a busy rank saves
                "expert_seconds_per_assignment": float(
                    sum(float(np.sum(reports[r]["expert_seconds"])) for r in ranks)
                    / max(int(computed.sum()), 1)
                ),
                "recorded": "workers"
                if any(reports[r].get("recorded") == "workers" for r in ranks)
                else "controller",
                **out,
            }
        )
        res = self._results[-1]
        self.telemetry.record_balance(
            step, imbalance=res["imbalance"], imbalance_static=res["imbalance_static"],
            balancedness=res["balancedness"], replicas=res["replicas"],
            fanout_bytes=res["fanout_bytes"], balance_seconds=res["balance_seconds"],
            seconds=seconds, microbatches=measured, within_dc=within, floor=floor,
            planner=planner or (),
        )  # fmt: skip

    def _planner_level(
        self, reports: dict[int, dict[str, Any]], ranks: list[int]
    ) -> list[list[float]] | None:
        """The planner's level on the step's exact counts (:func:`planner_level`: its split
        by DC and quota inside DCs, solved here on every rank's per-microbatch counts under
        the plan the step ran), or ``None`` when not asked for (``planner_level``), a
        report lacks its counts or the plan is no longer known."""
        if not self.settings.planner_level or any("load_mb" not in reports[r] for r in ranks):
            return None
        version = int(reports[ranks[0]]["version"])
        if version == 0:
            placements = initial_placements(self.topology, self.settings.lm, self.settings.layout)
        else:
            try:
                placements = [lp.placement for lp in self.core.get(version).layers]
            except ValueError:  # pruned from memory (a long-lived plan's store copy)
                return None
        first = np.asarray(reports[ranks[0]]["load_mb"])  # [k, L, E]
        counts = np.zeros(
            (first.shape[0], first.shape[1], self.topology.num_ranks, first.shape[2]), np.int64
        )  # [k, L, R, E]
        for r in ranks:
            counts[:, :, r] = np.asarray(reports[r]["load_mb"])
        rank_dc = np.full(self.topology.num_ranks, -1, np.int64)
        rank_dc[ranks] = self.topology.rank_dc[ranks]
        cost = None
        if self.settings.shaper:  # the workers' shaper prices crossings by bandwidth
            bw = self.topology.dc_gbps * 1e9 / 8.0
            cost = np.where(np.eye(self.topology.num_dcs, dtype=bool), 0.0, 1.0 / bw)
        return planner_level(counts, placements, rank_dc, cost)

    def _offer(self, step: int) -> dict[str, Any]:
        """Plan if the trigger fires and offer the plan to every worker (prepare happens on
        the workers at the next agreed boundary)."""
        try:
            pv = self.core.maybe_plan(step)
        except Exception as err:
            self.errors += 1
            log.exception("planning after step %d failed", step)
            return {"error": f"plan: {last_line(err)}"}
        if pv is None:
            return {}
        self._offered = pv
        if self.store is not None:  # a restarted controller numbers its plans above it
            self.store.note_issued(pv.version)
        members = [self._spmd_workers[r] for r in self._members]
        if self._crash_at == "offered":  # fault injection: half the workers have the offer
            ray.get(self._send_offer(members[: len(members) // 2]))
            self._maybe_crash("offered")
        self._send_offer(members)
        return {
            "imbalance_before": max(pv.imbalance_before),
            "imbalance_after": max(pv.imbalance_after),
        }

    def replace_workers(self, workers: list[Any], ranks: list[int]) -> None:
        """``ranks`` run on new worker actors (``workers``: every rank's); the plan on offer,
        if any, is offered to them too."""
        with self._spmd_lock:
            self._spmd_workers = workers
            self.workers = workers
            self.loads.gone(ranks)  # an aggregator a dead lead hosted: its partial window lost
            if self._offered is not None:
                self._send_offer([workers[r] for r in ranks])

    def _send_offer(self, workers: list[Any]) -> list[Any]:
        """The plan on offer, as every worker applies it: per layer ``(phy2log, master,
        route)`` and the migration rounds from the committed placement. Returns the calls'
        refs (nobody needs to wait for them)."""
        pv = self._offered
        assert pv is not None
        new = [lp.placement for lp in pv.layers]
        rounds = migration_rounds(
            self.placements, new, [lp.migration for lp in pv.layers], self.topology
        )
        layers = [(p.phy2log, p.master, lp.route) for p, lp in zip(new, pv.layers, strict=True)]
        self._trace["plans"][pv.version] = (layers, migration_collectives(rounds, self.topology))
        refs = [w.offer_plan.remote(pv.version, layers, rounds, pv.encoding) for w in workers]
        self._offer_calls = [*self._pending_offers(), *refs]
        return refs

    def _pending_offers(self) -> list[Any]:
        """The offer calls sent that have not returned yet."""
        calls = getattr(self, "_offer_calls", [])
        if not calls:
            return []
        _, pending = ray.wait(calls, num_returns=len(calls), timeout=0)
        return list(pending)

    def offers_landed(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` until every plan offer sent so far has reached its
        worker (its ``offer_plan`` call returned, or the worker died); the number still on
        the way (0: all landed). The driver asks before each chunk of steps, so a plan
        offered before a chunk starts is on every worker at its first step (the workers
        never wait for the controller inside a chunk)."""
        with self._spmd_lock:
            calls = list(getattr(self, "_offer_calls", []))
        if calls:
            ray.wait(calls, num_returns=len(calls), timeout=timeout_s)
        with self._spmd_lock:
            self._offer_calls = self._pending_offers()
            return len(self._offer_calls)

    def take_trace(self) -> dict[str, dict[int, Any]]:
        """What the run trained on since the last call (runtime/trace.py): per step the load
        ``[L, R, E]`` the ranks reported, their cumulative counters (collectives issued,
        seconds waiting in the link shaper) and the bytes each crossing collective sent
        (:func:`crossed_by_collective`), per plan offered its layers and migration
        collectives."""
        with self._spmd_lock:
            out, self._trace = self._trace, _empty_trace()
            return out

    def load_windows(self) -> dict[str, Any]:
        """The load books (:meth:`LoadIngest.accounting`) and, per layer, the newest complete
        DC window's exact sums ``(first_step, last_step, steps [D], dc_sum [D, E])`` and the
        loads the policies plan on (``ControllerCore.window``)."""
        newest = [
            self.core.windows_in.newest(layer) for layer in range(self.settings.lm.num_layers)
        ]
        return {
            "accounting": self.loads.accounting(),
            "newest": [None if w is None else (w.first_step, w.last_step, w.steps, w.dc_sum)
                       for w in newest],
            "window": [self.core.window(layer) for layer in range(len(newest))],  # [W, R, E]
        }  # fmt: skip

    def results_since(self, step: int) -> list[dict[str, Any]]:
        """Recorded steps from ``step`` on."""
        self._maybe_repair()
        with self._spmd_lock:
            return [r for r in self._results if r["step"] >= step]


def _empty_trace() -> dict[str, dict[int, Any]]:
    return {"load": {}, "plans": {}, "counters": {}, "crossed": {}}


def crossed_by_collective(
    per_rank: dict[int, list[Any]], rank_dc: np.ndarray
) -> list[tuple[int, list[list[int]]]]:
    """The members' crossing sends of one step's report (``Comm.take_crossed``: per rank
    ``(group, number, kind, [D] bytes)``) summed per collective: ``(kind, [D, D] bytes
    a -> b)``, in the order of (group, number)."""
    num_dcs = int(np.max(rank_dc)) + 1
    got: dict[tuple[str, int], tuple[int, np.ndarray]] = {}
    for r, rows in per_rank.items():
        for group, n, kind, to_dc in rows:
            _, m = got.setdefault((str(group), int(n)), (int(kind), np.zeros((num_dcs,) * 2)))
            m[int(rank_dc[r])] += np.asarray(to_dc, dtype=np.float64)
    return [(k, m.astype(np.int64).tolist()) for _, (k, m) in sorted(got.items())]


def last_line(err: BaseException) -> str:
    """The last non-empty line of an error's text (Ray's errors carry a traceback)."""
    lines = [x for x in str(err).splitlines() if x.strip()]
    return lines[-1] if lines else type(err).__name__
