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

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from expertmesh.planner.plan import Placement
from expertmesh.workers.bundles import unflatten
from expertmesh.workers.comm import KINDS, Comm
from expertmesh.workers.hops import HopCache, Transfer
from expertmesh.workers.layer import LayerPlan, MoELayer
from expertmesh.workers.model import ExpertWeights
from expertmesh.workers.moe import adam_
from expertmesh.workers.wire import WireFormat

__all__ = ["ExpertParallel", "Pending", "Transfer"]

State = tuple[list[torch.Tensor], list[torch.Tensor]]  # Adam (m, v) of an expert's tensors


@dataclass(eq=False)
class Pending:
    """A plan being prepared in the background (:meth:`ExpertParallel.prepare`): its
    ``plans`` per layer, ``wire`` format, the moved masters' state in flight on the world's
    second group (``got`` valid after ``work.wait()``; ``incoming`` the (layer, expert)
    keys in arrival order; ``arrive`` the link shaper's arrival times of this rank's
    sends), ``had`` [L] of [R, E]: the committed plan's holders, ``sent`` [D, D] bytes this
    rank sent in the background."""

    version: int
    plans: list[LayerPlan]
    wire: WireFormat
    had: list[np.ndarray]
    incoming: list[tuple[int, int]]
    got: torch.Tensor | None
    work: Any
    arrive: list[float]
    sent: np.ndarray
    prepare_seconds: float
    wait_seconds: float = 0.0
    landed: dict[tuple[int, int], tuple[list[torch.Tensor], ...]] = field(default_factory=dict)


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
        self.pending: Pending | None = None  # a plan prepared in the background
        self.switched: dict[str, Any] | None = None  # the switch the last step made
        self._hop_cache = HopCache([moe.num_experts for moe in layers])

    def rebind(self, comm: Comm) -> None:
        """Use ``comm``'s groups from now on; a plan in preparation is dropped (its transfer
        ran on the old groups; :meth:`prepare` it again)."""
        self.comm = comm
        self.cancel()

    def cancel(self) -> None:
        """Drop the plan in preparation, if any (after a failed step: it is prepared again)."""
        self.pending = None

    def _hops(self, old: list[LayerPlan], new: list[LayerPlan]) -> list[list[Transfer]]:
        """The step's four hops (:func:`~expertmesh.workers.hops.plan_hops`), remembered."""
        return self._hop_cache.hops(self.comm, old, new)

    def step(self, world_counts: np.ndarray) -> None:
        """After the backward: replica gradients into masters (inside the DC to the DC's lead
        holder, then once per DC over the WAN), Adam on the masters of experts some token
        reached (``world_counts`` [L, E] > 0, the world's assignments), fresh weights back to
        every replica (once per DC, then fanned out).

        With a plan prepared (:meth:`prepare`), this step is its switch: the gradients of
        the copies that computed under the committed plan go to the *new* plan's masters
        (a moved master's weights and Adam state arrived in the background), which step
        Adam, and the refresh fills the new plan's copies; then every layer switches. Only
        the refresh of the new copies moves at the boundary (it would run anyway: fresh
        weights must follow the last Adam step)."""
        self.opt_step += 1
        self.switched = None
        c, pend = self.comm, self.pending
        landed = self._land(pend) if pend is not None else {}
        old = [moe.plan for moe in self.layers]
        new = pend.plans if pend is not None else old
        hops = self._hops(old, new)
        acc: dict[tuple[int, int], list[torch.Tensor]] = {}
        for layer, moe in enumerate(self.layers):
            for e in moe.held():
                acc[(layer, e)] = [
                    p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                    for p in moe.expert(e)
                ]
        for hop in hops[:2]:
            for key, g in self._send(hop, lambda k: acc[k], self.wire.grads):
                mine = acc.get(key) or [torch.zeros_like(t) for t in g]
                acc[key] = [a + b.float() for a, b in zip(mine, g, strict=True)]
        # the masters of the plan in force after this step: weights and Adam state
        masters: dict[tuple[int, int], tuple[Any, State]] = {}
        for layer, (moe, plan) in enumerate(zip(self.layers, new, strict=True)):
            for e in np.flatnonzero(plan.master_rank == c.rank).tolist():
                if (layer, e) in landed:
                    w, m1, m2 = landed[(layer, e)]
                    masters[(layer, e)] = (w, (m1, m2))
                else:
                    masters[(layer, e)] = (list(moe.expert(e)), self.opt[layer][e])
        for (layer, e), (w, (m1, m2)) in masters.items():
            if world_counts[layer, e] == 0:
                continue
            g = acc.get((layer, e)) or [torch.zeros_like(t) for t in w]
            for p, gp, mom, var in zip(w, g, m1, m2, strict=True):
                adam_(p, gp, mom, var, self.opt_step, self.lr)
        fresh: dict[tuple[int, int], list[torch.Tensor]] = {}

        def weights(k: tuple[int, int]) -> list[torch.Tensor]:
            if k in fresh:
                return fresh[k]  # a DC's lead forwards what crossed the WAN
            return list(masters[k][0])

        wire = pend.wire if pend is not None else self.wire
        for hop in hops[2:]:
            fresh.update(self._send(hop, weights, wire.weights))
        if pend is None:
            with torch.no_grad():
                for (layer, e), ws in fresh.items():
                    for p, f in zip(self.layers[layer].expert(e), ws, strict=True):
                        p.copy_(f)
            return
        self._switch(pend, masters, fresh, hops, self._hops(old, old))

    def _switch(
        self,
        pend: Pending,
        masters: dict[tuple[int, int], tuple[Any, State]],
        fresh: dict[tuple[int, int], list[torch.Tensor]],
        hops: list[list[Transfer]],
        usual: list[list[Transfer]],
    ) -> None:
        """Commit ``pend`` on this rank: every layer holds the new plan's copies. ``hops``:
        the switch's; ``usual``: the committed plan's own (what a step without a switch
        sends), to count what the switch added."""
        t0 = time.perf_counter()
        c = self.comm
        for layer, (moe, plan) in enumerate(zip(self.layers, pend.plans, strict=True)):
            mine: dict[int, ExpertWeights] = {}
            for e in plan.held_by(c.rank):
                if (layer, e) in masters:
                    mine[e] = tuple(masters[(layer, e)][0])
                elif (layer, e) in fresh:
                    mine[e] = tuple(t.float() for t in fresh[(layer, e)])  # type: ignore[assignment]
                else:
                    raise ValueError(f"rank {c.rank} lacks expert {e} of layer {layer}")
            moe.set_plan(plan, mine)
            self.opt[layer] = {e: st for (lyr, e), (_, st) in masters.items() if lyr == layer}
        # what the boundary moved for the plan: its refresh's bytes beyond those of the
        # committed plan's refresh, which a step without a switch sends (signed, [D, D])
        per = sum(int(np.prod(t.shape)) for t in self._shapes()) * pend.wire.weights.itemsize
        usual_per = sum(int(np.prod(t.shape)) for t in self._shapes()) * self.wire.weights.itemsize
        boundary = np.zeros((c.num_dcs, c.num_dcs), np.int64)
        for hop_list, nbytes, sign in ((hops, per, 1), (usual, usual_per, -1)):
            for _, _, src, dst, _ in hop_list[2] + hop_list[3]:
                if src == c.rank:
                    boundary[c.rank_dc[src], c.rank_dc[dst]] += sign * nbytes
        self.wire, self.version, self.pending = pend.wire, pend.version, None
        self.switched = {
            "version": pend.version,
            "mode": "background",
            "prepare_seconds": pend.prepare_seconds,
            "wait_seconds": pend.wait_seconds,
            "seconds": pend.prepare_seconds + pend.wait_seconds + time.perf_counter() - t0,
            "background_bytes": pend.sent.tolist(),
            "boundary_bytes": boundary.tolist(),
        }

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
        pieces = unflatten(got, shapes, len(incoming), clone=False)
        return [(key, ts) for (_, key), ts in zip(incoming, pieces, strict=True)]

    def _shapes(self) -> ExpertWeights:
        d, f = self.hidden, self.ffn_hidden
        return torch.empty(d, f), torch.empty(d, f), torch.empty(f, d)

    # ---- plans ----

    def prepare(
        self,
        version: int,
        layers: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        wire: WireFormat | None = None,
    ) -> None:
        """Start switching to plan ``version`` (every rank at once, at a step boundary they
        agree on); per layer ``(phy2log [R, S], master [E], route [N, 4])``. What can move
        ahead moves now, in the background on the world's second group while training goes
        on: each moved master's float32 weights and Adam state, from the old master, as they
        are after this boundary's Adam step. The next :meth:`step` is the switch: its
        gradients go to the new masters, which step Adam themselves (so the state that
        arrived stays exact), and its refresh fills the new copies (so nothing stale is
        switched to). No token reaches a copy before that switch."""
        t0 = time.perf_counter()
        c, plans = self.comm, self._new_plans(version, layers)
        moves: list[Transfer] = []
        for layer, (moe, plan) in enumerate(zip(self.layers, plans, strict=True)):
            if (plan.placement.phy2log[~c.live] >= 0).any():
                raise ValueError(
                    f"plan {version} layer {layer} has copies on ranks not taking part"
                )
            old = moe.plan.master_rank
            for e in np.flatnonzero(old != plan.master_rank).tolist():
                moves.append((layer, e, int(old[e]), int(plan.master_rank[e]), "opt"))
        flat, send, recv, incoming = self._pack_state(moves, with_weights=True)
        before = c.bytes[KINDS.index("migration")].copy()
        arrive: list[float] = []
        got, work = None, None
        if moves:  # every rank knows the same moves: all take part or none
            got, work = c.all_to_all_async(flat, send, recv, c.world_aux, "migration", arrive)
        self.pending = Pending(
            version, plans, wire or WireFormat(), [moe.plan.holds.copy() for moe in self.layers],
            incoming, got, work, arrive, c.bytes[KINDS.index("migration")] - before,
            time.perf_counter() - t0,
        )  # fmt: skip

    def _new_plans(
        self, version: int, layers: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    ) -> list[LayerPlan]:
        """Plan ``version``'s layers, checked: newer than the committed plan, none being
        prepared in the background, one per MoE layer."""
        if version <= self.version:
            raise ValueError(f"plan {version} is not newer than committed plan {self.version}")
        if self.pending is not None:
            raise ValueError(f"plan {self.pending.version} is being prepared in the background")
        if len(layers) != len(self.layers):
            raise ValueError(f"plan has {len(layers)} layers, the model {len(self.layers)}")
        return [
            LayerPlan(Placement(np.asarray(p), np.asarray(m)), np.asarray(r)) for p, m, r in layers
        ]

    def _land(self, pend: Pending) -> dict[tuple[int, int], tuple[list[torch.Tensor], ...]]:
        """Wait for ``pend``'s background transfer (the wait is exposed: it was not hidden
        by the step's compute); ``(layer, expert) -> (weights, m, v)`` that arrived here."""
        t0 = time.perf_counter()
        if pend.work is not None:
            pend.work.wait()
        self.comm.settle(max(pend.arrive, default=0.0))
        if pend.incoming:
            assert pend.got is not None
            shapes = [t.shape for t in self._shapes()] * 3
            pieces = unflatten(pend.got, shapes, len(pend.incoming), clone=True)
            for key, ts in zip(pend.incoming, pieces, strict=True):
                pend.landed[key] = (ts[:3], ts[3:6], ts[6:])
        pend.wait_seconds = time.perf_counter() - t0
        return pend.landed

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
        plans = self._new_plans(version, layers)
        wire = wire or WireFormat()
        before = self.comm.bytes[KINDS.index("migration")].copy()
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
        c = self.comm
        flat, send, recv, incoming = self._pack_state(transfers, with_weights=with_weights)
        got = c.all_to_all(flat, send, recv, c.world, "migration")
        shapes = [t.shape for t in self._shapes()] * (3 if with_weights else 2)
        pieces = unflatten(got, shapes, len(incoming), clone=True)
        return dict(zip(incoming, pieces, strict=True))

    def _pack_state(
        self, moves: list[Transfer], *, with_weights: bool
    ) -> tuple[torch.Tensor, list[int], list[int], list[tuple[int, int]]]:
        """One all-to-all's buffer of the moving masters this rank sends (their float32
        weights when ``with_weights``, then Adam's m and v), in receiver order; the send
        and receive sizes per world rank, and the (layer, expert) keys that arrive here in
        arrival order (every rank passes the same ``moves``)."""
        c = self.comm
        per = sum(int(np.prod(t.shape)) for t in self._shapes()) * (3 if with_weights else 2)
        send, recv = [0] * c.world.size, [0] * c.world.size
        parts: list[torch.Tensor] = []
        incoming: list[tuple[int, int]] = []
        for layer, e, src, dst, _ in sorted(moves, key=lambda t: (t[3], t[0], t[1])):
            if src == c.rank:
                send[c.world.index[dst]] += per
                m, v = self.opt[layer][e]
                w = list(self.layers[layer].expert(e)) if with_weights else []
                parts += [t.detach().reshape(-1) for t in (*w, *m, *v)]
        for layer, e, src, dst, _ in sorted(moves, key=lambda t: (t[2], t[0], t[1])):
            if dst == c.rank:
                recv[c.world.index[src]] += per
                incoming.append((layer, e))
        flat = torch.cat(parts) if parts else torch.zeros(0, device=c.device)
        return flat, send, recv, incoming


def _zeros(w: Any) -> State:
    return [torch.zeros_like(t.detach()) for t in w], [torch.zeros_like(t.detach()) for t in w]
