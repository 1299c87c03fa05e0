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
