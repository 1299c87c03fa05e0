"""A worker killed mid-training on the SPMD data plane: the survivors undo the step, a
replacement starts in the dead rank's DC and rejoins the process groups, its copies come
from live holders and the checkpoint on disk, the step runs again, and training ends
exactly where a run without the fault ends (the single-process reference)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray

from expertmesh.controller.core import Trigger
from expertmesh.planner import Topology
from expertmesh.runtime.settings import NAMESPACE, RuntimeSettings
from expertmesh.runtime.spmd import SpmdRuntime

from .members_common import CORPUS_BYTES, LM, assert_copies_equal, reference

pytestmark = pytest.mark.integration

STEPS = 5


@pytest.fixture(scope="module")
def kills() -> Iterator[dict[str, Any]]:
    topo = Topology.generate(2, 2, masters=2, spare=2).with_inter_dc(0.5, 2.0)
    settings = RuntimeSettings(
        topology=topo.to_dict(),
        lm=LM,
        policy="hybrid",
        trigger=Trigger(mode="every_n", every=2),
        corpus_bytes=CORPUS_BYTES,
        checkpoint_every=1,
    )
    out: dict[str, Any] = {}
    with SpmdRuntime(settings) as rt:
        old = ray.get_actor("worker-1", namespace=NAMESPACE)
        ray.get(old.inject_exit.remote(0))  # dies as step 0 starts: initial weights restore
        ray.get(rt.workers[2].inject_exit.remote(3))  # a DC leader dies later
        out["steps"] = rt.train(STEPS)
        out["status"] = rt.status()
        out["weights"] = {
            (layer, e): [rt.expert_weights(r, layer, e) for r in range(4)]
            for layer in range(LM.num_layers)
            for e in range(LM.num_experts)
        }
    yield out


def test_training_finishes_with_every_step_once(kills: dict[str, Any]) -> None:
    assert [s.step for s in kills["steps"]] == list(range(STEPS))
    assert kills["status"]["retried_steps"] == [0, 3]
    recs = kills["status"]["recoveries"]
    assert [r["dead"] for r in recs] == [[1], [2]]
    assert all(r["checkpoint_step"] is not None for r in recs)  # masters' state from disk


def test_the_run_equals_the_reference_despite_the_deaths(kills: dict[str, Any]) -> None:
    ref, want = reference([(s, [0, 1, 2, 3]) for s in range(STEPS)])
    np.testing.assert_allclose([s.loss for s in kills["steps"]], want, rtol=1e-5)
    assert_copies_equal(ref, kills["weights"])
