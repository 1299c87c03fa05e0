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

import logging
import os
import shutil
import tempfile
import time
import uuid
from typing import Any

import numpy as np
import ray
from ray.cluster_utils import Cluster

from expertmesh.planner import Topology, imbalance
from expertmesh.planner.stepmodel import StepLayout
from expertmesh.runtime.actors import WORKER_THREADS, StepStalled, WorkerActor
from expertmesh.runtime.checkpoint import CheckpointDir
from expertmesh.runtime.controller import ControllerActor, last_line, weights_digest
from expertmesh.runtime.faults import NAME_WAIT_S, Membership
from expertmesh.runtime.settings import (
    CONTROLLER_RESTARTS,
    CONTROLLER_WAIT_S,
    NAMESPACE,
    RuntimeSettings,
    StepResult,
    check_dc_nodes,
    initial_placements,
    make_actor,
    source_roots,
    stop_ray,
)
from expertmesh.workers.engine import train_step
from expertmesh.workers.rank import KINDS
from expertmesh.workers.shaper import LinkShaper

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
_TOKENS, _WEIGHTS, _MIGRATION = (KINDS.index(k) for k in ("tokens", "weights", "migration"))


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
        os.environ["PYTHONPATH"] = source_roots()
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
            check_dc_nodes([dc.name for dc in dcs])
        head = {"label_selector": {"dc": dcs[0].name}}
        self.controller = (
            make_actor(
                ControllerActor, num_cpus=0, max_concurrency=8, max_restarts=CONTROLLER_RESTARTS
            )
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
        placements = [(p.phy2log, p.master) for p in initial_placements(self.topology, s.lm)]
        if self._worker_cls is None:
            self._worker_cls = make_actor(WorkerActor, num_cpus=0, max_concurrency=WORKER_THREADS)
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
        placements = [(p.phy2log, p.master) for p in initial_placements(topo, settings.lm)]
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
            log.warning("controller lost after step %d: %s", self.step, last_line(err))
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
        stop_ray(self)
        if self.shaper is not None:
            self.shaper.close()
            self.shaper = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
