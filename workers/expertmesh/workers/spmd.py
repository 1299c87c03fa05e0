"""One rank of the SPMD data plane: the demo model over :class:`MoELayer`, its optimizer,
and plan changes, all over ``torch.distributed`` (no Ray; the runtime hosts it in an actor).

Every rank runs the same loop (:meth:`SpmdRank.train_step`):

1. forward: embedding, per layer a causal mixer then :class:`MoELayer` (dispatch and
   combine over the process groups), the summed next-byte loss over the world's tokens;
2. backward (autograd; the layers' exchanges send gradients back);
3. :meth:`SpmdRank.sync`: dense gradients summed inside each DC, across DC leaders once
   per DC pair, then broadcast inside the DC; replica gradients reduced into their
   masters (inside the DC to the DC's lead holder, then once per DC over the WAN);
   masters step Adam; fresh weights go back to the replicas (once per DC, then fanned out);
4. :meth:`SpmdRank.apply_plan`: at a step boundary every rank agrees on (the newest plan
   every rank has received), the plan's migration rounds move copies and master state,
   then every rank commits: no token is ever routed by a plan whose weights are missing.

Every transfer is sized from what every rank knows (the plans), so only the token
dispatch exchanges sizes; rounds with nothing to send anywhere are skipped on every rank.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from expertmesh.planner.plan import Placement
from expertmesh.workers.comm import KINDS, Comm
from expertmesh.workers.layer import LayerPlan, MoELayer
from expertmesh.workers.model import Corpus, DenseModel, ExpertWeights, LMConfig, init_expert
from expertmesh.workers.moe import adam_
from expertmesh.workers.wire import WireFormat

__all__ = ["SpmdRank", "Transfer"]

Transfer = tuple[int, int, int, int, str]  # (layer, expert, src_rank, dst_rank, "w" | "opt")
State = tuple[list[torch.Tensor], list[torch.Tensor]]  # Adam (m, v) of an expert's tensors


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
        self.opt: list[dict[int, State]] = []
        for layer, placement in enumerate(placements):
            plan = LayerPlan(placement, np.zeros((0, 4), np.int64))
            mine = {e: init_expert(cfg, layer, e) for e in plan.held_by(self.rank)}
            gate: torch.nn.Linear = self.dense.gates[layer]  # type: ignore[assignment]
            moe = MoELayer(
                comm, plan, mine, top_k=cfg.top_k, ffn_hidden=cfg.ffn_hidden, gate=gate,
                balance=balance,
            )  # fmt: skip
            self.layers.append(moe)
            self.opt.append(
                {e: _zeros(moe.expert(e)) for e in mine if plan.master_rank[e] == self.rank}
            )
        self.wire = WireFormat()
        self.version, self.step, self.opt_step = 0, -1, 0
        self.loss = 0.0
        self.agreed = 0  # the plan version every rank has received (after a step)
        self._counts = np.zeros((cfg.num_layers, cfg.num_experts), np.int64)
        self._computed = np.zeros((cfg.microbatches, cfg.num_layers), np.int64)
        self.seconds: dict[str, float] = {}

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
        for p in self._dparams():
            p.grad = None
        for moe in self.layers:
            moe.expert_seconds = 0.0
            for p in moe.experts.values():
                p.grad = None
        k = self.cfg.microbatches
        total = self.cfg.tokens_per_rank * self.comm.world.size * k
        self.loss = 0.0
        counts = np.zeros((len(self.layers), self.cfg.num_experts), np.int64)
        computed = np.zeros((k, len(self.layers)), np.int64)  # [k, L] per microbatch
        for i in range(k):  # gradients accumulate over the microbatches
            x, y = self.corpus.batch(self.cfg, step * k + i, self.rank)
            x, y = x.to(self.comm.device), y.to(self.comm.device)
            h = self.dense.embed(x)  # [B, T, d]
            for layer, moe in enumerate(self.layers):
                a, u = self.dense.mix(layer, h)
                h = a + moe(u).reshape(a.shape)
                counts[layer] += moe.counts
                computed[i, layer] = moe.computed
                if self.report is not None:
                    self.report(layer, moe.counts)
            loss = self.dense.loss_sum(h, y) / total
            loss.backward()
            for moe in self.layers:  # fast-loop replicas' gradients back to their homes
                moe.return_replica_grads()
            self.loss += float(loss.detach())
        self._counts, self._computed = counts, computed
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
        c.all_reduce(flat, c.my_dc, min_tail=1)
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
        self._expert_sync()

    def _lead(self, plan: LayerPlan, e: int, dc: int) -> int:
        """Where ``e``'s gradients meet in ``dc`` (and its weights enter it): the master
        when it is in ``dc``, else the DC's lowest rank holding ``e``."""
        m = int(plan.master_rank[e])
        if self.comm.rank_dc[m] == dc:
            return m
        ranks = self.comm.dc_ranks[dc]
        return int(ranks[plan.holds[ranks, e]][0])

    def _expert_sync(self) -> None:
        """Replica gradients into masters, Adam on masters, weights back to replicas."""
        c = self.comm
        hops: list[list[Transfer]] = [[], [], [], []]  # grads in DC, WAN; weights WAN, in DC
        for layer, moe in enumerate(self.layers):
            plan = moe.plan
            for e in range(moe.num_experts):
                holders = np.flatnonzero(plan.holds[:, e] & c.live)
                if holders.size < 2:
                    continue
                m = int(plan.master_rank[e])
                for h in holders.tolist():
                    lead = self._lead(plan, e, int(c.rank_dc[h]))
                    if h != lead:
                        hops[0].append((layer, e, h, lead, "g"))
                        hops[3].append((layer, e, lead, h, "w"))
                for dc in sorted({int(c.rank_dc[h]) for h in holders.tolist()} - {c.rank_dc[m]}):
                    lead = self._lead(plan, e, dc)
                    hops[1].append((layer, e, lead, m, "g"))
                    hops[2].append((layer, e, m, lead, "w"))
        acc: dict[tuple[int, int], list[torch.Tensor]] = {}
        for layer, moe in enumerate(self.layers):
            for e in moe.held():
                acc[(layer, e)] = [
                    p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                    for p in moe.expert(e)
                ]
        for hop in hops[:2]:
            for (layer, e), g in self._send(hop, lambda k: acc[k], self.wire.grads):
                acc[(layer, e)] = [a + b.float() for a, b in zip(acc[(layer, e)], g, strict=True)]
        for layer, moe in enumerate(self.layers):
            for e, (m1, m2) in self.opt[layer].items():
                if self.world_counts[layer, e] == 0:
                    continue
                for p, gp, mom, var in zip(moe.expert(e), acc[(layer, e)], m1, m2, strict=True):
                    adam_(p, gp, mom, var, self.opt_step, self.cfg.lr)
        for hop in hops[2:]:
            fresh = self._send(
                hop, lambda k: list(self.layers[k[0]].expert(k[1])), self.wire.weights
            )
            with torch.no_grad():
                for (layer, e), ws in fresh:
                    for p, f in zip(self.layers[layer].expert(e), ws, strict=True):
                        p.copy_(f)

    def _send(
        self,
        transfers: list[Transfer],
        tensors: Any,
        dtype: torch.dtype,
        kind: str = "weights",
    ) -> list[tuple[tuple[int, int], list[torch.Tensor]]]:
        """Run ``transfers`` (every rank passes the same list) as one all-to-all; ``tensors``
        (layer, expert) -> the tensors this rank sends. Returns what arrived: ``(key,
        tensors)`` in sender order (one key may come from several senders)."""
        if not transfers:
            return []
        c = self.comm
        shapes = [t.shape for t in self._shapes()]
        per = sum(int(np.prod(s)) for s in shapes)
        send = [0] * c.world.size
        recv = [0] * c.world.size
        out_parts: list[torch.Tensor] = []
        incoming: list[tuple[int, tuple[int, int]]] = []
        for layer, e, src, dst, _ in sorted(transfers, key=lambda t: (t[3], t[0], t[1], t[2])):
            if src == c.rank:
                send[c.world.index[dst]] += per
                out_parts += [t.detach().reshape(-1).to(dtype) for t in tensors((layer, e))]
        for layer, e, src, dst, _ in sorted(transfers, key=lambda t: (t[2], t[3], t[0], t[1])):
            if dst == c.rank:
                recv[c.world.index[src]] += per
                incoming.append((src, (layer, e)))
        flat = torch.cat(out_parts) if out_parts else torch.zeros(0, dtype=dtype, device=c.device)
        got = c.all_to_all(flat, send, recv, c.world, kind)
        out = []
        at = 0
        for _, key in incoming:
            ts = []
            for s in shapes:
                size = int(np.prod(s))
                ts.append(got[at : at + size].reshape(s))
                at += size
            out.append((key, ts))
        return out

    def _shapes(self) -> ExpertWeights:
        d, f = self.cfg.hidden, self.cfg.ffn_hidden
        return torch.empty(d, f), torch.empty(d, f), torch.empty(f, d)

    # ---- plans ----

    def apply_plan(
        self,
        version: int,
        layers: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        rounds: list[list[Transfer]],
        wire: WireFormat | None = None,
    ) -> np.ndarray:
        """Prepare then commit plan ``version`` on every rank at once: per layer ``(phy2log
        [R, S], master [E], route [N, 4])``; ``rounds``: the migration's transfers (every rank
        passes the same). Returns [D, D] bytes this rank's migration sent between DCs."""
        if version <= self.version:
            raise ValueError(f"plan {version} is not newer than committed plan {self.version}")
        if len(layers) != self.cfg.num_layers:
            raise ValueError(f"plan has {len(layers)} layers, the model {self.cfg.num_layers}")
        wire = wire or WireFormat()
        before = self.comm.bytes[KINDS.index("migration")].copy()
        plans = [
            LayerPlan(Placement(np.asarray(p), np.asarray(m)), np.asarray(r)) for p, m, r in layers
        ]
        got_w: dict[tuple[int, int], list[torch.Tensor]] = {}
        got_opt: dict[tuple[int, int], list[torch.Tensor]] = {}

        def weights(key: tuple[int, int]) -> list[torch.Tensor]:
            layer, e = key
            if e in self.layers[layer].held():
                return list(self.layers[layer].expert(e))
            return got_w[key]  # a relay forwards what it received in an earlier round

        for rnd in rounds:
            ws = [t for t in rnd if t[4] == "w"]
            got_w.update(
                (k, [t.float() for t in v])
                for k, v in self._send(ws, weights, wire.weights, "migration")
            )
            opts = [t for t in rnd if t[4] == "opt"]
            if opts:
                got_opt.update(self._send_opt(opts, with_weights=wire.lossy_weights))
        for layer, (moe, plan) in enumerate(zip(self.layers, plans, strict=True)):
            mine: dict[int, ExpertWeights] = {}
            state: dict[int, State] = {}
            for e in plan.held_by(self.rank):
                key = (layer, e)
                master = plan.master_rank[e] == self.rank
                if e in moe.held():
                    mine[e] = tuple(p.detach().clone() for p in moe.expert(e))  # type: ignore[assignment]
                elif key in got_w:
                    mine[e] = tuple(got_w[key])  # type: ignore[assignment]
                else:
                    raise ValueError(f"rank {self.rank} lacks expert {e} of layer {layer}")
                if master and key in got_opt:  # a moved master: its Adam state (and float32
                    ts = got_opt[key]  # weights when copies travel rounded)
                    if len(ts) == 9:
                        mine[e], ts = tuple(ts[:3]), ts[3:]  # type: ignore[assignment]
                    state[e] = (ts[:3], ts[3:])
                elif master:
                    state[e] = self.opt[layer].get(e) or _zeros(mine[e])
            moe.set_plan(plan, mine)
            self.opt[layer] = {e: st for e, st in state.items()}
        self.wire, self.version = wire, version
        sent: np.ndarray = self.comm.bytes[KINDS.index("migration")] - before
        return sent

    def _send_opt(
        self, transfers: list[Transfer], *, with_weights: bool
    ) -> dict[tuple[int, int], list[torch.Tensor]]:
        """A moving master's Adam state (m, v: 6 tensors), after its float32 weights when
        ``with_weights`` (its copy arrived rounded): 9 tensors."""
        shapes = [t.shape for t in self._shapes()] * (3 if with_weights else 2)
        c = self.comm
        send = [0] * c.world.size
        recv = [0] * c.world.size
        per = sum(int(np.prod(s)) for s in shapes)
        parts: list[torch.Tensor] = []
        incoming = []
        for layer, e, src, dst, _ in sorted(transfers, key=lambda t: (t[3], t[0], t[1])):
            if src == c.rank:
                send[c.world.index[dst]] += per
                m, v = self.opt[layer][e]
                w = list(self.layers[layer].expert(e)) if with_weights else []
                parts += [t.detach().reshape(-1) for t in (*w, *m, *v)]
        for layer, e, src, dst, _ in sorted(transfers, key=lambda t: (t[2], t[0], t[1])):
            if dst == c.rank:
                recv[c.world.index[src]] += per
                incoming.append((layer, e))
        flat = torch.cat(parts) if parts else torch.zeros(0, device=c.device)
        got = c.all_to_all(flat, send, recv, c.world, "migration")
        out, at = {}, 0
        for key in incoming:
            ts = []
            for s in shapes:
                ts.append(got[at : at + int(np.prod(s))].reshape(s).clone())
                at += int(np.prod(s))
            out[key] = ts
        return out

    # ---- numbers ----

    def stats(self) -> dict[str, Any]:
        """This rank's numbers for the step just run."""
        c = self.comm
        return {
            "rank": self.rank,
            "step": self.step,
            "loss": self.loss,
            "computed": self._computed.sum(axis=0),  # [L] summed over the step's microbatches
            "computed_mb": self._computed.copy(),  # [k, L] per microbatch
            "replicas": np.array([m.replicas for m in self.layers], np.int64),  # [L] fast loop
            "fanout_bytes": int(sum(m.fanout_bytes for m in self.layers)),
            "balance_seconds": float(sum(m.balance_seconds for m in self.layers)),
            "load": self._counts.copy(),  # [L, E] summed over the step's microbatches
            "expert_seconds": np.array([m.expert_seconds for m in self.layers]),  # [L]
            "crossings": np.stack([m.crossings for m in self.layers]),  # [L, D]
            "routed": [m.routed.copy() for m in self.layers],  # per layer [N, 4]
            "bytes": c.bytes.copy(),  # [3, D, D] cumulative, by KINDS
            "shaped_seconds": c.shaped_seconds,
            "collectives": c.collectives,
            "version": self.version,
            "seconds": dict(self.seconds),
        }

    def expert_weights(self, layer: int, expert: int) -> list[np.ndarray] | None:
        """This rank's copy of ``expert`` of ``layer`` (numpy), or None."""
        moe = self.layers[layer]
        if expert not in moe.held():
            return None
        return [t.detach().cpu().numpy().copy() for t in moe.expert(expert)]


def _zeros(w: Any) -> State:
    return [torch.zeros_like(t.detach()) for t in w], [torch.zeros_like(t.detach()) for t in w]
