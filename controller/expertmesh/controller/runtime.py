"""Every Ray call of expertmesh: the local multi-DC cluster, the controller and worker actors.

- :class:`Runtime` starts an in-process Ray cluster with one node per DC labeled
  ``dc=<name>`` (``ray.cluster_utils.Cluster``), a link shaper actor, the controller
  actor (named ``controller`` in namespace ``expertmesh``) and one worker actor per
  rank (``worker-<rank>``) pinned to its DC with ``label_selector``.
- :class:`WorkerActor` is a thin wrapper over :class:`RankState`; packets between
  workers travel as object refs, so a whole step is submitted at once.
- :class:`ControllerActor` wraps :class:`ControllerCore`: it gathers the load reports,
  asks the core whether to plan, prepares the plan on the workers (migrations, relays
  included), then commits (or rolls back). Each phase is timed; an exception in a
  phase is logged and counted, never fatal to the loop.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import ray
from pydantic import BaseModel, ConfigDict, Field
from ray.cluster_utils import Cluster

from expertmesh.controller.core import ControllerCore, ControllerSettings, Trigger
from expertmesh.planner import Placement, Topology, imbalance
from expertmesh.planner.static import static_placement
from expertmesh.workers.engine import apply_plan, migration_rounds, train_step
from expertmesh.workers.model import Corpus, LMConfig
from expertmesh.workers.rank import RankState
from expertmesh.workers.shaper import LinkShaper

__all__ = ["ControllerActor", "Runtime", "RuntimeSettings", "StepResult", "WorkerActor"]

log = logging.getLogger(__name__)
NAMESPACE = "expertmesh"


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


class StepResult(BaseModel):
    """One training step as the runtime measured it."""

    step: int
    loss: float
    step_seconds: float
    control_seconds: float
    imbalance: float  # max over layers of max/mean assignments computed per rank
    imbalance_before: float | None = None  # of the plan made after this step (max over layers)
    imbalance_after: float | None = None
    plan_version: int
    cross_dc_token_bytes: int
    cross_dc_weight_bytes: int
    bytes_by_pair: list[list[list[int]]]  # [2, D, D] this step: tokens, weights
    tokens_per_rank: list[int]
    error: str | None = None


def _source_roots() -> str:
    """PYTHONPATH for Ray workers: the source roots this process imports expertmesh from."""
    import expertmesh.workers.rank as wr

    roots = [Path(__file__).resolve().parents[2], Path(wr.__file__).resolve().parents[2]]
    proto = roots[0].parent / "proto"
    if proto.is_dir():
        roots.append(proto)
    return os.pathsep.join(dict.fromkeys(str(r) for r in roots))


class ShaperActor:
    """The cluster's one :class:`LinkShaper` (all ranks of a DC pair share its buckets)."""

    def __init__(self, topology: dict[str, Any], enabled: bool) -> None:
        self.shaper = LinkShaper.from_topology(Topology.from_dict(topology), enabled=enabled)

    def reserve(self, src_dc: int, dst_dc: int, nbytes: int) -> float:
        return self.shaper.reserve(src_dc, dst_dc, nbytes)

    def totals(self) -> np.ndarray:
        return self.shaper.bytes.copy()


class WorkerActor:
    """One rank: a thin wrapper over :class:`RankState`."""

    def __init__(
        self,
        rank: int,
        settings: RuntimeSettings,
        placements: list[tuple[np.ndarray, np.ndarray]],
        shaper: Any,
        controller: Any,
    ) -> None:
        topo = Topology.from_dict(settings.topology)
        corpus = Corpus.load(settings.corpus, settings.corpus_bytes)
        self._reports: list[Any] = []

        def reserve(a: int, b: int, nbytes: int) -> float:
            return float(ray.get(shaper.reserve.remote(a, b, nbytes)))

        def report(step: int, layer: int, rank: int, load: np.ndarray) -> None:
            self._reports.append(controller.report_load.remote(step, layer, rank, load))

        self.state = RankState(
            rank,
            topo,
            settings.lm,
            corpus,
            [Placement(p, m) for p, m in placements],
            reserve=reserve if settings.shaper else None,
            report=report,
        )

    def phase(self, name: str, layer: int, *inbox: Any, arg: Any = None) -> Any:
        out = self.state.phase(name, layer, list(inbox), arg)
        return out if len(out) > 1 else out[0]

    def call(self, method: str, *args: Any) -> Any:
        if method not in ("begin_step", "prepare", "prepare_end", "commit", "abort", "stats"):
            raise ValueError(f"unknown worker method {method!r}")
        if method == "stats":
            ray.get(self._reports)  # every load report of the step reached the controller
            self._reports = []
        return getattr(self.state, method)(*args)

    def ping(self) -> dict[str, Any]:
        return {"rank": self.state.rank, "node": ray.get_runtime_context().get_node_id()}


class RayExecutor:
    """:class:`expertmesh.workers.engine.Executor` over worker actors (packets as refs)."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self.num_ranks = len(workers)

    def phase(self, name: str, layer: int, outs: list[list[Any]] | None, arg: Any = None) -> Any:
        n = self.num_ranks
        res = []
        for q, w in enumerate(self.workers):
            inbox = [outs[p][q] for p in range(n)] if outs else []
            refs = w.phase.options(num_returns=n).remote(name, layer, *inbox, arg=arg)
            res.append(refs if n > 1 else [refs])
        return res

    def call_all(self, method: str, *args: Any) -> list[Any]:
        return list(ray.get([w.call.remote(method, *args) for w in self.workers]))


class ControllerActor:
    """Thin actor over :class:`ControllerCore`: gather, call the core, apply the result."""

    def __init__(self, settings: RuntimeSettings) -> None:
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
        self.workers: list[Any] = []
        self.errors = 0
        self.phase_seconds: dict[str, float] = {}
        self.placements = _initial_placements(self.topology, settings.lm)

    def attach(self, workers: list[Any]) -> int:
        self.workers = workers
        return len(workers)

    def report_load(self, step: int, layer: int, rank: int, load: np.ndarray) -> None:
        try:
            self.core.report_load(step, layer, rank, load)
        except ValueError:
            log.exception("load report of rank %d step %d layer %d refused", rank, step, layer)

    def _timed(self, name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.phase_seconds[f"{name}_seconds"] = time.perf_counter() - t0

    def control(self, step: int) -> dict[str, Any]:
        """One turn of the loop after ``step``: maybe plan, prepare, commit. Never raises."""
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
        ex = RayExecutor(self.workers)
        try:
            rounds = migration_rounds(
                self.placements, new, [lp.migration for lp in pv.layers], self.topology
            )
            self._timed("prepare", lambda: apply_plan(ex, pv.version, layers, rounds))
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
        out["version"] = pv.version
        out["migration_transfers"] = sum(len(r) for r in rounds)
        return out

    def _commit(self, ex: RayExecutor, version: int) -> None:
        self.core.commit(version)
        ex.call_all("commit", version)

    def status(self) -> dict[str, Any]:
        c = self.core.committed
        return {
            "version": c.version if c else 0,
            "policy": self.core.settings.policy,
            "errors": self.errors,
            "reports_received": self.core.reports_received,
            "reports_rejected": self.core.reports_rejected,
            **self.phase_seconds,
        }


def _last_line(err: BaseException) -> str:
    lines = [x for x in str(err).splitlines() if x.strip()]
    return lines[-1] if lines else type(err).__name__


def _actor(cls: type, **options: Any) -> Any:
    """``cls`` as a Ray actor class (built when the runtime starts, not at import)."""
    return ray.remote(**options)(cls)


def _initial_placements(topology: Topology, lm: LMConfig) -> list[Placement]:
    p = static_placement(
        topology.num_ranks, topology.slots_per_rank, lm.num_experts, topology.masters_per_rank
    )
    return [p] * lm.num_layers


class Runtime:
    """A local multi-DC Ray cluster training the demo model. Use as a context manager."""

    def __init__(self, settings: RuntimeSettings) -> None:
        self.settings = settings
        self.topology = Topology.from_dict(settings.topology)
        self.cluster: Cluster | None = None
        self.workers: list[Any] = []
        self._bytes = np.zeros((2, self.topology.num_dcs, self.topology.num_dcs), np.int64)
        self.step = -1

    def __enter__(self) -> Runtime:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> None:
        os.environ["PYTHONPATH"] = _source_roots()
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        dcs = self.topology.dcs
        cpus = self.settings.cpus_per_dc
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": cpus, "labels": {"dc": dcs[0].name}},
        )
        for dc in dcs[1:]:
            self.cluster.add_node(num_cpus=cpus, labels={"dc": dc.name})
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False)
        s = self.settings
        head = {"label_selector": {"dc": dcs[0].name}}
        self.shaper = (
            _actor(ShaperActor, num_cpus=0)
            .options(name="shaper", **head)
            .remote(s.topology, s.shaper)
        )
        self.controller = (
            _actor(ControllerActor, num_cpus=0, max_concurrency=8)
            .options(name="controller", **head)
            .remote(s)
        )
        worker_cls = _actor(WorkerActor, num_cpus=0)
        placements = [(p.phy2log, p.master) for p in _initial_placements(self.topology, s.lm)]
        for r in range(self.topology.num_ranks):
            dc_name = dcs[int(self.topology.rank_dc[r])].name
            self.workers.append(
                worker_cls.options(name=f"worker-{r}", label_selector={"dc": dc_name}).remote(
                    r, s, placements, self.shaper, self.controller
                )
            )
        ray.get(self.controller.attach.remote(self.workers))
        self.nodes = ray.get([w.ping.remote() for w in self.workers])
        self.executor = RayExecutor(self.workers)

    def node_dcs(self) -> list[str]:
        """DC label of the node each worker runs on."""
        label = {n["NodeID"]: n.get("Labels", {}).get("dc") for n in ray.nodes()}
        return [label.get(p["node"], "") for p in self.nodes]

    def run_step(self) -> StepResult:
        """Train one step, then let the controller plan/apply. Returns the measurements."""
        self.step += 1
        t0 = time.perf_counter()
        stats = train_step(self.executor, self.step, self.settings.lm.num_layers)
        step_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        ctl = ray.get(self.controller.control.remote(self.step))
        control_s = time.perf_counter() - t1
        total = np.sum([np.asarray(s["bytes"]) for s in stats], axis=0)
        delta, self._bytes = total - self._bytes, total
        computed = np.stack([np.asarray(s["computed"]) for s in stats])  # [R, L]
        imb = max(imbalance(computed[:, layer]) for layer in range(computed.shape[1]))
        return StepResult(
            step=self.step,
            loss=float(sum(s["loss"] for s in stats)),
            step_seconds=step_s,
            control_seconds=control_s,
            imbalance=imb,
            imbalance_before=ctl.get("imbalance_before"),
            imbalance_after=ctl.get("imbalance_after"),
            plan_version=int(stats[0]["version"]),
            cross_dc_token_bytes=int(delta[0].sum()),
            cross_dc_weight_bytes=int(delta[1].sum()),
            bytes_by_pair=delta.tolist(),
            tokens_per_rank=computed.sum(axis=1).tolist(),
            error=ctl.get("error"),
        )

    def status(self) -> dict[str, Any]:
        return dict(ray.get(self.controller.status.remote()))

    def shutdown(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
