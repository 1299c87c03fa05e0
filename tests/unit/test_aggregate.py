"""Hierarchical load aggregation: the DC aggregator (workers/aggregate.py), the window
mean (planner/window.py, fast == reference) and the controller's assembly of DC windows
(controller/windows.py through ControllerCore.report_windows), with exact accounting."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.controller.core import BatchReportError, ControllerCore, ControllerSettings
from expertmesh.planner import ModelSpec, Topology
from expertmesh.planner.window import (
    WindowBlock,
    WindowReport,
    window_mean,
    window_mean_reference,
)
from expertmesh.workers.aggregate import DcAggregator

E, L, N = 6, 2, 4  # experts, layers, microbatches per window


def _topo() -> Topology:
    return Topology.from_dict(
        {
            "dcs": [
                {"name": "a", "nodes": 1, "ranks_per_node": 3},
                {"name": "b", "nodes": 1, "ranks_per_node": 2},
                {"name": "c", "nodes": 1, "ranks_per_node": 1},
            ],
            "slots_per_rank": {"masters": 2, "spare": 1},
        }
    )


def _core(topo: Topology, window: int = 8) -> ControllerCore:
    model = ModelSpec(num_layers=L, num_experts=E, top_k=2)
    return ControllerCore(topo, model, ControllerSettings(policy="eplb", window=window))


def _aggs(topo: Topology, **kw) -> list[DcAggregator]:
    return [DcAggregator(d, topo.dc_ranks[d].tolist(), L, E, N, **kw) for d in range(topo.num_dcs)]


# ---- window mean: fast == reference, and what it preserves ----


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    experts=st.integers(1, 7),
    uniform=st.booleans(),
)
def test_window_mean_equals_the_reference(seed, sizes, experts, uniform):
    rng = np.random.default_rng(seed)
    if uniform:  # every DC the same size, every rank live: the broadcast path
        sizes = [sizes[0]] * len(sizes)
    topo = Topology.from_dict(
        {
            "dcs": [
                {"name": f"d{i}", "nodes": 1, "ranks_per_node": n} for i, n in enumerate(sizes)
            ],
            "slots_per_rank": {"masters": 1, "spare": 1},
        }
    )
    live = rng.random(topo.num_ranks) < (1.0 if uniform else 0.8)
    steps = rng.integers(1, 9, topo.num_dcs)
    rank_sum = rng.integers(0, 1000, (topo.num_ranks, experts))
    rank_sum[~live] = 0
    dc_sum = np.stack([rank_sum[r].sum(axis=0) for r in topo.dc_ranks])
    per_rank = rng.random(topo.num_dcs) < 0.5
    kw = {"steps": steps, "dc_sum": dc_sum, "rank_sum": rank_sum, "per_rank": per_rank}
    fast = window_mean(topo, live, **kw)
    assert np.array_equal(fast, window_mean_reference(topo, live, **kw))
    assert (fast[~live] == 0).all()
    for d, ranks in enumerate(topo.dc_ranks):
        alive = ranks[live[ranks]]
        if not alive.size or per_rank[d]:
            continue
        # each expert's DC total is the rounded mean, split within one token
        want = (2 * dc_sum[d] + steps[d]) // (2 * steps[d])
        assert np.array_equal(fast[alive].sum(axis=0), want)
        assert (fast[alive].max(axis=0) - fast[alive].min(axis=0) <= 1).all()


# ---- the aggregator ----


def test_aggregator_sums_exactly_and_closes_aligned_windows():
    rng = np.random.default_rng(0)
    agg = DcAggregator(1, [3, 4], L, E, N, per_rank=True)
    loads = rng.integers(0, 50, (2 * N, 2, L, E))  # [T, n, L, E]
    out: list[WindowReport] = []
    for t in range(2 * N):
        for i, r in enumerate((3, 4)):
            got = agg.add_step(t, r, loads[t, i])
            # a window closes exactly when its last step's last report arrives
            last = t % N == N - 1 and i == 1
            assert len(got) == (L if last else 0)
            out += got
    assert [(w.first_step, w.last_step, w.layer) for w in out] == [
        (0, 3, 0), (0, 3, 1), (4, 7, 0), (4, 7, 1)
    ]  # fmt: skip
    for w in out:
        want = loads[w.first_step : w.last_step + 1, :, w.layer].sum(axis=0)
        assert np.array_equal(w.load, want) and w.steps == N and w.reports == 2 * N
    assert agg.received == agg.applied == agg.reports_sent == 2 * N * 2 * L
    # the DC's sum when not per rank
    agg2 = DcAggregator(1, [3, 4], L, E, N)
    for t in range(N):
        for i, r in enumerate((3, 4)):
            out2 = agg2.add_step(t, r, loads[t, i])
    assert np.array_equal(out2[0].load, loads[:N, :, 0].sum(axis=(0, 1)))


def test_aggregator_refuses_bad_reports_and_keeps_its_accounting():
    agg = DcAggregator(0, [0, 1, 2], L, E, N)
    good = np.ones(E, np.int64)
    agg.add(0, 0, 0, good)
    bad = [
        (0, 0, 0, good),  # duplicate
        (0, L, 0, good),  # unknown layer
        (0, 0, 7, good),  # rank of another DC
        (0, 0, 1, np.ones(E + 1, np.int64)),  # wrong length
        (0, 0, 1, -good),  # negative
        (0, 0, 1, good * 0.5),  # fractional
        (0, 0, 1, np.full(E, np.nan)),
        (0, 0, 1, good * 2**41),  # implausibly large
        (-1, 0, 1, good),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            agg.add(*args)
    assert agg.received == 1 + len(bad) and agg.rejected == len(bad) and agg.applied == 1
    assert agg.pending_reports == 1 and agg.reports_sent == 0
    with pytest.raises(ValueError):
        agg.add_step(1, 0, np.ones((L + 1, E)))
    assert agg.received == agg.applied + agg.rejected
    assert agg.applied == agg.reports_sent + agg.pending_reports


def test_a_dead_rank_a_silent_rank_and_flush_close_windows():
    agg = DcAggregator(0, [0, 1], 1, E, N)
    one = np.ones(E, np.int64)
    for t in range(N):
        assert agg.add(t, 0, 0, one) == []  # rank 1 silent: window 0 stays open
    (w,) = agg.set_live_ranks([0])  # rank 1 died: window 0 is complete without it
    assert (w.first_step, w.steps, w.reports) == (0, N, N)
    assert np.array_equal(w.load, N * one)
    # two windows ahead of an open one: the open one closes as it is
    agg.set_live_ranks([0, 1])
    agg.add(N, 0, 0, one)
    assert agg.add(2 * N, 0, 0, one) == []  # max_open=2: windows 1 and 2 open
    (w1,) = agg.add(3 * N, 0, 0, one)  # window 3 opens: window 1 closes (1 step, 1 report)
    assert (w1.first_step, w1.steps, w1.reports) == (N, 1, 1)
    with pytest.raises(ValueError, match="already sent"):
        agg.add(N + 1, 0, 1, one)  # window 1 is gone
    rest = agg.flush()
    assert [w.first_step for w in rest] == [2 * N, 3 * N]
    assert agg.pending_reports == 0 and agg.reports_sent == agg.applied


# ---- the controller ----


def _run(topo, core, aggs, loads):
    """Every rank reports ``loads`` [T, R, L, E] through its DC's aggregator."""
    sent = 0
    for t in range(loads.shape[0]):
        for agg in aggs:
            for r in agg.ranks:
                reps = agg.add_step(t, r, loads[t, r])
                if reps:
                    applied, _ = core.report_windows(reps)
                    sent += applied
    return sent


@pytest.mark.parametrize("per_rank", [False, True])
def test_the_controller_sees_each_window_mean_and_accounts_for_every_report(per_rank):
    topo = _topo()
    core = _core(topo)
    aggs = _aggs(topo, per_rank=per_rank)
    rng = np.random.default_rng(1)
    loads = rng.integers(0, 40, (3 * N, topo.num_ranks, L, E))  # [T, R, L, E]
    sent = _run(topo, core, aggs, loads)
    assert sent == 3 * L * topo.num_dcs
    for layer in range(L):
        win = core.window(layer)  # [3, R, E]: one entry per window
        assert win.shape == (3, topo.num_ranks, E)
        assert core.layer_newest_step(layer) == 3 * N - 1
        for w in range(3):
            sums = loads[w * N : (w + 1) * N, :, layer].sum(axis=0)  # [R, E]
            if per_rank:
                assert np.array_equal(win[w], (2 * sums + N) // (2 * N))
            for ranks in topo.dc_ranks:
                want = (2 * sums[ranks].sum(axis=0) + N) // (2 * N)
                if per_rank:
                    assert (np.abs(win[w][ranks].sum(axis=0) - want) <= len(ranks)).all()
                else:
                    assert np.array_equal(win[w][ranks].sum(axis=0), want)
        # the exact sums of the newest window, per DC
        newest = core.windows_in.newest(layer)
        sums = loads[2 * N :, :, layer].sum(axis=0)
        assert np.array_equal(newest.dc_sum, np.stack([sums[r].sum(0) for r in topo.dc_ranks]))
    agg_applied = sum(a.applied for a in aggs)
    assert agg_applied == 3 * N * topo.num_ranks * L  # every rank report summed
    assert core.windows_in.rank_reports == agg_applied == sum(a.reports_sent for a in aggs)
    w = core.windows_in
    assert w.received == w.applied + w.rejected and w.rejected == 0
    assert core.reports_received - core.reports_rejected == sent
    pv = core.plan(3 * N)  # policies plan on the window means
    assert len(pv.layers) == L


def test_bad_window_reports_are_refused_and_change_nothing():
    topo = _topo()
    core = _core(topo)
    load = np.ones(E, np.int64)

    def rep(**kw):
        base = {"first_step": 0, "last_step": N - 1, "layer": 0, "dc": 0, "steps": N,
                "reports": 3 * N, "load": load}  # fmt: skip
        return WindowReport(**{**base, **kw})

    assert core.report_windows([rep()]) == (1, 0)
    bad = [
        rep(),  # duplicate
        rep(dc=3),
        rep(layer=L),
        rep(dc=1, last_step=N),  # another end for the same window
        rep(dc=1, first_step=2, last_step=N + 1),  # overlaps the pending one
        rep(dc=1, load=np.ones((3, E), np.int64)),  # DC 1 has 2 ranks
        rep(dc=1, load=np.ones(E + 1, np.int64)),
    ]
    for b in bad:
        before = (core.windows_in.received, core.reports_received, core.window(0).shape[0])
        with pytest.raises(BatchReportError):
            core.report_windows([b])
        assert core.windows_in.received == before[0] + 1
        assert core.window(0).shape[0] == before[2] == 0
    assert core.windows_in.rejected == len(bad)
    # the rest of the window completes it, as if the refused ones never came
    assert core.report_windows([rep(dc=1), rep(dc=2)]) == (2, 1)
    assert core.window(0).shape[0] == 1
    # a stale window, and a batch whose second report is bad: the first stays applied
    with pytest.raises(BatchReportError) as err:
        core.report_windows([rep(first_step=N, last_step=2 * N - 1), rep()])
    assert err.value.applied == 1
    w = core.windows_in
    assert w.received == w.applied + w.rejected == 3 + len(bad) + 2
    with pytest.raises(ValueError):
        WindowReport(first_step=3, last_step=2, layer=0, dc=0, steps=1, reports=1, load=load)
    with pytest.raises(ValueError):
        WindowReport(first_step=0, last_step=1, layer=0, dc=0, steps=3, reports=1, load=load)


def _window(**kw) -> WindowReport:
    base = {"first_step": 0, "last_step": N - 1, "layer": 0, "steps": N, "reports": 1}
    return WindowReport(**{**base, **kw})


def test_dead_ranks_need_no_report_and_get_no_load():
    topo = _topo()
    core = _core(topo)
    core.set_dead_ranks([5, 3])  # DC c (rank 5) entirely, one rank of DC b
    load = np.full(E, 10, np.int64)
    reps = [_window(dc=d, load=load) for d in (0, 1)]
    with pytest.raises(BatchReportError, match="no live rank"):
        core.report_windows([_window(dc=2, load=load)])
    assert core.report_windows(reps) == (2, 1)
    win = core.window(0)[-1]
    assert (win[[3, 5]] == 0).all()
    assert np.array_equal(win[4], (2 * load + N) // (2 * N))  # DC b's only live rank


# ---- a whole step of a DC at once (what the SPMD runtime's DC lead feeds) ----


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), window=st.integers(1, 4), per_rank=st.booleans())
def test_add_rows_equals_one_report_at_a_time(seed, window, per_rank):
    rng = np.random.default_rng(seed)
    ranks = [5, 6, 7]
    loads = rng.integers(0, 50, (3 * window + 1, 3, L, E))  # [T, n, L, E]
    a = DcAggregator(2, ranks, L, E, window, per_rank=per_rank)
    b = DcAggregator(2, ranks, L, E, window, per_rank=per_rank)
    got_a: list[WindowReport] = []
    got_b: list[WindowReport] = []
    for t in range(loads.shape[0]):
        got_a += a.add_rows(t, ranks, loads[t])
        for i, r in enumerate(ranks):
            for layer in range(L):
                got_b += b.add(t, layer, r, loads[t, i, layer])
    got_a += a.flush()
    got_b += b.flush()
    key = [(w.first_step, w.layer, w.steps, w.reports) for w in got_a]
    assert key == [(w.first_step, w.layer, w.steps, w.reports) for w in got_b]
    assert all(np.array_equal(x.load, y.load) for x, y in zip(got_a, got_b, strict=True))
    for w in got_a:  # and each equals the plain sum
        part = loads[w.first_step : w.last_step + 1, :, w.layer]  # [steps, n, E]
        assert np.array_equal(w.load, part.sum(axis=0) if per_rank else part.sum(axis=(0, 1)))
    assert a.counters() == b.counters()
    assert a.received == a.applied == a.reports_sent == loads.shape[0] * 3 * L


def test_add_rows_is_all_or_nothing():
    agg = DcAggregator(0, [0, 1, 2], L, E, N)
    ok = np.ones((2, L, E), np.int64)
    assert agg.add_rows(0, [0, 1], ok) == []
    bad = [
        (0, [0, 1], ok),  # duplicate step
        (1, [0, 3], ok),  # a rank of another DC
        (1, [0, 0], ok),  # twice the same rank
        (1, [0, 1], ok[:, :, :-1]),  # wrong shape
        (1, [0, 1], -ok),
        (1, [0, 1], ok * 0.5),
    ]
    for args in bad:
        before = agg.counters()
        with pytest.raises(ValueError):
            agg.add_rows(*args)
        after = agg.counters()
        assert after["rejected"] == before["rejected"] + 2 * L  # every report of the call
        assert after["applied"] == before["applied"] and after["pending"] == before["pending"]
    assert agg.received == agg.applied + agg.rejected == 2 * L + len(bad) * 2 * L
    assert agg.applied == agg.reports_sent + agg.pending_reports == 2 * L


def test_an_aggregator_started_mid_window_expects_nothing_before_its_first_step():
    """A replacement lead's aggregator: its first window closes at the window's last step,
    holding only the steps it saw; steps before its start are refused."""
    agg = DcAggregator(0, [0, 1], L, E, N, first_step=N + 2)
    one = np.ones((2, L, E), np.int64)
    with pytest.raises(ValueError, match="step must be in"):
        agg.add_rows(N + 1, [0, 1], one)
    assert agg.add_rows(N + 2, [0, 1], one) == []
    out = agg.add_rows(2 * N - 1, [0, 1], one)  # the window's last step
    assert [(w.first_step, w.steps, w.reports) for w in out] == [(N, 2, 4)] * L
    assert all(np.array_equal(w.load, np.full(E, 4)) for w in out)
    assert agg.received == agg.applied + agg.rejected and agg.pending_reports == 0


def test_pending_windows_dropped_by_a_membership_change_are_counted():
    topo = _topo()
    core = _core(topo)
    load = np.full(E, 10, np.int64)
    core.report_windows([_window(dc=0, load=load, reports=7), _window(dc=1, load=load, reports=5)])
    w = core.windows_in
    assert (w.pending_dropped, w.dropped_rank_reports) == (0, 0)
    core.set_dead_ranks([5])  # DC c dies before reporting: the pending window is dropped
    assert (w.pending_dropped, w.dropped_rank_reports) == (1, 12)
    assert w.rank_reports == 12 and core.window(0).shape[0] == 0


# ---- one DC's window of every layer at once (WindowBlock, the wire's DcWindowReport) ----


def test_a_block_is_its_reports_and_the_core_applies_it_whole():
    topo = _topo()
    rng = np.random.default_rng(5)
    loads = rng.integers(0, 40, (N, topo.num_ranks, L, E))
    outs = []
    for mode in ("reports", "blocks"):
        core, aggs = _core(topo), _aggs(topo)
        for t in range(N):
            for agg in aggs:
                reps = [w for r in agg.ranks for w in agg.add_step(t, r, loads[t, r])]
                items = WindowBlock.of(reps) if mode == "blocks" else reps
                if mode == "blocks" and reps:
                    assert len(items) == 1 and len(items[0]) == L  # one block per DC window
                    assert [(x.layer, x.reports) for x in items[0].split()] == [
                        (x.layer, x.reports) for x in reps
                    ]
                if items:
                    assert core.report_windows(items) == (L, L if agg is aggs[-1] else 0)
        outs.append([core.window(layer) for layer in range(L)])
        assert core.windows_in.received == core.windows_in.applied == topo.num_dcs * L
    assert all(np.array_equal(a, b) for a, b in zip(*outs, strict=True))
    bad = [
        {"layers": [0, 0]},  # a layer twice
        {"steps": [0, 1]},
        {"load": -np.ones((L, E), np.int64)},
        {"load": np.ones((L + 1, E), np.int64)},
    ]
    base = {"layers": [0, 1], "steps": [1, 1], "reports": [1, 1], "load": np.ones((L, E), int)}
    for kw in bad:
        with pytest.raises(ValueError):
            WindowBlock(first_step=0, last_step=N - 1, dc=0, **{**base, **kw})
