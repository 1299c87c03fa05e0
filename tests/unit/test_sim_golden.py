"""The simulator's modeled results and the generated traces stay the same when the engine,
the cost model or the sampler are made faster.

``data/sim_golden.json`` holds what the code of commit 2d4121a (before the scale-run speed
work of #13 item 7) gives: every policy on two EP groups of 8 DCs (``simulate_groups``,
2 layers, 4 steps, solve time off the critical path so every modeled column is
deterministic), and generated traces (sha256 of the integer load; the calibration's
exponents and expectations). Integers, strings and the load digests must match exactly;
floats to a relative 1e-9: their last bits depend on the machine and the numpy build (the
same code gives ``552454706600.8018`` on one machine and ``...8016`` on another, summation
order), while a change of the model moves them by far more. Every column but
``solve_seconds`` (CPU time) is compared. Regenerate only for an intended change of the
model: ``python tests/unit/test_sim_golden.py --write``.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

from expertmesh.planner.costmodel import CostSettings
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.topology import Topology
from expertmesh.planner.trace import generate_trace
from expertmesh.sim.engine import COLUMNS, dense_source, simulate
from expertmesh.sim.groups import simulate_groups
from expertmesh.sim.sweep import TraceSpec

DATA = Path(__file__).parent / "data" / "sim_golden.json"
POLICIES = ["static", "eplb", "fastermoe", "quota", "hybrid"]
REL = 1e-9  # floats: equal up to the machine's summation order, not up to a model change
TRACES = {  # name: TraceSpec fields, ranks, experts, top-k
    "drift": ({"steps": 12, "drift": 0.05, "imbalance": 2.0, "seed": 3}, 64, 256, 8),
    "regimes": ({"steps": 9, "regime_every": 4, "imbalance": 1.5, "seed": 7}, 32, 256, 8),
    "reference": ({"steps": 10, "reference_ranks": 48, "imbalance": 1.8, "drift": 0.1}, 48, 256, 8),
    # the hottest experts capped at pi = 1 in most of the calibration's evaluations
    "capped": ({"steps": 6, "reference_ranks": 8, "imbalance": 1.8, "drift": 0.2}, 8, 32, 8),
}


def _model(layers: int = 2) -> ModelSpec:
    return ModelSpec(num_experts=256, num_layers=layers)


def _rows(result) -> dict[str, list[list[object]]]:
    out: dict[str, list[list[object]]] = {}
    for run in result.runs:
        assert run.skipped is None, run.skipped
        out[run.name] = [
            [v for c, v in zip(COLUMNS, r.values(), strict=True) if c != "solve_seconds"]
            for r in run.rows
        ]
    return out


def _world() -> dict[str, list[list[object]]]:
    """Every policy on 2 EP groups of 8 DCs x 8 ranks (the scale run's group), 4 steps."""
    group = Topology.generate(8, 8, inter_dc_gbps=10.0)
    model = _model()
    spec = TraceSpec(steps=4, drift=0.05)

    def trace(g: int):
        s = spec.model_copy(update={"seed": spec.seed + g}).settings(group.num_ranks, model)
        return dense_source(generate_trace(s).load)

    cost = CostSettings(solve_on_critical_path=False)
    return _rows(simulate_groups(group, 2, trace, model, POLICIES, cost=cost))


def _single() -> dict[str, list[list[object]]]:
    """One group through :func:`simulate` (the path sweeps and replay use), 2 microbatches."""
    topo = Topology.generate(4, 16, nodes_per_dc=2, inter_dc_gbps=1.0)
    model = _model(1)
    s = TraceSpec(steps=3, drift=0.1, seed=11).settings(topo.num_ranks, model)
    cost = CostSettings(solve_on_critical_path=False, microbatches_per_update=2)
    return _rows(simulate(dense_source(generate_trace(s).load), topo, model, POLICIES, cost=cost))


def _trace_digests() -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for name, (fields, ranks, experts, top_k) in TRACES.items():
        model = ModelSpec(num_experts=experts, top_k=top_k, num_layers=2)
        s = TraceSpec(**fields).settings(ranks, model)
        tr = generate_trace(s)
        out[name] = {
            "load": hashlib.sha256(tr.load.tobytes()).hexdigest(),
            # the calibration's exponents and expectations too
            "exponent": tr.exponent.ravel().tolist(),
            "expected_imbalance": tr.expected_imbalance.ravel().tolist(),
        }
    return out


def _now() -> dict[str, object]:
    return {"world": _world(), "single": _single(), "traces": _trace_digests()}


def _equal(a: object, b: object) -> bool:
    """Exact for integers and strings; floats to :data:`REL` (the same type either way)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=REL, abs_tol=0.0)
    return type(a) is type(b) and a == b


def _same(got: dict[str, list[list[object]]], want: dict[str, list[list[object]]]) -> None:
    assert sorted(got) == sorted(want)
    cols = [c for c in COLUMNS if c != "solve_seconds"]
    for name, rows in want.items():
        assert len(got[name]) == len(rows), name
        for g, w in zip(got[name], rows, strict=True):
            for c, a, b in zip(cols, g, w, strict=True):
                assert _equal(a, b), f"{name} step {g[1]} {c}: {a!r} != {b!r} (golden)"


def test_multi_group_run_matches_the_golden_rows():
    _same(_world(), json.loads(DATA.read_text())["world"])


def test_single_group_run_matches_the_golden_rows():
    _same(_single(), json.loads(DATA.read_text())["single"])


def test_generated_traces_match_the_golden_ones():
    want = json.loads(DATA.read_text())["traces"]
    got = _trace_digests()
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert g["load"] == w["load"], f"{name}: the load differs (golden)"
        for key in ("exponent", "expected_imbalance"):
            assert len(g[key]) == len(w[key]), (name, key)
            for a, b in zip(g[key], w[key], strict=True):
                assert _equal(a, b), f"{name} {key}: {a!r} != {b!r} (golden)"


def test_float_columns_are_compared_to_rel_1e9_not_looser():
    """A relative change of 1e-7 (far below any figure the docs round to, far above the
    machines' summation order) must fail the comparison."""
    assert _equal(552454706600.8018, 552454706600.8016)
    assert not _equal(552454706600.8018, 552454706600.8018 * (1 + 1e-7))
    assert not _equal(1, 1.0)  # an int column turned float is a change


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    DATA.write_text(json.dumps(_now(), indent=None) + "\n")
    print(f"wrote {DATA}")
