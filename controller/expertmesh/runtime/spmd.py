"""The driver of the SPMD data plane: start the cluster and the actors, then stay out of the way.

:class:`SpmdRuntime` starts (or joins) a Ray cluster with one node per DC labeled
``dc=<name>``, the controller actor, and one :class:`~expertmesh.runtime.worker.SpmdWorker`
per rank pinned to its DC; the workers form their process groups (gloo here, NCCL on
GPUs) and :meth:`SpmdRuntime.train` lets each run its own loop. The driver submits one
call per worker per :meth:`train`, not per phase or per step; while the workers train it
only reads the controller's recorded steps (for the live table). Tensors never pass
through it or through Ray's object store.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from ray.cluster_utils import Cluster

from expertmesh.planner import Topology
from expertmesh.runtime.checkpoint import CheckpointDir
from expertmesh.runtime.controller import ControllerActor
from expertmesh.runtime.resume import ResumeState
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
from expertmesh.runtime.spmd_faults import SpmdFaults, WorkersFailed, new_run_id
from expertmesh.runtime.spmd_members import SpmdMembership
from expertmesh.runtime.trace import RunTrace
from expertmesh.runtime.worker import SpmdWorker

__all__ = ["GROUP_TIMEOUT_S", "SpmdRuntime", "lost_step"]

log = logging.getLogger(__name__)
GROUP_TIMEOUT_S = 60.0  # a collective that waits this long for a peer fails (a dead peer)
RESULT_WAIT_S = 30.0  # after the workers return, the driver waits this long for the reports
OFFER_WAIT_S = 30.0  # before a chunk, the driver waits at most this long for offers to land


class SpmdRuntime(SpmdMembership, SpmdFaults):
    """A multi-DC Ray cluster training the demo model on the SPMD data plane."""

    def __init__(
        self,
        settings: RuntimeSettings,
        *,
        address: str | None = None,
        resume: ResumeState | None = None,
    ) -> None:
        """``resume``: go on from this checkpoint (:func:`~expertmesh.runtime.resume.load_resume`)
        instead of the initial weights; :meth:`train` then starts at the step after it."""
        self.settings, self.address, self.resume = settings, address, resume
        self.topology = Topology.from_dict(settings.topology)
        self.cluster: Cluster | None = None
        self.workers: list[Any] = []
        self.surfaces: dict[str, str] | None = None
        self.backend = ""
        self.step = -1
        self._tmp: str | None = None
        self.checkpoints: CheckpointDir | None = None
        self.checkpoint_log: list[dict[str, Any]] = []
        self.resumed: dict[str, Any] | None = None
        self.recoveries: list[dict[str, Any]] = []
        self.retried_steps: list[int] = []
        self._down_since: float | None = None
        self.controller_outages: list[dict[str, Any]] = []
        self.run_id = resume.run if resume is not None else new_run_id()
        self.trace = RunTrace(settings)  # what it trained on (trace.npz, plans.npz)
        # a collective that waits this long for a peer fails (a dead peer, a real cut)
        self.group_timeout_s = settings.step_deadline_s or GROUP_TIMEOUT_S

    def __enter__(self) -> SpmdRuntime:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> None:
        os.environ["PYTHONPATH"] = source_roots()
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        s, dcs = self.settings, self.topology.dcs
        self._tmp = tempfile.mkdtemp(prefix="expertmesh-")
        if self.address is None:
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={"num_cpus": s.cpus_per_dc, "labels": {"dc": dcs[0].name}},
            )
            for dc in dcs[1:]:
                self.cluster.add_node(num_cpus=s.cpus_per_dc, labels={"dc": dc.name})
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False)
        else:
            env = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}
            ray.init(
                address=self.address, namespace=NAMESPACE, log_to_driver=False, runtime_env=env
            )
            check_dc_nodes([dc.name for dc in dcs])
        self.controller = (
            make_actor(
                ControllerActor, num_cpus=0, max_concurrency=8, max_restarts=CONTROLLER_RESTARTS
            )
            .options(name="controller", label_selector={"dc": dcs[0].name})
            .remote(s, None if self.address else os.path.join(self._tmp, "plans.sqlite"))
        )
        self._shaper = (
            os.path.join(self._tmp, "links") if s.shaper and self.address is None else None
        )
        self._worker_cls = make_actor(SpmdWorker, num_cpus=0, max_concurrency=4)
        self.workers = [self._spawn(r) for r in range(self.topology.num_ranks)]
        self.nodes = ray.get([w.ping.remote() for w in self.workers])
        self._init_members()
        self._form_group()
        members = list(range(self.topology.num_ranks))
        ray.get(self.controller.attach.remote(self.workers))
        ray.get(self.controller.spmd_reset.remote(self.workers, members, self.backend))
        root = s.checkpoint_dir or os.path.join(self._tmp, "checkpoints")
        self.checkpoints = CheckpointDir(root, keep=s.checkpoint_keep)
        rs = self.resume
        if rs is not None:
            t0 = time.perf_counter()
            state = rs.worker_state()
            ray.get([w.resume.remote(state, rs.seeds(r)) for r, w in enumerate(self.workers)])
            ray.get(self.controller.resume_plan.remote(rs.version, rs.layers, rs.step))
            self.step = rs.step
            self.resumed = {"path": rs.path, "step": rs.step, "plan_version": rs.version,
                            "seconds": time.perf_counter() - t0}  # fmt: skip
        if rs is None or os.path.realpath(root) != os.path.realpath(os.path.dirname(rs.path)):
            self.take_checkpoint()  # the first weights: a death in step 0 recovers too
        if s.surfaces is not None:
            self.surfaces = ray.get(self.controller.start_surfaces.remote())

    def _spawn(self, rank: int) -> Any:
        """A ``worker-<rank>`` actor on a node of the rank's DC, with the initial weights."""
        s, dcs = self.settings, self.topology.dcs
        placements = [
            (p.phy2log, p.master) for p in initial_placements(self.topology, s.lm, s.layout)
        ]
        return self._worker_cls.options(
            name=f"worker-{rank}",
            label_selector={"dc": dcs[int(self.topology.rank_dc[rank])].name},
        ).remote(rank, s, placements, self._shaper, self.controller)

    def _form_group(self, members: list[int] | None = None) -> None:
        """Every member (default: the ranks taking part) joins one new process group (the
        store on the first member's node)."""
        members = self.members() if members is None else members
        t = self.group_timeout_s
        addr, port = ray.get(self.workers[members[0]].address.remote(t), timeout=t)
        refs = [self.workers[r].join.remote(members, addr, port, t) for r in members]
        self.backend = ray.get(refs, timeout=2 * t)[0]

    def node_dcs(self) -> list[str]:
        """DC label of the node each worker runs on."""
        label = {n["NodeID"]: n.get("Labels", {}).get("dc") for n in ray.nodes()}
        return [label.get(p["node"], "") for p in self.nodes]

    def train(
        self, steps: int, on_step: Callable[[StepResult], None] | None = None
    ) -> list[StepResult]:
        """Every worker trains ``steps`` steps on its own, in chunks of ``checkpoint_every``
        with a checkpoint of each chunk's end; a step that fails because a worker died
        runs again after :meth:`recover`. ``on_step`` sees each recorded step as the
        controller records it. Returns the steps in order.

        The workers hand back their state at a chunk's end with the chunk's result (the
        masters, and one rank's dense state and plan), so the next chunk starts at once
        and the driver writes that checkpoint and the trace while it trains: only the
        last chunk's are on the run's wall time (while a probed cut lasts, the chunks run
        one after another as before: the members may change between them)."""
        target = self.step + steps
        out: list[StepResult] = []
        every = self.settings.checkpoint_every or steps
        running: tuple[list[Any], int, int] | None = None  # a chunk already submitted
        while self.step < target:
            if running is None:
                self.probe_before_chunk()  # while a probed cut lasts: healed yet?
                running = self._submit(min(every, target - self.step))
            try:
                got, ends = self._chunk(running, on_step)
            except WorkersFailed as failed:
                rows = self._results_since(self.step + 1, CONTROLLER_WAIT_S) or []
                for row in rows:
                    if row["step"] < failed.failed_at and row["step"] > self.step:
                        result = StepResult(**row)
                        out.append(result)
                        if on_step is not None:
                            on_step(result)
                self.step = failed.failed_at - 1
                self.retried_steps.append(failed.failed_at)
                self.recover(failed)
                running = None
                continue
            out += got
            running = None
            if self.step < target and self.probed_up.all() and _has_state(ends):
                running = self._submit(min(every, target - self.step))  # trains meanwhile
            self.take_checkpoint(ends if _has_state(ends) else None)
            self.trace.record(self.controller, out, self.settings.trace_dir)
        return out

    def _submit(self, steps: int) -> tuple[list[Any], int, int]:
        """Start the next ``steps`` steps on every live worker: ``(refs, first step,
        steps)``. The first live worker hands back its state at the end, every worker its
        masters (:meth:`take_checkpoint`), when there is a checkpoint directory."""
        start = self.step + 1
        keep = self.checkpoints is not None
        self._offers_landed()
        refs = [
            w.run.remote(start, steps, ("state" if i == 0 else "masters") if keep else "")
            for i, w in enumerate(self.live_workers())
        ]
        return refs, start, steps

    def _chunk(
        self, running: tuple[list[Any], int, int], on_step: Callable[[StepResult], None] | None
    ) -> tuple[list[StepResult], list[dict[str, Any]]]:
        """Wait for the chunk :meth:`_submit` started: its recorded steps and what each
        worker returned at its end."""
        refs, start, steps = running
        seen: list[StepResult] = []
        ends: list[dict[str, Any]] = []
        pending = refs
        deadline: float | None = None
        while len(seen) < steps:
            if pending:
                _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.25)
                if not pending:
                    ends = self._check(refs, start)
                    deadline = time.monotonic() + RESULT_WAIT_S
            elif deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the controller recorded {len(seen)} of {steps} steps")
            else:
                time.sleep(0.05)
            rows = self._results_since(start + len(seen), 1.0)
            if rows is None:  # the controller is down: the workers train on, we wait
                if deadline is not None:
                    deadline = time.monotonic() + RESULT_WAIT_S
                continue
            for row in rows:
                while start + len(seen) < min(row["step"], start + steps):  # none survived
                    seen.append(lost_step(start + len(seen), self.backend))
                    if on_step is not None:
                        on_step(seen[-1])
                if row["step"] != start + len(seen):
                    continue
                result = StepResult(**row)
                seen.append(result)
                if on_step is not None:
                    on_step(result)
        if pending:  # every step recorded before the workers returned: wait for them
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=RESULT_WAIT_S)
            ends = [] if pending else self._check(refs, start)
        self.step = start + steps - 1
        return seen, ends

    def _offers_landed(self) -> None:
        """Before a chunk: wait (bounded) until the plans the controller offered so far are
        on every worker they went to, so when a chunk's steps switch plans does not depend
        on how fast Ray delivered an offer on a busy machine: a plan offered before the
        chunk is in every rank's first step's agreement (a dead or restarting controller:
        not waited for)."""
        try:
            left = ray.get(
                self.controller.offers_landed.remote(OFFER_WAIT_S), timeout=OFFER_WAIT_S + 10
            )
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
            log.warning("plan offers not confirmed before step %d: %s", self.step + 1, err)
            return
        if left:
            log.warning("%d plan offers still on the way before step %d", left, self.step + 1)

    def _check(self, refs: list[Any], start: int) -> list[dict[str, Any]]:
        """What the workers returned; ``WorkersFailed`` when a worker died or returned a
        failed step."""
        failed: list[int] = []
        errors = []
        got = []
        for ref in refs:
            try:
                res = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                errors.append(f"a worker died: {type(err).__name__}")
                continue
            if "failed_at" in res:
                failed.append(int(res["failed_at"]))
                errors.append(f"rank {res['rank']}: {res['error']}")
            got.append(res)
        if errors:
            raise WorkersFailed(min(failed, default=start), "; ".join(errors)[:1000])
        return got

    def _results_since(self, step: int, timeout: float) -> list[dict[str, Any]] | None:
        """The controller's recorded steps from ``step`` on; None while it is down
        (restarting), :class:`TimeoutError` when it stays down :data:`CONTROLLER_WAIT_S`."""
        try:
            rows = ray.get(self.controller.results_since.remote(step), timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
            now = time.monotonic()
            self._down_since = self._down_since or now
            if now - self._down_since > CONTROLLER_WAIT_S:
                raise TimeoutError(f"the controller is unavailable: {err}") from err
            return None
        if self._down_since is not None:  # it is back: how long the driver saw it down
            self.controller_outages.append(
                {"from_step": step, "seconds": time.monotonic() - self._down_since}
            )
            self._down_since = None
        return list(rows)

    def _ask(self, method: str, *args: Any) -> Any:
        deadline = time.monotonic() + CONTROLLER_WAIT_S
        while True:
            try:
                return ray.get(getattr(self.controller, method).remote(*args))
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def status(self) -> dict[str, Any]:
        out = dict(self._ask("status"))
        out["backend"] = self.backend
        out["retried_steps"] = list(self.retried_steps)
        out["recoveries"] = list(self.recoveries)
        out["checkpoints"] = list(self.checkpoint_log)
        out["dead_ranks"] = np.flatnonzero(self.dead).tolist()
        out["paused_ranks"] = np.flatnonzero(self.paused).tolist()
        out["resumed"] = self.resumed
        out["controller_outages"] = list(self.controller_outages)
        if out.get("restarted") and self.surfaces is not None:  # free ports: new ones now
            self.surfaces = self._ask("start_surfaces")
        return out

    def metrics(self) -> str:
        return bytes(self._ask("metrics")).decode()

    def committed_plan(self) -> list[tuple[Any, Any, Any]] | None:
        plan = self._ask("committed_plan")
        return None if plan is None else list(plan)

    def expert_weights(self, rank: int, layer: int, expert: int) -> Any:
        return ray.get(self.workers[rank].expert_weights.remote(layer, expert))

    def shutdown(self) -> None:
        stop_ray(self)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def _has_state(ends: list[dict[str, Any]]) -> bool:
    """Whether the workers' chunk results carry a whole checkpoint (:meth:`SpmdRuntime._submit`)."""
    return bool(ends) and all("masters" in e for e in ends) and any("state" in e for e in ends)


def lost_step(step: int, backend: str) -> StepResult:
    """A step whose every report was lost with a controller restart (``recorded="lost"``;
    only kept reports, 1,024 steps at most, survive one)."""
    nan = float("nan")
    return StepResult(
        step=step, loss=nan, step_seconds=nan, control_seconds=0.0, imbalance=nan,
        plan_version=-1, cross_dc_token_bytes=0, cross_dc_weight_bytes=0,
        cross_dc_migration_bytes=0, bytes_by_pair=[], tokens_per_rank=[],
        tokens_per_layer_rank=[], backend=backend, recorded="lost",
        error="no report of this step survived a controller restart",
    )  # fmt: skip
