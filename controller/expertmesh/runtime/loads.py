"""How load reaches the controller on the SPMD plane: summed per DC over windows by default.

Every step, a DC's ranks already hold each other's load counts: the dense gradient sum
inside the DC is an all-gather (``Comm.all_reduce_rows``) and the ``[L, E]`` counts ride
along, so the DC's lead (its lowest live rank) has the DC's ``[n, L, E]`` rows without an
extra collective (``SpmdRank.dc_loads``). :class:`LeadLoads` (in every worker) feeds
them to a :class:`~expertmesh.workers.aggregate.DcAggregator` on the lead, and the
windows it closes ride the lead's step report to the controller, where :class:`LoadIngest`
hands them to ``ControllerCore.report_windows``: one report per DC per layer per window
instead of every rank's ``[E]`` of every layer every step. Other ranks' step reports carry
no load; the world's ``[L, E]`` counts of the step (the static-imbalance figure) come
from one rank. Only a run that writes its trace (``RuntimeSettings.trace_dir``: the trace
is every rank's load of every step) still sends each rank's ``[L, E]`` in its step report,
for the trace file alone; the core gets the windows all the same.

Modes (``RuntimeSettings.load_reports``): ``dc`` (each DC's ``[E]`` window sums), ``dc_ranks``
(``[n, E]`` per-rank window sums, for policies that split tokens per source rank),
``rank`` (every rank's load every step, the path before aggregation; the opt-out), ``auto``
(``dc_ranks`` for :data:`RANK_LOAD_POLICIES`, ``dc`` otherwise). The window is
``load_window`` steps, or the trigger's period.

A dead lead is replaced like any dead worker (or, without replacement, the DC's next rank
leads): the new lead's aggregator starts at the step it runs first, so its first window
holds fewer steps (the window's mean is over the steps it holds). The dead lead's partial
window (its ``pending`` reports) is lost, and counted as ``lost``: nothing is summed
twice, nothing vanishes uncounted. Accounting (:meth:`LoadIngest.accounting`), over every
aggregator the run had, from the counters each lead sends with each step:

- ``produced == received`` (every rank's ``L`` reports of every recorded step reached its
  DC's aggregator), ``received == applied + rejected``;
- ``applied == sent + pending + lost``;
- ``sent == accepted + refused`` (rank reports in windows the controller applied / refused;
  ``accepted`` equals the core's ``windows_in.rank_reports``).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import numpy as np

from expertmesh.controller.core import BatchReportError, ControllerCore
from expertmesh.planner import Topology
from expertmesh.planner.window import WindowReport
from expertmesh.workers.aggregate import DcAggregator

__all__ = ["RANK_LOAD_POLICIES", "LeadLoads", "LoadIngest", "load_mode", "load_window"]

log = logging.getLogger(__name__)

# policies whose plans split tokens per source rank inside a DC (quota's domains may be
# smaller than a DC; fastermoe plans per rank): they get per-rank window sums under auto
RANK_LOAD_POLICIES = frozenset({"quota", "fastermoe"})


def load_mode(settings: Any) -> str:
    """``dc``, ``dc_ranks`` or ``rank`` for ``settings`` (a ``RuntimeSettings``)."""
    mode = str(settings.load_reports)
    if mode == "auto":
        return "dc_ranks" if settings.policy in RANK_LOAD_POLICIES else "dc"
    return mode


def load_window(settings: Any) -> int:
    """Steps per aggregation window: ``load_window``, or the trigger's period."""
    if settings.load_window:
        return int(settings.load_window)
    trig = settings.trigger
    return int(trig.every) if trig.mode == "every_n" else 1


class LeadLoads:
    """A worker's side (see the module docstring): on its DC's lead, the aggregator."""

    def __init__(self, settings: Any, topology: Topology, rank: int) -> None:
        self.mode, self.window = load_mode(settings), load_window(settings)
        self.keep_load = getattr(settings, "trace_dir", None) is not None  # for the trace
        # every microbatch's counts, for the planner's level (runtime/stepstats.py)
        self.keep_mb = bool(getattr(settings, "planner_level", False))
        self.topology, self.rank = topology, rank
        self.num_layers, self.num_experts = settings.lm.num_layers, settings.lm.num_experts
        self.dc = int(topology.rank_dc[rank])
        self.lead = False
        self.live: list[int] = []
        self.agg: DcAggregator | None = None
        self._id = ""
        self._out: list[dict[str, Any]] = []  # records not sent yet (a hand-over)
        self._windows: list[WindowReport] = []

    def joined(self, leader: int, live: list[int]) -> None:
        """The process groups (re-)formed: ``leader`` leads this rank's DC, whose live
        ranks are ``live``."""
        if self.mode == "rank":
            return
        self.lead, self.live = leader == self.rank, sorted(live)
        if self.agg is None:
            return
        if self.lead:
            self._windows += self.agg.set_live_ranks(self.live)
        else:  # a lower rank of the DC rejoined and leads: hand over what this one summed
            self._windows += self.agg.flush()
            self._out.append(self._record(final=True))
            self.agg = None

    def after_step(self, st: Any, stats: dict[str, Any]) -> None:
        """Fill ``stats`` (the step's report): the lead's windows and counters; no per-rank
        load (``rank`` mode, or a run writing its trace, keeps ``stats["load"]``; a run
        measuring the planner's level keeps ``stats["load_mb"]``)."""
        if not self.keep_mb:
            stats.pop("load_mb", None)
        if self.mode == "rank":
            return
        if not self.keep_load:
            stats.pop("load", None)
        c = st.comm
        if c.rank == c.world.ranks[0]:
            stats["world_load"] = np.asarray(st.world_counts, np.int64)  # [L, E]
        if self.lead:
            if self.agg is None:
                self.agg = DcAggregator(
                    self.dc, self.topology.dc_ranks[self.dc].tolist(), self.num_layers,
                    self.num_experts, self.window, per_rank=self.mode == "dc_ranks",
                    first_step=st.step,
                )  # fmt: skip
                self._id = f"{self.rank}/{uuid.uuid4().hex[:12]}"
                if self.live:
                    self.agg.set_live_ranks(self.live)
            try:
                self._windows += self.agg.add_rows(st.step, c.my_dc.ranks, st.dc_loads)
            except ValueError as err:  # counted as rejected by the aggregator
                log.warning("rank %d: DC load of step %d refused: %s", self.rank, st.step, err)
            self._out.append(self._record(final=False))
        if self._out:
            stats["dc_loads"], self._out = self._out, []

    def _record(self, *, final: bool) -> dict[str, Any]:
        assert self.agg is not None
        rec = {"id": self._id, "dc": self.dc, "rank": self.rank, "final": final,
               "windows": self._windows, **self.agg.counters()}  # fmt: skip
        self._windows = []
        return rec


_COUNTERS = ("received", "rejected", "applied", "sent", "pending")


class LoadIngest:
    """The controller's side (see the module docstring): feeds the core, keeps the books."""

    def __init__(self, core: ControllerCore, settings: Any) -> None:
        self.core, self.mode = core, load_mode(settings)
        self.num_layers, self.num_experts = settings.lm.num_layers, settings.lm.num_experts
        self.produced = 0  # per-rank layer reports the recorded steps stand for
        self.accepted = self.refused = 0  # rank reports the core applied / refused
        self.windows_accepted = self.windows_refused = 0
        self._aggs: dict[str, dict[str, Any]] = {}  # aggregator id -> newest record
        self._accepted_at_start = core.windows_in.rank_reports

    def record(self, step: int, reports: dict[int, dict[str, Any]]) -> None:
        """Step ``step``'s reports (every member's) are in: their load goes to the core."""
        self.produced += len(reports) * self.num_layers
        layers = np.arange(self.num_layers)
        for r in sorted(reports):
            rep = reports[r]
            if self.mode == "rank":
                steps, ranks = np.full(self.num_layers, step), np.full(self.num_layers, r)
                try:
                    applied, _ = self.core.report_batch(steps, layers, ranks, rep["load"])
                except BatchReportError as err:
                    applied = err.applied
                    log.warning("load of rank %d step %d refused: %s", r, step, err)
                self.accepted += applied
                self.refused += self.num_layers - applied
                continue
            for rec in rep.get("dc_loads", ()):
                self._books(rec)
                if rec["windows"]:
                    self._send(rec["windows"])

    def _books(self, rec: dict[str, Any]) -> None:
        if rec["id"] not in self._aggs:  # a new lead for the DC: the previous one is gone
            for old in self._aggs.values():
                if old["dc"] == rec["dc"] and old["state"] == "live":
                    old["state"] = "gone"
        state = "final" if rec["final"] else "live"  # it reports: it is alive
        self._aggs[rec["id"]] = {
            "dc": rec["dc"], "rank": rec["rank"], "state": state,
            **{k: int(rec[k]) for k in _COUNTERS},
        }  # fmt: skip

    def _send(self, windows: list[WindowReport]) -> None:
        try:
            applied, _ = self.core.report_windows(windows)
        except BatchReportError as err:
            applied = err.applied
            log.warning("DC windows refused: %s", err)
        self.windows_accepted += applied
        self.windows_refused += len(windows) - applied
        self.accepted += sum(w.reports for w in windows[:applied])
        self.refused += sum(w.reports for w in windows[applied:])

    def gone(self, ranks: list[int]) -> None:
        """The workers of ``ranks`` died: an aggregator one of them hosted is gone (its
        pending reports are lost, :meth:`accounting`)."""
        for rec in self._aggs.values():
            if rec["rank"] in ranks and rec["state"] == "live":
                rec["state"] = "gone"

    def world_load(self, reports: dict[int, dict[str, Any]]) -> np.ndarray:
        """[L, E] the world's counts of the step."""
        if self.mode == "rank":
            return np.sum([np.asarray(rep["load"], np.int64) for rep in reports.values()], axis=0)
        for rep in reports.values():
            if "world_load" in rep:
                return np.asarray(rep["world_load"], np.int64)
        return np.zeros((self.num_layers, self.num_experts), np.int64)

    def accounting(self) -> dict[str, Any]:
        """The books (module docstring) and whether they balance (``exact``)."""
        out: dict[str, Any] = {"mode": self.mode, "produced": self.produced,
                               "accepted": self.accepted, "refused": self.refused,
                               "windows_accepted": self.windows_accepted,
                               "windows_refused": self.windows_refused}  # fmt: skip
        if self.mode == "rank":
            out["exact"] = self.produced == self.accepted + self.refused
            return out
        aggs = list(self._aggs.values())
        for k in ("received", "rejected", "applied", "sent"):
            out[k] = sum(a[k] for a in aggs)
        out["pending"] = sum(a["pending"] for a in aggs if a["state"] == "live")
        out["lost"] = sum(a["pending"] for a in aggs if a["state"] == "gone")
        out["aggregators"] = len(aggs)
        out["exact"] = (
            out["produced"] == out["received"] == out["applied"] + out["rejected"]
            and out["applied"] == out["sent"] + out["pending"] + out["lost"]
            and out["sent"] == self.accepted + self.refused
            and self.accepted == self.core.windows_in.rank_reports - self._accepted_at_start
        )
        return out
