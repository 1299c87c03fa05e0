"""Request and response models of the REST API (explicit, with bounds)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from expertmesh.controller.core import Trigger
from expertmesh.controller.store import PlanSummary

MAX_COUNT = 2**40
MAX_RANKS = 65_536
MAX_EXPERTS = 65_536

Count = Annotated[int, Field(strict=True, ge=0, le=MAX_COUNT)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorOut(_Out):
    error: str = Field(description="what was wrong, in one line")
    detail: list[dict[str, Any]] | None = Field(default=None, description="validation errors")


# ---- topology ----


class DCOut(_Out):
    name: str
    index: int
    nodes: int
    ranks_per_node: int
    first_rank: int
    num_ranks: int


class LinkOut(_Out):
    a: str
    b: str
    gbps: float
    latency_ms: float


class ModelOut(_Out):
    num_layers: int
    num_experts: int
    top_k: int
    hidden: int
    ffn_hidden: int
    expert_bytes: int


class TopologyOut(_Out):
    dcs: list[DCOut]
    num_ranks: int
    masters_per_rank: int
    spare_per_rank: int
    slots_per_rank: int
    intra_node: LinkOut
    intra_dc: LinkOut
    inter_dc: LinkOut
    dc_links: list[LinkOut] = Field(description="every DC pair (a < b) with its link")
    model: ModelOut


# ---- layers ----


class LayerOut(_Out):
    layer: int
    loads: int = Field(description="complete loads in the window")
    newest_step: int | None
    imbalance: float = Field(description="newest load under the committed placement, max/mean")
    balancedness: float
    expert_load: list[float] = Field(description="[E] mean tokens per microbatch")
    rank_load: list[float] = Field(description="[R] mean tokens sent per source rank")


class LayersOut(_Out):
    layers: list[LayerOut]


# ---- plans ----


# One field list: the plan store's summary is the response model.
class PlanSummaryOut(PlanSummary):
    """A committed plan's metrics, without its arrays."""


class PlansPage(_Out):
    items: list[PlanSummaryOut]
    total: int
    offset: int
    limit: int


class TransferOut(_Out):
    expert: int
    src_rank: int
    dst_rank: int
    dst_slot: int
    nbytes: int
    round: int
    kind: str


class LayerPlanOut(_Out):
    layer: int
    phy2log: list[list[int]] = Field(description="[R, S] logical expert per slot, -1 empty")
    master: list[int] = Field(description="[E] flat slot r * S + s of each expert's master")
    logcnt: list[int] = Field(description="[E] copies of each expert")
    rank_tokens: list[int] = Field(description="[R] tokens each rank computes under the route")
    imbalance: float
    solve_seconds: float
    migrations: list[TransferOut]
    migration_seconds: float
    route: list[list[int]] | None = Field(
        default=None, description="[N, 4] (src_rank, expert, dst_rank, tokens) if asked for"
    )


class PlanOut(PlanSummaryOut):
    layers: list[LayerPlanOut]


# ---- engine placements (GET /plans/{version}/export; docs/engines.md) ----


class SglangPlacementOut(_Out):
    """SGLang ``--init-expert-location`` file: exactly this key (SGLang passes every key on)."""

    physical_to_logical_map: list[list[int]] = Field(
        description="[N, P] logical expert of each physical expert per model layer"
    )


class VllmPlacementOut(_Out):
    """vLLM ``EplbModelState`` maps per MoE layer."""

    physical_to_logical_map: list[list[int]] = Field(description="[L, P]")
    logical_to_physical_map: list[list[list[int]]] = Field(
        description="[L, E, P - E + 1] physical experts of each logical expert, -1 padded"
    )
    logical_replica_count: list[list[int]] = Field(description="[L, E]")


class TrtllmPlacementOut(_Out):
    """TensorRT-LLM MoE load balancer config (served as YAML)."""

    num_slots: int = Field(description="P = EP size x slots per rank")
    layer_updates_per_iter: int
    initial_global_assignments: dict[int, list[int]] = Field(
        description="model layer -> [expert of each slot], each rank's slots contiguous"
    )


class SlotChangeOut(_Out):
    rank: int
    slot: int
    before: int
    after: int


class LayerDiffOut(_Out):
    layer: int
    changed_slots: list[SlotChangeOut]
    migrations: list[TransferOut]
    migration_bytes: int
    imbalance_before: float
    imbalance_after: float


class PlanDiffOut(_Out):
    from_version: int
    to_version: int
    layers: list[LayerDiffOut]
    changed_slots: int
    migrations: int
    migration_bytes: int


# ---- what-if solve ----


class SolveIn(_In):
    load: list[Annotated[list[Count], Field(max_length=MAX_EXPERTS)]] = Field(
        max_length=MAX_RANKS, description="[R, E] tokens from source rank r to expert e"
    )
    policy: str | None = Field(default=None, max_length=64, description="default: the active one")
    policy_settings: dict[str, Any] = Field(default_factory=dict)
    layer: int = Field(default=0, ge=0, le=4096, description="layer whose committed plan is prev")
    from_committed: bool = Field(
        default=True, description="plan from the committed placement (migrations against it)"
    )


class SolveOut(_Out):
    policy: str
    imbalance_before: float = Field(description="the load under the committed (or static) plan")
    imbalance_after: float
    plan: LayerPlanOut


# ---- policy ----


class PolicyOut(_Out):
    policy: str
    policy_settings: dict[str, Any]
    trigger: Trigger
    window: int
    available: list[str]


class PolicyIn(_In):
    policy: str = Field(max_length=64)
    policy_settings: dict[str, Any] = Field(default_factory=dict)
    trigger: Trigger | None = None
    window: int | None = Field(default=None, ge=1, le=4096)


# ---- reports ----


class ReportIn(_In):
    step: int = Field(strict=True, ge=0, le=2**62)
    layer: int = Field(strict=True, ge=0, le=4096)
    rank: int = Field(strict=True, ge=0, le=MAX_RANKS)
    load: list[Count] = Field(max_length=MAX_EXPERTS, description="[E] tokens to each expert")


class LayerReportIn(_In):
    step: int = Field(strict=True, ge=0, le=2**62)
    layer: int = Field(strict=True, ge=0, le=4096)
    load: list[Annotated[list[Count], Field(max_length=MAX_EXPERTS)]] = Field(
        max_length=MAX_RANKS, description="[R, E]"
    )


class ReportOut(_Out):
    accepted: bool
    complete: bool = Field(description="this report completed the step's [R, E] load")
    received: int
    rejected: int


# ---- health ----


class HealthOut(_Out):
    status: Literal["ok"]


class ReadyOut(_Out):
    ready: bool
    checks: dict[str, bool]


# ---- dashboard ----


class StepOut(_Out):
    step: int
    seconds: float
    loss: float | None
    imbalance: float
    tokens: int
    at: float


class BalanceStepOut(_Out):
    """One SPMD step's measured balance (what the data plane's fast loop did)."""

    step: int
    imbalance: float = Field(
        description="max over microbatches and layers of max/mean tokens computed per rank"
    )
    imbalance_static: float = Field(description="what static EP would have had on the tokens")
    balancedness: list[float] = Field(description="[L] mean/max tokens computed per rank")
    replicas: int = Field(description="replicas the fast loop added, over layers and domains")
    fanout_bytes: int = Field(description="replica weights fetched inside domains")
    balance_seconds: float = Field(
        description="exposed fast-loop seconds: counts exchange + quota solve + replica-fetch "
        "wait not hidden by compute, summed over microbatches, max over ranks"
    )
    seconds: float = Field(description="end-to-end step")
    at: float
    microbatches: list[list[float]] = Field(
        default_factory=list,
        description="[k][L] max/mean tokens computed per rank, per microbatch and layer",
    )
    within_dc: list[list[float]] = Field(
        default_factory=list,
        description="[k][L] the worst DC's max/mean over its own ranks (what the fast loop, "
        "balancing inside each DC, reaches)",
    )
    floor: list[list[float]] = Field(
        default_factory=list,
        description="[k][L] the busiest DC's mean tokens per rank over the global mean (the "
        "floor the slow loop's experts per DC set under the measured imbalance)",
    )
    planner: list[list[float]] = Field(
        default_factory=list,
        description="[k][L] the planner's level: max/mean tokens per rank its own split by DC "
        "and quota reach on the same exact counts under the same plan, solved by the "
        "controller (empty where the runtime does not solve it)",
    )
    imbalance_planner: float | None = Field(
        default=None,
        description="the planner's level, max over microbatches and layers (null where not "
        "solved), beside the measured imbalance",
    )


class BalanceOut(_Out):
    """Recent measured steps, oldest first (the controller keeps a bounded history)."""

    steps: list[BalanceStepOut]
    num_layers: int
    history: int = Field(description="steps the controller keeps")


class PlanEventOut(_Out):
    event: str
    version: int
    step: int
    policy: str
    imbalance_before: float
    imbalance_after: float
    migrations: int
    migration_bytes: int
    solve_seconds: float
    at: float


class DCLinkTrafficOut(_Out):
    src: str
    dst: str
    token_bytes: float
    weight_bytes: float
    gbps: float


class WorkerOut(_Out):
    rank: int
    dc: str
    up: bool | None = Field(
        description="the worker's health as a runtime reports it; None: no runtime reported it "
        "(`expertmesh serve` has none: see last_report)"
    )
    since: float | None
    last_report: float | None = Field(
        default=None, description="unix time of the rank's newest accepted load report; None: none"
    )


class DashboardOut(_Out):
    """Everything the dashboard draws, in one poll."""

    now: float
    plan_version: int
    policy: str
    heatmap: list[list[float]] = Field(description="[L, E] mean tokens per expert (window)")
    rank_before: list[float] = Field(description="[R] tokens per rank under static EP (newest)")
    rank_after: list[float] = Field(description="[R] tokens per rank under the committed plan")
    imbalance_before: float
    imbalance_after: float
    layer_imbalance: list[float | None] = Field(
        description="[L] max/mean of each layer's newest load under the committed plan; "
        "null for a layer without a complete load yet"
    )
    runtime: bool = Field(
        description="a runtime records steps, cross-DC traffic and worker health (`expertmesh "
        "demo`); false under `expertmesh serve`, which only receives load reports"
    )
    steps: list[StepOut]
    balance: list[BalanceStepOut] = Field(description="measured balance of recent SPMD steps")
    plan_events: list[PlanEventOut]
    plans: list[PlanSummaryOut]
    dcs: list[DCOut]
    links: list[DCLinkTrafficOut]
    workers: list[WorkerOut]
    reports_received: int
    reports_rejected: int
