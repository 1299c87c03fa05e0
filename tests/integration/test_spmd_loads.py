"""Load aggregation on the SPMD plane, on a real multi-node local Ray cluster: each DC's
lead sums its DC's load over windows and the controller plans on them (the default), and
the sums equal what every rank's per-step reports (the opt-out, ``load_reports="rank"``)
add up to in a run of the same training. The lead of a DC is killed mid-window: its
partial window is lost and counted, never summed twice, and the books balance."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray

from expertmesh.controller.core import Trigger
from expertmesh.planner import Topology
from expertmesh.runtime.settings import RuntimeSettings
from expertmesh.runtime.spmd import SpmdRuntime
from expertmesh.workers.model import LMConfig

pytestmark = pytest.mark.integration

LM = LMConfig(num_layers=2, num_experts=8, top_k=2, hidden=16, ffn_hidden=16, batch=4, seq_len=32)
W, STEPS = 3, 7  # steps per window; windows [0, 2] and [3, 5] complete, step 6 pending
TOPO = Topology.generate(2, 2, masters=2, spare=2).with_inter_dc(0.5, 2.0)


def _run(mode: str, kill_lead_at: int | None) -> dict[str, Any]:
    settings = RuntimeSettings(
        topology=TOPO.to_dict(), lm=LM, policy="eplb", trigger=Trigger(mode="every_n", every=W),
        corpus_bytes=200_000, checkpoint_every=2, load_reports=mode,
    )  # fmt: skip
    with SpmdRuntime(settings) as rt:
        if kill_lead_at is not None:
            ray.get(rt.workers[2].inject_exit.remote(kill_lead_at))  # DC 1's lead
        steps = rt.train(STEPS)
        return {
            "steps": steps,
            "status": rt.status(),
            "loads": ray.get(rt.controller.load_windows.remote()),
        }


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, Any]]:
    yield {"rank": _run("rank", None), "dc": _run("auto", kill_lead_at=W + 1)}


def test_the_default_sends_dc_windows_and_the_books_balance(runs: dict[str, Any]) -> None:
    books = runs["dc"]["loads"]["accounting"]
    n = TOPO.num_ranks * LM.num_layers
    assert books["mode"] == "dc" and books["exact"], books
    assert books["produced"] == books["received"] == STEPS * n  # every recorded step, once
    assert books["rejected"] == books["refused"] == 0
    # DC 1's lead died as step W + 1 started: step W's DC-1 reports (2 ranks) were lost
    assert books["lost"] == 2 * LM.num_layers
    assert books["pending"] == n  # step 6, in the third window
    assert books["windows_accepted"] == 2 * TOPO.num_dcs * LM.num_layers
    assert runs["dc"]["status"]["retried_steps"] == [W + 1]
    assert runs["dc"]["status"]["loads"] == books
    rank = runs["rank"]["loads"]["accounting"]
    assert rank["mode"] == "rank" and rank["exact"] and rank["accepted"] == STEPS * n


def test_dc_window_sums_equal_the_per_rank_reports(runs: dict[str, Any]) -> None:
    """The same training in both runs (the death is undone), so the per-rank loads the
    opt-out run planned on add up to the DC windows of the default run."""
    dc, rank = runs["dc"]["loads"], runs["rank"]["loads"]
    for layer in range(LM.num_layers):
        per_step = rank["window"][layer]  # [STEPS, R, E], one entry per step
        assert per_step.shape[0] == STEPS
        first, last, steps, dc_sum = dc["newest"][layer]
        assert (first, last) == (W, 2 * W - 1)
        assert steps.tolist() == [W, W - 1]  # DC 1's new lead summed steps W + 1 .. 2W - 1
        want0 = per_step[W : 2 * W][:, TOPO.dc_ranks[0]].sum(axis=(0, 1))
        want1 = per_step[W + 1 : 2 * W][:, TOPO.dc_ranks[1]].sum(axis=(0, 1))
        assert np.array_equal(dc_sum[0], want0)
        assert np.array_equal(dc_sum[1], want1)  # step W is in neither: lost, not twice
        # the window means the policy planned on: one entry per window, DC totals the mean
        means = dc["window"][layer]  # [2, R, E]
        assert means.shape[0] == 2
        for ranks in TOPO.dc_ranks:
            total = per_step[:W][:, ranks].sum(axis=(0, 1))
            assert np.array_equal(means[0][ranks].sum(axis=0), (2 * total + W) // (2 * W))


def test_the_per_step_figures_do_not_depend_on_the_load_path(runs: dict[str, Any]) -> None:
    a, b = runs["rank"]["steps"], runs["dc"]["steps"]
    assert [s.step for s in a] == [s.step for s in b] == list(range(STEPS))
    np.testing.assert_allclose([s.loss for s in b], [s.loss for s in a], rtol=1e-6)
    assert [s.imbalance_static for s in b] == [s.imbalance_static for s in a]
    assert [s.tokens_per_rank for s in b] != [] and all(s.imbalance >= 1.0 for s in b)
    # the plan made after step W - 1 (the first complete windows) is on every worker when
    # the chunk from step W + 1 starts (the driver waits for offers to land before a
    # chunk, the replacement's too): agreed in step W + 1, switched in W + 2's sync
    assert b[-1].plan_version >= 1 and runs["dc"]["status"]["errors"] == 0
