"""One rank of the SPMD data plane: the demo model over :class:`MoELayer`, its optimizer,
and plan changes, all over ``torch.distributed`` (no Ray; the runtime hosts it in an actor).

Every rank runs the same loop (:meth:`SpmdRank.train_step`):

1. forward: embedding, per layer a causal mixer then :class:`MoELayer` (dispatch and
   combine over the process groups), the summed next-byte loss over the world's tokens;
2. backward (autograd; the layers' exchanges send gradients back);
3. :meth:`SpmdRank.sync`: dense gradients summed inside each DC, across DC leaders once
   per DC pair, then broadcast inside the DC, and Adam; the experts' side is
   :class:`~expertmesh.workers.experts.ExpertParallel` (replica gradients into masters,
   masters' Adam, replica refresh);
4. plan switches, at a step boundary every rank agrees on (the newest plan every rank has
   received): :meth:`SpmdRank.prepare` starts moving the moved masters' weights and Adam
   state in the background and the next step's sync is the switch (its gradients go to the
   new masters, its refresh fills the new copies); or :meth:`SpmdRank.apply_plan` runs the
   plan's migration rounds and commits at once. Either way no token is ever routed by a
   plan whose weights are missing.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from expertmesh.planner.plan import Placement
from expertmesh.workers.comm import Comm
from expertmesh.workers.experts import ExpertParallel, Transfer
from expertmesh.workers.layer import LayerPlan, MoELayer
from expertmesh.workers.model import Corpus, DenseModel, ExpertWeights, LMConfig, init_expert
from expertmesh.workers.moe import adam_
from expertmesh.workers.wire import WireFormat

__all__ = ["RankSnapshot", "SpmdRank", "Transfer"]


class SpmdRank:
    """Dense model, the MoE layers with this rank's experts, masters' Adam state, plans."""

    def __init__(
        self,
        comm: Comm,
        cfg: LMConfig,
        corpus: Corpus,
        placements: list[Placement],
        *,
        report: Any = None,
        balance: bool = False,
        spread: bool = True,
        fused: bool = True,
    ) -> None:
        if len(placements) != cfg.num_layers:
            raise ValueError(f"need {cfg.num_layers} placements, got {len(placements)}")
        torch.set_num_threads(1)
        self.comm, self.cfg, self.corpus, self.rank = comm, cfg, corpus, comm.rank
        dev = comm.device
        self.dense = DenseModel(cfg).to(dev)
        self.dense_state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in self._dparams()]
        self.report = report  # (layer, counts [E]) -> None, every forward
        self.layers: list[MoELayer] = []
        for layer, placement in enumerate(placements):
            plan = LayerPlan(placement, np.zeros((0, 4), np.int64))
            mine = {e: init_expert(cfg, layer, e) for e in plan.held_by(self.rank)}
            gate: torch.nn.Linear = self.dense.gates[layer]  # type: ignore[assignment]
            moe = MoELayer(
                comm, plan, mine, top_k=cfg.top_k, ffn_hidden=cfg.ffn_hidden, gate=gate,
                balance=balance, spread=spread, fused=fused,
            )  # fmt: skip
            self.layers.append(moe)
        self.experts = ExpertParallel(comm, self.layers, lr=cfg.lr)
        self.step, self.opt_step = -1, 0
        self.loss = 0.0
        self.agreed = 0  # the plan version every rank has received (after a step)
        self._counts = np.zeros((cfg.num_layers, cfg.num_experts), np.int64)
        self._counts_mb = np.zeros((cfg.microbatches, cfg.num_layers, cfg.num_experts), np.int64)
        self._computed = np.zeros((cfg.microbatches, cfg.num_layers), np.int64)
        self._fast: list[Any] = [np.zeros(cfg.num_layers, np.int64), 0, 0.0]
        self._crossings = np.zeros((cfg.num_layers, comm.num_dcs), np.int64)
        self._routed = [np.zeros((0, 4), np.int64) for _ in range(cfg.num_layers)]
        self.dc_loads = np.zeros((0, cfg.num_layers, cfg.num_experts), np.int64)  # sync()
        self.seconds: dict[str, float] = {}
        self._ran = 0

    def _dparams(self) -> list[torch.Tensor]:
        return list(self.dense.parameters())

    # ---- one training step ----

    def train_step(self, step: int, offer: int = 0) -> dict[str, Any]:
        """Forward, backward and optimizer step ``step`` on every rank at once. ``offer``: the
        newest plan version this rank has received; :attr:`agreed` becomes the smallest
        offer of every rank (the plan every rank can switch to after this step)."""
        if step <= self.step:
            raise ValueError(f"step {step} is not after step {self.step}")
        t0 = time.perf_counter()
        self.step = step
        self._ran = self.experts.version  # a switch in this step's sync comes after
        for p in self._dparams():
            p.grad = None
        for moe in self.layers:
            moe.expert_seconds = 0.0
            for p in moe.experts.values():
                p.grad = None
        k = self.cfg.microbatches
        total = self.cfg.tokens_per_rank * self.comm.world.size * k
        self.loss = 0.0
        counts = np.zeros((k, len(self.layers), self.cfg.num_experts), np.int64)  # [k, L, E]
        computed = np.zeros((k, len(self.layers)), np.int64)  # [k, L] per microbatch
        fast: list[Any] = [np.zeros(len(self.layers), np.int64), 0, 0.0]  # summed over k
        crossings = np.zeros((len(self.layers), self.comm.num_dcs), np.int64)  # [L, D]
        routed: list[list[np.ndarray]] = [[] for _ in self.layers]
        for i in range(k):  # gradients accumulate over the microbatches
            x, y = self.corpus.batch(self.cfg, step * k + i, self.rank)
            x, y = x.to(self.comm.device), y.to(self.comm.device)
            h = self.dense.embed(x)  # [B, T, d]
            for layer, moe in enumerate(self.layers):
                a, u = self.dense.mix(layer, h)
                h = a + moe(u).reshape(a.shape)
                counts[i, layer] = moe.counts
                computed[i, layer] = moe.computed
                crossings[layer] += moe.crossings
                routed[layer].append(moe.routed)
                if self.report is not None:
                    self.report(layer, moe.counts)
            loss = self.dense.loss_sum(h, y) / total
            loss.backward()
            for layer, moe in enumerate(self.layers):  # fast-loop replica grads to homes
                moe.return_replica_grads()
                fast[0][layer] += moe.replicas
                fast[1] += moe.fanout_bytes
                fast[2] += moe.balance_seconds + moe.fetch_wait_seconds
            self.loss += float(loss.detach())
        self._counts, self._computed, self._fast = counts.sum(axis=0), computed, fast
        self._counts_mb = counts
        self._crossings, self._routed = crossings, [_sum_rows(r) for r in routed]
        t1 = time.perf_counter()
        self.sync(offer)
        t2 = time.perf_counter()
        self.seconds = {"forward_backward": t1 - t0, "sync": t2 - t1, "step": t2 - t0}
        return self.stats()

    def sync(self, offer: int = 0) -> None:
        """Gradients to where they are applied, Adam, fresh weights back (module docstring);
        ``offer`` rides along (:meth:`train_step`)."""
        c = self.comm
        self.opt_step += 1
        params = self._dparams()
        # the world's token counts per (layer, expert) ride along (an expert no token reached
        # anywhere has no gradient and skips its Adam step, as in any single-process run)
        counts = torch.from_numpy(self._counts.astype(np.float32))
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
            + [counts.reshape(-1).to(c.device), torch.tensor([float(offer)], device=c.device)]
        )
        at = flat.numel() - counts.numel() - 1
        rows = c.all_reduce_rows(flat, c.my_dc, slice(at, at + counts.numel()), min_tail=1)
        # every DC rank's counts of this step [n, L, E] (its DC's ranks in order): the load
        # a DC's lead aggregates (runtime/loads.py); exact below 2**24 tokens a step
        self.dc_loads = rows.reshape(-1, *counts.shape).astype(np.int64)
        if c.leaders.size > 1 and c.rank == c.leader:
            c.all_reduce(flat, c.leaders, min_tail=1)
        c.broadcast(flat, c.leader, c.my_dc)
        self.agreed = int(flat[-1].item())
        flat = flat[:-1]
        at = 0
        for p, (m, v) in zip(params, self.dense_state, strict=True):
            g = flat[at : at + p.numel()].reshape(p.shape)
            adam_(p, g, m, v, self.opt_step, self.cfg.lr)
            at += p.numel()
        self.world_counts = flat[at:].reshape(counts.shape).cpu().numpy().astype(np.int64)  # [L, E]
        self.experts.step(self.world_counts)

    def rebind(self, comm: Comm) -> None:
        """Use ``comm``'s process groups from now on (after the groups re-formed); a plan in
        preparation is dropped (it is prepared again at the next agreed boundary)."""
        self.comm = comm
        for moe in self.layers:
            moe.rebind(comm)
        self.experts.rebind(comm)

    def prepare(
        self,
        version: int,
        layers: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        wire: WireFormat | None = None,
    ) -> None:
        """:meth:`ExpertParallel.prepare` (every rank at once); the next step switches."""
        self.experts.prepare(version, layers, wire)

    @property
    def preparing(self) -> int:
        """The version being prepared in the background (0: none)."""
        pend = self.experts.pending
        return 0 if pend is None else pend.version

    @property
    def version(self) -> int:
        """The committed plan's version."""
        return self.experts.version

    def apply_plan(
        self,
        version: int,
        layers: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        rounds: list[list[Transfer]],
        wire: WireFormat | None = None,
    ) -> np.ndarray:
        """:meth:`ExpertParallel.apply_plan` (every rank at once)."""
        return self.experts.apply_plan(version, layers, rounds, wire)

    def stats(self) -> dict[str, Any]:
        """This rank's numbers for the step just run."""
        c = self.comm
        return {
            "rank": self.rank,
            "step": self.step,
            "loss": self.loss,
            "computed": self._computed.sum(axis=0),  # [L] summed over the step's microbatches
            "computed_mb": self._computed.copy(),  # [k, L] per microbatch
            # the fast loop over the step's microbatches: replicas [L] it added, replica
            # weights this rank sent, and its exposed seconds (counts exchange + solve + the
            # replica fetch not hidden by compute)
            "replicas": self._fast[0].copy(),
            "fanout_bytes": int(self._fast[1]),
            "balance_seconds": float(self._fast[2]),
            "load": self._counts.copy(),  # [L, E] summed over the step's microbatches
            "load_mb": self._counts_mb.copy(),  # [k, L, E] per microbatch
            "expert_seconds": np.array([m.expert_seconds for m in self.layers]),  # [L]
            # summed over the step's microbatches: distinct tokens sent to each DC [L, D] and
            # per layer [N, 4] (rank, expert, dst, assignments) dispatched
            "crossings": self._crossings.copy(),
            "routed": [r.copy() for r in self._routed],
            # [3, D] cumulative bytes this rank sent from its DC to each DC, by KINDS: the one
            # row of Comm.bytes [3, D, D] a rank fills (24 KB at 1,000 DCs, not 24 MB)
            "bytes": c.bytes[:, c.dc].copy(),
            "shaped_seconds": c.shaped_seconds,
            "collectives": c.collectives,
            # cumulative CPU seconds of this rank's process (its threads, gloo's included):
            # the trace's per-rank CPU per step (the replay's check of its CPU terms)
            "cpu_seconds": time.process_time(),
            # crossing sends per collective since the last step's stats (Comm.crossed): a
            # plan switch after this report (prepare or apply_plan) counts in the next
            "crossed": c.take_crossed(),
            "version": self._ran,  # the plan the step's tokens were routed by
            "switched": self.experts.switched,  # a plan this step's sync switched to
            "seconds": dict(self.seconds),
        }

    # ---- recovery ----

    def export_state(self) -> dict[str, Any]:
        """What a replacement of a dead rank takes from a live one: dense weights and Adam
        state, counters, the committed plan and its encoding (no experts)."""
        return {
            "dense": [p.detach().cpu().clone() for p in self._dparams()],
            "dense_state": [(m.cpu().clone(), v.cpu().clone()) for m, v in self.dense_state],
            "step": self.step,
            "opt_step": self.opt_step,
            "expert_step": self.experts.opt_step,
            "version": self.experts.version,
            "wire": self.experts.wire,
            "layers": [
                (m.plan.placement.phy2log, m.plan.placement.master, m.plan.route)
                for m in self.layers
            ],
        }

    def adopt(self, state: dict[str, Any], experts: list[dict[int, ExpertWeights]]) -> None:
        """Become a live rank's twin (:meth:`export_state`) holding ``experts`` (per layer:
        the weights of every expert the committed plan gives this rank)."""
        dev = self.comm.device
        with torch.no_grad():
            for p, t in zip(self._dparams(), state["dense"], strict=True):
                p.copy_(t.to(dev))
        self.dense_state = [(m.to(dev), v.to(dev)) for m, v in state["dense_state"]]
        self.step, self.opt_step = state["step"], state["opt_step"]
        ep = self.experts
        ep.opt_step, ep.version, ep.wire = state["expert_step"], state["version"], state["wire"]
        for moe, (p2l, master, route), mine in zip(
            self.layers, state["layers"], experts, strict=True
        ):
            moe.set_plan(LayerPlan(Placement(np.asarray(p2l), np.asarray(master)), route), mine)
        ep.opt = [{} for _ in self.layers]

    def masters(self) -> dict[tuple[int, int], tuple[list[Any], list[Any], list[Any]]]:
        """Every master this rank holds: ``(layer, expert) -> (weights, adam m, adam v)``
        as numpy (for the checkpoint on disk)."""
        out = {}
        for layer, (moe, opt) in enumerate(zip(self.layers, self.experts.opt, strict=True)):
            for e, (m, v) in opt.items():
                out[(layer, e)] = (
                    [t.detach().cpu().numpy().copy() for t in moe.expert(e)],
                    [t.cpu().numpy().copy() for t in m],
                    [t.cpu().numpy().copy() for t in v],
                )
        return out

    def expert_weights(self, layer: int, expert: int) -> list[np.ndarray] | None:
        """This rank's copy of ``expert`` of ``layer`` (numpy), or None."""
        moe = self.layers[layer]
        if expert not in moe.held():
            return None
        return [t.detach().cpu().numpy().copy() for t in moe.expert(expert)]


def _sum_rows(parts: list[np.ndarray]) -> np.ndarray:
    """Rows ``(rank, expert, dst, count)`` [N, 4] of several microbatches, one row per
    ``(rank, expert, dst)`` with the counts summed (sorted)."""
    rows = np.concatenate([*parts, np.zeros((0, 4), np.int64)])
    keys, inv = np.unique(rows[:, :3], axis=0, return_inverse=True)
    total = np.bincount(inv.reshape(-1), weights=rows[:, 3], minlength=len(keys))
    return np.concatenate([keys, total.astype(np.int64)[:, None]], axis=1).astype(np.int64)


class RankSnapshot:
    """Copies of everything a step changes on one rank (to undo a step that failed)."""

    def __init__(self, rank: SpmdRank) -> None:
        def cl(ts: Any) -> list[torch.Tensor]:
            return [t.detach().clone() for t in ts]

        self.step, self.opt_step = rank.step, rank.opt_step
        self.dense = cl(rank._dparams())
        self.dense_state = [(m.clone(), v.clone()) for m, v in rank.dense_state]
        ep = rank.experts
        self.expert_step = ep.opt_step
        self.experts = [{e: cl(moe.expert(e)) for e in moe.held()} for moe in rank.layers]
        self.opt = [{e: (cl(m), cl(v)) for e, (m, v) in o.items()} for o in ep.opt]
        self.version = ep.version

    def restore(self, rank: SpmdRank) -> None:
        """Put ``rank`` back to this snapshot (the plan it had then stays committed)."""
        if rank.experts.version != self.version:
            raise ValueError("a plan was switched since the snapshot; it cannot be undone")
        with torch.no_grad():
            for p, t in zip(rank._dparams(), self.dense, strict=True):
                p.copy_(t)
                p.grad = None
            for moe, mine in zip(rank.layers, self.experts, strict=True):
                for e, ts in mine.items():
                    for p, t in zip(moe.expert(e), ts, strict=True):
                        p.copy_(t)
                        p.grad = None
        rank.dense_state = self.dense_state
        rank.experts.opt = self.opt
        rank.experts.cancel()  # prepared again at the next agreed boundary
        rank.step, rank.opt_step, rank.experts.opt_step = self.step, self.opt_step, self.expert_step
