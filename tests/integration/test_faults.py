"""Faults survived, nothing lost: the runtime on a real local Ray cluster under injected
crashes (issue 7). The demo model's losses do not depend on the placement (every policy
trains to the same losses), so a faulted run must reproduce an unfaulted one step for step:
a lost step, a skipped optimizer update or a half-applied plan would change them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import ray

from expertmesh.runtime.cluster import NAMESPACE, Runtime

STEPS = 7
CRASH = {2: "prepared", 5: "committed"}  # crash the controller while applying this step's plan


def _worker_plans(num_ranks: int) -> list[tuple[int, Any, bool]]:
    ws = [ray.get_actor(f"worker-{r}", namespace=NAMESPACE) for r in range(num_ranks)]
    return [tuple(x) for x in ray.get([w.call.remote("plan_state") for w in ws])]


@pytest.fixture(scope="module")
def controller_crashes(fault_runtime: Runtime) -> dict[str, Any]:
    rt = fault_runtime
    base = [rt.run_step() for _ in range(STEPS)]
    rt.reset(rt.settings)
    steps, statuses = [], []
    for i in range(STEPS):
        if i in CRASH:
            ray.get(rt.controller.inject_crash.remote(CRASH[i]))
        steps.append(rt.run_step())
        statuses.append(rt.status())
    return {
        "base": base,
        "steps": steps,
        "statuses": statuses,
        "failures": list(rt.controller_failures),
        "workers": _worker_plans(rt.topology.num_ranks),
    }


def test_controller_crashes_lose_no_step(controller_crashes: dict[str, Any]) -> None:
    base, steps = controller_crashes["base"], controller_crashes["steps"]
    assert controller_crashes["failures"] == sorted(CRASH)
    assert [s.step for s in steps] == list(range(STEPS))
    np.testing.assert_allclose([s.loss for s in steps], [s.loss for s in base], rtol=1e-4)
    for s in steps:
        assert (s.error is not None) == (s.step in CRASH), (s.step, s.error)


def test_prepared_plan_is_rolled_back_after_a_restart(controller_crashes: dict[str, Any]) -> None:
    steps, statuses = controller_crashes["steps"], controller_crashes["statuses"]
    # the plan prepared after step 2 never committed: step 3 trains on the plan of step 1
    assert steps[3].plan_version == steps[2].plan_version
    after = statuses[3]
    assert after["restarted"] is True
    assert after["reconciled"]["rolled_back"] == [0, 1, 2, 3]
    assert after["errors"] == 0  # a fresh actor: the crash is not an error it saw
    assert after["version"] > steps[2].plan_version  # and it plans again after reconciling


def test_stored_commit_is_completed_after_a_restart(controller_crashes: dict[str, Any]) -> None:
    steps, statuses = controller_crashes["steps"], controller_crashes["statuses"]
    committed = statuses[4]["version"]  # committed after step 4, run by step 5
    assert steps[5].plan_version == committed
    # the crash after step 5 came between the store's commit and the workers'
    assert statuses[6]["reconciled"]["completed"] == [0, 1, 2, 3]
    assert steps[6].plan_version == committed  # step 6 ran before the restart reconciled
    final = statuses[-1]["version"]
    assert final > committed + 1
    assert controller_crashes["workers"] == [(final, None, False)] * 4
