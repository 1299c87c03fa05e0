"""Replay what the runtime trained on: predict each step's time from its trace and plans.

The runtime writes, for a training run, the two interchange files the planner already
reads (README: Interchange formats):

- a **trace** ``.npz``: ``load`` int64 ``[T, L, R, E]`` (the gate's exact counts of each
  step), with ``meta`` holding :class:`RuntimeMeta` (the topology it ran on, the model's
  sizes, the dense parameter count, the encoding, and the measured step seconds);
- a **plan** ``.npz``: the ``phy2log``/``master``/``route`` of every step and layer it ran.

:func:`replay` models each step with :func:`~expertmesh.planner.stepmodel.training_step_cost`
(the runtime's own order of rounds, the layout of the plan, the calibrated ``F`` and ``o``
of :class:`Calibration`) and compares the median with the measured one. Pure: the CLI
(``expertmesh sim replay``) reads the files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from expertmesh.planner.costmodel import CostSettings, TransferEncoding
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import Placement
from expertmesh.planner.stepmodel import step_layout, training_step_cost
from expertmesh.planner.topology import Topology
from expertmesh.planner.traffic import traffic_from_route

__all__ = ["Calibration", "Replay", "RuntimeMeta", "replay"]


class Calibration(BaseModel):
    """The constants ``make bench-runtime`` measures on a machine (docs/cost-model.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    flops_per_second: float = Field(gt=0, description="expert FLOP/s of one rank, measured")
    message_seconds: float = Field(ge=0, le=60, description="fixed seconds of one round")


class RuntimeMeta(BaseModel):
    """The ``meta`` of a trace the runtime writes (JSON object; extra keys are kept)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    topology: dict[str, Any] = Field(description="the topology it ran on (the YAML structure)")
    top_k: int = Field(ge=1, le=64)
    hidden: int = Field(ge=1)
    ffn_hidden: int = Field(ge=1)
    dense_params: int = Field(default=0, ge=0, description="parameters outside the experts")
    weight_bytes: int = Field(default=4, ge=1, le=8, description="bytes per weight (fp32: 4)")
    grad_bytes: int = Field(default=4, ge=1, le=8)
    act_bytes: int = Field(default=4, ge=1, le=8)
    encoding: TransferEncoding = Field(default_factory=TransferEncoding)
    policy: str = "?"
    step_seconds: list[float] = Field(
        default_factory=list, description="measured seconds of every step, in order"
    )


@dataclass(frozen=True)
class Replay:
    """Per-step predicted seconds ``[T]``; measured ones ``[T]`` (empty if not in the meta);
    the medians and the relative error of the predicted median."""

    predicted: np.ndarray
    measured: np.ndarray

    @property
    def predicted_median(self) -> float:
        return float(np.median(self.predicted)) if self.predicted.size else float("nan")

    @property
    def measured_median(self) -> float:
        return float(np.median(self.measured)) if self.measured.size else float("nan")

    @property
    def error(self) -> float:
        """``predicted median / measured median - 1`` (nan without measurements)."""
        m = self.measured_median
        return self.predicted_median / m - 1.0 if m > 0 else float("nan")


def replay(
    load: np.ndarray,
    meta: RuntimeMeta,
    phy2log: np.ndarray,
    master: np.ndarray,
    route: np.ndarray,
    *,
    calibration: Calibration,
) -> Replay:
    """Model every step of a runtime run.

    - ``load``: [T, L, R, E] the trace; ``phy2log``: [T, L, R, S]; ``master``: [T, L, E]
      flat slots; ``route``: [N, 6] ``(step, layer, src, expert, dst, tokens)`` rows.
    - Returns one predicted step time per ``t`` (``ValueError`` when the shapes disagree).
    """
    topology = Topology.from_dict(meta.topology)
    num_steps, num_layers, num_ranks, num_experts = load.shape
    if phy2log.shape[:3] != (num_steps, num_layers, num_ranks):
        raise ValueError(f"plan phy2log {phy2log.shape} does not match the trace {load.shape}")
    if master.shape != (num_steps, num_layers, num_experts):
        raise ValueError(f"plan master {master.shape} is not [T, L, E] of the trace")
    if num_ranks != topology.num_ranks:
        raise ValueError(f"trace has {num_ranks} ranks, its topology {topology.num_ranks}")
    if meta.step_seconds and len(meta.step_seconds) != num_steps:
        raise ValueError(f"meta has {len(meta.step_seconds)} step times for {num_steps} steps")
    model = ModelSpec(
        num_layers=num_layers, num_experts=num_experts, top_k=meta.top_k, hidden=meta.hidden,
        ffn_hidden=meta.ffn_hidden, weight_bytes=meta.weight_bytes, grad_bytes=meta.grad_bytes,
        act_bytes=meta.act_bytes,
    )  # fmt: skip
    cost = CostSettings(
        flops_per_second=calibration.flops_per_second,
        message_seconds=calibration.message_seconds,
    )
    route = np.asarray(route, np.int64).reshape(-1, 6)
    order = np.lexsort((route[:, 1], route[:, 0]))
    route = route[order]
    key = route[:, 0] * num_layers + route[:, 1]
    bounds = np.searchsorted(key, np.arange(num_steps * num_layers + 1))
    out = np.zeros(num_steps)
    for t in range(num_steps):
        placements, routes, traffic = [], [], []
        for layer in range(num_layers):
            i = t * num_layers + layer
            rows = route[bounds[i] : bounds[i + 1], 2:]
            placements.append(Placement(phy2log[t, layer], master[t, layer]))
            routes.append(rows)
            traffic.append(traffic_from_route(rows, load[t, layer], topology, model.top_k))
        layout = step_layout(placements, routes, topology)
        out[t] = training_step_cost(
            topology, model, traffic, placements, dense_params=meta.dense_params,
            settings=cost, encoding=meta.encoding, layout=layout,
        ).seconds  # fmt: skip
    return Replay(out, np.asarray(meta.step_seconds, dtype=np.float64))
