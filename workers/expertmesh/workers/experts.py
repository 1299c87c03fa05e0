r"""Expert parallelism's bookkeeping around :class:`~expertmesh.workers.layer.MoELayer`\s:
masters, replicas and plan switches, over one :class:`~expertmesh.workers.comm.Comm`.

Any ``torch.distributed`` trainer that uses :class:`MoELayer` drives the experts through
one :class:`ExpertParallel`: after its backward it calls :meth:`ExpertParallel.step`
(replica gradients reduce into masters, masters step Adam, fresh weights go back to the
replicas; the trainer's own optimizer handles everything else), and at a step boundary
every rank agrees on, :meth:`ExpertParallel.apply_plan` (the plan's migration rounds move
copies and master state, then every layer switches). Every transfer is sized from what
every rank knows (the plans), so no sizes are exchanged, and rounds with nothing to send
anywhere are skipped on every rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from expertmesh.planner.plan import Placement
from expertmesh.workers.comm import KINDS, Comm
from expertmesh.workers.layer import LayerPlan, MoELayer
from expertmesh.workers.model import ExpertWeights
from expertmesh.workers.moe import adam_
from expertmesh.workers.wire import WireFormat

__all__ = ["ExpertParallel", "Transfer"]

Transfer = tuple[int, int, int, int, str]  # (layer, expert, src_rank, dst_rank, "w" | "opt")
State = tuple[list[torch.Tensor], list[torch.Tensor]]  # Adam (m, v) of an expert's tensors


class ExpertParallel:
    """The masters' Adam state and the plan version of ``layers`` (one per MoE layer, in
    model order) on this rank; ``lr``: the masters' Adam learning rate."""

    def __init__(self, comm: Comm, layers: list[MoELayer], *, lr: float) -> None:
        self.comm, self.layers, self.lr = comm, layers, lr
        self.hidden, self.ffn_hidden = layers[0].gate.in_features, layers[0].ffn_hidden
        self.opt: list[dict[int, State]] = [
            {e: _zeros(moe.expert(e)) for e in moe.held() if moe.plan.master_rank[e] == comm.rank}
            for moe in layers
        ]
        self.wire = WireFormat()
        self.version = 0
        self.opt_step = 0

    def _lead(self, plan: LayerPlan, e: int, dc: int) -> int:
        """Where ``e``'s gradients meet in ``dc`` (and its weights enter it): the master
        when it is in ``dc``, else the DC's lowest rank holding ``e``."""
        m = int(plan.master_rank[e])
        if self.comm.rank_dc[m] == dc:
            return m
        ranks = self.comm.dc_ranks[dc]
        return int(ranks[plan.holds[ranks, e]][0])

    def step(self, world_counts: np.ndarray) -> None:
        """After the backward: replica gradients into masters (inside the DC to the DC's lead
        holder, then once per DC over the WAN), Adam on the masters of experts some token
        reached (``world_counts`` [L, E] > 0, the world's assignments), fresh weights back to
        every replica (once per DC, then fanned out)."""
        self.opt_step += 1
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
                if world_counts[layer, e] == 0:
                    continue
                for p, gp, mom, var in zip(moe.expert(e), acc[(layer, e)], m1, m2, strict=True):
                    adam_(p, gp, mom, var, self.opt_step, self.lr)
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
        d, f = self.hidden, self.ffn_hidden
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
        if len(layers) != len(self.layers):
            raise ValueError(f"plan has {len(layers)} layers, the model {len(self.layers)}")
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
            for e in plan.held_by(self.comm.rank):
                key = (layer, e)
                master = plan.master_rank[e] == self.comm.rank
                if e in moe.held():
                    mine[e] = tuple(p.detach().clone() for p in moe.expert(e))  # type: ignore[assignment]
                elif key in got_w:
                    mine[e] = tuple(got_w[key])  # type: ignore[assignment]
                else:
                    raise ValueError(f"rank {self.comm.rank} lacks expert {e} of layer {layer}")
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


def _zeros(w: Any) -> State:
    return [torch.zeros_like(t.detach()) for t in w], [torch.zeros_like(t.detach()) for t in w]
