"""One rank of the data plane, without Ray: the state and the phases of a training step.

A training step is a sequence of *phases*; in each, every rank takes the
packets addressed to it in the previous phase (``inbox[p]`` from rank ``p``)
and returns one packet per rank (``None``: nothing). The driver
(:mod:`expertmesh.workers.engine`) moves packets; in Ray they travel as
object refs between actors. Every packet that leaves the rank's DC books its
bytes on the :class:`LinkShaper` and the rank sleeps until it has arrived.

Per MoE layer, forward (the backward mirrors it with gradients):

1. ``src``: gate, report ``load[r, :]``, pick each assignment's destination from the
   committed route; send distinct tokens directly to ranks of the own DC and, once
   per remote DC, one bundle of distinct tokens to that DC's relay.
2. ``fan``: relays fan each bundle out to the ranks of their DC.
3. ``expert``: compute; answer direct senders, and relays for fanned-out tokens.
4. ``gather``: relays sum the answers per token inside the DC and send one result back.
5. ``src`` of the next layer combines.

After the backward: replica gradients reduce into masters (inside a DC first, then
once per DC over the WAN), masters run Adam, refreshed weights go back to replicas
(once per DC, then fanned out); dense gradients are summed per DC, exchanged between
DC leaders and applied by every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from expertmesh.planner.costmodel import TransferEncoding
from expertmesh.planner.plan import Placement
from expertmesh.planner.topology import Topology
from expertmesh.workers.model import Corpus, DenseModel, ExpertWeights, LMConfig, init_expert
from expertmesh.workers.moe import (
    ExpertContext,
    adam_,
    assign_destinations,
    expert_backward,
    expert_compute,
    relay_rank,
)
from expertmesh.workers.recovery import RankRecovery
from expertmesh.workers.wire import WireFormat, from_wire, payload_nbytes, to_wire, widen

__all__ = ["KINDS", "LayerState", "RankState", "from_wire", "payload_nbytes", "to_wire"]

KINDS = ("tokens", "weights", "migration")  # what crossed: activations, sync, plan moves
Packet = Any
Span = tuple[str, int, int, int, int, int, int]  # (kind, via, src, row0, rows, asn0, asns)
Reserve = Callable[[int, int, int], float]  # (src_dc, dst_dc, nbytes) -> arrival clock time


@dataclass(eq=False)
class LayerState:
    """The committed plan of one layer as a rank sees it."""

    placement: Placement
    route: np.ndarray  # [N, 4]
    holds: np.ndarray = field(init=False)  # [R, E]
    master_rank: np.ndarray = field(init=False)  # [E]

    def __post_init__(self) -> None:
        self.holds = self.placement.holds()
        self.master_rank = self.placement.master_rank()
        # two slots of one rank may hold the same expert (eplb does this): the rank keeps
        # one set of weights and computes both slots' tokens with it


class RankState(RankRecovery):
    """Everything one rank holds: dense weights, its experts, masters' Adam state, plans."""

    def __init__(
        self,
        rank: int,
        topology: Topology,
        cfg: LMConfig,
        corpus: Corpus,
        placements: list[Placement],
        *,
        reserve: Reserve | None = None,
        report: Callable[[int, int, int, np.ndarray], None] | None = None,
    ) -> None:
        if len(placements) != cfg.num_layers:
            raise ValueError(f"need {cfg.num_layers} placements, got {len(placements)}")
        torch.set_num_threads(1)
        self.rank, self.topology, self.cfg, self.corpus = rank, topology, cfg, corpus
        self.R = topology.num_ranks
        self.dc = int(topology.rank_dc[rank])
        self.set_live([True] * self.R)
        self._snap: dict[str, Any] | None = None
        self._reserve = reserve
        self._report = report
        self.dense = DenseModel(cfg)
        self.dense_state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in self._dparams()]
        self.version = 0
        self.wire = WireFormat()  # the committed plan's transfer encoding of expert streams
        self.layers = [LayerState(p, np.zeros((0, 4), np.int64)) for p in placements]
        self.experts: list[dict[int, ExpertWeights]] = []
        self.opt: list[dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]]] = []
        for layer, ls in enumerate(self.layers):
            mine = {e: self._param(init_expert(cfg, layer, e)) for e in self._row(ls)}
            self.experts.append(mine)
            self.opt.append({e: _zeros_state(mine[e]) for e in mine if ls.master_rank[e] == rank})
        self.opt_step = 0
        self.step = -1
        self.bytes = np.zeros((len(KINDS), topology.num_dcs, topology.num_dcs), np.int64)
        self.shaped_seconds = 0.0
        self._pending: dict[str, Any] | None = None
        self._reset_step()

    # ---- membership and step rollback ----

    def set_live(self, live: list[bool]) -> None:
        """Take part only with the ``live`` [R] ranks: the others (dead, or in a DC cut off)
        get no packet, lead no DC and count in no loss; a DC without live ranks is skipped."""
        mask = np.asarray(live, dtype=bool)
        if mask.shape != (self.R,) or not mask[self.rank]:
            raise ValueError(f"live must be [{self.R}] bools with this rank ({self.rank}) live")
        self.live = mask
        self.rank_dc = np.where(mask, self.topology.rank_dc, -1)  # -1: not taking part
        self.dc_ranks = [np.flatnonzero(self.rank_dc == d) for d in range(self.topology.num_dcs)]

    # ---- helpers ----

    def _row(self, ls: LayerState) -> list[int]:
        row = ls.placement.phy2log[self.rank]
        return sorted({int(e) for e in row if e >= 0})

    def _lead(self, ls: LayerState, e: int, dc: int) -> int:
        """Lowest rank of ``dc`` holding ``e`` (the DC's reduce/fan-out point for ``e``)."""
        holders = self.dc_ranks[dc][ls.holds[self.dc_ranks[dc], e]]
        return int(holders[0])

    def _empty(self) -> list[Packet]:
        return [None] * self.R

    def _ship(self, out: list[Packet], kind: str) -> list[Packet]:
        """Count and shape every packet of ``out`` that leaves this rank's DC."""
        k = KINDS.index(kind)
        arrive = 0.0
        for q, pkt in enumerate(out):
            if pkt is None or int(self.rank_dc[q]) == self.dc:
                continue
            nbytes = payload_nbytes(pkt)
            self.bytes[k, self.dc, self.rank_dc[q]] += nbytes
            if self._reserve is not None:
                arrive = max(arrive, self._reserve(self.dc, int(self.rank_dc[q]), nbytes))
        if self._reserve is not None and arrive > 0:
            wait = arrive - time.time()
            if wait > 0:
                self.shaped_seconds += wait
                time.sleep(wait)
        return out

    def _reset_step(self) -> None:
        self._src: dict[int, dict[str, Any]] = {}
        self._relay: dict[int, dict[int, Any]] = {}
        self._direct_in: dict[int, dict[int, Any]] = {}
        self._expert: dict[int, tuple[ExpertContext, list[Span]]] = {}
        self._direct_resp: dict[int, dict[int, Any]] = {}
        self.loss_sum = 0.0
        self.computed = np.zeros(self.cfg.num_layers, np.int64)
        self.load = np.zeros((self.cfg.num_layers, self.cfg.num_experts), np.int64)
        self.expert_seconds = np.zeros(self.cfg.num_layers)  # forward + backward, wall
        self.crossings = np.zeros((self.cfg.num_layers, self.topology.num_dcs), np.int64)
        self.routed: list[np.ndarray] = [np.zeros((0, 4), np.int64)] * self.cfg.num_layers

    # ---- the phases of a training step ----

    def phase(self, name: str, layer: int, inbox: list[Packet], arg: Any = None) -> list[Packet]:
        """Run phase ``name`` of ``layer`` on ``inbox`` [R]; returns the packets [R].

        Packets travel as numpy arrays (pickling a numpy array costs a small fraction of
        pickling a torch tensor); the phases work on tensors."""
        if len(inbox) not in (0, self.R):
            raise ValueError(f"inbox must hold {self.R} packets, got {len(inbox)}")
        if "+" in name:  # rounds joined: the ones before the last must send nothing
            first, *rest = name.split("+")
            out = self.phase(first, layer, inbox, arg)
            for nxt in rest:
                if any(p is not None for p in out):
                    raise ValueError(
                        f"rank {self.rank}: phase {first} of layer {layer} sent packets; the "
                        f"step's layout skips its round (the plan needs it)"
                    )
                first, out = nxt, self.phase(nxt, layer, [], None)
            return out
        inbox = [from_wire(p) for p in inbox] if inbox else self._empty()
        if name == "mig":
            return [to_wire(p) for p in self._mig(inbox, arg or [])]
        if name == "begin":
            self.begin_step(int(arg))
        fn = getattr(self, f"_ph_{name}", None)
        if fn is None:
            raise ValueError(f"unknown phase {name!r}")
        result: list[Packet] = fn(layer, inbox)
        return [to_wire(p) for p in result]

    def begin_step(self, step: int) -> None:
        if step <= self.step:
            raise ValueError(f"step {step} is not after step {self.step}")
        self._snap = self._snapshot()
        self.step = step
        self._reset_step()
        for p in self._dparams():
            p.grad = None
        for mine in self.experts:
            for w in mine.values():
                for t in w:
                    t.grad = None

    def _ph_begin(self, layer: int, inbox: list[Packet]) -> list[Packet]:
        x, y = self.corpus.batch(self.cfg, self.step, self.rank)
        self._targets = y
        h = self.dense.embed(x)  # [B, T, d]
        return self._layer_start(0, h)

    def _layer_start(self, layer: int, h: torch.Tensor) -> list[Packet]:
        a, u = self.dense.mix(layer, h)
        idx, w = self.dense.gate(layer, u)
        idx_np = idx.numpy()
        counts = np.bincount(idx_np.reshape(-1), minlength=self.cfg.num_experts)
        self.load[layer] = counts
        if self._report is not None:
            self._report(self.step, layer, self.rank, counts)
        ls = self.layers[layer]
        dst = assign_destinations(self.rank, idx_np, ls.route, ls.holds, self.rank_dc).reshape(-1)
        self.routed[layer] = _route_rows(self.rank, idx_np.reshape(-1), dst, self.R)
        flat_e = torch.from_numpy(idx_np.reshape(-1))
        wf = w.detach().reshape(-1)
        tok = np.repeat(np.arange(u.shape[0]), self.cfg.top_k)
        ud = u.detach()
        out = self._empty()
        sent: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # dest -> (U tokens, assignment ids)
        dst_dc = self.rank_dc[dst]
        for b in range(self.topology.num_dcs):
            in_b = np.flatnonzero(dst_dc == b)
            if in_b.size == 0:
                continue
            if b == self.dc:
                for q in np.unique(dst[in_b]).tolist():
                    a_ids = in_b[dst[in_b] == q]
                    out[q], sent[q] = self._packet(ud, tok, a_ids, flat_e, wf, None)
            else:
                relay = relay_rank(self.rank, b, self.rank_dc)
                out[relay], sent[relay] = self._packet(ud, tok, in_b, flat_e, wf, dst)
                self.crossings[layer, b] = sent[relay][0].numel()
        self._src[layer] = {"a": a, "u": u, "w": w, "sent": sent, "n": u.shape[0]}
        return self._ship(out, "tokens")

    def _packet(  # noqa: PLR0917
        self,
        ud: torch.Tensor,
        tok: np.ndarray,
        a_ids: np.ndarray,
        flat_e: torch.Tensor,
        wf: torch.Tensor,
        dst: np.ndarray | None,
    ) -> tuple[dict[str, Any], tuple[torch.Tensor, np.ndarray]]:
        uniq, pos = np.unique(tok[a_ids], return_inverse=True)
        ids = torch.from_numpy(a_ids)
        # on the wire: per token its activation; per assignment its row and destination
        # (int32), expert (int16) and gate weight (fp32); ids widen to int64 on arrival
        pkt = {
            "v": self.version,
            "x": ud[torch.from_numpy(uniq)],
            "pos": torch.from_numpy(pos.astype(np.int32)),
            "e": flat_e[ids].to(_ID),
            "w": wf[ids],
        }
        if dst is not None:
            pkt["dst"] = torch.from_numpy(dst[a_ids].astype(np.int32))
        return pkt, (torch.from_numpy(uniq), a_ids)

    def _ph_fan(self, layer: int, inbox: list[Packet]) -> list[Packet]:
        """Relays fan bundles out inside the DC; direct packets wait for the expert phase."""
        out = self._empty()
        self._direct_in[layer], self._relay[layer] = {}, {}
        for p, pkt in enumerate(inbox):
            if pkt is None:
                continue
            if "dst" not in pkt:
                self._direct_in[layer][p] = pkt
                continue
            book = {}
            dst = pkt["dst"].numpy()
            for q in np.unique(dst).tolist():
                sel = np.flatnonzero(dst == q)
                uniq, pos = np.unique(pkt["pos"].numpy()[sel].astype(np.int64), return_inverse=True)
                sub = {
                    "v": pkt["v"],
                    "x": pkt["x"][torch.from_numpy(uniq)],
                    "pos": torch.from_numpy(pos.astype(np.int32)),
                    "e": pkt["e"][torch.from_numpy(sel)],
                    "w": pkt["w"][torch.from_numpy(sel)],
                }
                out[q] = out[q] or {}
                out[q][p] = sub
                book[q] = (torch.from_numpy(uniq), torch.from_numpy(sel))
            self._relay[layer][p] = (pkt["x"].shape[0], len(pkt["e"]), book)
        return self._ship(out, "tokens")

    def _ph_expert(self, layer: int, inbox: list[Packet]) -> list[Packet]:
        """Compute this rank's experts on everything received; answer each sender."""
        items: list[tuple[str, int, int, dict[str, Any]]] = []  # (kind, via, src, packet)
        for p, pkt in sorted(self._direct_in[layer].items()):
            items.append(("direct", p, p, pkt))
        for q, subs in enumerate(inbox):
            for src, pkt in sorted((subs or {}).items()):
                items.append(("relay", q, src, pkt))
        for _, _, _, pkt in items:
            if pkt["v"] != self.version:
                raise ValueError(
                    f"rank {self.rank} holds plan {self.version}, tokens routed by plan {pkt['v']}"
                )
        xs, pos, es, ws = [], [], [], []
        spans: list[Span] = []
        row = asn = 0
        for kind, via, src, pkt in items:
            u, m = int(pkt["x"].shape[0]), int(pkt["e"].shape[0])
            xs.append(pkt["x"])
            pos.append(pkt["pos"].long() + row)
            es.append(pkt["e"].long())
            ws.append(pkt["w"])
            spans.append((kind, via, src, row, u, asn, m))
            row, asn = row + u, asn + m
        d = self.cfg.hidden
        x = torch.cat(xs) if xs else torch.zeros(0, d)
        t0 = time.perf_counter()
        y, ctx = expert_compute(
            x, _cat(pos, torch.int64), _cat(es, torch.int64), _cat(ws, torch.float32),
            self.experts[layer],
        )  # fmt: skip
        self.expert_seconds[layer] += time.perf_counter() - t0
        self.computed[layer] = asn
        self._expert[layer] = (ctx, spans)
        out = self._empty()
        for kind, via, src, r0, u, _, _ in spans:
            self._answer(out, kind, via, src, y[r0 : r0 + u])
        return self._ship(out, "tokens")

    @staticmethod
    def _answer(out: list[Packet], kind: str, via: int, src: int, val: Any) -> None:
        slot = out[via] = out[via] or {"direct": None, "relay": {}}
        if kind == "direct":
            slot["direct"] = val
        else:
            slot["relay"][src] = val

    def _ph_gather(self, layer: int, inbox: list[Packet]) -> list[Packet]:
        """Keep direct answers; sum relayed answers per token and send each source one."""
        self._direct_resp[layer] = {}
        out = self._empty()
        acc: dict[int, Any] = {}
        for q, pkt in enumerate(inbox):
            if pkt is None:
                continue
            if pkt["direct"] is not None:
                self._direct_resp[layer][q] = pkt["direct"]
            for src, val in pkt["relay"].items():
                nu, nm, book = self._relay[layer][src]
                uniq, sel = book[q]
                if src not in acc:
                    acc[src] = (torch.zeros(nu, self.cfg.hidden), torch.zeros(nm))
                if isinstance(val, tuple):  # backward: (dL/dx, dL/dw)
                    acc[src][0].index_add_(0, uniq, val[0])
                    acc[src][1][sel] = val[1]
                else:
                    acc[src][0].index_add_(0, uniq, val)
        for src, (rows, gw) in acc.items():
            out[src] = (rows, gw) if self._backward_mode else rows
        return self._ship(out, "tokens")

    _backward_mode = False

    def _combine(self, layer: int, inbox: list[Packet]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum direct and WAN answers into [n, d] rows (and [n*k] dL/dw when backward)."""
        st = self._src[layer]
        rows = torch.zeros(st["n"], self.cfg.hidden)
        gw = torch.zeros(st["n"] * self.cfg.top_k)
        answers = dict(self._direct_resp[layer])
        for p, pkt in enumerate(inbox):
            if pkt is not None:
                answers[p] = pkt
        for dest, val in sorted(answers.items()):
            uniq, a_ids = st["sent"][dest]
            if isinstance(val, tuple):
                rows.index_add_(0, uniq, val[0])
                gw[torch.from_numpy(a_ids)] = val[1]
            else:
                rows.index_add_(0, uniq, val)
        return rows, gw

    def _ph_next(self, layer: int, inbox: list[Packet]) -> list[Packet]:
        """Combine ``layer``; start the next layer, or take the loss and start the backward."""
        y, _ = self._combine(layer, inbox)
        y.requires_grad_(True)
        self._src[layer]["y"] = y
        st = self._src[layer]
        h = st["a"] + y.reshape(st["a"].shape)
        if layer + 1 < self.cfg.num_layers:
            return self._layer_start(layer + 1, h)
        total = self.cfg.tokens_per_rank * int(self.live.sum())
        loss = self.dense.loss_sum(h, self._targets) / total
        self.loss_sum = float(loss.detach())
        loss.backward(retain_graph=True)
        self._backward_mode = True
        return self._grad_start(layer)

    def _grad_start(self, layer: int) -> list[Packet]:
        st = self._src[layer]
        g = st["y"].grad if st["y"].grad is not None else torch.zeros_like(st["y"])
        out = self._empty()
        for dest, (uniq, _) in st["sent"].items():
            out[dest] = {"g": g[uniq], "b": int(self.rank_dc[dest]) != self.dc}
        return self._ship(out, "tokens")

    def _ph_bfan(self, layer: int, inbox: list[Packet]) -> list[Packet]:
        out = self._empty()
        self._direct_in[layer] = {}
        for p, pkt in enumerate(inbox):
            if pkt is None:
                continue
            if not pkt["b"]:
                self._direct_in[layer][p] = pkt["g"]
                continue
            for q, (uniq, _) in self._relay[layer][p][2].items():
                out[q] = out[q] or {}
                out[q][p] = pkt["g"][uniq]
        return self._ship(out, "tokens")

    def _ph_bexpert(self, layer: int, inbox: list[Packet]) -> list[Packet]:
        ctx, spans = self._expert.pop(layer)
        g = torch.zeros(ctx.x.shape)
        for kind, via, src, r0, u, _, _ in spans:
            part = self._direct_in[layer][src] if kind == "direct" else inbox[via][src]
            g[r0 : r0 + u] = part
        t0 = time.perf_counter()
        gx, gw = expert_backward(ctx, g)
        self.expert_seconds[layer] += time.perf_counter() - t0
        out = self._empty()
        for kind, via, src, r0, u, a0, m in spans:
            self._answer(out, kind, via, src, (gx[r0 : r0 + u], gw[a0 : a0 + m]))
        return self._ship(out, "tokens")

    def _ph_bgather(self, layer: int, inbox: list[Packet]) -> list[Packet]:
        return self._ph_gather(layer, inbox)

    def _ph_bnext(self, layer: int, inbox: list[Packet]) -> list[Packet]:
        """Backward through ``layer``'s dense segment; start the layer below."""
        gu, gw = self._combine(layer, inbox)
        st = self._src.pop(layer)
        torch.autograd.backward(
            [st["u"], st["w"]], [gu, gw.reshape(st["w"].shape)], retain_graph=True
        )
        if layer > 0:
            return self._grad_start(layer - 1)
        self._backward_mode = False
        return self._empty()

    # ---- gradient reduction, optimizer, replica refresh ----

    def _grads(self, layer: int, e: int) -> list[torch.Tensor] | None:
        w = self.experts[layer][e]
        if all(t.grad is None for t in w):
            return None
        return [t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in w]

    def _ph_red1(self, layer: int, inbox: list[Packet]) -> list[Packet]:
        """Replica grads to the master (same DC) or the DC's lead holder; dense grads to
        the DC leader."""
        out = self._empty()
        self._acc: dict[tuple[int, int], list[torch.Tensor] | None] = {}
        for lyr, ls in enumerate(self.layers):
            for e in self.experts[lyr]:
                g = self._grads(lyr, e)
                m = int(ls.master_rank[e])
                target = m if self.rank_dc[m] == self.dc else self._lead(ls, e, self.dc)
                if target == self.rank:
                    self._acc[(lyr, e)] = g
                elif g is not None:
                    out[target] = out[target] or {}
                    out[target].setdefault("eg", {})[(lyr, e)] = self.wire.send_grads(g)
        leader = int(self.dc_ranks[self.dc][0])
        dgrads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._dparams()]
        if leader == self.rank:
            self._dense_sum = [g.clone() for g in dgrads]
        else:
            out[leader] = out[leader] or {}
            out[leader]["dg"] = [g.clone() for g in dgrads]
        return self._ship(out, "weights")

    def _add_grads(self, inbox: list[Packet]) -> None:
        for pkt in inbox:
            for key, sent in ((pkt or {}).get("eg") or {}).items():
                g = widen(sent)  # summed in float32 whatever the wire carried
                cur = self._acc.get(key)
                self._acc[key] = g if cur is None else [a + b for a, b in zip(cur, g, strict=True)]

    def _ph_red2(self, layer: int, inbox: list[Packet]) -> list[Packet]:
        """Leads send their DC's replica grads over the WAN; DC leaders exchange dense sums."""
        self._add_grads(inbox)
        out = self._empty()
        for (lyr, e), g in list(self._acc.items()):
            m = int(self.layers[lyr].master_rank[e])
            if m != self.rank and g is not None:
                out[m] = out[m] or {}
                out[m].setdefault("eg", {})[(lyr, e)] = self.wire.send_grads(g)
                del self._acc[(lyr, e)]
        if int(self.dc_ranks[self.dc][0]) == self.rank:
            for pkt in inbox:
                if pkt is not None and "dg" in pkt:
                    self._dense_sum = [
                        a + b for a, b in zip(self._dense_sum, pkt["dg"], strict=True)
                    ]
            for b in range(self.topology.num_dcs):
                if b != self.dc and self.dc_ranks[b].size:
                    lead = int(self.dc_ranks[b][0])
                    out[lead] = out[lead] or {}
                    out[lead]["ds"] = (self.dc, self._dense_sum)
        return self._ship(out, "weights")

    def _ph_red3(self, layer: int, inbox: list[Packet]) -> list[Packet]:
        """Masters step Adam and send fresh weights to replicas (once per remote DC);
        DC leaders step the dense weights and pass the global gradient to their DC."""
        self._add_grads(inbox)
        self.opt_step += 1
        out = self._empty()
        for lyr, ls in enumerate(self.layers):
            for e, (m1, m2) in self.opt[lyr].items():
                g = self._acc.get((lyr, e))
                w = self.experts[lyr][e]
                if g is not None:
                    for p, gp, mom, var in zip(w, g, m1, m2, strict=True):
                        adam_(p, gp, mom, var, self.opt_step, self.cfg.lr)
                holders = np.flatnonzero(ls.holds[:, e])
                fresh = self.wire.send_weights(w)  # the master keeps float32
                for h in holders.tolist():
                    if h == self.rank:
                        continue
                    hdc = int(self.rank_dc[h])
                    target = h if hdc == self.dc else self._lead(ls, e, hdc)
                    out[target] = out[target] or {}
                    out[target].setdefault("ew", {})[(lyr, e)] = fresh
        if int(self.dc_ranks[self.dc][0]) == self.rank:
            sums: dict[int, list[torch.Tensor]] = {self.dc: self._dense_sum}
            for pkt in inbox:
                if pkt is not None and "ds" in pkt:
                    sums[int(pkt["ds"][0])] = pkt["ds"][1]
            order = [b for b in range(self.topology.num_dcs) if self.dc_ranks[b].size]
            total = sums[order[0]]  # summed in DC order: every leader gets the same bits
            for b in order[1:]:
                total = [x + c for x, c in zip(total, sums[b], strict=True)]
            self._dense_step(total)
            for q in self.dc_ranks[self.dc].tolist():
                if q != self.rank:
                    out[q] = out[q] or {}
                    out[q]["dg"] = total
        return self._ship(out, "weights")

    def _dense_step(self, grads: list[torch.Tensor]) -> None:
        for p, g, (m, v) in zip(self._dparams(), grads, self.dense_state, strict=True):
            adam_(p, g, m, v, self.opt_step, self.cfg.lr)

    def _store(self, inbox: list[Packet]) -> list[Packet]:
        out = self._empty()
        for pkt in inbox:
            for (lyr, e), fresh in ((pkt or {}).get("ew") or {}).items():
                with torch.no_grad():
                    for t, f in zip(self.experts[lyr][e], fresh, strict=True):
                        t.copy_(f)
                ls = self.layers[lyr]
                if self.rank_dc[ls.master_rank[e]] != self.dc:  # I am this DC's lead: fan out
                    for h in self.dc_ranks[self.dc][ls.holds[self.dc_ranks[self.dc], e]].tolist():
                        if h != self.rank:
                            out[h] = out[h] or {}
                            out[h].setdefault("ew", {})[(lyr, e)] = fresh
        return out

    def _ph_red4(self, layer: int, inbox: list[Packet]) -> list[Packet]:
        out = self._store(inbox)
        for pkt in inbox:
            if pkt is not None and "dg" in pkt:
                self._dense_step(pkt["dg"])
        return self._ship(out, "weights")

    def _ph_red5(self, layer: int, inbox: list[Packet]) -> list[Packet]:
        """Store the fanned-out weights; the packet to itself is the step's :meth:`stats`."""
        self._store(inbox)
        out = self._empty()
        out[self.rank] = self.stats()
        return out

    # ---- two-phase plan application ----

    def prepare(
        self,
        version: int,
        layers: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        encoding: TransferEncoding | None = None,
    ) -> None:
        """Start preparing plan ``version``: per layer ``(phy2log [R, S], master [E], route
        [N, 4])``; ``encoding``: the plan's transfer encoding of expert streams (None:
        float32), used by its migration and, once committed, by every step's replica sync.
        Refuses a version not newer than the committed or a prepared one."""
        if version <= self.version:
            raise ValueError(f"plan {version} is not newer than committed plan {self.version}")
        if self._pending is not None and version < self._pending["version"]:
            raise ValueError(
                f"plan {version} is older than prepared plan {self._pending['version']}"
            )
        if len(layers) != self.cfg.num_layers:
            raise ValueError(f"plan has {len(layers)} layers, the model {self.cfg.num_layers}")
        new = [
            LayerState(Placement(np.asarray(p2l), np.asarray(master)), np.asarray(route))
            for p2l, master, route in layers
        ]
        self._pending = {
            "version": version,
            "layers": new,
            "wire": WireFormat.of(encoding),
            "w": {},
            "opt": {},
            "wf": {},  # moved masters' float32 weights (when copies travel lossy)
            "bytes": self.bytes[KINDS.index("migration")].copy(),
        }

    def _mig(
        self, inbox: list[Packet], transfers: list[tuple[int, int, int, int, str]]
    ) -> list[Packet]:
        """Store what arrived; send this round's transfers ``(layer, expert, src, dst, kind)``
        (kind ``w``: weights, ``opt``: the master's Adam state)."""
        pend = self._pending
        if pend is None:
            raise ValueError("no plan is being prepared")
        for pkt in inbox:
            pend["w"].update((k, widen(w)) for k, w in (pkt or {}).get("mw", {}).items())
            pend["opt"].update((pkt or {}).get("mo", {}))
            pend["wf"].update((pkt or {}).get("mf", {}))
        out = self._empty()
        wire: WireFormat = pend["wire"]
        for lyr, e, src, dst, kind in transfers:
            if src != self.rank:
                continue
            out[dst] = out[dst] or {"mw": {}, "mo": {}}
            if kind == "opt":  # a moving master's state: always float32
                m, v = self.opt[lyr][e]
                out[dst]["mo"][(lyr, e)] = ([t.clone() for t in m], [t.clone() for t in v])
                if wire.lossy_weights:  # its weights too: the copy it got was rounded
                    w32 = [t.detach().clone() for t in self.experts[lyr][e]]
                    out[dst].setdefault("mf", {})[(lyr, e)] = w32
                continue
            have = self.experts[lyr].get(e)
            w = have if have is not None else pend["w"].get((lyr, e))
            if w is None:
                raise ValueError(
                    f"rank {self.rank} must send expert {e} of layer {lyr}; it has none"
                )
            out[dst]["mw"][(lyr, e)] = wire.send_weights(w)
        return self._ship(out, "migration")

    def prepare_end(self, version: int) -> np.ndarray:
        """Check every copy and master state of plan ``version`` is here (PREPARED).

        Returns [D, D] the bytes this rank sent between DCs while preparing it."""
        pend = self._pending
        if pend is None or pend["version"] != version:
            raise ValueError(f"plan {version} is not being prepared on rank {self.rank}")
        for lyr, ls in enumerate(pend["layers"]):
            for e in self._row(ls):
                if e not in self.experts[lyr] and (lyr, e) not in pend["w"]:
                    raise ValueError(f"rank {self.rank} lacks expert {e} of layer {lyr}")
                mine = ls.master_rank[e] == self.rank
                if mine and e not in self.opt[lyr] and (lyr, e) not in pend["opt"]:
                    raise ValueError(f"rank {self.rank} lacks the master state of {e}")
        pend["ready"] = True
        sent: np.ndarray = self.bytes[KINDS.index("migration")] - pend["bytes"]
        return sent

    def commit(self, version: int) -> None:
        """Switch to prepared plan ``version`` (idempotent for the committed version)."""
        if version == self.version:
            return
        pend = self._pending
        if pend is None or pend["version"] != version or not pend.get("ready"):
            raise ValueError(f"plan {version} is not prepared on rank {self.rank}")
        experts, opt = [], []
        for lyr, ls in enumerate(pend["layers"]):
            mine: dict[int, ExpertWeights] = {}
            state = {}
            for e in self._row(ls):
                old = self.experts[lyr].get(e)
                mine[e] = old if old is not None else self._param(pend["w"][(lyr, e)])
                if (lyr, e) in pend["wf"] and ls.master_rank[e] == self.rank:
                    mine[e] = self._param(pend["wf"][(lyr, e)])  # a master stays float32
                if ls.master_rank[e] == self.rank:
                    st = self.opt[lyr].get(e) or pend["opt"].get((lyr, e))
                    if st is None:
                        st = _zeros_state(mine[e])
                    state[e] = st
            experts.append(mine)
            opt.append(state)
        self.experts, self.opt, self.layers = experts, opt, pend["layers"]
        self.wire = pend["wire"]
        self.version, self._pending = version, None

    def plan_state(self) -> tuple[int, int | None, bool]:
        """``(committed version, prepared version or None, whether it is ready)``."""
        pend = self._pending
        if pend is None:
            return self.version, None, False
        return self.version, int(pend["version"]), bool(pend.get("ready"))

    def abort(self, version: int) -> None:
        """Drop prepared plan ``version`` (rollback); the committed plan stays."""
        if self._pending is not None and self._pending["version"] == version:
            self._pending = None

    def stats(self) -> dict[str, Any]:
        """This rank's numbers for the step just run."""
        return {
            "rank": self.rank,
            "step": self.step,
            "loss": self.loss_sum,
            "computed": self.computed.copy(),  # [L] assignments computed per layer
            "load": self.load.copy(),  # [L, E]
            "expert_seconds": self.expert_seconds.copy(),  # [L] in the experts, fwd + bwd
            "crossings": self.crossings.copy(),  # [L, D] distinct tokens sent to each DC
            "routed": [r.copy() for r in self.routed],  # per layer [N, 4] what was dispatched
            "bytes": self.bytes.copy(),  # [3, D, D] cumulative, by KINDS
            "shaped_seconds": self.shaped_seconds,
            "version": self.version,
        }


_ID = torch.int16  # expert ids on the wire (LMConfig allows 4096 experts)


def _route_rows(rank: int, experts: np.ndarray, dst: np.ndarray, num_ranks: int) -> np.ndarray:
    """[N, 4] rows ``(rank, expert, dst_rank, assignments)`` of what ``rank`` dispatched:
    ``experts`` and ``dst`` [m] per assignment."""
    key, count = np.unique(experts.astype(np.int64) * num_ranks + dst, return_counts=True)
    rows = np.empty((key.size, 4), np.int64)
    rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3] = rank, key // num_ranks, key % num_ranks, count
    return rows


def _cat(ts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(ts) if ts else torch.zeros(0, dtype=dtype)


def _zeros_state(w: ExpertWeights) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.zeros_like(t) for t in w], [torch.zeros_like(t) for t in w]
