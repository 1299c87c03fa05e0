"""Planning in a planner process gives the same plans as in process, and its failures are
errors, never a dead controller."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from pydantic import ValidationError

from expertmesh.controller.core import (
    ControllerCore,
    ControllerSettings,
    PlannerError,
    PlannerSettings,
)
from expertmesh.controller.planning import (
    LayerJob,
    ProcessPlanner,
    _widen,
    compact_ints,
    plan_jobs,
)
from expertmesh.planner import ModelSpec, Placement, Topology
from expertmesh.planner.static import StaticPolicy

TOPO = Topology.generate(dcs=2, ranks_per_dc=4, masters=2, spare=1)
MODEL = ModelSpec(num_layers=2, num_experts=16, top_k=2)
# a planner's nap in the tests below: far longer than any load makes a kill or a timeout take,
# so "it did not wait for the nap" is elapsed < NAP / 2, not a wall-time budget
NAP = 300


class SleepyPolicy(StaticPolicy):
    """Static placement after a nap (importable by the planner process, never registered)."""

    def place(self, ctx):
        time.sleep(float(os.environ.get("EXPERTMESH_TEST_NAP", "30")))
        return super().place(ctx)


class BrokenPolicy(StaticPolicy):
    def place(self, ctx):
        raise ValueError("this policy refuses to plan")


@pytest.fixture(scope="module")
def pool():
    planner = ProcessPlanner(TOPO, MODEL, PlannerSettings(process=True, timeout_seconds=60))
    yield planner
    planner.close()


def _feed(core, steps, seed=0):
    rng = np.random.default_rng(seed)
    for step in steps:
        for layer in range(MODEL.num_layers):
            core.report_layer(step, layer, rng.zipf(1.5, (TOPO.num_ranks, MODEL.num_experts)))


def _plans(process: bool, policy: str, settings: dict) -> list:
    core = ControllerCore(
        TOPO,
        MODEL,
        ControllerSettings(policy=policy, policy_settings=settings),
        planner=PlannerSettings(process=process),
    )
    out = []
    try:
        for step in range(0, 13):
            _feed(core, [step], seed=step)
            if step in (0, 1, 5, 10, 12):
                if step == 10:
                    core.set_dead_ranks([3])  # a membership change: planned afresh
                pv = core.plan(step)
                core.commit(pv.version)
                out.append(pv)
    finally:
        core.close()
    return out


@pytest.mark.parametrize(
    ("policy", "settings"),
    [("eplb", {"period": 1, "window": 4, "min_gain": 0.0}), ("quota", {}), ("hybrid", {})],
)
def test_a_planner_process_makes_the_same_plans(policy, settings):
    inline, remote = _plans(False, policy, settings), _plans(True, policy, settings)
    assert len(inline) == len(remote) == 5
    for a, b in zip(inline, remote, strict=True):
        assert a.imbalance_before == b.imbalance_before
        assert a.imbalance_after == b.imbalance_after
        for la, lb in zip(a.layers, b.layers, strict=True):
            assert np.array_equal(la.phy2log, lb.phy2log)
            assert np.array_equal(la.placement.master, lb.placement.master)
            assert la.route.dtype == lb.route.dtype == np.int64
            assert np.array_equal(la.route, lb.route)
            assert la.migration.transfers == lb.migration.transfers
            assert la.migration.round_seconds == lb.migration.round_seconds
    # the dead rank holds nothing in either
    assert not (remote[3].layers[0].phy2log[3] >= 0).any()


def _jobs(step=1):
    rng = np.random.default_rng(step)
    load = rng.integers(0, 50, (TOPO.num_ranks, MODEL.num_experts))
    hist = rng.integers(0, 50, (3, TOPO.num_ranks, MODEL.num_experts))
    return [
        LayerJob(layer, step, step, load, hist, committed=None, fresh=False, dead_ranks=())
        for layer in range(MODEL.num_layers)
    ]


def test_the_planner_process_runs_at_a_lower_priority(pool):
    pool.start()
    (pid,) = pool.pids()
    assert pid != os.getpid()
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + 10)


def test_a_policy_error_comes_back_as_itself(pool):
    with pytest.raises(ValueError, match="refuses to plan"):
        pool.run(BrokenPolicy(), _jobs())
    got = pool.run(StaticPolicy(), _jobs())  # the same processes go on
    assert [r.plan.route.shape[1] for r in got] == [4, 4]
    assert pool.restarts == 0


def test_a_planner_killed_mid_plan_is_an_error_and_replaced(pool, monkeypatch):
    monkeypatch.setenv("EXPERTMESH_TEST_NAP", str(NAP))  # read by new planner processes
    pool.close()  # the next run spawns processes that see the nap
    pool.start()
    (pid,) = pool.pids()
    killer = threading.Timer(1.0, os.kill, (pid, 9))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(PlannerError, match="died"):
        pool.run(SleepyPolicy(), _jobs())
    killer.join()
    assert time.monotonic() - t0 < NAP / 2 and pool.restarts == 1
    monkeypatch.setenv("EXPERTMESH_TEST_NAP", "0")
    got = pool.run(SleepyPolicy(), _jobs())  # a new process plans
    assert pool.pids() != [pid]
    expected = plan_jobs(StaticPolicy(), TOPO, MODEL, _jobs())
    assert all(
        np.array_equal(a.plan.phy2log, b.plan.phy2log) for a, b in zip(got, expected, strict=True)
    )


def test_a_plan_over_its_time_is_an_error_and_its_process_stopped(monkeypatch):
    monkeypatch.setenv("EXPERTMESH_TEST_NAP", str(NAP))
    planner = ProcessPlanner(TOPO, MODEL, PlannerSettings(process=True, timeout_seconds=1))
    try:
        planner.start()
        (pid,) = planner.pids()
        t0 = time.monotonic()
        with pytest.raises(PlannerError, match="longer than 1 s"):
            planner.run(SleepyPolicy(), _jobs())
        assert time.monotonic() - t0 < NAP / 2
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}")  # the stuck planner was stopped
    finally:
        planner.close()


def test_the_core_survives_a_failed_plan_and_plans_again(monkeypatch):
    core = ControllerCore(TOPO, MODEL, planner=PlannerSettings(process=True))
    try:
        _feed(core, [0])
        core.set_dead_ranks([1])
        core._planner.start()  # the test kills its process
        for pid in core._planner.pids():
            os.kill(pid, 9)
        with pytest.raises(PlannerError):
            core.plan(0)
        assert core.versions() == []
        pv = core.plan(0)  # a new planner process, still planned afresh without rank 1
        assert pv.version == 1 and not (pv.layers[0].phy2log[1] >= 0).any()
    finally:
        core.close()
        core.close()  # idempotent


def test_planner_settings_are_bounded():
    with pytest.raises(ValidationError):
        PlannerSettings(workers=0)
    with pytest.raises(ValidationError):
        PlannerSettings(nice=20)
    assert PlannerSettings().process is False  # in process unless asked (serve asks)


def test_jobs_with_a_committed_placement_plan_from_it():
    jobs = _jobs()
    first = plan_jobs(StaticPolicy(), TOPO, MODEL, jobs)
    placement = first[0].plan.placement
    job = LayerJob(0, 2, 1, jobs[0].load, jobs[0].history, placement, False, ())
    (again,) = plan_jobs(StaticPolicy(), TOPO, MODEL, [job])
    assert again.plan.placement is placement  # kept: no migration
    assert again.imbalance_before == pytest.approx(again.imbalance_after)
    assert isinstance(placement, Placement)


@given(
    hnp.arrays(
        dtype=np.int64,
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
        elements=st.integers(-(2**40), 2**40),
    )
)
def test_compact_arrays_keep_every_value(arr):
    small = compact_ints(arr)
    assert small.dtype.itemsize <= arr.dtype.itemsize
    back = _widen(small, arr.dtype)
    assert back.dtype == arr.dtype and np.array_equal(back, arr)


def test_token_counts_and_ranks_cross_in_16_bits():
    route = np.array([[999, 255, 0, 60_000]], np.int64)
    assert compact_ints(route).dtype == np.uint16
    assert compact_ints(np.array([-1, 5])).dtype.itemsize <= 2
