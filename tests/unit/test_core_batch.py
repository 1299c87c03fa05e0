"""ControllerCore.report_batch behaves like report_load applied one report at a time."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.controller.core import BatchReportError, ControllerCore
from expertmesh.planner import ModelSpec, Topology

E = 4


def _core() -> ControllerCore:
    topo = Topology.generate(dcs=1, ranks_per_dc=3, masters=2, spare=0)
    return ControllerCore(topo, ModelSpec(num_layers=2, num_experts=E))


def _state(core):
    return (
        core.reports_received,
        core.reports_rejected,
        [core.window(layer).tolist() for layer in range(2)],
        sorted((k, v[0].tolist(), v[1].tolist()) for k, v in core.loads._pending.items()),
        np.isnan(core.last_reports()).tolist(),  # which ranks have reported (times differ)
    )


count = st.one_of(st.integers(-2, 5), st.sampled_from([2**40, 2**40 + 1]))
report = st.tuples(
    st.integers(-1, 3),  # step
    st.integers(-1, 2),  # layer
    st.integers(-1, 3),  # rank
    st.lists(count, min_size=E, max_size=E),
)


def _one_by_one(core: ControllerCore, reports) -> tuple[int, int]:
    applied = completed = 0
    for i, (s, layer, r, load) in enumerate(reports):
        try:
            completed += core.report_load(s, layer, r, np.array(load))
            applied += 1
        except ValueError:
            core.reject_report(len(reports) - i - 1)  # the rest of the batch is refused
            break
    return applied, completed


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(report, max_size=12), min_size=1, max_size=3))
def test_batch_equals_one_by_one(batches):
    """Several batches on one core (counters accumulate): the same reports applied, steps
    completed, counters, windows, pending loads and reporting ranks as one report at a time."""
    seq, bat = _core(), _core()
    for reports in batches:
        applied, completed = _one_by_one(seq, reports)
        arr = np.array([x[3] for x in reports], np.int64).reshape(-1, E)
        cols = [np.array([x[k] for x in reports], np.int64) for k in range(3)]
        try:
            got = bat.report_batch(*cols, arr)
        except BatchReportError as err:
            got = (err.applied, err.completed)
        assert got == (applied, completed)
        assert _state(bat) == _state(seq)


def test_batch_shape_errors_reject_everything():
    core = _core()
    with pytest.raises(BatchReportError, match=r"load must be \[4\]"):
        core.report_batch(
            np.zeros(2, int), np.zeros(2, int), np.zeros(2, int), np.zeros((2, 3), int)
        )
    assert core.reports_received == core.reports_rejected == 2 and not core.loads._pending
