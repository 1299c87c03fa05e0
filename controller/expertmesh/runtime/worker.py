"""The SPMD worker actor: one rank that runs its own training loop over torch.distributed.

Ray starts it once (pinned to its DC by the ``dc`` label) and the driver only tells it to
:meth:`SpmdWorker.join` a process group and to :meth:`SpmdWorker.run` a number of steps;
the worker is then on its own. Tensors move over the process groups (gloo on CPU, NCCL
when CUDA is present), never through Ray. Ray carries only small control messages, all
fire-and-forget from the worker's side: each step's report to the controller (load,
loss, bytes, timings) and plan offers from the controller (:meth:`SpmdWorker.offer_plan`,
taken on another thread of the actor while the loop runs); a report that cannot reach
the controller (dead, restarting) is dropped without waiting, and the worker keeps its
newest reports (:data:`REPORT_LOG_BYTES`) for a restarted controller to replay
(:meth:`SpmdWorker.controller_view`, :mod:`expertmesh.runtime.reattach`). Every rank learns at the same
step's end that every rank has a plan (the newest version rides along the dense gradient
reduction, so agreeing costs no extra message); the moved masters' weights and Adam
state then travel in the background during the next step, whose sync switches every
rank to the plan (``RuntimeSettings.migration="background"``, the default), or the plan's
migration rounds run and commit at that boundary (``"boundary"``).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist

from expertmesh.planner import Placement, Topology
from expertmesh.runtime.loads import LeadLoads
from expertmesh.runtime.procgroup import (
    connect_store,
    interface_of,
    leave_group,
    listen_store,
    pin_process,
)
from expertmesh.runtime.worker_resume import REPORT_LOG_BYTES, WorkerResume, plan_digest
from expertmesh.workers.comm import Comm, pick_backend
from expertmesh.workers.model import Corpus
from expertmesh.workers.shaper import LinkShaper
from expertmesh.workers.spmd import RankSnapshot, SpmdRank
from expertmesh.workers.wire import WireFormat

__all__ = ["REPORT_LOG_BYTES", "SpmdWorker", "connect_store", "listen_store", "pin_process"]

log = logging.getLogger(__name__)


class SpmdWorker(WorkerResume):
    """One rank; see the module docstring."""

    def __init__(
        self,
        rank: int,
        settings: Any,
        placements: list[tuple[np.ndarray, np.ndarray]],
        shaper_path: str | None,
        controller: Any,
    ) -> None:
        self.rank, self.settings, self.controller = rank, settings, controller
        self.cpus = self._pin()
        self.topology = Topology.from_dict(settings.topology)
        self.placements = [Placement(p, m) for p, m in placements]
        self.shaper = (
            LinkShaper.from_topology(self.topology, path=shaper_path)
            if settings.shaper and shaper_path
            else None
        )
        self.corpus = Corpus.load(settings.corpus, settings.corpus_bytes)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.state: SpmdRank | None = None
        self._plans: dict[int, tuple[Any, ...]] = {}  # version -> offered plan
        self._lock = threading.Lock()
        self.ip = ray.util.get_node_ip_address()
        self._exit_at: int | None = None
        self._store: Any = None  # the store this worker listens on for the next group
        self._group_store: Any = None  # the store of the group it is in (kept alive)
        self.loads = LeadLoads(settings, self.topology, rank)  # the DC lead's load windows
        self.backend = ""
        self._init_resume(settings, placements)

    def _pin(self) -> list[int]:
        """Pin this process to the rank's ``settings.worker_cpus`` (if any); its CPUs."""
        if self.settings.worker_cpus is None:
            return sorted(os.sched_getaffinity(0))
        return sorted(pin_process(set(self.settings.worker_cpus[self.rank])))

    def address(self, timeout_s: float = 60.0) -> tuple[str, int]:
        """Open the rendezvous store of a new process group here (the first member's
        worker); returns where it listens: this node's address and the store's port."""
        self._store = listen_store(self.ip, timeout_s)
        return self.ip, int(self._store.port)

    def join(self, members: list[int], addr: str, port: int, timeout_s: float) -> str:
        """(Re-)form the process groups with ``members`` (expertmesh ranks); the store runs
        on ``addr:port`` (the first member's). Returns the backend."""
        leave_group(self.rank)
        iface = interface_of(self.ip)
        if iface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
        backend = pick_backend(self.device)
        members = sorted(members)
        mine = self._store is not None and (addr, port) == (self.ip, int(self._store.port))
        store = self._store if mine else connect_store(addr, port, timeout_s)
        self._store, self._group_store = None, store
        dist.init_process_group(
            backend,
            store=store,
            rank=members.index(self.rank),
            world_size=len(members),
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        comm = Comm(
            self.rank, self.topology.rank_dc, members, shaper=self.shaper, device=self.device,
            timeout_s=timeout_s,
        )  # fmt: skip
        if self.state is None:
            self.state = SpmdRank(
                comm, self.settings.lm, self.corpus, self.placements,
                balance=self.settings.balance, spread=self.settings.spread,
                fused=self.settings.spread_fused,
            )  # fmt: skip
        else:
            self.state.rebind(comm)
        self.loads.joined(comm.leader, comm.my_dc.ranks)
        self.backend = backend
        return backend

    def leave(self) -> None:
        """Leave the process groups (a rank that pauses, or is left out of the new ones);
        plans on offer go (they were made for the old members)."""
        leave_group(self.rank)
        with self._lock:
            self._plans.clear()

    def offer_plan(
        self,
        version: int,
        layers: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        rounds: list[list[tuple[int, int, int, int, str]]],
        encoding: Any = None,
    ) -> None:
        """A prepared plan from the controller; switched to at the next agreed boundary (a
        version already committed here, e.g. sent again by a restarted controller, is
        ignored)."""
        digest = plan_digest(layers)
        with self._lock:
            if self._digests.setdefault(version, digest) != digest:  # never two plans for one
                self.conflicts += 1  # version: refused (counted; the test of restarts checks)
                log.error("rank %d: plan %d offered again with other contents", self.rank, version)
                return
            if len(self._digests) > 256:
                del self._digests[min(self._digests)]
            if version > self._committed[0]:
                self._plans[version] = (layers, rounds, encoding)

    def _offered(self) -> int:
        with self._lock:
            return max(self._plans, default=0)

    def run(self, start: int, steps: int, keep: str = "") -> dict[str, Any]:
        """Train steps ``start .. start + steps - 1``; each step's report goes to the
        controller as it ends. Returns how far it got and what a checkpoint of the last
        step takes from this rank (``keep``: "masters", or "state": masters, dense, plan)."""
        st = self.state
        if st is None:
            raise RuntimeError("join a process group before running")
        self.cpus = self._pin()  # threads Ray started since (this one among them)
        t_prev = time.perf_counter()
        ray_s = 0.0
        for step in range(start, start + steps):
            if self._exit_at == step:
                log.error("rank %d: injected exit at step %d", self.rank, step)
                os._exit(1)
            snap = RankSnapshot(st)
            try:
                stats = st.train_step(step, offer=self._offered())
                applied = self._apply(stats.get("switched"))
            except Exception as err:  # a peer died or a link is down: undo, leave the group
                self._switching = None
                log.warning("rank %d: step %d failed: %s", self.rank, step, err)
                snap.restore(st)  # a plan switch commits last, so none happened
                leave_group(self.rank)
                return {"rank": self.rank, "failed_at": step, "error": str(err)[:500]}
            now = time.perf_counter()
            stats["wall_seconds"] = now - t_prev  # the whole step, plan switch included
            t_prev = now
            stats["applied"] = applied
            stats["ray_seconds"] = ray_s  # submitting the previous step's report
            stats.pop("routed", None)
            self.loads.after_step(st, stats)
            stats["bytes_before"], self._bytes = self._bytes, stats["bytes"]
            with self._lock:
                self._log.append(stats)  # before sending: a lost report can be replayed
            t_ray = time.perf_counter()
            try:  # fire and forget; never waits for (or fails with) the controller
                self.controller.step_report.remote(self.rank, stats)
            except Exception as err:
                log.warning("rank %d: step %d's report not sent: %s", self.rank, step, err)
            ray_s = time.perf_counter() - t_ray
        out: dict[str, Any] = {"rank": self.rank, "step": st.step, "version": st.version}
        out |= {"masters": st.masters()} if keep else {}
        return out | ({"state": st.export_state()} if keep == "state" else {})

    def _apply(self, switched: dict[str, Any] | None) -> dict[str, Any] | None:
        """After a step: the plan its sync switched to (background migration), else, when
        every rank has a newer plan than the committed one, start it: prepared in the
        background (``settings.migration == "background"``: the next step switches) or
        migrated and committed here (``"boundary"``). Returns the switch made, if any."""
        st = self.state
        assert st is not None
        if switched is None and st.agreed > st.version and not st.preparing:
            version = st.agreed
            with self._lock:
                layers, rounds, encoding = self._plans[version]
                self._switching = (version, self._plans[version])  # agreed: it will switch
            wire = WireFormat.of(encoding)
            if self.settings.migration == "background":
                st.prepare(version, layers, wire)
            else:
                t0 = time.perf_counter()
                sent = st.apply_plan(version, layers, rounds, wire)
                switched = {
                    "version": version, "mode": "boundary",
                    "seconds": time.perf_counter() - t0, "boundary_bytes": sent.tolist(),
                }  # fmt: skip
        if switched is not None:
            with self._lock:  # what a restarted controller reads back (controller_view)
                offer = self._plans.get(switched["version"])
                if offer is not None:
                    self._committed = (int(switched["version"]), list(offer[0]))
                self._switching = None
                for v in [v for v in self._plans if v <= switched["version"]]:
                    del self._plans[v]
        return switched

    # ---- faults ----

    def inject_exit(self, step: int) -> None:
        """Fault injection: exit the process (as a crash would) when step ``step`` starts."""
        self._exit_at = step

    def export_state(self) -> dict[str, Any]:
        assert self.state is not None
        return self.state.export_state()

    def masters(self) -> dict[tuple[int, int], Any]:
        return {} if self.state is None else self.state.masters()

    def refill(
        self,
        transfers: list[tuple[int, int, int, int, str]],
        state: dict[str, Any] | None = None,
        seeds: dict[tuple[int, int], Any] | None = None,
    ) -> None:
        """After the groups re-formed with replacements (every member calls it): live
        holders send the replacements' expert copies (``transfers``); a replacement
        (``state``: a live rank's :meth:`export_state`) adopts it, with ``seeds``
        ``(layer, expert) -> (weights, m, v)`` from the checkpoint on disk for the experts
        no live rank holds and the Adam state of the masters it takes over."""
        st = self.state
        assert st is not None
        ep = st.experts
        got = ep._send(
            transfers, lambda k: list(st.layers[k[0]].expert(k[1])), torch.float32, "migration"
        )
        if state is None:
            return
        with self._lock:
            self._committed = (int(state["version"]), list(state["layers"]))
        dev = self.device
        seeds = seeds or {}
        experts: list[dict[int, Any]] = [{} for _ in st.layers]
        for (layer, e), ts in got:
            experts[layer][e] = tuple(t.clone() for t in ts)
        for (layer, e), (w, _, _) in seeds.items():
            if e not in experts[layer]:
                experts[layer][e] = tuple(torch.as_tensor(np.asarray(t)).to(dev) for t in w)
        st.adopt(state, experts)
        for layer, moe in enumerate(st.layers):
            for e in moe.held():
                if moe.plan.master_rank[e] != self.rank:
                    continue
                if (layer, e) in seeds:
                    _, m, v = seeds[(layer, e)]
                    ep.opt[layer][e] = (
                        [torch.as_tensor(np.asarray(t)).to(dev) for t in m],
                        [torch.as_tensor(np.asarray(t)).to(dev) for t in v],
                    )
                else:
                    log.warning(
                        "rank %d: master %d/%d restarts its Adam state", self.rank, layer, e
                    )
                    ep.opt[layer][e] = (
                        [torch.zeros_like(p.detach()) for p in moe.expert(e)],
                        [torch.zeros_like(p.detach()) for p in moe.expert(e)],
                    )

    def where(self) -> dict[str, int]:
        """The last step this rank trained and its committed plan version."""
        st = self.state
        return (
            {"step": -1, "version": 0} if st is None else {"step": st.step, "version": st.version}
        )

    def reshape(
        self,
        plan: dict[str, Any],
        seeds: dict[tuple[int, int], tuple[Any, Any]],
        state: dict[str, Any] | None,
    ) -> np.ndarray:
        """A membership change (every member at once, after :meth:`join`): a rank that
        rejoins (``state``: a live rank's :meth:`export_state`) takes its dense state,
        counters and committed plan and drops its own, stale, expert copies; ``seeds``
        ``(layer, expert) -> (weights | None, (m, v) | None)`` from the checkpoint on disk;
        then ``plan`` (:meth:`~expertmesh.runtime.membership.MembershipSteps.membership_plan`)
        is applied, copies moving in float32 from the ranks that trained until now.
        Returns [D, D] bytes this rank sent."""
        version = int(plan["version"])
        st = self.state
        assert st is not None
        with self._lock:
            self._plans = {v: p for v, p in self._plans.items() if v > version}
        if state is not None:
            st.adopt(state, [{} for _ in st.layers])  # the plan it adopts gives it nothing
        dev = self.device
        for (layer, e), (w, mv) in sorted(seeds.items()):
            moe = st.layers[layer]
            if w is not None:
                have = {h: moe.expert(h) for h in moe.held()}
                got = tuple(torch.as_tensor(np.asarray(t)).to(dev) for t in w)
                moe.set_experts({**have, e: got})  # type: ignore[dict-item]
            if mv is not None:
                st.experts.opt[layer][e] = (
                    [torch.as_tensor(np.asarray(t)).to(dev) for t in mv[0]],
                    [torch.as_tensor(np.asarray(t)).to(dev) for t in mv[1]],
                )
        sent = st.apply_plan(version, plan["layers"], plan["rounds"], WireFormat())
        st.experts.wire = WireFormat.of(plan["encoding"])
        with self._lock:  # what a restarted controller reads back (controller_view)
            self._committed = (version, list(plan["layers"]))
        return sent

    def probe(self, targets: dict[int, tuple[str, int]], timeout_s: float) -> dict[int, bool]:
        """Whether a TCP connection opens to each DC's node (``targets``: DC -> address,
        port), within ``timeout_s`` each."""
        out = {}
        for dc, (host, port) in targets.items():
            try:
                socket.create_connection((host, port), timeout=timeout_s).close()
                out[dc] = True
            except OSError:
                out[dc] = False
        return out

    def dense(self) -> list[np.ndarray]:
        """This rank's dense weights (numpy copies)."""
        assert self.state is not None
        return [p.detach().cpu().numpy().copy() for p in self.state._dparams()]

    def expert_weights(self, layer: int, expert: int) -> list[np.ndarray] | None:
        return None if self.state is None else self.state.expert_weights(layer, expert)

    def ping(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "node": ray.get_runtime_context().get_node_id(),
            "cpus": self.cpus,  # what the training thread may run on (settings.worker_cpus)
        }
