import numpy as np
import pytest

from expertmesh.controller.core import (
    ControllerCore,
    ControllerSettings,
    PlanState,
    StaleReportError,
    Trigger,
)
from expertmesh.planner import ModelSpec, Topology


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _core(**settings):
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    model = ModelSpec(num_layers=2, num_experts=8, top_k=2)
    saved = []

    class Store:
        def save(self, pv):
            saved.append(pv.version)

    core = ControllerCore(
        topo, model, ControllerSettings(**settings), clock=FakeClock(), store=Store()
    )
    return core, saved


def _report_step(core, step, rng):
    done = []
    for layer in range(core.model.num_layers):
        for rank in range(core.topology.num_ranks):
            done.append(
                core.report_load(step, layer, rank, rng.integers(0, 20, core.model.num_experts))
            )
    return done


def test_reports_assemble_a_step_and_fill_the_window():
    core, _ = _core()
    done = _report_step(core, 0, np.random.default_rng(0))
    assert done == [False, False, False, True] * 2
    assert core.window(0).shape == (1, 4, 8)
    assert core.reports_received == 8 and core.reports_rejected == 0


@pytest.mark.parametrize(
    ("step", "layer", "rank", "load", "message"),
    [
        (0, 5, 0, np.zeros(8, int), "unknown layer"),
        (0, 0, 9, np.zeros(8, int), "unknown rank"),
        (0, 0, 0, np.zeros(7, int), r"must be \[8\]"),
        (0, 0, 0, -np.ones(8, int), "negative"),
        (0, 0, 0, np.full(8, np.nan), "finite"),
        (0, 0, 0, np.full(8, "x"), "integers"),
    ],
)
def test_bad_reports_are_rejected_and_change_nothing(step, layer, rank, load, message):
    core, _ = _core()
    with pytest.raises(ValueError, match=message):
        core.report_load(step, layer, rank, load)
    assert core.reports_rejected == 1
    assert core.window(0).shape[0] == 0 and not core.loads._pending


def test_duplicate_and_stale_reports_are_rejected():
    core, _ = _core()
    rng = np.random.default_rng(1)
    core.report_load(0, 0, 0, np.ones(8, int))
    with pytest.raises(ValueError, match="already reported"):
        core.report_load(0, 0, 0, np.ones(8, int))
    _report_step(core, 1, rng)
    with pytest.raises(StaleReportError):
        core.report_load(1, 0, 0, np.ones(8, int))
    assert core.reports_rejected == 2


def test_every_n_trigger_and_two_phase_lifecycle():
    core, saved = _core(trigger=Trigger(mode="every_n", every=3))
    rng = np.random.default_rng(2)
    _report_step(core, 0, rng)
    pv = core.maybe_plan(0)
    assert pv is not None and pv.state == PlanState.PREPARED and pv.version == 1
    assert core.committed is None
    core.commit(1)
    core.commit(1)  # idempotent
    assert core.committed is pv and saved == [1]
    for step in (1, 2):
        _report_step(core, step, rng)
        assert core.maybe_plan(step) is None
    _report_step(core, 3, rng)
    assert core.maybe_plan(3).version == 2
    core.rollback(2)
    with pytest.raises(ValueError, match="cannot become"):
        core.commit(2)
    assert core.committed.version == 1


def test_commit_of_newer_version_retires_older_prepared_ones():
    core, _ = _core(trigger=Trigger(mode="every_step"), policy="static")
    rng = np.random.default_rng(3)
    _report_step(core, 0, rng)
    a = core.plan(0)
    b = core.plan(0)
    core.commit(b.version)
    assert a.state == PlanState.ROLLED_BACK
    with pytest.raises(ValueError):
        core.commit(a.version)


def test_threshold_trigger_fires_only_on_skew():
    core, _ = _core(trigger=Trigger(mode="threshold", threshold=1.5))
    core.report_layer(0, 0, np.ones((4, 8), int))
    core.report_layer(0, 1, np.ones((4, 8), int))
    core.commit(core.plan(0).version)
    core.report_layer(1, 0, np.ones((4, 8), int))
    core.report_layer(1, 1, np.ones((4, 8), int))
    assert not core.should_plan(1)
    skew = np.zeros((4, 8), int)
    skew[:, 0] = 100  # all tokens to expert 0 on rank 0
    core.report_layer(2, 0, skew)
    core.report_layer(2, 1, np.ones((4, 8), int))
    assert core.should_plan(2)


def test_bad_policy_leaves_settings_unchanged():
    core, _ = _core()
    with pytest.raises(ValueError, match="unknown policy"):
        core.configure(ControllerSettings(policy="nope"))
    assert core.settings.policy == "static"


def test_incomplete_steps_are_bounded_per_layer():
    core, _ = _core()
    cap = core.settings.max_pending_steps
    for step in range(1, cap + 11):  # rank 0 only: no step ever completes
        core.report_load(step, 0, 0, np.ones(8, np.int64))
    core.report_load(5, 1, 0, np.ones(8, np.int64))  # another layer keeps its own
    assert sorted(k[0] for k in core.loads._pending if k[1] == 0) == list(range(11, cap + 11))
    assert (5, 1) in core.loads._pending and core.pending_dropped == 10
    assert core.reports_received == cap + 11 and core.reports_rejected == 0


@pytest.mark.parametrize("step", [-1, 2**62, 2**64 - 1])
def test_steps_outside_int62_are_refused(step):
    core, _ = _core()
    with pytest.raises(ValueError, match="step must be in"):
        core.report_load(step, 0, 0, np.ones(8, np.int64))
    with pytest.raises(ValueError, match="step must be in"):
        core.report_layer(step, 0, np.ones((4, 8), np.int64))
    assert core.reports_rejected == 2 and not core.loads._pending


def test_finished_plans_beyond_keep_versions_leave_memory():
    core, saved = _core(trigger={"mode": "every_step"})
    rng = np.random.default_rng(0)
    for step in range(core.KEEP_VERSIONS + 5):
        _report_step(core, step, rng)
        core.commit(core.plan(step).version)
    prepared = core.plan(step)  # stays until committed or rolled back
    kept = [pv.version for pv in core.versions()]
    assert kept == [*range(step + 1 - core.KEEP_VERSIONS, step + 3)]
    assert core.committed.version == step + 1 and prepared.version == step + 2
    assert saved == list(range(1, step + 2))  # every commit reached the store
    with pytest.raises(ValueError, match="unknown plan version"):
        core.get(1)


def test_dead_ranks_complete_steps_and_get_nothing_in_plans():
    core, _ = _core(policy="eplb")
    rng = np.random.default_rng(1)
    _report_step(core, 0, rng)
    pv = core.plan(0)
    core.commit(pv.version)
    core.set_dead_ranks([1])
    assert core.dead_ranks == (1,)
    done = [
        core.report_load(1, layer, rank, rng.integers(0, 20, 8))
        for layer in range(2)
        for rank in (0, 2, 3)  # rank 1 is dead: the others complete the step
    ]
    assert done[-1] and done[2]
    pv = core.plan(1)
    for lp in pv.layers:
        assert (lp.phy2log[1] < 0).all()
        assert (lp.placement.master_rank() != 1).all()
        assert (lp.route[:, 2] != 1).all()
    core.commit(pv.version)
    core.set_dead_ranks([])  # rank 1 rejoins: the next plan is made afresh and uses it
    _report_step(core, 2, rng)
    pv = core.plan(2)
    assert all((lp.phy2log[1] >= 0).any() for lp in pv.layers)
    with pytest.raises(ValueError, match="unknown rank"):
        core.set_dead_ranks([4])
    with pytest.raises(ValueError, match="every rank"):
        core.set_dead_ranks([0, 1, 2, 3])


def test_unchanged_membership_keeps_the_placement():
    """eplb (period 100) keeps its placement from step 2 on; telling the core the same dead
    ranks again (none) is no membership change, so the next plan still keeps it (a change
    would make it plan afresh, as test_dead_ranks_complete_steps_and_get_nothing_in_plans
    checks)."""
    core, _ = _core(policy="eplb", policy_settings={"period": 100}, trigger={"mode": "every_step"})
    rng = np.random.default_rng(0)
    plans = []
    for step in range(4):
        if step == 3:
            core.set_dead_ranks([])
        load = rng.integers(0, 5, (core.topology.num_ranks, 8))
        load[:, step] += 200  # a different hot expert every step
        for layer in range(2):
            core.report_layer(step, layer, load)
        plans.append(core.commit(core.plan(step).version))
    for a, b in ((plans[1], plans[2]), (plans[2], plans[3])):
        assert all(
            np.array_equal(x.phy2log, y.phy2log) for x, y in zip(a.layers, b.layers, strict=True)
        )


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (2**40, None),  # the largest count accepted
        (2**40 + 1, r"implausibly large \(> 2\*\*40\)"),
        (-1, "negative"),
    ],
)
def test_load_counts_at_their_limits(value, error):
    """The same limits for a rank's report and a what-if solve. (A whole layer's report,
    core.report_layer, takes counts above 2**40: its callers bound them.)"""
    core, _ = _core(trigger={"mode": "every_step"})
    row = np.ones(8, np.int64)
    row[3] = value
    layer = np.ones((core.topology.num_ranks, 8), np.int64)
    layer[2, 3] = value
    calls = [
        lambda: core.report_load(0, 0, 0, row),
        lambda: core.what_if(layer, policy="static"),
    ]
    for call in calls:
        if error is None:
            call()
        else:
            with pytest.raises(ValueError, match=error):
                call()


def test_a_float_report_must_hold_integers():
    core, _ = _core()
    core.report_load(0, 0, 0, np.full(8, 2.0))
    with pytest.raises(ValueError, match="finite integers"):
        core.report_load(0, 0, 1, np.full(8, 1.5))
