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
from expertmesh.sim.engine import SimResult, dense_source, simulate

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
    counts: list[PositiveInt] = Field(default=[8, 32, 125, 250, 500, 1000], min_length=1)
    steps: int | None = Field(default=None, ge=1, description="override trace.steps here")


class SweepConfig(_Strict):
    policies: list[str] = Field(default_factory=lambda: list(DEFAULT_POLICIES), min_length=1)
    policy_settings: dict[str, dict[str, Any]] = Field(default_factory=dict)
    model: ModelSpec = ModelSpec()
    cost: CostSettings = CostSettings()
    trace: TraceSpec = TraceSpec()
    bandwidth: BandwidthSweep | None = BandwidthSweep()
    dcs: DCSweep | None = DCSweep()


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
    """One point of a sweep: ``kind`` is ``"bandwidth"`` (x in Gbit/s) or ``"dcs"``."""

    kind: str
    x: float
    topology: Topology
    result: SimResult = field(repr=False)


def points(config: SweepConfig) -> list[tuple[str, float, Topology, int]]:
    """Every (kind, x, topology, steps) the sweep runs, in order."""
    out: list[tuple[str, float, Topology, int]] = []
    if config.bandwidth is not None:
        for g in config.bandwidth.gbps:
            topo = config.bandwidth.topology.build(inter_dc_gbps=g)
            out.append(("bandwidth", g, topo, config.trace.steps))
    if config.dcs is not None:
        steps = config.dcs.steps or config.trace.steps
        for n in config.dcs.counts:
            out.append(("dcs", float(n), config.dcs.topology.build(dcs=n), steps))
    return out


def run_sweep(
    config: SweepConfig,
    progress: Callable[[int], None] | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
) -> list[SweepPoint]:
    """Run every point of ``config``; ``progress(n)`` after each step of a point."""
    model = config.model
    out: list[SweepPoint] = []
    for kind, x, topo, steps in points(config):
        trace = generate_trace(config.trace.settings(topo.num_ranks, model, steps))
        source = dense_source(trace.load)
        result = simulate(
            source,
            topo,
            model,
            list(config.policies),
            policy_settings=config.policy_settings,
            cost=config.cost,
            progress=progress,
        )
        point = SweepPoint(kind, x, topo, result)
        out.append(point)
        if on_point is not None:
            on_point(point)
    return out
