"""Every Ray call of expertmesh: the local multi-DC cluster, the controller and worker actors.

- :class:`Runtime` starts an in-process Ray cluster with one node per DC labeled
  ``dc=<name>`` (``ray.cluster_utils.Cluster``), the controller actor (named
  ``controller`` in namespace ``expertmesh``) and one worker actor per rank
  (``worker-<rank>``) pinned to its DC with ``label_selector``. The link shaper's
  buckets live in a shared file every worker maps (:class:`LinkShaper`, ``path=``).
- :class:`WorkerActor` is a thin wrapper over :class:`RankState`; packets between
  workers travel as object refs, so a whole step is submitted at once and the driver
  waits once per step. Packets up to ``inline_object_bytes`` travel inline (through
  the owner) instead of through the object store, which on one machine is several
  times faster for the tens-of-kilobytes packets of a step.
- :class:`ControllerActor` wraps :class:`ControllerCore`: it gathers the load reports,
  asks the core whether to plan, prepares the plan on the workers (migrations, relays
  included), then commits (or rolls back). Each phase is timed; an exception in a
  phase is logged and counted, never fatal to the loop. It hosts the control-plane
  :class:`Surfaces` (REST, dashboard, ``/metrics``, gRPC) when asked and feeds their
  :class:`Telemetry` every step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import ray
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray.cluster_utils import Cluster

from expertmesh.controller.core import ControllerCore, ControllerSettings, Trigger
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.controller.telemetry import Telemetry
from expertmesh.planner import Placement, Topology, imbalance, make_policy
from expertmesh.planner.static import static_placement
from expertmesh.planner.stepmodel import StepLayout, step_layout
from expertmesh.runtime.actors import WORKER_THREADS, RayExecutor, StepStalled, WorkerActor
from expertmesh.runtime.checkpoint import CheckpointDir
from expertmesh.runtime.faults import NAME_WAIT_S, Membership
from expertmesh.workers.engine import apply_plan, migration_rounds, recovery_rounds, train_step
from expertmesh.workers.model import LMConfig
from expertmesh.workers.rank import KINDS
from expertmesh.workers.shaper import LinkShaper
from expertmesh.workers.wire import WireFormat

__all__ = [
    "NAMESPACE",
    "ControllerActor",
    "Runtime",
    "RuntimeSettings",
    "StepResult",
    "WorkerActor",
    "weights_digest",
]

log = logging.getLogger(__name__)
NAMESPACE = "expertmesh"
_TOKENS, _WEIGHTS, _MIGRATION = (KINDS.index(k) for k in ("tokens", "weights", "migration"))
CONTROLLER_RESTARTS = 5  # Ray restarts the controller actor this many times
CONTROLLER_WAIT_S = 120.0  # the driver waits this long for a restarting controller


class RuntimeSettings(BaseModel):
    """What the runtime starts and how it trains."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    topology: dict[str, Any] = Field(description="the topology (YAML structure)")
    lm: LMConfig = LMConfig()
    policy: str = Field(default="static", description="registered policy name")
    policy_settings: dict[str, Any] = Field(default_factory=dict)
    trigger: Trigger = Trigger(mode="every_n", every=5)
    shaper: bool = Field(default=True, description="shape inter-DC links (off on real DCs)")
    corpus: str | None = Field(default=None, description="corpus file; None: Python's stdlib")
    corpus_bytes: int = Field(default=4_000_000, ge=1024, description="bytes of stdlib text")
    cpus_per_dc: float = Field(default=1.0, gt=0, description="CPUs each DC's Ray node offers")
    inline_object_bytes: int = Field(
        default=4 << 20,
        ge=0,
        le=1 << 30,
        description="packets up to this size travel inline, not through the object store",
    )
    surfaces: SurfaceSettings | None = Field(
        default=None, description="REST/dashboard/metrics and gRPC from the controller (None: off)"
    )
    checkpoint_every: int = Field(
        default=5,
        ge=0,
        description="the driver writes every master (weights, Adam state) to the checkpoint "
        "directory every this many steps, besides the initial one (0: the initial one only)",
    )
    checkpoint_dir: str | None = Field(
        default=None, description="expert checkpoints go here (None: the run's temp dir)"
    )
    checkpoint_keep: int = Field(default=3, ge=1, description="newest checkpoints kept on disk")
    replace_dead_workers: bool = Field(
        default=True, description="start a new worker for a dead rank in its DC; it rejoins"
    )

    step_deadline_s: float = Field(
        default=0.0, ge=0, description="a late step probes the DC links (faults.py); 0: derived"
    )
    probe_timeout_s: float = Field(
        default=1.0, gt=0, le=60, description="connect timeout of a link probe between two DCs"
    )

    @model_validator(mode="after")
    def _encoding_sendable(self) -> RuntimeSettings:
        """The policy's transfer encoding must be one the workers can send."""
        policy = make_policy(self.policy, self.policy_settings)
        WireFormat.of(getattr(policy, "transfer_encoding", None))
        return self


class StepResult(BaseModel):
    """One training step as the runtime measured it.

    Bytes are what crossed between DCs: ``tokens`` (activations and their gradients),
    ``weights`` (replica gradients and refreshed weights, dense gradient sums) during the
    step, and ``migration`` (expert copies and master state moved while preparing the plan
    applied right after this step; not part of the step's time).
    """

    step: int
    loss: float
    step_seconds: float
    control_seconds: float
    imbalance: float  # max over layers of max/mean assignments computed per rank
    imbalance_before: float | None = None  # of the plan made after this step (max over layers)
    imbalance_after: float | None = None
    plan_version: int  # the plan this step ran under
    cross_dc_token_bytes: int
    cross_dc_weight_bytes: int
    cross_dc_migration_bytes: int
    bytes_by_pair: list[list[list[int]]]  # [3, D, D]: tokens, weights, migration
    tokens_per_rank: list[int]
    tokens_per_layer_rank: list[list[int]]  # [L, R] assignments each rank computed
    error: str | None = None


def _source_roots() -> str:
    """PYTHONPATH for Ray workers: the source roots this process imports expertmesh from."""
    import expertmesh.workers.rank as wr

    roots = [Path(__file__).resolve().parents[2], Path(wr.__file__).resolve().parents[2]]
    proto = roots[0].parent / "proto"
    if proto.is_dir():
        roots.append(proto)
    return os.pathsep.join(dict.fromkeys(str(r) for r in roots))


class ControllerActor:
    """Thin actor over :class:`ControllerCore`: gather, call the core, apply the result."""

    def __init__(self, settings: RuntimeSettings, store_path: str | None = None) -> None:
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
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.reset(settings, recover=restarted)
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
        self.placements = _initial_placements(self.topology, settings.lm)
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
        committed) or ``"committed"`` (the store has the commit, no worker has it yet)."""
        if at not in ("prepared", "committed"):
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
                return {"version": 0, "error": f"reconcile: {_last_line(err)}",
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
            return {**out, "error": f"plan: {_last_line(err)}"}
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
            return {**out, "error": f"apply: {_last_line(err)}"}
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
            "restarted": self.restarted,
            "reconciled": self.reconciled,
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


def _last_line(err: BaseException) -> str:
    lines = [x for x in str(err).splitlines() if x.strip()]
    return lines[-1] if lines else type(err).__name__


def _actor(cls: type, **options: Any) -> Any:
    """``cls`` as a Ray actor class (built when the runtime starts, not at import)."""
    return ray.remote(**options)(cls)


def _check_dc_nodes(names: list[str]) -> None:
    """ValueError unless every DC in ``names`` has an alive node labeled ``dc=<name>``."""
    have = {n.get("Labels", {}).get("dc") for n in ray.nodes() if n.get("Alive")}
    missing = [n for n in names if n not in have]
    if missing:
        ray.shutdown()
        raise ValueError(
            f"the Ray cluster has no alive node labeled dc={missing[0]} (labels: "
            f"{sorted(str(h) for h in have)}); start each DC's nodes with --labels=dc=<name>"
        )


def _initial_placements(topology: Topology, lm: LMConfig) -> list[Placement]:
    p = static_placement(
        topology.num_ranks, topology.slots_per_rank, lm.num_experts, topology.masters_per_rank
    )
    return [p] * lm.num_layers


class Runtime(Membership):
    """A local multi-DC Ray cluster training the demo model. Use as a context manager."""

    def __init__(self, settings: RuntimeSettings, *, address: str | None = None) -> None:
        self.settings = settings
        self.address = address  # an existing Ray cluster (nodes labeled dc=<name>); None: start one
        self.topology = Topology.from_dict(settings.topology)
        self.cluster: Cluster | None = None
        self.workers: list[Any] = []
        self.surfaces: dict[str, str] | None = None
        self._tmp: str | None = None
        self.shaper: LinkShaper | None = None
        self._bytes = np.zeros((len(KINDS), self.topology.num_dcs, self.topology.num_dcs), np.int64)
        self.step = -1
        self.controller_failures: list[int] = []  # steps after which the controller was lost
        self.live = np.ones(self.topology.num_ranks, bool)
        self.dead = np.zeros(self.topology.num_ranks, bool)
        self.paused = np.zeros(self.topology.num_ranks, bool)
        self._rank_bytes = np.zeros((self.topology.num_ranks, *self._bytes.shape), np.int64)
        self.retried_steps: list[int] = []  # steps that failed (a worker died) and ran again
        self.recoveries: list[dict[str, Any]] = []  # what each recovery did, with its timing
        self.checkpoints: CheckpointDir | None = None  # the expert checkpoints on disk
        self.checkpoint_log: list[dict[str, Any]] = []
        self.run_id = uuid.uuid4().hex
        self.replacements: list[dict[str, Any]] = []
        self._starting: dict[int, tuple[Any, Any, float]] = {}
        self._rank_base = np.zeros_like(self._rank_bytes)
        self._worker_cls: Any = None
        self._shaper_path = ""
        self.last_stats: list[dict[str, Any]] = []  # each live rank's stats of the last step
        self.layout: StepLayout | None = None  # rounds of the committed plan (None: every one)
        self.probes: dict[int, Any] = {}  # DC -> LinkProbe actor
        self.probe_targets: dict[int, tuple[str, int]] = {}
        self._init_links(settings)

    def __enter__(self) -> Runtime:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> None:
        os.environ["PYTHONPATH"] = _source_roots()
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        dcs = self.topology.dcs
        s = self.settings
        self._tmp = tempfile.mkdtemp(prefix="expertmesh-")
        path = os.path.join(self._tmp, "links")
        self.shaper = LinkShaper.from_topology(self.topology, path=path)
        if self.address is None:
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": s.cpus_per_dc,
                    "labels": {"dc": dcs[0].name},
                    "_system_config": {"max_direct_call_object_size": s.inline_object_bytes},
                },
            )
            for dc in dcs[1:]:
                self.cluster.add_node(num_cpus=s.cpus_per_dc, labels={"dc": dc.name})
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False)
        else:
            # the cluster's workers import this checkout (a job-level runtime env)
            env = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}
            ray.init(
                address=self.address, namespace=NAMESPACE, log_to_driver=False, runtime_env=env
            )
            _check_dc_nodes([dc.name for dc in dcs])
        head = {"label_selector": {"dc": dcs[0].name}}
        self.controller = (
            _actor(ControllerActor, num_cpus=0, max_concurrency=8, max_restarts=CONTROLLER_RESTARTS)
            .options(name="controller", **head)
            .remote(s, None if self.address else os.path.join(self._tmp, "plans.sqlite"))
        )
        self._shaper_path = path
        self.workers = [self._spawn_worker(r) for r in range(self.topology.num_ranks)]
        self.nodes = ray.get([w.ping.remote() for w in self.workers])
        self._start_probes()
        ray.get(self.controller.attach.remote(self.workers))
        self.executor = self._executor()
        root = s.checkpoint_dir or os.path.join(self._tmp, "checkpoints")
        self.checkpoints = CheckpointDir(root, keep=s.checkpoint_keep)
        self._take_checkpoint(0)
        if s.surfaces is not None:
            self.surfaces = ray.get(self.controller.start_surfaces.remote())

    def _spawn_worker(self, rank: int) -> Any:
        """A new ``worker-<rank>`` actor on a node of the rank's DC (initial weights)."""
        s, dc = self.settings, self.topology.dcs[int(self.topology.rank_dc[rank])].name
        placements = [(p.phy2log, p.master) for p in _initial_placements(self.topology, s.lm)]
        if self._worker_cls is None:
            self._worker_cls = _actor(WorkerActor, num_cpus=0, max_concurrency=WORKER_THREADS)
        return self._worker_cls.options(name=f"worker-{rank}", label_selector={"dc": dc}).remote(
            rank, s, placements, self._shaper_path, self.controller
        )

    def reset(self, settings: RuntimeSettings) -> None:
        """Train afresh under ``settings`` on the running cluster (same DCs and ranks;
        links, model seed, policy and trigger may differ): initial weights, no plans."""
        topo = Topology.from_dict(settings.topology)
        if topo.num_ranks != self.topology.num_ranks or [d.name for d in topo.dcs] != [
            d.name for d in self.topology.dcs
        ]:
            raise ValueError("reset needs the same DCs and ranks; start a new runtime")
        if self.surfaces is not None or settings.surfaces is not None:
            raise ValueError("reset is for runs without surfaces")
        self.settings, self.topology = settings, topo
        self._init_links(settings)
        self.executor = self._executor()
        ray.get(self.controller.reset.remote(settings))
        placements = [(p.phy2log, p.master) for p in _initial_placements(topo, settings.lm)]
        ray.get([w.reset.remote(settings, placements) for w in self.workers])
        ray.get(self.controller.attach.remote(self.workers))
        assert self.shaper is not None
        self.shaper.reset()
        self._bytes[:] = 0
        self._rank_bytes[:] = 0
        self.step = -1
        self.layout = None
        self.controller_failures = []
        if not self.live.all():
            raise ValueError("reset needs every worker alive; start a new runtime")
        self.retried_steps, self.recoveries = [], []
        self.run_id, self.checkpoint_log = uuid.uuid4().hex, []
        self._take_checkpoint(0)

    def node_dcs(self) -> list[str]:
        """DC label of the node each worker runs on."""
        label = {n["NodeID"]: n.get("Labels", {}).get("dc") for n in ray.nodes()}
        return [label.get(p["node"], "") for p in self.nodes]

    def run_step(self) -> StepResult:
        """Train one step, then let the controller plan/apply. Returns the measurements."""
        self.step += 1
        self.probe_before_step()  # while a probed cut lasts: has it healed?
        t0 = time.perf_counter()
        try:
            stats = train_step(self.executor, self.step, self.settings.lm.num_layers, self.layout)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, StepStalled) as err:
            # a worker died, or a link was cut, during the step: the ranks that go on undo
            # it, the controller replans without the others and restores their masters, and
            # the step runs again
            if self.recover_step(err) is None:
                raise
            self.retried_steps.append(self.step)
            self.start_replacements()  # they start while the step runs again
            t0 = time.perf_counter()
            stats = train_step(self.executor, self.step, self.settings.lm.num_layers)
        step_s = time.perf_counter() - t0
        self.last_stats = stats  # each live rank's RankState.stats() of this step
        for s_ in stats:  # cumulative per rank; a dead rank's last count stays in the sum
            self._rank_bytes[s_["rank"]] = self._rank_base[s_["rank"]] + np.asarray(s_["bytes"])
        total = self._rank_bytes.sum(axis=0)  # [K, D, D]
        delta, self._bytes = total - self._bytes, total
        computed = np.zeros((self.topology.num_ranks, self.settings.lm.num_layers), np.int64)
        for s_ in stats:
            computed[s_["rank"]] = np.asarray(s_["computed"])  # [R, L]; dead ranks 0
        loss = float(sum(s["loss"] for s in stats))
        record = {
            "seconds": step_s,
            "loss": loss,
            "tokens_per_rank": computed.sum(axis=1),
            "token_bytes": delta[_TOKENS],
            "weight_bytes": delta[_WEIGHTS],
        }
        t1 = time.perf_counter()
        try:
            # wait for a restarting controller (no turn is skipped); it serves its surfaces again
            if self.controller_failures and self._ask("status") and self.surfaces is not None:
                self.surfaces = self._ask("start_surfaces")
            ctl = ray.get(self.controller.control.remote(self.step, record))
        except ray.exceptions.RayActorError as err:
            # the controller died (Ray restarts it; it recovers from its store and reconciles
            # the workers on its next turn): this step trained on the committed plan
            log.warning("controller lost after step %d: %s", self.step, _last_line(err))
            self.controller_failures.append(self.step)
            d = self.topology.num_dcs
            ctl = {"error": f"controller: {type(err).__name__}", "migration_bytes": [[0] * d] * d}
        control_s = time.perf_counter() - t1
        self.layout = ctl.get("layout")  # the next step runs only the rounds its plan needs
        migration = np.asarray(ctl["migration_bytes"], np.int64)
        self._bytes[_MIGRATION] += migration  # counted here, not in the next step's delta
        pairs = np.stack([delta[_TOKENS], delta[_WEIGHTS], migration]).astype(np.int64)
        if self.dead.any() and (self.start_replacements(NAME_WAIT_S) or self._starting):
            self.finish_replacements()  # dead ranks rejoin on new workers
        every = self.settings.checkpoint_every
        if every and (self.step + 1) % every == 0:
            self._take_checkpoint(int(ctl.get("version", stats[0]["version"])))
        return StepResult(
            step=self.step,
            loss=loss,
            step_seconds=step_s,
            control_seconds=control_s,
            imbalance=max(imbalance(computed[:, layer]) for layer in range(computed.shape[1])),
            imbalance_before=ctl.get("imbalance_before"),
            imbalance_after=ctl.get("imbalance_after"),
            plan_version=int(stats[0]["version"]),
            cross_dc_token_bytes=int(pairs[0].sum()),
            cross_dc_weight_bytes=int(pairs[1].sum()),
            cross_dc_migration_bytes=int(pairs[2].sum()),
            bytes_by_pair=pairs.tolist(),
            tokens_per_rank=computed.sum(axis=1).tolist(),
            tokens_per_layer_rank=computed.T.tolist(),
            error=ctl.get("error"),
        )

    def _ask(self, method: str, *args: Any) -> Any:
        """A read-only call on the controller, retried while Ray restarts it."""
        deadline = time.monotonic() + CONTROLLER_WAIT_S
        while True:
            try:
                return ray.get(getattr(self.controller, method).remote(*args))
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def committed_plan(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
        """Per layer ``(phy2log, master, route)`` of the committed plan, or None."""
        plan = self._ask("committed_plan")
        return None if plan is None else list(plan)

    def metrics(self) -> str:
        """The controller's Prometheus exposition."""
        return bytes(self._ask("metrics")).decode()

    def status(self) -> dict[str, Any]:
        """The controller's status plus the driver's fault record: ``retried_steps`` (steps
        that failed because a worker died and ran again), ``dead_ranks``, ``recoveries``."""
        out = dict(self._ask("status"))
        out["retried_steps"] = list(self.retried_steps)
        out["dead_ranks"] = np.flatnonzero(self.dead).tolist()
        out["paused_ranks"] = np.flatnonzero(self.paused).tolist()
        out["recoveries"] = [{k: v for k, v in r.items() if k != "migration_bytes"}
                             for r in self.recoveries]  # fmt: skip
        out["replacements"] = list(self.replacements)
        out["checkpoints"] = list(self.checkpoint_log)
        return out

    def shutdown(self) -> None:
        if ray.is_initialized():
            if self.surfaces is not None:
                try:
                    ray.get(self.controller.stop_surfaces.remote(), timeout=30)
                except Exception:
                    log.exception("stopping the surfaces failed")
                self.surfaces = None
            if self.address is not None and getattr(self, "controller", None) is not None:
                try:
                    ray.get(self.controller.drop_store.remote(), timeout=30)
                except Exception:
                    log.exception("removing the controller's plan store failed")
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        if self.shaper is not None:
            self.shaper.close()
            self.shaper = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
