"""Replay what the SPMD runtime trained on: predict each step's time from its trace and plans.

The runtime writes, for a training run (``expertmesh.runtime.trace``; ``make demo``: into
``out/``):

- ``trace.npz``: ``load`` int64 ``[T, L, R, E]`` (the gate's exact counts of each step as
  the controller saw them), ``meta`` a :class:`RuntimeMeta` (topology, model sizes,
  policy, microbatches, tokens per rank, how plans were switched, and per step its plan
  version, measured end-to-end seconds, bytes between DCs as the workers counted them,
  per DC pair and per collective that crossed, replica weights the fast loop fetched);
- ``plans.npz``: per step the plan it ran on (``phy2log``, ``master``, ``route`` rows
  ``(step, layer, src, expert, dst, tokens)``: the plan's route, whose shares split the
  step's tokens) and, in its meta, each version's migration collectives.

:func:`replay` models every step with :func:`~expertmesh.planner.stepmodel.spmd_step_cost`
(docs/cost-model.md, "A training step of the SPMD data plane"): the collectives the
step's plan issues (which layers let tokens cross DCs, the expert sync's hops, a plan
switch: in the background, the moved masters' transfer during the switch step and a sync
from the old plan's holders to the new plan's masters and copies; at the boundary, the
migration rounds after the step; the fast loop's exchanges), the bytes of each collective
that crossed DCs (each takes its busiest pair's time, the step their sum), and the
machine constants of :class:`Calibration` (``make bench-runtime`` writes them:
``out/bench-runtime/cal-<D>dc-<speed>.yaml``). What it takes as given, not
predicted: the bytes (the trace's counts; the load alone does not say how many distinct
tokens a rank sends to a DC) and whether the fast loop fetched replicas in a step. Pure:
the CLI (``expertmesh sim replay``) reads the files.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from expertmesh.planner.costmodel import TransferEncoding
from expertmesh.planner.dcsplit import can_spread
from expertmesh.planner.plan import Placement
from expertmesh.planner.stepmodel import (
    SpmdCollectives,
    copies_per_rank,
    spmd_step_cost,
    sync_hops,
)
from expertmesh.planner.topology import Topology
from expertmesh.workers.layerplan import LayerPlan  # which layers let tokens cross DCs

__all__ = ["Calibration", "Replay", "RuntimeMeta", "fit_copy_constants", "planned_from", "replay"]


class Calibration(BaseModel):
    """The machine constants of the SPMD step model, measured by ``make bench-runtime``
    (static EP on free links at two batch sizes, and a layout holding more copies) for
    one shape of run."""

    model_config = ConfigDict(frozen=True, extra="allow", allow_inf_nan=False)

    seconds_per_token: float = Field(
        ge=0, le=1, description="a: compute and intra-DC copies per token a rank trains"
    )
    collective_seconds: float = Field(
        ge=0, le=60, description="c: the software cost of one collective"
    )
    copy_seconds: float = Field(
        default=0.0,
        ge=0,
        le=60,
        description="h: the cost of one expert copy a rank holds, per step (0: not calibrated)",
    )
    ranks: int | None = Field(
        default=None, ge=1, description="ranks of the runs it was measured on (checked)"
    )


def fit_copy_constants(
    static: tuple[float, float, float], replicated: tuple[float, float, float]
) -> dict[str, Any]:
    """``c`` and ``h`` of :class:`Calibration` from two layouts' ``(collectives, copies per
    rank, seconds)``, the seconds a step's CPU beyond its tokens (``T - a * tokens - links``
    over free links): ``c * collectives + h * copies = seconds`` on both. Solved exactly
    when the solution is non-negative; neither constant can be negative (a collective
    issued or a copy held never makes a step faster), so when the exact solution has a
    negative one (the layouts' residuals differ by less than the machine's noise) the fit
    is the non-negative least-squares one (``scipy.optimize.nnls``: that constant at its
    bound 0, the other the best fit to both layouts). Returns ``collective_seconds``,
    ``copy_seconds``, ``fit`` (which of the two) and, for the second, the exact solution
    (``exact_collective_seconds``, ``exact_copy_seconds``; nan when singular)."""
    from scipy.optimize import nnls

    lhs = np.array([static[:2], replicated[:2]], dtype=np.float64)
    rhs = np.array([static[2], replicated[2]], dtype=np.float64)
    singular = abs(np.linalg.det(lhs)) <= 1e-9 * max(float(np.abs(lhs).max()), 1.0) ** 2
    exact = np.full(2, np.nan) if singular else np.linalg.solve(lhs, rhs)
    if not singular and (exact >= 0).all():
        return {"collective_seconds": float(exact[0]), "copy_seconds": float(exact[1]),
                "fit": "exact"}  # fmt: skip
    ch, _ = nnls(lhs, np.maximum(rhs, 0.0))
    return {
        "collective_seconds": float(ch[0]),
        "copy_seconds": float(ch[1]),
        "fit": "non-negative least squares (the exact solution has a negative constant)",
        "exact_collective_seconds": float(exact[0]),
        "exact_copy_seconds": float(exact[1]),
    }


class RuntimeMeta(BaseModel):
    """The ``meta`` of a trace the SPMD runtime writes (JSON object; extra keys are kept)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    topology: dict[str, Any] = Field(description="the topology it ran on (the YAML structure)")
    top_k: int = Field(ge=1, le=64)
    hidden: int = Field(ge=1)
    ffn_hidden: int = Field(ge=1)
    weight_bytes: int = Field(default=4, ge=1, le=8, description="bytes per weight (fp32: 4)")
    grad_bytes: int = Field(default=4, ge=1, le=8)
    act_bytes: int = Field(default=4, ge=1, le=8)
    encoding: TransferEncoding = Field(default_factory=TransferEncoding)
    policy: str = "?"
    balance: bool = Field(default=False, description="the fast loop was on")
    spread: bool = Field(
        default=False,
        description="with the fast loop: crossing tokens split by DC on the world's counts "
        "(RuntimeSettings.spread; a trace written before it: False)",
    )
    spread_fused: bool = Field(
        default=False, description="with spread: the counts all-gather is the sizes exchange"
    )
    microbatches: int = Field(default=1, ge=1, le=1 << 16)
    tokens_per_rank: int = Field(
        ge=1, le=1 << 40, description="tokens a rank trains per microbatch"
    )
    plan_versions: list[int] = Field(description="the plan version every step ran on")
    step_seconds: list[float] = Field(
        default_factory=list, description="measured end-to-end seconds of every step"
    )
    bytes_by_pair: list[list[list[list[int]]]] = Field(
        description="[T, 3, D, D] tokens, weights and migration bytes between DCs per step"
    )
    collective_bytes: list[list[tuple[int, list[list[int]]]]] = Field(
        default_factory=list,
        description="per step, every collective that crossed DCs in the order issued per "
        "group: (kind: 0 tokens, 1 weights, 2 migration; [D, D] bytes a -> b); a plan "
        "switch's transfers count in the step after the one they were started in",
    )
    migration: Literal["background", "boundary"] = Field(
        default="boundary",
        description="how plans were switched (RuntimeSettings.migration): background (the "
        "moved masters travel during the switch step, its sync switches) or boundary (the "
        "migration rounds run after the step)",
    )
    fanout_bytes: list[int] = Field(
        default_factory=list, description="replica weights the fast loop fetched per step"
    )


def planned_from(plan_versions: Sequence[int]) -> int:
    """The first step that ran on a plan the controller made (its version differs from
    step 0's); 1 when every step ran on the first plan (the first step is never measured:
    fresh workers). The medians :func:`replay` compares start there: before it a row runs
    the initial placement whatever its policy, and a median over both phases is an order
    statistic of a two-valued mixture (it lands in the tail of the faster phase's noise)."""
    for t, v in enumerate(plan_versions):
        if v != plan_versions[0]:
            return max(t, 1)
    return 1


@dataclass(frozen=True)
class Replay:
    """Per-step predicted seconds ``[T]`` and their parts; measured ones ``[T]`` (empty if
    not in the meta); the medians and the relative error of the predicted median.
    ``skip``: the first steps the medians leave out (fresh workers)."""

    predicted: np.ndarray
    measured: np.ndarray
    parts: dict[str, np.ndarray]  # compute, software, copies, latency, transfer [T] seconds
    counts: dict[str, np.ndarray]  # collectives, crossing, migration, copies [T] (the model's)
    skip: int = 1

    def _median(self, a: np.ndarray) -> float:
        a = a[self.skip :] if a.size > self.skip else a
        return float(np.median(a)) if a.size else float("nan")

    @property
    def predicted_median(self) -> float:
        return self._median(self.predicted)

    @property
    def measured_median(self) -> float:
        return self._median(self.measured)

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
    migration: Mapping[int, Sequence[int]],
    calibration: Calibration,
    skip: int | None = None,
) -> Replay:
    """Model every step of an SPMD run.

    - ``load``: [T, L, R, E] the trace (its shape checks the plans'; the step's tokens
      per rank are ``meta.tokens_per_rank x microbatches``); ``phy2log``: [T, L, R, S];
      ``master``: [T, L, E] flat slots; ``route``: [N, 6] ``(step, layer, src, expert,
      dst, tokens)`` rows; ``migration``: plan version -> ``(collectives, crossing)`` of
      switching to it.
    - ``skip``: the first steps the medians leave out (None: up to the first step on a
      plan the controller made, :func:`planned_from`).
    - Returns one predicted step time per ``t`` (``ValueError`` when the inputs disagree).
    """
    topology = Topology.from_dict(meta.topology)
    num_steps, num_layers, num_ranks, num_experts = load.shape
    if phy2log.shape[:3] != (num_steps, num_layers, num_ranks):
        raise ValueError(f"plan phy2log {phy2log.shape} does not match the trace {load.shape}")
    if master.shape != (num_steps, num_layers, num_experts):
        raise ValueError(f"plan master {master.shape} is not [T, L, E] of the trace")
    if num_ranks != topology.num_ranks:
        raise ValueError(f"trace has {num_ranks} ranks, its topology {topology.num_ranks}")
    if calibration.ranks is not None and calibration.ranks != num_ranks:
        raise ValueError(
            f"the calibration was measured on {calibration.ranks} ranks, the trace has "
            f"{num_ranks}: calibrate on the run's shape"
        )
    d = topology.num_dcs
    for name, n in (
        ("step times", len(meta.step_seconds)),
        ("plan versions", len(meta.plan_versions)),
        ("byte counts", len(meta.bytes_by_pair)),
        ("fan-out counts", len(meta.fanout_bytes)),
    ):
        if n and n != num_steps:
            raise ValueError(f"meta has {n} {name} for {num_steps} steps")
    by = np.asarray(meta.bytes_by_pair, dtype=np.float64)
    if by.shape != (num_steps, 3, d, d) or (by < 0).any():
        raise ValueError(f"meta bytes_by_pair must be [{num_steps}, 3, {d}, {d}] and >= 0")
    versions = meta.plan_versions
    switched = {b for a, b in itertools.pairwise(versions) if a != b}
    missing = sorted(switched - set(migration))
    if missing:
        raise ValueError(f"the plans' meta has no migration collectives for versions {missing}")
    route = np.asarray(route, np.int64).reshape(-1, 6)
    route = route[np.lexsort((route[:, 1], route[:, 0]))]
    bounds = np.searchsorted(
        route[:, 0] * num_layers + route[:, 1], np.arange(num_steps * num_layers + 1)
    )
    tokens = meta.tokens_per_rank * meta.microbatches
    rank_dc = np.asarray(topology.rank_dc)
    per_coll = _collective_bytes(meta, num_steps, d)
    background = meta.migration == "background"
    parts = {
        k: np.zeros(num_steps) for k in ("compute", "software", "copies", "latency", "transfer")
    }
    counts: dict[str, np.ndarray] = {
        k: np.zeros(num_steps, np.int64) for k in ("collectives", "crossing", "migration")
    }
    counts["copies"] = np.zeros(num_steps)  # expert copies per rank, the mean
    out = np.zeros(num_steps)

    def placements_of(t: int) -> list[Placement]:
        return [Placement(phy2log[t, layer], master[t, layer]) for layer in range(num_layers)]

    for t in range(num_steps):
        placements = placements_of(t)
        cross = [
            LayerPlan(placements[layer], route[bounds[i] : bounds[i + 1], 2:]).crosses(rank_dc)
            for layer, i in ((layer, t * num_layers + layer) for layer in range(num_layers))
        ]
        mig = (0, 0)  # the plan switch at the step's end: its migration's collectives
        hops = sync_hops(placements, topology)
        switch = t + 1 < num_steps and versions[t + 1] != versions[t]
        if switch and background:
            # the moved masters' state travelled during this step on one background
            # all-to-all (its latency hidden by the step; its bytes queue on the links) and
            # this step's sync switched: gradients to the new masters, refresh of new copies
            new = placements_of(t + 1)
            moved = any(
                (a.master_rank() != b.master_rank()).any()
                for a, b in zip(placements, new, strict=True)
            )
            mig = (int(moved), 0)
            hops = sync_hops(placements, topology, new)
        elif switch:
            mig = tuple(migration[versions[t + 1]])  # type: ignore[assignment]
        fetch = bool(meta.fanout_bytes and meta.fanout_bytes[t] > 0)
        spread = [meta.balance and meta.spread and _can_spread(p, rank_dc, d) for p in placements]
        coll = SpmdCollectives.of(
            cross,
            microbatches=meta.microbatches,
            num_dcs=d,
            balance=meta.balance,
            fetch=[fetch] * num_layers,  # per step, not per layer: an upper bound
            hops=hops,
            migration=int(mig[0]),
            migration_cross=int(mig[1]),
            spread=spread,
            fused=meta.spread_fused,
        )
        # the step's tokens and weights and its plan switch's migration: background, the
        # transfer started after the step before (the workers count it in this step's
        # report); boundary, the rounds after this step (counted in the next step's)
        later = t + 1 if not background else t
        if per_coll is not None:
            own = [m for k, m in per_coll[t] if k != _MIGRATION]
            moves = [m for k, m in per_coll[later] if k == _MIGRATION] if later < num_steps else []
            nbytes = np.asarray(own + moves, dtype=np.float64).reshape(-1, d, d)
        else:
            nbytes = by[t, 0] + by[t, 1] + (by[later, 2] if later < num_steps else 0.0)
        held = copies_per_rank(placements)
        st = spmd_step_cost(
            topology, coll, nbytes, tokens_per_rank=tokens,
            seconds_per_token=calibration.seconds_per_token,
            collective_seconds=calibration.collective_seconds,
            copies_per_rank=held,
            copy_seconds=calibration.copy_seconds,
        )  # fmt: skip
        out[t] = st.seconds
        for k, v in parts.items():
            v[t] = getattr(st, k)
        counts["collectives"][t], counts["crossing"][t] = coll.total, coll.crossing
        counts["migration"][t] = int(mig[0])
        counts["copies"][t] = held
    if skip is None:
        skip = planned_from(versions)
    return Replay(out, np.asarray(meta.step_seconds, dtype=np.float64), parts, counts, skip)


def _can_spread(placement: Placement, rank_dc: np.ndarray, num_dcs: int) -> bool:
    """Whether the fast loop's split by DC has a choice on this layer
    (:func:`~expertmesh.planner.dcsplit.can_spread`, as ``MoELayer``'s ``can_spread``) over
    the DCs' copies of ``placement`` (every rank of a trace takes part)."""
    held = np.zeros((num_dcs, placement.master.size), bool)  # [D, E]
    np.logical_or.at(held, rank_dc, placement.holds())
    return can_spread(held)


_MIGRATION = 2  # the kind index of a plan switch's transfers (workers/comm.py KINDS)


def _collective_bytes(meta: RuntimeMeta, num_steps: int, d: int) -> list[Any] | None:
    """``meta.collective_bytes`` checked (None when the trace has none: a trace written
    before the workers counted bytes per collective)."""
    got = meta.collective_bytes
    if not got:
        return None
    if len(got) != num_steps:
        raise ValueError(f"meta has collective bytes of {len(got)} steps for {num_steps}")
    for step in got:
        for kind, m in step:
            a = np.asarray(m)
            if not 0 <= kind <= _MIGRATION or a.shape != (d, d) or (a < 0).any():
                raise ValueError(f"collective bytes must be (kind 0-2, [{d}, {d}] >= 0)")
    return got
