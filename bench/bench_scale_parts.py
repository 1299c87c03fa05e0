"""The scale run's trace and solves, a few EP groups at a time (issue 13 item 7).

``expertmesh sim --dcs 1000 --ranks-per-dc 8`` runs 125 EP groups of 8 DCs x 8 ranks
(256 experts, 4 master and 2 spare slots per rank), each on its own generated trace. This
runs ``--groups`` of them the same way (``generate_trace`` with seed ``g``, then
``simulate`` with ``--policies``) and prints the CPU seconds of the trace generation and
of each policy's solves (``solve_seconds`` summed: place, alignment, route), and a digest
of each policy's modeled rows (every column but ``solve_seconds`` and ``exposed_seconds``)
and of the traces: two builds that print the same digests planned and sampled the same.
Run it with two interpreters (two checkouts) back to back for an A/B.

``--draws``: instead, the trace's token draws alone, on the segment probabilities of
``--steps`` steps of one group (64 ranks x 256 segments, 8,192 tokens per rank): numpy's
``Generator.multinomial`` (what ``planner/trace.py`` calls) against another exact sampler
of the same multinomial, independent Poisson counts completed to ``n`` (below); median
milliseconds per step over 5 repeats.

``--batching``: instead, what batching a cost model over items saves on these shapes:
the step cost (``costmodel.step_cost``) of ``--steps`` steps of one group's static
placement with its even split, item by item against one ``step_costs`` call over all of
them (the simulator's batched path; the same floats, checked here); median CPU per item
over 7 repeats and their ratio. The solves and the other cost models run item by item
(one group-step at a time); this is the gain their batching over the 125 groups could
aim at, per-call overhead being most of their CPU on [64, 256] arrays.

``.venv/bin/python bench/bench_scale_parts.py [--groups 5] [--steps 100]
[--policies fastermoe,quota,eplb] [--draws] [--batching]``
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np

from expertmesh.planner import ModelSpec, Topology
from expertmesh.planner.costmodel import ExpertStreams, step_cost, step_costs
from expertmesh.planner.evensplit import even_traffic
from expertmesh.planner.static import static_placement
from expertmesh.planner.trace import _calibrate, _drift, _expert_rank, generate_trace
from expertmesh.sim.engine import COLUMNS, dense_source, simulate
from expertmesh.sim.sweep import TraceSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--policies", default="fastermoe,quota,eplb")
    ap.add_argument("--draws", action="store_true", help="time the trace's draws alone")
    ap.add_argument(
        "--batching", action="store_true", help="time the step cost item by item and batched"
    )
    args = ap.parse_args()
    if args.draws:
        _draws(args.steps)
        return
    if args.batching:
        _batching(args.steps)
        return
    policies = [p for p in args.policies.split(",") if p]
    group, model = _scale_group()
    spec = TraceSpec(steps=args.steps)
    trace_cpu = 0.0
    solve = dict.fromkeys(policies, 0.0)
    rows = {p: hashlib.sha256() for p in policies}
    loads = hashlib.sha256()
    skip = {COLUMNS.index("solve_seconds"), COLUMNS.index("exposed_seconds")}
    for g in range(args.groups):
        t0 = time.process_time()
        load = generate_trace(
            spec.model_copy(update={"seed": g}).settings(group.num_ranks, model)
        ).load
        trace_cpu += time.process_time() - t0
        loads.update(load.tobytes())
        if not policies:
            continue
        result = simulate(dense_source(load), group, model, policies)
        for run in result.runs:
            assert run.skipped is None, run.skipped
            for r in run.rows:
                solve[run.name] += r.solve_seconds
                vals = [v for i, v in enumerate(r.values()) if i not in skip]
                rows[run.name].update(repr(vals).encode())
    print(f"groups {args.groups} x {args.steps} steps")
    print(f"trace CPU s {trace_cpu:.3f}  load digest {loads.hexdigest()[:16]}")
    for p in policies:
        print(f"{p:10s} solve CPU s {solve[p]:.3f}  rows digest {rows[p].hexdigest()[:16]}")


def _segments(steps: int, num_ranks: int = 64, num_experts: int = 256) -> list[np.ndarray]:
    """[R, K] segment probabilities of the trace's multinomial at each of ``steps`` steps
    (the scale run's settings: calibrated Zipf, drift 0.02, a fresh order per rank)."""
    rng = np.random.default_rng(0)
    ranks = _expert_rank(num_experts, num_experts)
    perm, out = rng.permutation(num_experts), []
    for _ in range(steps):
        _drift(rng, perm, 0.02)
        pi = _calibrate(perm, ranks, num_experts, 8, 2.0)[2]
        order = rng.permuted(np.tile(np.arange(num_experts), (num_ranks, 1)), axis=1)
        c = np.cumsum(pi[order], axis=1) - pi[order]
        start = np.sort(np.round(c - np.floor(c), 12) % 1.0, axis=1)
        seg = np.diff(start, axis=1, append=1.0)
        out.append(seg / seg.sum(axis=1, keepdims=True))
    return out


def poisson_multinomial(rng: np.random.Generator, n: int, p: np.ndarray) -> np.ndarray:
    """[R, K] one Multinomial(n, p[r]) draw per row, exactly: Poisson counts of mean
    ``(n - sqrt(n)) p`` are, given their total ``m``, Multinomial(m, p); a row with
    ``m > n`` is drawn again, and the ``n - m`` tokens left are categorical draws, which
    completes Multinomial(n, p) whatever ``m`` was."""
    lam = max(n - np.sqrt(n), 0.0) * p
    x = rng.poisson(lam)
    over = np.flatnonzero(x.sum(axis=1) > n)
    while over.size:
        x[over] = rng.poisson(lam[over])
        over = over[x[over].sum(axis=1) > n]
    left = n - x.sum(axis=1)
    rows = np.repeat(np.arange(p.shape[0]), left)
    cdf = np.cumsum(p, axis=1)
    cdf[:, -1] = 1.0
    cdf += np.arange(p.shape[0])[:, None]  # row r's CDF on [r, r + 1]
    hit = np.searchsorted(cdf.ravel(), rng.random(rows.size) + rows, side="right")
    x.ravel()[:] += np.bincount(hit, minlength=x.size)
    return x


def _draws(steps: int, n: int = 8192) -> None:
    segs = _segments(steps)
    rng = np.random.default_rng(1)
    samplers = {
        "numpy Generator.multinomial": lambda p: rng.multinomial(n, p),
        "Poisson, completed to n": lambda p: poisson_multinomial(rng, n, p),
    }
    for name, draw in samplers.items():
        times = []
        for _ in range(5):
            t0 = time.process_time()
            for p in segs:
                counts = draw(p)
            times.append((time.process_time() - t0) / len(segs))
            assert (counts.sum(axis=1) == n).all()
        print(f"{name:30s} {np.median(times) * 1e3:.3f} ms per step ({steps} steps, 64 x 256)")


def _scale_group() -> tuple[Topology, ModelSpec]:
    """One EP group of the scale run (8 DCs x 8 ranks, 4 + 2 slots) and its model."""
    return Topology.generate(8, 8, masters=4, spare=2), ModelSpec(num_experts=256)


def batching_ms(steps: int = 100, repeats: int = 7) -> tuple[float, float]:
    """Median CPU ms per item of the step cost of ``steps`` steps of one scale-run group
    (static placement, its even split, no expert streams): item by item (``step_cost``)
    and in one ``step_costs`` call; the two give the same seconds (checked)."""
    group, model = _scale_group()
    load = generate_trace(TraceSpec(steps=steps).settings(group.num_ranks, model)).load
    placement = static_placement(
        group.num_ranks, group.slots_per_rank, model.num_experts, group.masters_per_rank
    )
    traffics = [
        even_traffic(load[t, 0], placement, group, model.top_k, domain="dc", remote="spread")
        for t in range(steps)
    ]
    none = ExpertStreams.empty(group.num_ranks)
    one, many = [], []
    for _ in range(repeats):
        t0 = time.process_time()
        apart = [step_cost(group, model, x, none) for x in traffics]
        one.append((time.process_time() - t0) / steps * 1e3)
        t0 = time.process_time()
        together = step_costs(group, model, traffics, [none] * steps)
        many.append((time.process_time() - t0) / steps * 1e3)
        assert [c.seconds for c in apart] == [c.seconds for c in together]
    return float(np.median(one)), float(np.median(many))


def _batching(steps: int, repeats: int = 7) -> None:
    a, b = batching_ms(steps, repeats)
    print(f"step cost, {steps} steps of 64 x 256 (medians of {repeats}; same seconds)")
    print(f"item by item  {a:.3f} ms per item")
    print(f"one batch     {b:.3f} ms per item  ({a / b:.2f}x)")


if __name__ == "__main__":
    main()
