"""Measured balance (the SPMD fast loop's per-step record) in Prometheus and history."""

import math

import numpy as np
import pytest

from expertmesh.controller.core import ControllerCore
from expertmesh.controller.telemetry import Telemetry, TelemetrySettings
from expertmesh.planner import ModelSpec, Topology
from tests.unit.test_telemetry import _samples

L = 3


def _tel(history: int = 512) -> Telemetry:
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    model = ModelSpec(num_layers=L, num_experts=8, top_k=2, hidden=16, ffn_hidden=8)
    return Telemetry(ControllerCore(topo, model), TelemetrySettings(history=history))


def _step(tel: Telemetry, step: int, computed: np.ndarray, **kw: float) -> None:
    """computed: [R, L] tokens each rank computed; static: [R, L] under static EP."""
    bal = [float(computed[:, i].mean() / computed[:, i].max()) for i in range(L)]
    args = {
        "imbalance": float(max(computed.max(axis=0) / computed.mean(axis=0))),
        "imbalance_static": 1.6,
        "balancedness": bal,
        "replicas": 5,
        "fanout_bytes": 4096,
        "balance_seconds": 0.002,
        "seconds": 0.5,
    }
    args.update(kw)
    tel.record_balance(step, **args)  # type: ignore[arg-type]


MEASURED = (
    "expertmesh_measured_balancedness_ratio",
    "expertmesh_measured_imbalance_ratio",
    "expertmesh_static_imbalance_ratio",
)


def test_absent_until_a_step_is_measured_counters_start_at_zero():
    tel = _tel()
    got = _samples(tel)
    assert not [k for k in got if k[0].startswith(MEASURED)], got
    assert got[("expertmesh_fast_loop_replicas_total", ())] == 0
    assert got[("expertmesh_fast_loop_fanout_bytes_total", ())] == 0
    assert got[("expertmesh_fast_loop_seconds_count", ())] == 0


def test_series_follow_the_newest_step_and_counters_sum():
    tel = _tel()
    rng = np.random.default_rng(0)
    first = rng.integers(50, 100, (4, L))
    _step(tel, 0, first, replicas=3, fanout_bytes=1000, balance_seconds=0.004)
    newest = rng.integers(50, 100, (4, L))
    _step(tel, 1, newest, replicas=7, fanout_bytes=2500, imbalance_static=1.9)
    got = _samples(tel)
    for layer in range(L):
        want = newest[:, layer].mean() / newest[:, layer].max()  # vLLM's mean/max
        key = ("expertmesh_measured_balancedness_ratio", (("layer", str(layer)),))
        assert got[key] == pytest.approx(want)
    want_imb = max(newest.max(axis=0) / newest.mean(axis=0))
    assert got[("expertmesh_measured_imbalance_ratio", ())] == pytest.approx(want_imb)
    assert got[("expertmesh_static_imbalance_ratio", ())] == pytest.approx(1.9)
    assert got[("expertmesh_fast_loop_replicas_total", ())] == 10
    assert got[("expertmesh_fast_loop_fanout_bytes_total", ())] == 3500
    assert got[("expertmesh_fast_loop_seconds_count", ())] == 2
    assert got[("expertmesh_fast_loop_seconds_sum", ())] == pytest.approx(0.006)
    # the planned series are not the measured ones: no load was reported, so none of them
    assert not [k for k in got if k[0] == "expertmesh_layer_balancedness_ratio"]


def test_history_is_bounded_and_filtered_by_step():
    tel = _tel(history=3)
    computed = np.full((4, L), 10)
    for step in range(5):
        _step(tel, step, computed)
    assert [r.step for r in tel.balance.records()] == [2, 3, 4]
    assert [r.step for r in tel.balance.records(since=4)] == [4]
    assert tel.balance.records(since=9) == []


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"balancedness": [1.0, 0.5]}, "balancedness must be"),
        ({"balancedness": [1.0, 0.5, 1.2]}, "balancedness must be finite"),
        ({"balancedness": [1.0, math.nan, 1.0]}, "balancedness must be finite"),
        ({"imbalance": 0.5}, "imbalance must be"),
        ({"imbalance_static": math.inf}, "imbalance_static must be"),
        ({"replicas": -1}, "must be >= 0"),
        ({"fanout_bytes": -5}, "must be >= 0"),
        ({"balance_seconds": -0.1}, "balance_seconds must be"),
        ({"seconds": math.nan}, "seconds must be"),
    ],
)
def test_bad_records_raise_and_change_nothing(kw, message):
    tel = _tel()
    _step(tel, 0, np.full((4, L), 10))
    before = _samples(tel)
    with pytest.raises(ValueError, match=message):
        _step(tel, 1, np.full((4, L), 10), **kw)
    assert _samples(tel) == before
    assert [r.step for r in tel.balance.records()] == [0]
    with pytest.raises(ValueError, match="step must be"):
        _step(tel, -1, np.full((4, L), 10))


def test_every_microbatch_of_the_newest_step_is_a_series():
    """Per microbatch and layer: measured max/mean, within-DC and cross-DC floor, computed
    by the runtime controller from the tokens each rank computed in each microbatch."""
    from expertmesh.runtime.stepstats import per_microbatch

    rank_dc = np.array([0, 0, 1, 1])
    computed = np.zeros((4, 2, L), np.int64)  # [R, k, L]
    computed[:, 0, :] = [[10], [30], [20], [20]]  # DC 0: 40 tokens 10/30; DC 1: 20/20
    computed[:, 1, :] = [[20], [20], [20], [20]]  # even
    measured, within, floor = per_microbatch(computed, rank_dc)
    assert measured == [[1.5] * L, [1.0] * L]  # max 30 over mean 20
    assert within == [[1.5] * L, [1.0] * L]  # DC 0: 30 over its mean 20
    assert floor == [[1.0] * L, [1.0] * L]  # both DCs' means 20 = the global mean
    computed[:, 0, :] = [[30], [30], [10], [10]]  # balanced inside, DC 0 busier
    measured, within, floor = per_microbatch(computed, rank_dc)
    assert measured[0] == [1.5] * L and within[0] == [1.0] * L and floor[0] == [1.5] * L
    tel = _tel()
    ones = np.full((4, L), 50)
    _step(tel, 0, ones, imbalance=1.5, microbatches=measured, within_dc=within, floor=floor)
    got = _samples(tel)
    for name, grid in (
        ("expertmesh_microbatch_imbalance_ratio", measured),
        ("expertmesh_within_dc_imbalance_ratio", within),
        ("expertmesh_cross_dc_floor_ratio", floor),
    ):
        for i, row in enumerate(grid):
            for layer, v in enumerate(row):
                assert got[(name, (("layer", str(layer)), ("microbatch", str(i))))] == v, name
    assert tel.balance.newest().microbatches == tuple(tuple(r) for r in measured)


@pytest.mark.parametrize(
    "bad",
    [
        {"microbatches": [[1.2] * L], "imbalance": 1.3},  # the step's max must be the worst
        {"microbatches": [[1.2] * (L - 1)], "imbalance": 1.2},  # one value per layer
        {"microbatches": [[0.9] * L], "imbalance": 1.0},  # a ratio below 1
        {"floor": [[1.1] * L], "within_dc": [[1.1] * L, [1.0] * L]},  # k differs
        {"within_dc": [[math.nan] * L]},
    ],
)
def test_bad_microbatch_grids_are_refused_and_nothing_recorded(bad):
    tel = _tel()
    with pytest.raises(ValueError):
        _step(tel, 0, np.full((4, L), 50), **bad)
    assert tel.balance.newest() is None
