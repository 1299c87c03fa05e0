"""A worker killed mid-training on the SPMD data plane with replacement off (``demo
--no-replace``): the survivors undo the step, re-form their process groups without the
dead rank (world, DC, aux and leader groups over the live ranks only), the controller
plans without it (no copy on it, no token to it, one master per expert on a survivor),
the masters it held are restored on survivors (from a live copy, else the checkpoint on
disk), and training goes on as a smaller data-parallel group. With a checkpoint after
every step nothing is lost: the run equals the single-process reference that leaves the
dead rank's data out from the step it died."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from expertmesh.runtime.spmd import SpmdRuntime

from .members_common import (
    LM,
    TOPOLOGY,
    assert_copies_equal,
    reference,
    settings,
    write_report,
)

pytestmark = pytest.mark.integration

STEPS, DIES, RANK = 5, 2, 2  # rank 2 (DC 1's leader) exits as step 2 starts


@pytest.fixture(scope="module")
def run() -> Iterator[dict[str, Any]]:
    topo = TOPOLOGY
    out: dict[str, Any] = {"rank_dc": topo.rank_dc.copy()}
    with SpmdRuntime(settings(replace_dead_workers=False)) as rt:
        rt.workers[RANK].inject_exit.remote(DIES)
        out["steps"] = rt.train(STEPS)
        out["status"] = rt.status()
        out["plan"] = rt.committed_plan()
        live = [r for r in range(topo.num_ranks) if r != RANK]
        out["weights"] = {
            (layer, e): [rt.expert_weights(r, layer, e) for r in live]
            for layer in range(LM.num_layers)
            for e in range(LM.num_experts)
        }
    write_report(__name__, out["status"]["recoveries"], out["steps"])
    yield out


def test_the_dead_rank_stays_out_and_training_goes_on(run: dict[str, Any]) -> None:
    assert [s.step for s in run["steps"]] == list(range(STEPS))  # every step once
    st = run["status"]
    assert st["retried_steps"] == [DIES] and st["dead_ranks"] == [RANK]
    (rec,) = st["recoveries"]
    assert rec["dead"] == [RANK] and rec["members"] == [0, 1, 3] and rec["reason"] == "dead"
    assert rec["failed_step"] == DIES
    for s in run["steps"]:
        assert s.error is None and np.isfinite(s.loss)
        if s.step >= DIES:
            assert s.tokens_per_rank[RANK] == 0  # no token to the dead rank
            assert all(t > 0 for r, t in enumerate(s.tokens_per_rank) if r != RANK)
    for phy2log, master, route in run["plan"]:
        assert (phy2log[RANK] < 0).all()  # no copy on it
        slots = phy2log.shape[1]
        assert (master // slots != RANK).all()  # every master on a survivor,
        assert (phy2log.reshape(-1)[master] == np.arange(LM.num_experts)).all()  # one each
        assert not np.isin(route[:, [0, 2]], [RANK]).any()  # no route names it


def test_the_run_equals_the_reference_without_the_dead_ranks_data(run: dict[str, Any]) -> None:
    ref, want = reference([(s, [0, 1, 2, 3] if s < DIES else [0, 1, 3]) for s in range(STEPS)])
    np.testing.assert_allclose([s.loss for s in run["steps"]], want, rtol=1e-5)
    assert_copies_equal(ref, run["weights"])
