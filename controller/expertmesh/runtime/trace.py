"""What an SPMD run trained on, written beside its output: ``trace.npz`` and ``plans.npz``.

The controller keeps, per recorded step, the load ``[L, R, E]`` every rank reported (the
gate's exact counts, summed over the step's microbatches: what the controller saw) and,
per plan it offered, the layers the workers applied and the collectives of its migration
(:meth:`~expertmesh.runtime.steps.SpmdSteps.take_trace`). At every checkpoint and at
the end of :meth:`~expertmesh.runtime.spmd.SpmdRuntime.train` the driver takes that and
rewrites, in ``RuntimeSettings.trace_dir``:

- ``trace.npz`` (README: Interchange formats): ``load`` int64 ``[T, L, R, E]`` of the
  steps in order, ``meta`` a :class:`~expertmesh.sim.replay.RuntimeMeta`: the topology,
  the model's sizes, policy, microbatches, tokens per rank, and per step its number, plan
  version, measured end-to-end seconds, bytes between DCs as the workers counted them (per
  DC pair and kind, and per collective that crossed: ``collective_bytes``), the switch
  mode (``migration``) and replica weights the fast loop fetched;
- ``plans.npz``: per step the plan it ran on (``phy2log`` ``[T, L, R, S]``, ``master``
  ``[T, L, E]``; ``route`` rows ``(step, layer, src, expert, dst, tokens)`` are the plan's
  route, whose shares split the step's tokens, not counts of the step), ``meta`` with
  each version's migration collectives.

``expertmesh sim replay --trace trace.npz --plan plans.npz --calibration cal.yaml``
predicts the run's steps from them (:mod:`expertmesh.sim.replay`). A failed write is
logged and training goes on.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from expertmesh.formats import write_plan, write_trace
from expertmesh.planner import Topology
from expertmesh.runtime.settings import RuntimeSettings, StepResult, initial_placements

__all__ = ["RunTrace", "migration_collectives"]

log = logging.getLogger(__name__)
Layers = list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # per layer (phy2log, master, route)


def migration_collectives(rounds: list[list[Any]], topology: Topology) -> tuple[int, int]:
    """``(collectives, crossing)`` the workers run to apply a plan's migration ``rounds``
    (``ExpertParallel.apply_plan``: per round one all-to-all of weight copies and one of
    moving masters' state, each only when it has transfers; crossing: some transfer goes
    between DCs)."""
    total = crossing = 0
    for rnd in rounds:
        for kind in ("w", "opt"):
            part = [t for t in rnd if t[4] == kind]
            if part:
                total += 1
                crossing += any(topology.rank_dc[t[2]] != topology.rank_dc[t[3]] for t in part)
    return total, crossing


class RunTrace:
    """The driver's copy of what the run trained on (steps merged by step number)."""

    def __init__(self, settings: RuntimeSettings) -> None:
        self.settings = settings
        self.topology = Topology.from_dict(settings.topology)
        self.steps: dict[int, StepResult] = {}
        self.load: dict[int, np.ndarray] = {}
        # cumulative, per rank: (collectives, shaper waits, CPU seconds)
        self.counters: dict[int, dict[int, tuple[float, ...]]] = {}
        self.crossed: dict[int, list[tuple[int, list[list[int]]]]] = {}  # per collective
        self.plans: dict[int, tuple[Layers, tuple[int, int]]] = {}
        initial = initial_placements(self.topology, settings.lm, settings.layout)
        empty = np.zeros((0, 4), np.int64)
        self.plans[0] = ([(p.phy2log, p.master, empty) for p in initial], (0, 0))

    def record(self, controller: Any, rows: list[StepResult], directory: str | None) -> None:
        """Take the controller's trace, add ``rows`` and rewrite the files in
        ``directory`` (None: keep them in memory only). Never raises."""
        import ray

        try:
            got = ray.get(controller.take_trace.remote(), timeout=60)
            self.load.update(got["load"])
            self.counters.update(got.get("counters", {}))
            self.crossed.update(got.get("crossed", {}))
            self.plans.update(got["plans"])
            self.steps.update((r.step, r) for r in rows)
            if directory:
                self.write(Path(directory))
        except Exception:
            log.exception("writing the run's trace failed (training goes on)")

    def complete(self) -> list[int]:
        """Steps with their load, result and plan, in order."""
        return sorted(
            s for s in self.steps if s in self.load and self.steps[s].plan_version in self.plans
        )

    def arrays(self) -> tuple[np.ndarray, dict[str, Any], dict[str, np.ndarray], dict[str, Any]]:
        """``(load, trace meta, plan arrays, plan meta)`` of :meth:`complete` steps."""
        steps = self.complete()
        if not steps:
            raise ValueError("no complete step to write")
        s, lm = self.settings, self.settings.lm
        rows = [self.steps[t] for t in steps]
        load = np.stack([self.load[t] for t in steps])  # [T, L, R, E]
        phy2log = np.stack(
            [np.stack([a for a, _, _ in self.plans[r.plan_version][0]]) for r in rows]
        )
        master = np.stack(
            [np.stack([b for _, b, _ in self.plans[r.plan_version][0]]) for r in rows]
        )
        route = [
            np.column_stack([np.full((len(rt), 2), (i, layer)), np.asarray(rt).reshape(-1, 4)])
            for i, r in enumerate(rows)
            for layer, (_, _, rt) in enumerate(self.plans[r.plan_version][0])
        ]
        spec = lm.spec()
        policy = make_encoding(s)
        collectives, shaped, waits, cpu = self._deltas(steps)
        meta: dict[str, Any] = {
            "data_plane": "spmd",
            "topology": s.topology,
            "top_k": spec.top_k,
            "hidden": spec.hidden,
            "ffn_hidden": spec.ffn_hidden,
            "weight_bytes": spec.weight_bytes,
            "grad_bytes": spec.grad_bytes,
            "act_bytes": spec.act_bytes,
            "encoding": policy,
            "policy": s.policy,
            "balance": s.balance,
            "spread": s.spread,  # with balance: the split by DC (world counts all-gather)
            "spread_fused": s.spread_fused,  # ... standing in for the sizes exchange
            "migration": s.migration,  # background: moved masters travel before the switch
            "microbatches": lm.microbatches,
            "tokens_per_rank": lm.tokens_per_rank,
            "steps": steps,
            "plan_versions": [r.plan_version for r in rows],
            "step_seconds": [float(r.seconds or r.step_seconds) for r in rows],
            "train_seconds": [float(r.step_seconds) for r in rows],
            "bytes_by_pair": [r.bytes_by_pair for r in rows],
            # per step, every collective that crossed DCs: (kind, [D, D] bytes a -> b)
            # (empty when some step lacks them: the replay falls back to bytes_by_pair)
            "collective_bytes": [self.crossed[t] for t in steps]
            if all(t in self.crossed for t in steps)
            else [],
            "fanout_bytes": [int(r.fanout_bytes) for r in rows],
            "collectives": collectives,
            "shaped_seconds": shaped,
            # per step and rank ([T][R]; empty when a step lacks counters): shaper waits
            # and the rank process's CPU seconds (the replay's check of its CPU terms)
            "rank_shaped_seconds": waits if len(waits) == len(steps) else [],
            "rank_cpu_seconds": cpu if len(cpu) == len(steps) else [],
            "backend": rows[-1].backend,
            "shaper": s.shaper,
        }
        plans = {
            "phy2log": phy2log.astype(np.int64),
            "master": master.astype(np.int64),
            "route": np.concatenate(route).astype(np.int64)
            if route
            else np.zeros((0, 6), np.int64),
            "solve_seconds": np.zeros((len(steps), lm.num_layers)),
        }
        versions = sorted(({r.plan_version for r in rows} | set(self.plans)) - {0})
        plan_meta = {
            "policy": s.policy,
            "route": "the plan's route: its shares split each step's tokens",
            "migration_collectives": {
                str(v): list(self.plans[v][1]) for v in versions if v in self.plans
            },
        }
        return load, meta, plans, plan_meta

    def _deltas(
        self, steps: list[int]
    ) -> tuple[list[int], list[float], list[list[float]], list[list[float]]]:
        """Per step, max over ranks: collectives issued and seconds waited in the link
        shaper since the rank's previous recorded step (a restarted rank counts from 0);
        and per step each rank's shaper waits and CPU seconds over it ([T][R], 0 for a
        rank that did not report or whose counters lack the CPU)."""
        prev: dict[int, tuple[float, ...]] = {}
        coll, shaped, waits, cpu = [], [], [], []
        ranks = self.topology.num_ranks
        for t in sorted(self.counters):
            cur = {r: (*c, 0.0)[:3] for r, c in self.counters[t].items()}  # (n, wait, cpu)
            d = {
                r: tuple(x - y for x, y in zip(c, prev[r], strict=True))
                if r in prev and c[0] >= prev[r][0]
                else c
                for r, c in cur.items()
            }
            prev.update(cur)
            if t in steps:
                coll.append(int(max((n for n, _, _ in d.values()), default=0)))
                shaped.append(max((w for _, w, _ in d.values()), default=0.0))
                waits.append([float(d[r][1]) if r in d else 0.0 for r in range(ranks)])
                cpu.append([max(float(d[r][2]), 0.0) if r in d else 0.0 for r in range(ranks)])
        return coll, shaped, waits, cpu

    def write(self, directory: Path) -> tuple[Path, Path]:
        """Write ``trace.npz`` and ``plans.npz`` into ``directory`` (each atomically)."""
        load, meta, plans, plan_meta = self.arrays()
        directory.mkdir(parents=True, exist_ok=True)
        trace, plan = directory / "trace.npz", directory / "plans.npz"
        for path, write in (
            (trace, lambda p: write_trace(p, load, meta)),
            (plan, lambda p: write_plan(p, plans, plan_meta)),
        ):
            tmp = path.with_name(f".{path.stem}.tmp.npz")
            write(tmp)
            os.replace(tmp, path)
        return trace, plan


def make_encoding(settings: RuntimeSettings) -> dict[str, Any]:
    """The transfer encoding of the run's policy (JSON)."""
    from expertmesh.planner import make_policy
    from expertmesh.planner.costmodel import TransferEncoding

    policy = make_policy(settings.policy, settings.policy_settings)
    enc = getattr(policy, "transfer_encoding", None) or TransferEncoding()
    return dict(enc.model_dump(mode="json"))
