"""The plan lifecycle of ``ControllerCore`` against its specification (docs/architecture.md):
``PREPARED -> COMMITTED | ROLLED_BACK``, nothing else; commit and rollback are idempotent;
a refused transition changes no state, the committed plan and the listeners hear nothing.
The expected table is written out here, not read from ``core.LEGAL_TRANSITIONS``, so a wrong
table fails. And the trigger: at most one plan per step, however often it is asked."""

from __future__ import annotations

import numpy as np
import pytest

from expertmesh.controller.core import ControllerCore, ControllerSettings, PlanState, Trigger
from expertmesh.planner import ModelSpec, Topology

P, C, RB = PlanState.PREPARED, PlanState.COMMITTED, PlanState.ROLLED_BACK
# (state, action) -> the state after, or None if refused
SPEC = {
    (P, "commit"): C,
    (P, "rollback"): RB,
    (C, "commit"): C,  # idempotent
    (C, "rollback"): None,
    (RB, "commit"): None,
    (RB, "rollback"): RB,  # idempotent
}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _core(trigger: Trigger) -> tuple[ControllerCore, list[tuple[str, int]]]:
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    model = ModelSpec(num_layers=2, num_experts=8, top_k=2)
    core = ControllerCore(
        topo, model, ControllerSettings(trigger=trigger, policy="static"), clock=FakeClock()
    )
    heard: list[tuple[str, int]] = []
    core.listeners.append(lambda event, pv: heard.append((event, pv.version)))
    return core, heard


def _report(core: ControllerCore, step: int) -> None:
    rng = np.random.default_rng(step)
    for layer in range(core.model.num_layers):
        core.report_layer(step, layer, rng.integers(0, 20, (core.topology.num_ranks, 8)))


def _plan_in(core: ControllerCore, state: PlanState) -> int:
    """A new plan brought to ``state`` through the public calls; its version."""
    pv = core.plan(0)
    if state == C:
        core.commit(pv.version)
    elif state == RB:
        core.rollback(pv.version)
    assert pv.state == state
    return pv.version


@pytest.mark.parametrize(("state", "action"), sorted(SPEC, key=str))
def test_every_transition_follows_the_lifecycle(state: PlanState, action: str) -> None:
    core, heard = _core(Trigger(mode="every_step"))
    _report(core, 0)
    if state != C:  # a committed plan beside it: a refused call must not touch it
        core.commit(core.plan(0).version)
    version = _plan_in(core, state)
    committed, before = core.committed, list(heard)
    want = SPEC[(state, action)]
    call = core.commit if action == "commit" else core.rollback
    if want is None:
        with pytest.raises(ValueError, match=f"plan {version} is {state}; cannot become"):
            call(version)
        assert core.get(version).state == state
    else:
        assert call(version).state == want
        assert core.get(version).state == want
    if want is None or want == state:  # refused or idempotent: nothing happened
        assert core.committed is committed and heard == before
    else:
        event = "committed" if want == C else "rolled_back"
        assert heard == [*before, (event, version)]


def test_a_committed_plan_stays_committed_and_its_successor_too() -> None:
    core, heard = _core(Trigger(mode="every_step"))
    _report(core, 0)
    first = core.plan(0)
    core.commit(first.version)
    _report(core, 1)
    second = core.plan(1)
    core.commit(second.version)
    for v in (first.version, second.version):
        with pytest.raises(ValueError, match="cannot become"):
            core.rollback(v)
    assert (first.state, second.state) == (C, C) and core.committed is second
    assert heard == [("prepared", 1), ("committed", 1), ("prepared", 2), ("committed", 2)]


def test_every_step_trigger_plans_once_per_step() -> None:
    core, _ = _core(Trigger(mode="every_step"))
    _report(core, 0)
    assert core.should_plan(0)  # nothing committed yet
    pv = core.maybe_plan(0)
    assert pv is not None
    core.commit(pv.version)
    assert not core.should_plan(0) and core.maybe_plan(0) is None  # not twice at step 0
    _report(core, 1)
    assert core.should_plan(1)
    core.commit(core.maybe_plan(1).version)
    assert not core.should_plan(1) and core.maybe_plan(1) is None
    assert [v.version for v in core.versions()] == [1, 2]


def test_every_n_trigger_fires_exactly_every_n_steps() -> None:
    core, _ = _core(Trigger(mode="every_n", every=2))
    fired = []
    for step in range(7):
        _report(core, step)
        pv = core.maybe_plan(step)
        if pv is not None:
            core.commit(pv.version)
            fired.append(step)
        assert core.maybe_plan(step) is None  # never a second plan at the same step
    assert fired == [0, 2, 4, 6]


def test_no_plan_before_every_layer_has_a_complete_step() -> None:
    core, _ = _core(Trigger(mode="every_step"))
    assert not core.should_plan(0) and core.maybe_plan(0) is None
    core.report_layer(0, 0, np.ones((core.topology.num_ranks, 8), int))  # layer 1 missing
    assert not core.should_plan(0) and core.maybe_plan(0) is None
    core.report_layer(0, 1, np.ones((core.topology.num_ranks, 8), int))
    assert core.should_plan(0)


@pytest.mark.parametrize(("threshold", "fires"), [(2.0, False), (1.99, True)])
def test_threshold_trigger_fires_only_above_the_threshold(threshold: float, fires: bool) -> None:
    """Static placement: rank r holds experts 2r and 2r+1. Expert 0 gets 5 tokens from each
    of the 4 ranks, every other expert 1: rank 0 computes 24, the others 8; mean 12, so the
    imbalance is exactly 2.0, which is not above a threshold of 2.0."""
    core, _ = _core(Trigger(mode="threshold", threshold=threshold))
    ranks = core.topology.num_ranks
    for layer in range(2):
        core.report_layer(0, layer, np.ones((ranks, 8), int))
    core.commit(core.plan(0).version)
    skew = np.ones((ranks, 8), int)
    skew[:, 0] = 5
    core.report_layer(1, 0, skew)
    core.report_layer(1, 1, np.ones((ranks, 8), int))
    assert core.layer_stats(0).imbalance == 2.0
    assert core.should_plan(1) is fires


def test_refusals_name_the_version() -> None:
    core, _ = _core(Trigger(mode="every_step"))
    _report(core, 0)
    old, new = core.plan(0), core.plan(0)
    core.commit(new.version)
    with pytest.raises(ValueError, match="unknown plan version 99"):
        core.commit(99)
    with pytest.raises(ValueError, match="unknown plan version 99"):
        core.rollback(99)
    assert old.state == RB  # retired when the newer one committed
    # a prepared plan older than a committed one adopted from the store (a restart)
    other, _ = _core(Trigger(mode="every_step"))
    _report(other, 0)
    for _ in range(3):
        adopted = other.plan(0)
    other.commit(adopted.version)
    fresh, _ = _core(Trigger(mode="every_step"))
    _report(fresh, 0)
    stale = fresh.plan(0)
    fresh.restore(adopted)
    with pytest.raises(ValueError, match=f"plan {stale.version} is older than committed plan 3"):
        fresh.commit(stale.version)
    assert stale.state == P and fresh.committed is adopted
