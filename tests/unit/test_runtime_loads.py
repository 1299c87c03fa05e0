"""The SPMD runtime's load path without Ray (runtime/loads.py): each DC's lead sums its
DC's rows into windows that ride its step report, the controller feeds them to the core
and keeps exact books; a dead lead's partial window is lost and counted, never summed
twice; ``rank`` mode (the opt-out) reports every rank every step."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest

from expertmesh.controller.core import ControllerCore, ControllerSettings, Trigger
from expertmesh.planner import Topology
from expertmesh.runtime.loads import LeadLoads, LoadIngest, load_mode, load_window
from expertmesh.runtime.settings import RuntimeSettings
from expertmesh.workers.model import LMConfig

LM = LMConfig(num_layers=2, num_experts=8, top_k=2, hidden=16, ffn_hidden=16, batch=4, seq_len=32)
W = 3  # steps per window
TOPO = Topology.generate(2, 2, masters=2, spare=2)  # DC 0: ranks 0, 1; DC 1: ranks 2, 3


def _settings(mode: str = "auto", policy: str = "eplb") -> RuntimeSettings:
    return RuntimeSettings(
        topology=TOPO.to_dict(), lm=LM, policy=policy, trigger=Trigger(mode="every_n", every=W),
        load_reports=mode,
    )  # fmt: skip


class Plane:
    """Fake ranks (the fields LeadLoads reads) and the controller's side, in lock-step."""

    def __init__(self, mode: str = "auto") -> None:
        self.settings = _settings(mode)
        self.core = ControllerCore(TOPO, LM.spec(), ControllerSettings(policy="eplb"))
        self.ingest = LoadIngest(self.core, self.settings)
        self.ranks = {r: LeadLoads(self.settings, TOPO, r) for r in range(TOPO.num_ranks)}
        self.loads: dict[int, np.ndarray] = {}  # step -> [R, L, E]
        self.form()

    def form(self) -> None:
        """The groups (re-)form with the live ranks (a DC's lowest live rank leads)."""
        for r, lead in self.ranks.items():
            mine = [q for q in sorted(self.ranks) if TOPO.rank_dc[q] == TOPO.rank_dc[r]]
            lead.joined(mine[0], mine)

    def step(self, step: int) -> None:
        loads = np.random.default_rng(step).integers(0, 20, (TOPO.num_ranks, 2, 8))
        self.loads[step] = loads
        live = sorted(self.ranks)
        reports = {}
        for r in live:
            mine = [q for q in live if TOPO.rank_dc[q] == TOPO.rank_dc[r]]
            comm = NS(rank=r, world=NS(ranks=live), my_dc=NS(ranks=mine))
            st = NS(comm=comm, step=step, world_counts=loads[live].sum(0), dc_loads=loads[mine])
            stats = {"load": loads[r].copy()}
            self.ranks[r].after_step(st, stats)
            reports[r] = stats
        self.ingest.record(step, reports)
        assert np.array_equal(self.ingest.world_load(reports), loads[live].sum(axis=0))


def test_modes_and_windows_follow_the_settings():
    assert load_mode(_settings()) == "dc"
    assert load_mode(_settings(policy="quota")) == "dc_ranks"
    assert load_mode(_settings("rank")) == "rank"
    assert load_window(_settings()) == W
    s = _settings().model_copy(update={"trigger": Trigger(mode="every_step")})
    assert load_window(s) == 1
    assert load_window(s.model_copy(update={"load_window": 7})) == 7


def test_one_report_per_dc_per_layer_per_window_with_exact_sums_and_books():
    p = Plane()
    for t in range(2 * W + 1):
        p.step(t)
    books = p.ingest.accounting()
    assert books["windows_accepted"] == 2 * TOPO.num_dcs * LM.num_layers  # 2 windows closed
    for layer in range(LM.num_layers):
        newest = p.core.windows_in.newest(layer)
        assert (newest.first_step, newest.last_step) == (W, 2 * W - 1)
        want = sum(p.loads[t][:, layer] for t in range(W, 2 * W))  # [R, E]
        assert np.array_equal(newest.dc_sum, np.stack([want[r].sum(0) for r in TOPO.dc_ranks]))
        assert p.core.layer_newest_step(layer) == 2 * W - 1
    n = TOPO.num_ranks * LM.num_layers
    assert books["produced"] == books["received"] == (2 * W + 1) * n
    assert books["pending"] == n  # the third window's first step
    assert books["lost"] == books["rejected"] == books["refused"] == 0
    assert books["accepted"] == 2 * W * n == p.core.windows_in.rank_reports
    assert books["exact"]
    # nothing per rank reached the core: only window reports
    assert p.core.reports_received == p.core.windows_in.received == books["windows_accepted"]


def test_per_rank_window_sums_under_dc_ranks():
    p = Plane("dc_ranks")
    for t in range(W):
        p.step(t)
    win = p.core.window(0)[-1]  # [R, E] mean per step over the window
    want = sum(p.loads[t][:, 0] for t in range(W))
    assert np.array_equal(win, (2 * want + W) // (2 * W))
    assert p.ingest.accounting()["exact"]


@pytest.mark.parametrize("replace", [True, False])
def test_a_dead_lead_loses_its_partial_window_counted_and_nothing_twice(replace):
    p = Plane()
    for t in range(W + 1):  # window 1 has its first step summed on rank 2 (DC 1's lead)
        p.step(t)
    del p.ranks[2]  # rank 2 dies at the start of step W + 1
    p.ingest.gone([2])
    if replace:  # a replacement with the same rank rejoins; step W + 1 runs again
        p.ranks[2] = LeadLoads(p.settings, TOPO, 2)
    else:  # the DC goes on without it: rank 3 leads
        p.core.set_dead_ranks([2])
    p.form()
    for t in range(W + 1, 2 * W):
        p.step(t)
    books = p.ingest.accounting()
    n_dc1 = 2 if replace else 1
    assert books["lost"] == 2 * LM.num_layers  # DC 1's step W, both ranks, every layer
    assert books["pending"] == 0 and books["exact"], books
    assert books["aggregators"] == 3  # DC 0's, the dead lead's, its successor's
    for layer in range(LM.num_layers):
        newest = p.core.windows_in.newest(layer)
        assert newest.first_step == W
        assert newest.steps.tolist() == [W, W - 1]  # DC 1's lead saw W - 1 steps of it
        dc1 = TOPO.dc_ranks[1][-n_dc1:]
        want = sum(p.loads[t][dc1, layer].sum(0) for t in range(W + 1, 2 * W))
        assert np.array_equal(newest.dc_sum[1], want)  # step W is not in it: lost, not twice


def test_a_lower_rank_rejoining_takes_the_lead_and_the_books_stay_exact():
    p = Plane()
    p.step(0)
    del p.ranks[2]
    p.ingest.gone([2])
    p.core.set_dead_ranks([2])
    p.form()  # rank 3 leads DC 1 from step 1
    p.step(1)
    p.ranks[2] = LeadLoads(p.settings, TOPO, 2)
    p.core.set_dead_ranks([])
    p.form()  # rank 2 rejoins and leads again: rank 3 hands over what it summed
    for t in range(2, 2 * W):
        p.step(t)
    books = p.ingest.accounting()
    assert books["exact"], books
    assert books["lost"] == 2 * LM.num_layers  # rank 2's step 0, when it died
    # rank 3's window 0 (step 1) arrives once; rank 2's share of window 0 is refused as a
    # duplicate of DC 1's window 0: counted, not summed twice
    assert books["refused"] > 0 and books["windows_refused"] == LM.num_layers


def test_rank_mode_reports_every_rank_every_step():
    p = Plane("rank")
    for t in range(2):
        p.step(t)
    books = p.ingest.accounting()
    n = TOPO.num_ranks * LM.num_layers
    assert books == {
        "mode": "rank", "produced": 2 * n, "accepted": 2 * n, "refused": 0,
        "windows_accepted": 0, "windows_refused": 0, "exact": True,
    }  # fmt: skip
    assert p.core.reports_received == 2 * n
    assert np.array_equal(p.core.window(1)[-1], p.loads[1][:, 1])
    # a duplicate is refused by the core and counted
    p.ingest.record(1, {0: {"load": p.loads[1][0]}})
    books = p.ingest.accounting()
    assert books["refused"] == LM.num_layers and books["exact"]


def test_a_run_writing_its_trace_keeps_each_ranks_load_in_its_step_report():
    """The trace file is every rank's load of every step; the core still gets windows."""
    s = _settings().model_copy(update={"trace_dir": "/nonexistent"})
    lead = LeadLoads(s, TOPO, 0)
    lead.joined(0, [0, 1])
    loads = np.ones((2, 2, 8), np.int64)
    comm = NS(rank=0, world=NS(ranks=[0, 1, 2, 3]), my_dc=NS(ranks=[0, 1]))
    stats = {"load": loads[0]}
    lead.after_step(NS(comm=comm, step=0, world_counts=loads.sum(0), dc_loads=loads), stats)
    assert "load" in stats and stats["dc_loads"][0]["received"] == 2 * LM.num_layers
    plain = LeadLoads(_settings(), TOPO, 1)
    plain.joined(0, [0, 1])
    stats = {"load": loads[1]}
    plain.after_step(NS(comm=NS(rank=1, world=comm.world, my_dc=comm.my_dc), step=0), stats)
    assert stats == {}  # not the lead, not rank 0 of the world, no trace: nothing
