"""What the runtime is told and what it measures: settings, step results, shared helpers.

No actor here; :mod:`expertmesh.runtime.controller`, :mod:`expertmesh.runtime.worker` and
the drivers import it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal

import numpy as np
import ray
from pydantic import BaseModel, ConfigDict, Field, model_validator

from expertmesh.controller.core import Trigger
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.planner import Placement, Topology, make_policy
from expertmesh.planner.static import static_placement
from expertmesh.workers.model import LMConfig
from expertmesh.workers.wire import WireFormat

__all__ = [
    "CONTROLLER_RESTARTS",
    "CONTROLLER_WAIT_S",
    "NAMESPACE",
    "RuntimeSettings",
    "StepResult",
    "check_dc_nodes",
    "initial_placements",
    "make_actor",
    "replicated_placement",
    "source_roots",
    "stop_ray",
]

NAMESPACE = "expertmesh"
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
    balance: bool = Field(
        default=True,
        description="the fast loop: quota inside each DC on every microbatch's exact counts "
        "(replicas in free slots, tokens by quota); off: the plan's route splits tokens",
    )
    spread: bool = Field(
        default=True,
        description="with the fast loop: every microbatch, tokens whose DC lacks their expert "
        "go to the holding DCs so that the DCs' tokens per rank even out (the world's exact "
        "counts, all-gathered); off: to the DC the plan's route names",
    )
    planner_level: bool = Field(
        default=False,
        description="every rank's per-microbatch counts ride its step report and the "
        "controller solves the planner's split by DC and quota on them (imbalance_planner: "
        "the planner's level on the step's exact tokens, beside the measured imbalance); a "
        "few ms of controller time per step at the demo's size",
    )
    spread_fused: bool = Field(
        default=True,
        description="with spread: the world counts all-gather stands in for the dispatch's "
        "sizes exchange (one WAN round trip per layer and microbatch instead of two): every "
        "rank derives what it receives from the split, and a crossing bundle carries one row "
        "per assignment (a token two of whose experts go to one DC crosses twice); off: the "
        "sizes are exchanged after the split and each token crosses a DC pair once",
    )
    migration: Literal["background", "boundary"] = Field(
        default="background",
        description="a new plan's moved masters travel in the background during the step "
        "after every rank has the plan, whose sync switches (background), or its migration "
        "rounds run at that boundary, on the critical path (boundary)",
    )
    layout: Literal["static", "replicated"] = Field(
        default="static",
        description="the initial placement: static EP (the masters alone), or replicated "
        "(the same masters, and each DC's spare slots filled so that the DC holds every "
        "expert: the calibration layout of the SPMD step model's per-copy cost, "
        "bench/bench_runtime.py)",
    )
    corpus: str | None = Field(default=None, description="corpus file; None: Python's stdlib")
    corpus_bytes: int = Field(default=4_000_000, ge=1024, description="bytes of stdlib text")
    cpus_per_dc: float = Field(default=1.0, gt=0, description="CPUs each DC's Ray node offers")
    worker_cpus: list[list[int]] | None = Field(
        default=None,
        description="per rank, the CPUs of its node its worker process is pinned to (every "
        "thread, os.sched_setaffinity; Linux), e.g. [[0], [1]]: each of 2 ranks on its own "
        "core; None: not pinned",
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
    trace_dir: str | None = Field(
        default=None,
        description="the SPMD runtime writes trace.npz and plans.npz (what it trained on, "
        "runtime/trace.py) here at every checkpoint and at the end (None: not written)",
    )
    replace_dead_workers: bool = Field(
        default=True, description="start a new worker for a dead rank in its DC; it rejoins"
    )

    load_reports: Literal["auto", "dc", "dc_ranks", "rank"] = Field(
        default="auto",
        description="how load reaches the controller: each DC's lead sends its DC's sums per "
        "layer per window (dc), per-rank sums of the window (dc_ranks), or every rank every "
        "step (rank, the old path); auto: dc_ranks for policies that split tokens per source "
        "rank (quota, fastermoe), dc otherwise (runtime/loads.py)",
    )
    load_window: int = Field(
        default=0,
        ge=0,
        le=4096,
        description="steps a DC's lead sums before it reports; 0: the trigger's period "
        "(every_n: every, otherwise 1)",
    )
    step_deadline_s: float = Field(
        default=0.0,
        ge=0,
        description="timeout of every process group's collectives: a rank waiting longer on a "
        "dead or cut peer aborts, and the driver probes the DC links (0: GROUP_TIMEOUT_S)",
    )
    probe_timeout_s: float = Field(
        default=1.0, gt=0, le=60, description="connect timeout of a link probe between two DCs"
    )

    @model_validator(mode="after")
    def _worker_cpus_fit(self) -> RuntimeSettings:
        """One non-empty set of CPU ids (>= 0) per rank of the topology."""
        if self.worker_cpus is not None:
            ranks = Topology.from_dict(self.topology).num_ranks
            if len(self.worker_cpus) != ranks:
                raise ValueError(f"worker_cpus: {len(self.worker_cpus)} entries for {ranks} ranks")
            if any(not cpus or min(cpus) < 0 for cpus in self.worker_cpus):
                raise ValueError("worker_cpus: every rank needs one or more CPU ids >= 0")
        return self

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
    step_seconds: float  # forward, backward and gradient sync (max over ranks)
    control_seconds: float
    seconds: float | None = None  # end to end: everything the step's wall time holds
    imbalance: float  # max over microbatches and layers of max/mean assignments computed
    # per microbatch and layer [k][L]: max/mean; the worst DC's own max/mean (what the fast
    # loop reaches inside DCs); the busiest DC's mean over the global mean (the cross-DC
    # floor the slow loop's experts per DC set)
    imbalance_microbatches: list[list[float]] | None = None
    imbalance_within_dc: list[list[float]] | None = None
    imbalance_floor: list[list[float]] | None = None
    imbalance_static: float | None = None  # what static EP would have had on the same tokens
    # the planner's level on the step's exact counts (RuntimeSettings.planner_level): its
    # split by DC and quota inside DCs solved by the controller on the counts, under the
    # plan the step ran: max over microbatches and layers, and per microbatch and layer
    imbalance_planner: float | None = None
    imbalance_planner_microbatches: list[list[float]] | None = None
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
    backend: str | None = None  # the collective backend the step ran on (gloo, nccl)
    replicas: int = 0  # replicas the fast loop added, summed over layers and DCs
    fanout_bytes: int = 0  # replica weights fetched inside DCs by the fast loop
    balance_seconds: float = 0.0  # counts exchange + solve + fetch, max over ranks
    balancedness: list[float] | None = None  # [L] mean / max tokens computed per rank
    ray_seconds: float | None = None  # on the workers, in Ray calls during the step
    # the plan switch right after this step: mode, seconds on the critical path (max over
    # ranks), wait_seconds, cross-DC bytes moved at the boundary and in the background
    switch: dict[str, Any] | None = None
    expert_seconds_per_assignment: float | None = None  # expert compute over assignments
    # who recorded it: "controller" (as the reports came), "workers" (a restarted controller,
    # from the reports the workers kept: the old one's record was lost), "lost" (no report
    # survived a controller restart: loss NaN, nothing else known)
    recorded: str = "controller"


def source_roots() -> str:
    """PYTHONPATH for Ray workers: the source roots this process imports expertmesh from."""
    import expertmesh.workers.layer as wr

    roots = [Path(__file__).resolve().parents[2], Path(wr.__file__).resolve().parents[2]]
    proto = roots[0].parent / "proto"
    if proto.is_dir():
        roots.append(proto)
    return os.pathsep.join(dict.fromkeys(str(r) for r in roots))


def make_actor(cls: type, **options: Any) -> Any:
    """``cls`` as a Ray actor class (built when the runtime starts, not at import)."""
    return ray.remote(**options)(cls)


def check_dc_nodes(names: list[str]) -> None:
    """ValueError unless every DC in ``names`` has an alive node labeled ``dc=<name>``."""
    have = {n.get("Labels", {}).get("dc") for n in ray.nodes() if n.get("Alive")}
    missing = [n for n in names if n not in have]
    if missing:
        ray.shutdown()
        raise ValueError(
            f"the Ray cluster has no alive node labeled dc={missing[0]} (labels: "
            f"{sorted(str(h) for h in have)}); start each DC's nodes with --labels=dc=<name>"
        )


def initial_placements(topology: Topology, lm: LMConfig, layout: str = "static") -> list[Placement]:
    """The placement every layer starts on (``RuntimeSettings.layout``)."""
    p = static_placement(
        topology.num_ranks, topology.slots_per_rank, lm.num_experts, topology.masters_per_rank
    )
    if layout == "replicated":
        p = replicated_placement(p, np.asarray(topology.rank_dc))
    elif layout != "static":
        raise ValueError(f"unknown layout {layout!r}")
    return [p] * lm.num_layers


def replicated_placement(placement: Placement, rank_dc: np.ndarray) -> Placement:
    """``placement``'s masters, and in each DC the experts it lacks copied into its ranks'
    empty slots (round robin over the DC's ranks, lowest expert first), so that every DC
    holds every expert. ``ValueError`` when a DC's empty slots are too few."""
    p2l = np.array(placement.phy2log, copy=True)
    holds = placement.holds()  # [R, E]
    for d in np.unique(rank_dc).tolist():
        ranks = np.flatnonzero(rank_dc == d)
        have = holds[ranks].any(axis=0)
        free = [(r, s) for s in range(p2l.shape[1]) for r in ranks.tolist() if p2l[r, s] < 0]
        lack = np.flatnonzero(~have).tolist()
        if len(lack) > len(free):
            raise ValueError(f"DC {d} has {len(free)} empty slots for {len(lack)} missing experts")
        for (r, s), e in zip(free, lack, strict=False):
            p2l[r, s] = e
    return Placement(phy2log=p2l, master=np.array(placement.master, copy=True))


def stop_ray(rt: Any) -> None:
    """A driver's end (either plane): the controller's surfaces stopped, its plan store
    dropped when it lives on a cluster we joined, Ray shut down, our local cluster gone
    (``rt``: ``surfaces``, ``address``, ``controller``, ``cluster``)."""
    log = logging.getLogger(__name__)
    if ray.is_initialized():
        if rt.surfaces is not None:
            try:
                ray.get(rt.controller.stop_surfaces.remote(), timeout=30)
            except Exception:
                log.exception("stopping the surfaces failed")
            rt.surfaces = None
        if rt.address is not None and getattr(rt, "controller", None) is not None:
            try:
                ray.get(rt.controller.drop_store.remote(), timeout=30)
            except Exception:
                log.exception("removing the controller's plan store failed")
        ray.shutdown()
    if rt.cluster is not None:
        rt.cluster.shutdown()
        rt.cluster = None
