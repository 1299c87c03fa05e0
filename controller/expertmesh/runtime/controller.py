"""The controller actor: a thin Ray wrapper over :class:`ControllerCore`.

It gathers the workers' load and step reports, asks the core whether to plan, hands
plans to the workers (prepare, then commit), records every step in :class:`Telemetry`,
keeps plans in SQLite (recovered when Ray restarts the actor) and hosts the control-plane
:class:`Surfaces` (REST, dashboard, ``/metrics``, gRPC) when asked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from expertmesh.controller.core import ControllerCore, ControllerSettings
from expertmesh.controller.telemetry import Telemetry
from expertmesh.planner import Placement, Topology, imbalance
from expertmesh.planner.stepmodel import StepLayout, step_layout
from expertmesh.runtime.actors import RayExecutor
from expertmesh.runtime.loads import LoadIngest
from expertmesh.runtime.membership import MembershipSteps
from expertmesh.runtime.reattach import Reattach
from expertmesh.runtime.settings import NAMESPACE, RuntimeSettings, initial_placements
from expertmesh.runtime.stepstats import per_microbatch, switch_summary
from expertmesh.runtime.trace import migration_collectives
from expertmesh.workers.engine import apply_plan, migration_rounds, recovery_rounds

__all__ = ["ControllerActor", "SpmdSteps", "last_line", "weights_digest"]

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
        self._bytes = np.zeros((3, self.topology.num_dcs, self.topology.num_dcs), np.int64)
        self._rank_bytes: dict[int, np.ndarray] = {}
        self._spmd_lock = threading.Lock()
        self._static_owner = initial_placements(self.topology, self.settings.lm)[0].master_rank()
        if not hasattr(self, "_trace"):  # kept across a re-formed group (recovery)
            self._trace: dict[str, dict[int, Any]] = {"load": {}, "plans": {}, "counters": {}}
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
        delta = np.zeros_like(self._bytes)
        for r in ranks:  # cumulative per rank; a replacement worker counts from zero again
            cur = np.asarray(reports[r]["bytes"])
            prev = self._rank_bytes.get(r, np.zeros_like(cur))
            delta += cur - prev if (cur >= prev).all() else cur
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
        self._trace["counters"][step] = {  # cumulative per rank: collectives, shaper waits
            r: (int(reports[r].get("collectives", 0)), float(reports[r].get("shaped_seconds", 0)))
            for r in ranks
        }
        static = np.zeros((num_layers, self.topology.num_ranks), np.int64)
        for layer in range(num_layers):
            np.add.at(static[layer], self._static_owner, load[layer])
        alive = np.asarray(ranks)
        seconds = max(float(reports[r]["wall_seconds"]) for r in ranks)
        per_mb = np.stack([np.asarray(reports[r]["computed_mb"]) for r in ranks])  # [R', k, L]
        measured, within, floor = per_microbatch(per_mb, self.topology.rank_dc[alive])
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
        )  # fmt: skip

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
        return [w.offer_plan.remote(pv.version, layers, rounds, pv.encoding) for w in workers]

    def take_trace(self) -> dict[str, dict[int, Any]]:
        """What the run trained on since the last call (runtime/trace.py): per step the load
        ``[L, R, E]`` the ranks reported and their cumulative counters (collectives issued,
        seconds waiting in the link shaper), per plan offered its layers and migration
        collectives."""
        with self._spmd_lock:
            out, self._trace = self._trace, {"load": {}, "plans": {}, "counters": {}}
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


class ControllerActor(Reattach, SpmdSteps, MembershipSteps):
    """Thin actor over :class:`ControllerCore`: gather, call the core, apply the result.

    ``spmd``: the workers are the SPMD plane's; after a restart the actor re-attaches to
    them (:mod:`expertmesh.runtime.reattach`) before serving any call."""

    def __init__(
        self, settings: RuntimeSettings, store_path: str | None = None, *, spmd: bool = False
    ) -> None:
        self.workers: list[Any] = []
        self.surfaces: Any = None  # expertmesh.controller.server.Surfaces while serving
        if store_path is None:  # on the controller's node; the job id survives restarts
            job = ray.get_runtime_context().get_job_id()
            store_path = os.path.join(tempfile.gettempdir(), f"expertmesh-{job}", "plans.sqlite")
        self.store_path = store_path
        self.store: Any = None
        self._crash_at: str | None = None
        self.restarted = False
        self.reconciled: dict[str, list[int]] = {}
        self.reattached_spmd: dict[str, Any] | None = None
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.reset(settings, recover=restarted)
        if restarted and spmd:
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
        plan and the policy settings from the SQLite store, and the first :meth:`control`
        reconciles the workers with it before anything else (:meth:`_reconcile`)."""
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
        self.phase_seconds: dict[str, float] = {}
        self.placements = initial_placements(self.topology, settings.lm)
        self.layout: StepLayout | None = None  # rounds the committed plan needs; None: all
        self.live = np.ones(self.topology.num_ranks, bool)
        self._needs_reconcile = False
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
            self._needs_reconcile = True
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
        """Fault injection: exit the process (as a crash would) during the next plan
        application, ``at`` ``"prepared"`` (every worker holds the plan ready, nothing is
        committed) or ``"committed"`` (the store has the commit, no worker has it yet); on
        the SPMD plane ``"offered"`` (half the workers have the next offer) or
        ``"applied"`` (the workers switched to it, the store does not have it yet)."""
        if at not in ("prepared", "committed", "offered", "applied"):
            raise ValueError(f"unknown crash point {at!r}")
        self._crash_at = at

    def _maybe_crash(self, at: str) -> None:
        if self._crash_at == at:
            log.error("injected crash at %s", at)
            os._exit(1)

    def _reconcile(self) -> None:
        """After a restart: bring every worker to the recovered committed plan.

        A worker holding a prepared plan that the store committed commits it (the crash
        came between the store and the workers); any other prepared plan is aborted (it was
        never committed); a worker on the committed version keeps it. Nothing is ever
        half-applied: the tokens check refuses mixed versions, so every worker must agree."""
        ranks = self.topology.num_ranks
        if not self.workers:
            self.workers = [ray.get_actor(f"worker-{r}", namespace=NAMESPACE) for r in range(ranks)]
            for r in range(ranks):
                self.telemetry.set_worker_state(r, True)
        c = self.core.committed
        version = c.version if c is not None else 0
        states = ray.get([w.call.remote("plan_state") for w in self.workers])
        done: dict[str, list[int]] = {"completed": [], "rolled_back": [], "kept": []}
        for r, (w, (have, pending, ready)) in enumerate(zip(self.workers, states, strict=True)):
            if have == version:
                if pending is not None:
                    ray.get(w.call.remote("abort", pending))
                    done["rolled_back"].append(r)
                else:
                    done["kept"].append(r)
            elif pending == version and ready:
                ray.get(w.call.remote("commit", version))
                done["completed"].append(r)
            else:
                raise RuntimeError(
                    f"worker {r} is on plan {have} (prepared {pending}); the store has {version}"
                )
        self.reconciled = done
        self._needs_reconcile = False
        log.warning("workers reconciled with plan %d: %s", version, done)

    def replace_worker(self, rank: int, worker: Any) -> None:
        """Rank ``rank`` runs on a new worker actor (it rejoins at the next recovery)."""
        self.workers[rank] = worker

    def set_worker_state(self, rank: int, up: bool) -> None:
        self.telemetry.set_worker_state(rank, up)

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

    def report_loads(self, step: int, rank: int, load: np.ndarray) -> None:
        """``load`` [L, E]: rank ``rank``'s tokens per expert of every layer at ``step``."""
        for layer, row in enumerate(load):
            try:
                self.core.report_load(step, layer, rank, row)
            except ValueError:
                log.exception("load report of rank %d step %d layer %d refused", rank, step, layer)

    def _timed(self, name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.phase_seconds[f"{name}_seconds"] = time.perf_counter() - t0

    def control(self, step: int, record: dict[str, Any]) -> dict[str, Any]:
        """One turn of the loop after ``step``: maybe plan, prepare, commit; then record the
        step (``record``: :meth:`Telemetry.record_step` arguments) with any migration bytes
        counted as weights. Never raises."""
        d = self.topology.num_dcs
        migration = np.zeros((d, d), np.int64)
        if self._needs_reconcile:
            try:
                self._reconcile()
            except Exception as err:
                self.errors += 1
                log.exception("reconciling the workers after a restart failed")
                return {"version": 0, "error": f"reconcile: {last_line(err)}",
                        "migration_bytes": migration.tolist()}  # fmt: skip
        out = self._plan_and_apply(step, migration)
        out["migration_bytes"] = migration.tolist()
        out["layout"] = self.layout
        try:
            self.telemetry.record_step(
                step,
                record["seconds"],
                record["loss"],
                np.asarray(record["tokens_per_rank"]),
                cross_dc_token_bytes=np.asarray(record["token_bytes"]),
                cross_dc_weight_bytes=np.asarray(record["weight_bytes"]) + migration,
            )
        except Exception:
            log.exception("recording step %d failed", step)
        return out

    def _plan_and_apply(self, step: int, migration: np.ndarray) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.core.committed.version if self.core.committed else 0}
        try:
            pv = self._timed("plan", lambda: self.core.maybe_plan(step))
        except Exception as err:
            self.errors += 1
            log.exception("planning after step %d failed", step)
            return {**out, "error": f"plan: {last_line(err)}"}
        if pv is None:
            return out
        out.update(
            imbalance_before=max(pv.imbalance_before), imbalance_after=max(pv.imbalance_after)
        )
        new = [lp.placement for lp in pv.layers]
        layers = [(p.phy2log, p.master, lp.route) for p, lp in zip(new, pv.layers, strict=True)]
        ex = RayExecutor(self.workers, self.live)
        try:
            rounds = migration_rounds(
                self.placements, new, [lp.migration for lp in pv.layers], self.topology
            )
            sent = self._timed(
                "prepare", lambda: apply_plan(ex, pv.version, layers, rounds, pv.encoding)
            )
            migration += sent
            self._maybe_crash("prepared")
            self._timed("commit", lambda: self._commit(ex, pv.version))
        except Exception as err:
            self.errors += 1
            log.error("plan %d failed, rolling back: %s", pv.version, traceback.format_exc())
            self.core.rollback(pv.version)
            try:
                ex.call_all("abort", pv.version)
            except Exception:
                log.exception("abort of plan %d failed", pv.version)
            return {**out, "error": f"apply: {last_line(err)}"}
        self.placements = new
        self.layout = step_layout(new, [lp.route for lp in pv.layers], self.topology, self.live)
        out["version"] = pv.version
        out["migration_transfers"] = sum(len(r) for r in rounds)
        return out

    def recover(
        self, excluded: list[int], step: int, checkpoint: dict[tuple[int, int], Any]
    ) -> dict[str, Any]:
        """Ranks ``excluded`` (dead, or in a DC cut off) take no part from now on (the
        others do, rejoining ones included): plan for the live ranks and apply it.

        Copies the live ranks lack come from a live replica (exact weights); what no live
        rank holds (an expert whose every copy left) and the Adam state of masters that
        left come from ``checkpoint`` ((layer, expert) -> (weights, m, v), the newest on
        disk). Raises when the plan cannot be applied (the run cannot go on)."""
        self.live[:] = True
        self.live[list(excluded)] = False
        for r in range(self.topology.num_ranks):
            self.telemetry.set_worker_state(r, bool(self.live[r]))
        self.core.set_dead_ranks(np.flatnonzero(~self.live).tolist())
        pv = self.core.plan(step)
        new = [lp.placement for lp in pv.layers]
        layers = [(p.phy2log, p.master, lp.route) for p, lp in zip(new, pv.layers, strict=True)]
        rounds, restore = recovery_rounds(self.placements, new, self.live, self.topology)
        lost_masters = [
            (layer, e)
            for layer, p in enumerate(self.placements)
            for e in np.flatnonzero(~self.live[p.master_rank()]).tolist()
        ]
        ex = RayExecutor(self.workers, self.live)
        ex.call_all("prepare", pv.version, layers, pv.encoding)
        seeds: dict[int, tuple[dict[Any, Any], dict[Any, Any]]] = {}
        for layer, e, r, kind in restore:
            if (layer, e) not in checkpoint:
                raise ValueError(f"expert {layer}/{e}: no live copy and no usable checkpoint")
            w, m, v = checkpoint[(layer, e)]
            ws, opts = seeds.setdefault(r, ({}, {}))
            if kind == "w":
                ws[(layer, e)] = w
            else:
                opts[(layer, e)] = (m, v)
        ray.get([self.workers[r].call.remote("seed", *sv) for r, sv in seeds.items()])
        outs = None
        for rnd in [*rounds, []]:
            outs = ex.phase("mig", 0, outs, rnd)
        if outs is not None:  # the last round is done (worker calls may run out of order)
            ex.results(outs)
        sent = np.sum(ex.call_all("prepare_end", pv.version), axis=0)
        self._commit(ex, pv.version)
        self.placements = new
        self.layout = step_layout(new, [lp.route for lp in pv.layers], self.topology, self.live)
        digests = self._digests(lost_masters, new)
        from_ckpt = {(layer, e) for layer, e, _, kind in restore if kind == "w"}
        return {
            "version": pv.version,
            "excluded": np.flatnonzero(~self.live).tolist(),
            "lost_masters": len(lost_masters),
            "restored_from_replica": sum(1 for k in lost_masters if k not in from_ckpt),
            "restored_from_checkpoint": sum(1 for k in lost_masters if k in from_ckpt),
            "from_checkpoint": [f"{layer}/{e}" for layer, e in sorted(from_ckpt)],
            "migration_bytes": np.asarray(sent).tolist(),
            "restored_digests": digests,
        }

    def _digests(self, keys: list[tuple[int, int]], new: list[Placement]) -> dict[str, str]:
        """sha256 of the weights each ``(layer, expert)``'s master holds now, by
        ``"layer/expert"`` (to check a restored master bit for bit)."""
        refs = {
            f"{layer}/{e}": self.workers[int(new[layer].master_rank()[e])].call.remote(
                "expert_weights", layer, e
            )
            for layer, e in keys
        }
        return {k: weights_digest(ray.get(ref)) for k, ref in refs.items()}

    def _commit(self, ex: RayExecutor, version: int) -> None:
        self.core.commit(version)  # saved to the store, when there is one
        self._maybe_crash("committed")
        ex.call_all("commit", version)

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
            "reconciled": self.reconciled,
            "reattached": self.reattached_spmd,
            **self.phase_seconds,
        }


def weights_digest(weights: list[np.ndarray]) -> str:
    """sha256 over an expert's weight arrays (dtype, shape and bytes)."""
    import hashlib

    h = hashlib.sha256()
    for a in weights:
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def last_line(err: BaseException) -> str:
    lines = [x for x in str(err).splitlines() if x.strip()]
    return lines[-1] if lines else type(err).__name__
