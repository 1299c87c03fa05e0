"""The controller actor killed mid-training on the SPMD data plane (test_faults.py's checks,
ported): the workers train on while it is down, Ray restarts it, it re-attaches to them,
learns the plan they run and the steps it missed, and planning goes on.

One run of 16 steps on a real local Ray cluster (2 DCs x 2 ranks, eplb planned after every
step, so an offer is always on its way) with three controller deaths:

- ``offered``: the controller exits after sending the next plan to half the workers;
- ``applied``: it exits after the workers switched to a plan, before its store has it;
- ``ray.kill`` while the workers train (reports in flight are lost).

Nothing may be lost or half-applied: every step is recorded once, every rank runs the same
plan version at every step and versions never go back or name two plans, and the losses
and final weights equal the single-process reference.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from expertmesh.controller.core import Trigger
from expertmesh.controller.store import SqlitePlanStore
from expertmesh.planner import Topology
from expertmesh.runtime.settings import NAMESPACE, RuntimeSettings
from expertmesh.runtime.spmd import SpmdRuntime

from .members_common import CORPUS_BYTES, LM, assert_copies_equal, assert_dense_equal, reference

pytestmark = pytest.mark.integration

PHASES = [(3, None), (4, "offered"), (4, "applied"), (5, "kill")]  # (steps, fault before)
STEPS = sum(n for n, _ in PHASES)
KILL_AT = 12  # ray.kill the controller when the driver sees this step


@pytest.fixture(scope="module")
def crashes() -> Iterator[dict[str, Any]]:
    topo = Topology.generate(2, 2, masters=2, spare=2).with_inter_dc(0.5, 2.0)
    settings = RuntimeSettings(
        topology=topo.to_dict(),
        lm=LM,
        policy="eplb",
        trigger=Trigger(mode="every_step"),
        corpus_bytes=CORPUS_BYTES,
        checkpoint_every=4,
    )
    out: dict[str, Any] = {"steps": [], "status": []}
    with SpmdRuntime(settings) as rt:

        def kill(result: Any) -> None:
            if result.step == KILL_AT:
                ray.kill(rt.controller, no_restart=False)  # Ray restarts it

        for n, fault in PHASES:
            if fault in ("offered", "applied"):
                ray.get(rt.controller.inject_crash.remote(fault))
            out["steps"] += rt.train(n, on_step=kill if fault == "kill" else None)
            out["status"].append(rt.status())
        workers = [ray.get_actor(f"worker-{r}", namespace=NAMESPACE) for r in range(4)]
        out["views"] = ray.get([w.controller_view.remote() for w in workers])
        out["plan"] = rt.committed_plan()
        assert rt._tmp is not None
        store = SqlitePlanStore(os.path.join(rt._tmp, "plans.sqlite"))
        out["stored"] = {v: store.get(v) for v in range(1, out["status"][-1]["version"] + 1)}
        store.close()
        out["weights"] = {
            (layer, e): [rt.expert_weights(r, layer, e) for r in range(4)]
            for layer in range(LM.num_layers)
            for e in range(LM.num_experts)
        }
        out["dense"] = [t.numpy() for t in ray.get(rt.workers[0].export_state.remote())["dense"]]
    report = os.environ.get("EXPERTMESH_CONTROLLER_REPORT")
    if report:  # the figures of docs/reliability.md
        Path(report).write_text(json.dumps({
            "outages": out["status"][-1]["controller_outages"],
            "reattached": [st["reattached"] for st in out["status"][1:]],
            "recorded": [s.recorded for s in out["steps"]],
            "plan_versions": [s.plan_version for s in out["steps"]],
        }, indent=1, default=str))  # fmt: skip
    yield out


def test_controller_crashes_lose_no_step(crashes: dict[str, Any]) -> None:
    steps = crashes["steps"]
    assert [s.step for s in steps] == list(range(STEPS))  # each once, in order
    assert all(s.recorded in ("controller", "workers") for s in steps)  # none lost
    assert any(s.recorded == "workers" for s in steps)  # replayed from the workers' reports
    assert all(np.isfinite(s.loss) and s.error is None for s in steps)
    final = crashes["status"][-1]
    assert final["restarted"] is True
    assert len(final["controller_outages"]) == 3  # the driver saw it down three times
    assert final["errors"] == 0


def test_the_workers_train_while_the_controller_is_down(crashes: dict[str, Any]) -> None:
    applied = crashes["status"][2]["reattached"]
    switched = min(s.step for s in crashes["steps"] if s.plan_version == applied["adopted"])
    # the controller died recording step switched - 1 (its reports say "applied"); by the
    # time the restarted one read the workers, every worker had gone past it
    assert min(applied["worker_steps"]) >= switched
    killed = crashes["status"][3]["reattached"]
    assert min(killed["worker_steps"]) > KILL_AT


def test_an_offered_plan_is_never_half_applied_after_a_restart(crashes: dict[str, Any]) -> None:
    offered = crashes["status"][1]["reattached"]
    assert offered["offer"] is not None and offered["offer"] > offered["workers_version"]
    logs = {v["rank"]: {x["step"]: x["version"] for x in v["reports"]} for v in crashes["views"]}
    per_step = [{logs[r][s] for r in range(4)} for s in range(STEPS)]
    assert all(len(vs) == 1 for vs in per_step), per_step  # one version per step, every rank
    versions = [vs.pop() for vs in per_step]
    assert versions == sorted(versions)  # never backwards
    assert offered["offer"] in versions  # the half-sent offer was completed on every rank
    assert all(v["conflicts"] == 0 for v in crashes["views"])  # no version named two plans
    assert crashes["status"][-1]["version"] > offered["offer"]  # and planning went on


def test_a_plan_the_workers_switched_to_is_adopted_after_a_restart(
    crashes: dict[str, Any],
) -> None:
    applied = crashes["status"][2]["reattached"]
    assert applied["adopted"] is not None
    assert applied["adopted"] == applied["workers_version"] > applied["store_version"]
    stored = crashes["stored"][applied["adopted"]]
    assert stored is not None and stored.state == "committed"  # the store has it now
    final, view = crashes["status"][-1]["version"], crashes["views"][0]
    assert final > applied["adopted"]  # planning resumed after it
    assert all(v["version"] == final for v in crashes["views"])
    for (p2l, master, route), (wp, wm, wr) in zip(crashes["plan"], view["layers"], strict=True):
        np.testing.assert_array_equal(p2l, wp)  # the controller's committed plan is theirs
        np.testing.assert_array_equal(master, wm)
        np.testing.assert_array_equal(route, wr)
    assert crashes["stored"][final] is not None


def test_the_run_equals_the_reference_despite_the_crashes(crashes: dict[str, Any]) -> None:
    ref, want = reference([(s, [0, 1, 2, 3]) for s in range(STEPS)])
    np.testing.assert_allclose([s.loss for s in crashes["steps"]], want, rtol=1e-5)
    assert_copies_equal(ref, crashes["weights"])
    assert_dense_equal(ref, crashes["dense"])
