"""The Ray-rounds data plane's driver overhead, measured as bench_runtime.py measured it
before the SPMD plane (``expertmesh.runtime.cluster.Runtime``; ``demo --data-plane
rounds``): the driver steps every rank through Ray rounds, and the fixed cost ``o`` of
one round comes from a calibration run (static on free links): the measured step beyond
the cost model with ``o = 0`` (``planner.stepmodel.training_step_cost`` on the step's
realized token streams, with the expert compute rate ``F`` from the ranks' own expert
seconds), over the rounds the step ran. Overhead of a step = ``o * rounds / step``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import numpy as np
import ray

from expertmesh.planner import Placement, Topology
from expertmesh.planner.costmodel import CostSettings
from expertmesh.planner.static import static_placement
from expertmesh.planner.stepmodel import StepLayout, training_step_cost
from expertmesh.planner.traffic import traffic_from_route
from expertmesh.runtime.cluster import Runtime
from expertmesh.runtime.settings import RuntimeSettings
from expertmesh.workers.model import DenseModel, LMConfig


@dataclasses.dataclass
class Run:
    steps: list[Any]  # StepResult
    stats: list[list[dict[str, Any]]]  # per step, per rank
    placements: list[list[Placement]]
    layouts: list[StepLayout]
    wall: list[float] = dataclasses.field(default_factory=list)  # run_step's wall per step
    cpu: list[float] = dataclasses.field(default_factory=list)  # driver CPU s per step


def noop_round_seconds(rt: Runtime, rounds: int = 40) -> float:
    """Median wall time of one round of do-nothing Ray calls on every worker."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        ray.get([w.ping.remote() for w in rt.workers])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _run(rt: Runtime, settings: RuntimeSettings, steps: int) -> Run:
    rt.reset(settings)
    topo, lm = Topology.from_dict(settings.topology), settings.lm
    current = [
        static_placement(topo.num_ranks, topo.slots_per_rank, lm.num_experts, topo.masters_per_rank)
    ] * lm.num_layers
    out = Run([], [], [], [])
    for _ in range(steps):
        out.placements.append(current)
        out.layouts.append(rt.layout or StepLayout.full(lm.num_layers))
        t0, c0 = time.perf_counter(), time.process_time()
        out.steps.append(rt.run_step())
        out.wall.append(time.perf_counter() - t0)
        out.cpu.append(time.process_time() - c0)
        out.stats.append(rt.last_stats)
        plan = rt.committed_plan()
        if plan is not None:
            current = [Placement(np.asarray(p), np.asarray(m)) for p, m, _ in plan]
    return out


def _traffic(stats: list[dict[str, Any]], layer: int, topo: Topology, top_k: int) -> Any:
    route = np.concatenate([s["routed"][layer] for s in stats])
    load = np.stack([s["load"][layer] for s in stats])
    tr = traffic_from_route(route, load, topo, top_k)
    cross = np.zeros((topo.num_dcs, topo.num_dcs))
    for s in stats:
        cross[topo.rank_dc[s["rank"]]] += s["crossings"][layer]
    return dataclasses.replace(tr, pair_crossings=cross[tr.pair_src, tr.pair_dst])


def _model(run: Run, topo: Topology, lm: LMConfig, dense: int, cost: CostSettings) -> list[float]:
    out = []
    for stats, placements, layout in zip(run.stats, run.placements, run.layouts, strict=True):
        traffic = [_traffic(stats, layer, topo, lm.top_k) for layer in range(lm.num_layers)]
        t = training_step_cost(
            topo, lm.spec(), traffic, placements, dense_params=dense, settings=cost, layout=layout
        )
        out.append(t.seconds)
    return out


def round_cost(run: Run, topo: Topology, lm: LMConfig) -> tuple[float, float]:
    """``(F, o)``: expert FLOP/s per rank and seconds per Ray round, from a calibration run."""
    dense = sum(p.numel() for p in DenseModel(lm).parameters())
    per_assignment = 6.0 * lm.spec().expert_params
    work = sum(float(np.sum(s["computed"])) for st in run.stats[1:] for s in st)
    secs = sum(float(np.sum(s["expert_seconds"])) for st in run.stats[1:] for s in st)
    base = CostSettings(flops_per_second=work * per_assignment / secs)
    model = _model(run, topo, lm, dense, base)
    per_round = statistics.median(
        (r.step_seconds - m) / layout.rounds
        for r, m, layout in zip(run.steps[1:], model[1:], run.layouts[1:], strict=True)
    )
    return base.flops_per_second, max(per_round, 0.0)


def overhead(
    free: RuntimeSettings, link: RuntimeSettings, *, calib_steps: int, steps: int
) -> dict[str, Any]:
    """One old-plane Runtime: a warm-up, the calibration on ``free`` (static on free links),
    then ``link``'s run; the Ray rounds' share of ``link``'s median step, modeled and
    measured (module docstring)."""
    topo_free = Topology.from_dict(free.topology)
    with Runtime(free) as rt:
        _run(rt, free, calib_steps)  # fresh workers are slower; not used
        calib = _run(rt, free, calib_steps)
        flops, o = round_cost(calib, topo_free, free.lm)
        noop_before = noop_round_seconds(rt)
        run = _run(rt, link, steps)
        noop = statistics.median([noop_before, noop_round_seconds(rt)])
    measured = [s.step_seconds for s in run.steps[1:]]
    rounds = statistics.median(layout.rounds for layout in run.layouts[1:])
    med = statistics.median(measured)
    wall = statistics.median(run.wall[1:])
    control = statistics.median(s.control_seconds for s in run.steps[1:])
    return {
        "policy": link.policy,
        "median_step_seconds": med,  # the rounds only (train_step's wall)
        "median_seconds": wall,  # end to end: rounds, controller call, checkpoint
        "rounds_per_step": rounds,
        "round_seconds": o,
        "flops_per_second": flops,
        "ray_seconds_per_step": o * rounds,
        "ray_fraction": o * rounds / med,
        "noop_round_seconds": noop,
        "control_seconds": control,
        "measured_overhead_fraction": (rounds * noop + control) / wall,
        "driver_cpu_fraction": sum(run.cpu[1:]) / sum(run.wall[1:]),
        "steps": measured,
        "wall": run.wall,
        "driver_cpu": run.cpu,
    }
