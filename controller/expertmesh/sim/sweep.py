"""Sweeps: speedup over ``static`` against inter-DC bandwidth and against the number of DCs.

A sweep is a validated config (YAML for ``expertmesh sim sweep --config``):

```yaml
policies: [static, eplb, fastermoe, quota, hybrid]
model: {num_experts: 256, top_k: 8, hidden: 7168, ffn_hidden: 2048}
cost: {flops_per_second: 4.0e14}
trace: {steps: 20, tokens_per_rank: 8192, imbalance: 2.0, drift: 0.02, seed: 0}
bandwidth:                      # one topology, every inter-DC bandwidth
  topology: {dcs: 2, ranks_per_dc: 64, nodes_per_dc: 8}
  gbps: [400, 100, 25, 10, 1]
dcs:                            # one inter-DC bandwidth, every DC count
  topology: {ranks_per_dc: 8, inter_dc_gbps: 10}
  counts: [8, 32, 125, 250, 500, 1000]
```

Every point runs every policy on the same generated trace and topology.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError

from expertmesh.planner.costmodel import CostSettings
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.topology import Topology
from expertmesh.planner.trace import TraceSettings, generate_trace
from expertmesh.sim.engine import LoadSource, SimResult, dense_source
from expertmesh.sim.groups import auto_group_dcs, simulate_groups

__all__ = ["SweepConfig", "SweepPoint", "load_sweep_config", "run_sweep"]

DEFAULT_POLICIES = ["static", "eplb", "fastermoe", "quota", "hybrid"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TopologySpec(_Strict):
    """A generated topology (:meth:`Topology.generate`)."""

    dcs: int = Field(default=2, ge=1, le=100_000)
    ranks_per_dc: int = Field(default=8, ge=1, le=100_000)
    nodes_per_dc: int = Field(default=1, ge=1, le=100_000)
    masters: int = Field(default=4, ge=1, le=4096)
    spare: int = Field(default=2, ge=0, le=4096)
    inter_dc_gbps: float = Field(default=10.0, gt=0)
    inter_dc_latency_ms: float = Field(default=20.0, ge=0)
    ep_dcs: int | None = Field(
        default=None,
        ge=1,
        description="DCs per data-parallel EP group (None: the fewest whose master slots hold "
        "every expert, when that divides dcs; = dcs: one group); see expertmesh.sim.groups",
    )

    def build(self, **override: Any) -> Topology:
        spec = self.model_copy(update=override)
        return Topology.generate(
            spec.dcs,
            spec.ranks_per_dc,
            nodes_per_dc=spec.nodes_per_dc,
            masters=spec.masters,
            spare=spec.spare,
            inter_dc_gbps=spec.inter_dc_gbps,
            inter_dc_latency_ms=spec.inter_dc_latency_ms,
        )

    def grouped(self, num_experts: int, **override: Any) -> tuple[Topology, int]:
        """The topology of one EP group and the number of groups (1: the whole world)."""
        spec = self.model_copy(update=override)
        per = spec.ep_dcs or auto_group_dcs(spec.dcs, spec.ranks_per_dc, num_experts, spec.masters)
        if spec.dcs % per:
            raise ValueError(f"sweep config: ep_dcs {per} does not divide {spec.dcs} DCs")
        return spec.build(dcs=per), spec.dcs // per


class TraceSpec(_Strict):
    """The generated trace of every point (:mod:`expertmesh.planner.trace`): Zipf popularity
    calibrated so that static EP on ``reference_ranks`` ranks (default: one per expert, the
    same skew at any scale) shows ``imbalance`` max/mean, drifting by ``drift`` a step."""

    steps: int = Field(default=20, ge=1, le=1_000_000)
    tokens_per_rank: int = Field(default=8192, ge=1)
    imbalance: float = Field(default=2.0, ge=1.0)
    drift: float = Field(default=0.02, ge=0.0, le=1.0)
    regime_every: int = Field(default=0, ge=0)
    reference_ranks: int | None = Field(default=None, ge=1)
    seed: int = Field(default=0, ge=0)

    def settings(self, num_ranks: int, model: ModelSpec, steps: int | None = None) -> TraceSettings:
        """The :class:`TraceSettings` for ``num_ranks`` ranks of ``model``."""
        return TraceSettings(
            num_ranks=num_ranks,
            num_experts=model.num_experts,
            num_layers=model.num_layers,
            num_steps=steps or self.steps,
            top_k=model.top_k,
            tokens_per_rank=self.tokens_per_rank,
            imbalance=self.imbalance,
            drift=self.drift,
            regime_every=self.regime_every,
            seed=self.seed,
            reference_ranks=self.reference_ranks or model.num_experts,
        )


class BandwidthSweep(_Strict):
    topology: TopologySpec = TopologySpec(dcs=2, ranks_per_dc=64, nodes_per_dc=8)
    gbps: list[PositiveFloat] = Field(default=[400, 100, 25, 10, 1], min_length=1)


class DCSweep(_Strict):
    topology: TopologySpec = TopologySpec()
    counts: list[PositiveInt] = Field(default=[8, 32, 128, 256, 512, 1000], min_length=1)
    steps: int | None = Field(default=None, ge=1, description="override trace.steps here")
    scale_gbps: list[PositiveFloat] = Field(
        default_factory=list,
        description="also run the largest count at each of these inter-DC bandwidths "
        "(points of kind 'scale', x = Gbit/s)",
    )


class RegimeSweep(_Strict):
    """Bandwidth x microbatches per optimizer update x tokens per rank on one topology (the
    regimes where a copy is worth its sync); points of kind 'regime', labelled ``name``."""

    name: str = Field(default="regime", min_length=1, max_length=80)
    topology: TopologySpec = TopologySpec(dcs=8, ranks_per_dc=8)
    gbps: list[PositiveFloat] = Field(default=[400, 10, 0.1], min_length=1)
    microbatches_per_update: list[PositiveInt] = Field(default=[1, 16], min_length=1)
    tokens_per_rank: list[PositiveInt] = Field(default=[8192], min_length=1)
    steps: int | None = Field(default=None, ge=1, description="override trace.steps here")


class DispatchStudy(_Strict):
    """Hierarchical dispatch against a flat all-to-all on one topology (``bench/results.py``)."""

    topology: TopologySpec = TopologySpec(dcs=8, ranks_per_dc=8)
    gbps: list[PositiveFloat] = Field(default=[100, 10, 1], min_length=1)
    steps: int | None = Field(default=None, ge=1, description="override trace.steps here")


class EPSpec(_Strict):
    """One expert-parallel layout of a single DC: ``ranks`` over ``nodes``."""

    ranks: int = Field(ge=1, le=100_000)
    nodes: int = Field(default=1, ge=1, le=100_000)
    masters: int = Field(ge=1, le=4096)
    spare: int = Field(default=2, ge=0, le=4096)


class StragglerStudy(_Strict):
    """Token straggler per policy inside one DC (FEPLB's setting; ``bench/results.py``)."""

    model: ModelSpec = ModelSpec(num_experts=128)
    trace: TraceSpec = TraceSpec()
    ep: list[EPSpec] = Field(min_length=1)


class SweepConfig(_Strict):
    policies: list[str] = Field(default_factory=lambda: list(DEFAULT_POLICIES), min_length=1)
    policy_settings: dict[str, dict[str, Any]] = Field(default_factory=dict)
    model: ModelSpec = ModelSpec()
    cost: CostSettings = CostSettings()
    trace: TraceSpec = TraceSpec()
    bandwidth: BandwidthSweep | None = BandwidthSweep()
    dcs: DCSweep | None = DCSweep()
    regime: list[RegimeSweep] = Field(
        default_factory=list, description="regime grids, each on its own topology"
    )
    dispatch: DispatchStudy | None = None
    feplb: StragglerStudy | None = None


def load_sweep_config(data: Any) -> SweepConfig:
    """Validate a parsed YAML mapping; ``ValueError`` naming the bad key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError("sweep config: expected a mapping")
    try:
        return SweepConfig.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"]) or "config"
        raise ValueError(f"sweep config: {where}: {e['msg']}") from None


@dataclass
class SweepPoint:
    """One point of a sweep: ``kind`` is ``"bandwidth"`` (x in Gbit/s), ``"dcs"``, ``"scale"``
    (the largest DC count, x in Gbit/s) or ``"regime"`` (x in Gbit/s, with ``microbatches``
    per update and ``tokens_per_rank``). ``topology`` is one EP group's, ``groups`` of them."""

    kind: str
    x: float
    topology: Topology
    result: SimResult = field(repr=False)
    groups: int = 1
    microbatches: int = 1
    tokens_per_rank: int = 0
    label: str = ""


@dataclass(frozen=True)
class _Point:
    kind: str
    x: float
    topology: Topology
    groups: int
    steps: int
    microbatches: int | None = None
    tokens_per_rank: int | None = None
    label: str = ""


def points(config: SweepConfig) -> list[_Point]:
    """Every point the sweep runs, in order."""
    out: list[_Point] = []
    e = config.model.num_experts
    steps = config.trace.steps
    if config.bandwidth is not None:
        for g in config.bandwidth.gbps:
            topo, n = config.bandwidth.topology.grouped(e, inter_dc_gbps=g)
            out.append(_Point("bandwidth", g, topo, n, steps))
    if config.dcs is not None:
        dcs = config.dcs
        steps = dcs.steps or config.trace.steps
        for c in dcs.counts:
            topo, n = dcs.topology.grouped(e, dcs=c)
            out.append(_Point("dcs", float(c), topo, n, steps))
        for g in dcs.scale_gbps:
            topo, n = dcs.topology.grouped(e, dcs=max(dcs.counts), inter_dc_gbps=g)
            out.append(_Point("scale", g, topo, n, steps))
    for reg in config.regime:
        steps = reg.steps or config.trace.steps
        for tpr in reg.tokens_per_rank:
            for m in reg.microbatches_per_update:
                for g in reg.gbps:
                    topo, n = reg.topology.grouped(e, inter_dc_gbps=g)
                    out.append(_Point("regime", g, topo, n, steps, m, tpr, reg.name))
    return out


def run_sweep(
    config: SweepConfig,
    progress: Callable[[int], None] | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
    workers: int = 1,
) -> list[SweepPoint]:
    """Run every point of ``config``; ``progress(n)`` after each step of a point (one
    worker only). ``workers`` > 1: that many processes run points side by side (each point
    is independent and deterministic, so the numbers are those of one worker; the solve
    times a policy charges are CPU seconds, as long as every worker has a core); the
    points come back in order, ``on_point`` as each finishes."""
    pts = points(config)
    if workers <= 1:
        out: list[SweepPoint] = []
        for p in pts:
            out.append(_run_point(config, p, progress))
            if on_point is not None:
                on_point(out[-1])
        return out
    from concurrent.futures import ProcessPoolExecutor, as_completed

    done: dict[int, SweepPoint] = {}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        # the largest points first, so the last ones to finish are small
        order = sorted(range(len(pts)), key=lambda i: -_size(pts[i]))
        futures = {pool.submit(_run_point, config, pts[i]): i for i in order}
        for fut in as_completed(futures):
            done[futures[fut]] = fut.result()
            if on_point is not None:
                on_point(done[futures[fut]])
    return [done[i] for i in range(len(pts))]


def _size(p: _Point) -> int:
    """Rank-steps of a point: how long it runs, roughly."""
    return p.groups * p.topology.num_ranks * p.steps


def _run_point(
    config: SweepConfig, p: _Point, progress: Callable[[int], None] | None = None
) -> SweepPoint:
    model = config.model
    cost, spec = config.cost, config.trace
    if p.microbatches is not None:
        cost = cost.model_copy(update={"microbatches_per_update": p.microbatches})
    if p.tokens_per_rank is not None:
        spec = spec.model_copy(update={"tokens_per_rank": p.tokens_per_rank})

    def trace(g: int) -> LoadSource:
        s = spec.model_copy(update={"seed": spec.seed + g})
        return dense_source(generate_trace(s.settings(p.topology.num_ranks, model, p.steps)).load)

    result = simulate_groups(
        p.topology, p.groups, trace, model, list(config.policies),
        policy_settings=config.policy_settings, cost=cost, progress=progress,
    )  # fmt: skip
    return SweepPoint(
        p.kind, p.x, p.topology, result, p.groups,
        cost.microbatches_per_update, spec.tokens_per_rank, p.label,
    )  # fmt: skip
