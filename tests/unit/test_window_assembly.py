"""The controller's assembly of DC windows (controller/windows.py through
ControllerCore.report_windows), vectorized over a DC's layers: a block or a merged run of
reports gives what one report at a time gives, a refused one changes nothing, a window's
mean is made when first asked for."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.controller.core import BatchReportError, ControllerCore, ControllerSettings
from expertmesh.controller.windows import WindowMean
from expertmesh.planner import ModelSpec
from expertmesh.planner.window import WindowBlock, WindowReport, window_mean_reference
from tests.unit.test_aggregate import _topo  # DCs of 3, 2 and 1 ranks

E, L, N = 5, 3, 4  # experts, layers, microbatches per window


def _core(max_pending: int = 2) -> ControllerCore:
    model = ModelSpec(num_layers=L, num_experts=E, top_k=2)
    settings = ControllerSettings(policy="eplb", window=4, max_pending_steps=max_pending)
    return ControllerCore(_topo(), model, settings)


def _rep(w: int, layer: int, dc: int, load: np.ndarray, reports: int = 1) -> WindowReport:
    return WindowReport(w * N, (w + 1) * N - 1, layer, dc, N, reports, load)


def _state(core: ControllerCore) -> tuple:
    w = core.windows_in
    newest = [w.newest(layer) for layer in range(L)]
    return (
        [core.window(layer).tolist() for layer in range(L)],
        [None if s is None else (s.first_step, s.dc_sum.tolist(), s.reports) for s in newest],
        w.applied,
        w.completed,
        w.rank_reports,
        w.pending_dropped,
        w.dropped_rank_reports,
    )


_item = st.tuples(
    st.integers(0, 3),  # window
    st.integers(0, L),  # layer (L: unknown)
    st.integers(0, 3),  # DC (3: unknown)
    st.integers(1, 9),  # per-rank reports summed
    st.booleans(),  # per rank
)


@settings(max_examples=80, deadline=None)
@given(items=st.lists(_item, min_size=1, max_size=40), cuts=st.lists(st.integers(1, 6)))
def test_runs_and_blocks_give_what_one_report_at_a_time_gives(items, cuts):
    """Core A takes each report in a call of its own; core B takes them in calls of several
    (runs of one DC's window merge into a block), and after a refusal sends the rest again:
    the same windows, sums and counts."""
    topo = _topo()
    rng = np.random.default_rng(len(items))
    reps = []
    for w, layer, dc, reports, per_rank in items:
        n = topo.dcs[dc].num_ranks if dc < topo.num_dcs else 1
        load = rng.integers(0, 50, (n, E) if per_rank else E)
        reps.append(_rep(w, layer, dc, load, reports))
    a, b = _core(), _core()
    for r in reps:
        with contextlib.suppress(BatchReportError):
            a.report_windows([r])
    rest, k = list(reps), 0
    while rest:
        size = cuts[k % len(cuts)] if cuts else len(rest)
        k += 1
        part, rest = rest[:size], rest[size:]
        try:
            b.report_windows(part)
        except BatchReportError as err:
            rest = part[err.applied + 1 :] + rest  # the bad one is gone; send the others
    assert _state(a) == _state(b)


def test_a_block_equals_its_reports():
    topo = _topo()
    rng = np.random.default_rng(2)
    sums = rng.integers(0, 90, (topo.num_dcs, L, E))
    a, b = _core(), _core()
    for d in range(topo.num_dcs):
        reps = [_rep(0, layer, d, sums[d, layer], 4) for layer in (2, 0, 1)]
        assert a.report_windows(reps) == (L, L if d == topo.num_dcs - 1 else 0)
        (block,) = WindowBlock.of(reps)
        assert b.report_windows([block]) == (L, L if d == topo.num_dcs - 1 else 0)
    assert _state(a) == _state(b)
    for layer in range(L):
        assert np.array_equal(a.windows_in.newest(layer).dc_sum, sums[:, layer])


def test_a_bad_report_in_a_run_keeps_the_ones_before_it():
    core = _core()
    one = np.ones(E, np.int64)
    run = [_rep(0, 0, 0, one), _rep(0, 1, 0, one), _rep(0, L, 0, one), _rep(0, 2, 0, one)]
    with pytest.raises(BatchReportError, match="unknown layer") as err:
        core.report_windows(run)
    assert err.value.applied == 2
    w = core.windows_in
    assert (w.received, w.applied, w.rejected) == (4, 2, 2)
    core.report_windows([_rep(0, 2, 0, one)])  # refused before: not a duplicate now
    with pytest.raises(BatchReportError, match="already reported"):
        core.report_windows([_rep(0, 1, 0, one)])  # applied before
    assert w.received == w.applied + w.rejected


def test_a_dropped_window_reopened_starts_from_nothing():
    """max_pending 1: a newer window of the layer drops the pending one (counted); when
    the older one is sent again it starts from zero, its earlier reports gone (DC 0 sent
    its ranks apart before, its DC sum now)."""
    topo = _topo()
    core = _core(max_pending=1)
    w = core.windows_in
    # layer 1's window 0 stays pending beside it: layer 0's part is reused when reopened
    old = np.full((3, E), 7)
    core.report_windows([_rep(0, 0, 0, old, 3), _rep(0, 1, 0, np.full(E, 7), 4)])
    core.report_windows([_rep(1, 0, 0, np.full(E, 1), 2)])  # drops window 0 of layer 0
    assert (w.pending_dropped, w.dropped_rank_reports) == (1, 3)
    rng = np.random.default_rng(6)
    dc_sum = rng.integers(0, 99, (topo.num_dcs, E))
    rows = rng.integers(0, 99, (2, E))  # DC 1's two ranks apart
    dc_sum[1] = rows.sum(axis=0)
    for d, load in enumerate([dc_sum[0], rows, dc_sum[2]]):
        core.report_windows([_rep(0, 0, d, load, 1)])
    assert (w.pending_dropped, w.dropped_rank_reports) == (2, 5)  # window 1 went for it
    assert np.array_equal(w.newest(0).dc_sum, dc_sum) and w.newest(0).reports == 3
    rank_sum = np.zeros((topo.num_ranks, E), np.int64)
    rank_sum[topo.dc_ranks[1]] = rows
    ref = window_mean_reference(
        topo,
        np.ones(topo.num_ranks, bool),
        steps=np.full(topo.num_dcs, N),
        dc_sum=dc_sum,
        rank_sum=rank_sum,
        per_rank=np.array([False, True, False]),
    )
    assert np.array_equal(core.window(0)[-1], ref)


def test_a_window_mean_is_made_when_first_asked_for_and_kept():
    topo = _topo()
    core = _core()
    rng = np.random.default_rng(4)
    sums = rng.integers(0, 90, (topo.num_dcs, E))
    core.report_windows([_rep(0, 0, d, sums[d]) for d in range(topo.num_dcs)])
    ((step, kept),) = [(s, x) for s, x in core.loads._windows[0]]
    assert step == N - 1 and isinstance(kept, WindowMean) and kept._array is None
    got = core.window(0)[-1]
    ref = window_mean_reference(
        topo,
        np.ones(topo.num_ranks, bool),
        steps=np.full(topo.num_dcs, N),
        dc_sum=sums,
        rank_sum=None,
        per_rank=np.zeros(topo.num_dcs, bool),
    )
    assert np.array_equal(got, ref)
    assert kept._array is not None and kept.array() is kept._array  # made once


def test_a_plan_makes_its_window_means_before_it_takes_the_lock():
    topo = _topo()
    core = _core()
    rng = np.random.default_rng(9)
    for layer in range(L):
        core.report_windows([_rep(0, layer, d, rng.integers(0, 90, E)) for d in range(3)])
    kept = [core.loads._windows[layer][-1][1] for layer in range(L)]
    made_under_lock = []

    class Spy:  # the core's lock, noting means still unmade each time it is taken
        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            made_under_lock.append(sum(k._array is None for k in kept))
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    core._lock = Spy(core._lock)
    pv = core.plan(N)
    assert len(pv.layers) == L and made_under_lock[0] == 0
    assert all(np.array_equal(k.array(), core.window(layer)[-1]) for layer, k in enumerate(kept))
    assert topo.num_ranks == kept[0].array().shape[0]
