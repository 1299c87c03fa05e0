"""A DC cut off on the SPMD data plane: the link shaper drops a DC pair, the DC on the
controller's side trains on alone (the cut DC's ranks pause: they keep their state,
compute nothing and are out of the re-formed process groups), plans place no copy and
route no token across the cut, and the cut DC rejoins when the link heals (a live rank's
dense state and committed plan, then a plan that gives it copies again). A cut the runtime
is not told about (the shaper's file only) fails the step on the sender (``LinkDown``);
the DC is paused and the step runs again. With a checkpoint after every step the run
equals the single-process reference trained on the ranks that took part in each step."""

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
    assert_dense_equal,
    reference,
    settings,
    write_report,
)

pytestmark = pytest.mark.integration

BEFORE, DURING, AFTER = 3, 3, 3


@pytest.fixture(scope="module")
def dc_cut() -> Iterator[dict[str, Any]]:
    topo = TOPOLOGY
    out: dict[str, Any] = {"dc": topo.rank_dc.copy()}
    with SpmdRuntime(settings()) as rt:
        assert rt.links is not None
        out["before"] = rt.train(BEFORE)
        out["cut"] = rt.cut(0, 1)
        out["plan_cut"] = rt.committed_plan()
        out["during"] = rt.train(DURING)
        out["plan_during"] = rt.committed_plan()
        out["status_cut"] = rt.status()
        out["heal"] = rt.heal(1, 0)
        out["after"] = rt.train(AFTER)
        out["plan_after"] = rt.committed_plan()
        out["status"] = rt.status()
        # a cut the runtime is not told about: the next step's first crossing send fails,
        # the runtime finds the cut, pauses DC 1 and runs the step again
        rt.links.cut(0, 1)
        out["silent_step"] = rt.train(1)[0]
        out["silent"] = rt.status()
        rt.heal(0, 1)
        out["final"] = rt.train(1)[0]
        out["status_end"] = rt.status()
        out["dense"] = [rt.dense(r) for r in range(topo.num_ranks)]
        out["weights"] = {
            (layer, e): [rt.expert_weights(r, layer, e) for r in range(topo.num_ranks)]
            for layer in range(LM.num_layers)
            for e in range(LM.num_experts)
        }
    write_report(
        __name__,
        out["status_end"]["recoveries"],
        [s for k in ("before", "during", "after") for s in out[k]]
        + [out["silent_step"], out["final"]],
    )
    yield out


def test_cut_dc_pauses_and_nothing_crosses_the_cut(dc_cut: dict[str, Any]) -> None:
    dc = dc_cut["dc"]
    cut = dc_cut["cut"]
    assert cut is not None and cut["paused"] == np.flatnonzero(dc == 1).tolist()
    assert cut["members"] == np.flatnonzero(dc == 0).tolist() and cut["reason"] == "cut"
    assert dc_cut["status_cut"]["paused_ranks"] == cut["paused"]
    for plan in (dc_cut["plan_cut"], dc_cut["plan_during"]):
        for phy2log, master, route in plan:
            assert (phy2log[dc == 1] < 0).all()  # no copy across the cut
            assert (dc[master // phy2log.shape[1]] == 0).all()  # masters in DC 0,
            assert sorted(phy2log.reshape(-1)[master]) == list(range(LM.num_experts))  # one each
            assert (dc[route[:, 0]] == 0).all() and (dc[route[:, 2]] == 0).all()
    for s in dc_cut["during"]:
        assert s.error is None and np.isfinite(s.loss)
        assert all(s.tokens_per_rank[r] == 0 for r in np.flatnonzero(dc == 1))
        assert all(s.tokens_per_rank[r] > 0 for r in np.flatnonzero(dc == 0))
        pairs = np.asarray(s.bytes_by_pair)  # [kinds, D, D] the ranks counted
        assert pairs[:, 0, 1].sum() == 0 and pairs[:, 1, 0].sum() == 0


def test_cut_dc_rejoins_when_the_link_heals(dc_cut: dict[str, Any]) -> None:
    dc = dc_cut["dc"]
    heal = dc_cut["heal"]
    assert heal is not None and heal["rejoined"] == np.flatnonzero(dc == 1).tolist()
    assert heal["paused"] == [] and dc_cut["status"]["paused_ranks"] == []
    steps = [s.step for k in ("before", "during", "after") for s in dc_cut[k]]
    assert steps == list(range(BEFORE + DURING + AFTER))  # no step dropped
    for phy2log, _, _ in dc_cut["plan_after"]:
        assert (phy2log[dc == 1] >= 0).any()  # copies on the rejoined DC again
    for s in dc_cut["after"]:
        assert s.error is None and np.isfinite(s.loss)
        assert all(t > 0 for t in s.tokens_per_rank)
    assert dc_cut["after"][-1].cross_dc_weight_bytes > 0  # dense sums cross the link again
    # every rank trains the same dense weights, bit for bit
    first = dc_cut["dense"][0]
    for other in dc_cut["dense"][1:]:
        assert all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_a_cut_noticed_mid_step_pauses_the_dc_and_retries(dc_cut: dict[str, Any]) -> None:
    dc = dc_cut["dc"]
    step = dc_cut["silent_step"]
    st = dc_cut["silent"]
    assert st["retried_steps"] == [step.step] and st["paused_ranks"] == [2, 3]
    assert step.error is None and np.isfinite(step.loss)
    assert all(step.tokens_per_rank[r] == 0 for r in np.flatnonzero(dc == 1))
    final = dc_cut["final"]  # healed again: everyone trains
    assert final.step == step.step + 1 and all(t > 0 for t in final.tokens_per_rank)


def test_the_run_equals_the_reference_on_the_ranks_that_trained(dc_cut: dict[str, Any]) -> None:
    steps = [s for k in ("before", "during", "after") for s in dc_cut[k]]
    steps += [dc_cut["silent_step"], dc_cut["final"]]
    paused = set(range(BEFORE, BEFORE + DURING)) | {dc_cut["silent_step"].step}
    ref, want = reference([(s.step, [0, 1] if s.step in paused else [0, 1, 2, 3]) for s in steps])
    np.testing.assert_allclose([s.loss for s in steps], want, rtol=1e-5)
    assert_copies_equal(ref, dc_cut["weights"])
    assert_dense_equal(ref, dc_cut["dense"][0])
