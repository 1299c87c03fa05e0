"""The expert-parallel MoE layer as a ``torch.nn.Module`` any ``torch.distributed`` job can use.

:class:`MoELayer` runs, on every rank at once (SPMD), for ``u`` [n, d]:

1. gate: top-k over a linear router, weights a softmax over the k chosen logits; the exact
   per-expert ``counts`` [E] of this rank go to ``on_counts`` (load reports);
2. destinations: each assignment (token, expert) goes to a rank holding the expert, split
   by the committed route's shares (:func:`~expertmesh.workers.moe.assign_destinations`);
   with the fast loop (``balance``, ``spread``), the world's exact counts are all-gathered
   instead and every rank makes the same split by DC (:mod:`expertmesh.workers.dcspread`
   over :func:`~expertmesh.planner.dcsplit.split_dcs`): a token whose DC holds its expert stays
   home, the others cross to the holders so that the DCs' tokens per rank even out;
   ``fused`` (the default), the all-gather is also the dispatch's sizes exchange: every
   rank reads what it receives off the split, so the layer has one WAN round trip before
   the tokens move, as with the route's DCs (a crossing bundle then carries one row per
   assignment, since the distinct tokens of another rank's bundle are not known);
3. dispatch, hierarchical (the NVIDIA Hybrid-EP structure): a token crosses each DC pair
   once, to the *relay* of the remote DC (:func:`~expertmesh.workers.moe.relay_rank`),
   which fans it out inside its DC (stage A over the world group, stage B over the DC's);
4. experts: with the fast loop, the DC's exact counts and one quota solve
   (:mod:`expertmesh.workers.balance`) pick the rank of the DC that computes each
   assignment, fetching replica weights inside the DC
   (:mod:`expertmesh.workers.replicas`) while the held experts compute; each rank computes
   the experts it holds, then the fetched copies, on what it received;
5. combine: results travel back the same way, summed per token at the relay before they
   cross back, and are summed into ``y`` [n, d] at the source.

Every float transfer is one :func:`~expertmesh.workers.comm.exchange`, so autograd's
backward sends gradients back over the same groups, in the reverse order, on every rank
alike; expert parameters get their gradients where they live. The layer holds the
weights of the experts its rank holds (``experts[e]``: W1, W3, W2 parameters) and the
committed placement (:class:`LayerPlan`); plans change between steps
(:meth:`MoELayer.set_plan`).

Shapes: ``n`` tokens, ``k`` top-k, ``d`` hidden, ``E`` experts, ``R`` ranks, ``m``
assignments, ``u`` distinct tokens of a bundle.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from expertmesh.workers.balance import DomainBase, solve
from expertmesh.workers.bundles import ix, lengths, pack, unpack
from expertmesh.workers.comm import Comm, exchange
from expertmesh.workers.dcspread import (
    can_spread,
    dc_holders,
    relay_sizes,
    relayed_sources,
    spread,
)
from expertmesh.workers.layerplan import LayerPlan
from expertmesh.workers.model import ExpertWeights, expert_forward
from expertmesh.workers.moe import assign_destinations, relay_rank
from expertmesh.workers.replicas import ReplicaFetch

__all__ = ["LayerPlan", "MoELayer"]

_META = 3  # int32 per assignment in stage A: (row, expert, destination rank)
_META_B = 2  # in stage B: (row, expert)


class MoELayer(nn.Module):
    """Gate, dispatch, experts, combine; see the module docstring.

    ``gate``: the router (``nn.Linear(d, E, bias=False)``; shared with a dense model when
    given). ``experts``: initial weights of the experts this rank holds under ``plan``
    (W1, W3 [d, ffn_hidden], W2 [ffn_hidden, d]). ``balance``: the fast loop (quota inside
    the DC on the exact counts of every microbatch, :mod:`expertmesh.workers.balance`)
    decides which rank of the DC computes each assignment, instead of the plan's route;
    with ``spread`` (and ``balance``) it also picks, every microbatch, which holding DC
    computes each token that must cross (:func:`~expertmesh.planner.dcsplit.split_dcs` on
    the world's all-gathered counts, which then stand in for the DC's own all-gather), to
    the cheapest holders by the link shaper's bandwidths when it has them. ``fused``
    (with ``spread``): no sizes exchange after the split (:meth:`_relay_sizes`); off: the
    sizes are exchanged and each token crosses a DC pair once.
    """

    def __init__(
        self,
        comm: Comm,
        plan: LayerPlan,
        experts: dict[int, ExpertWeights],
        *,
        top_k: int,
        ffn_hidden: int,
        gate: nn.Linear,
        on_counts: Callable[[np.ndarray], None] | None = None,
        balance: bool = False,
        spread: bool = True,
        fused: bool = True,
    ) -> None:
        super().__init__()
        self.comm, self.top_k, self.gate, self.ffn_hidden = comm, top_k, gate, ffn_hidden
        self.balance = balance  # the fast loop: quota inside the DC every microbatch
        self.spread = spread  # with it: crossing tokens' DCs from the world's exact counts
        self.fused = fused  # with it: the counts all-gather is the dispatch's sizes exchange
        self.num_experts = gate.out_features
        self.on_counts = on_counts
        self.experts = nn.ParameterDict()
        self.plan = plan
        self.set_experts(experts)
        self._bases()
        # the fast loop's replica weights fetched inside the DC for this microbatch
        self.replica_fetch = ReplicaFetch(gate.in_features, ffn_hidden)
        self.replicas = 0  # replicas the fast loop added in the last forward (this DC)
        self.balance_seconds = 0.0  # counts exchange + solve + starting the fetch, last forward
        self.counts = np.zeros(self.num_experts, np.int64)  # of the last forward
        self.computed = 0  # assignments this rank computed in the last forward
        self.crossings = np.zeros(comm.num_dcs, np.int64)  # distinct tokens sent per DC
        self.routed = np.zeros((0, 4), np.int64)  # [N, 4] (rank, expert, dst, assignments)
        self.expert_seconds = 0.0
        self.spread_seconds = 0.0  # split by DC (+ the world counts all-gather unless fused)
        self.counts_seconds = 0.0  # the world counts all-gather, last forward
        self.floor = 1.0  # the split's max DC tokens per rank / mean, last forward
        self._dc_counts: np.ndarray | None = None  # [Rd, E] this DC's, from the split
        self._split: np.ndarray | None = None  # [R, E, D] the split, when fused

    # ---- the experts this rank holds ----

    def set_experts(self, experts: dict[int, ExpertWeights]) -> None:
        """Hold exactly ``experts`` (e -> W1, W3, W2); tensors become parameters."""
        for key in list(self.experts.keys()):
            del self.experts[key]
        for e, w in sorted(experts.items()):
            for i, t in enumerate(w):
                self.experts[f"{e}_{i}"] = nn.Parameter(t.detach().clone().to(self.comm.device))

    def expert(self, e: int) -> ExpertWeights:
        p = self.experts
        return p[f"{e}_0"], p[f"{e}_1"], p[f"{e}_2"]

    def held(self) -> list[int]:
        return sorted({int(k.split("_")[0]) for k in self.experts})

    @property
    def temp(self) -> dict[int, ExpertWeights]:
        """This microbatch's fetched replicas (expert -> weights)."""
        return self.replica_fetch.temp

    @property
    def fanout_bytes(self) -> int:
        """Replica weights this rank sent in the last forward."""
        return self.replica_fetch.fanout_bytes

    @property
    def fetch_wait_seconds(self) -> float:
        """Waiting for replica weights not hidden by compute, last forward."""
        return self.replica_fetch.wait_seconds

    def return_replica_grads(self) -> None:
        """After the backward: the gradients of this microbatch's fetched replicas go back
        to the home they came from and add into its gradient (then the slow loop's
        reduction carries them to the master)."""
        self.replica_fetch.return_grads(self.comm, self.expert)

    def set_plan(self, plan: LayerPlan, experts: dict[int, ExpertWeights]) -> None:
        """Switch to ``plan``; ``experts``: the weights of every expert it gives this rank."""
        want = plan.held_by(self.comm.rank)
        if sorted(experts) != want:
            raise ValueError(f"rank {self.comm.rank} needs experts {want}, got {sorted(experts)}")
        self.plan = plan
        self.set_experts(experts)
        self._bases()

    def rebind(self, comm: Comm) -> None:
        """Use ``comm``'s process groups from now on (after the groups re-formed)."""
        self.comm = comm
        self._bases()

    def _bases(self) -> None:
        """What the plan and the live ranks fix for every microbatch: whether tokens may
        cross, this DC's base, each DC's holders ([D, E]: the lowest live rank holding the
        expert, -1 none) and the cost per byte between DCs (the shaper's, else equal)."""
        c, plan = self.comm, self.plan
        self.cross = plan.crosses(c.rank_dc)
        self.base = DomainBase.of(plan.placement, c.dc_ranks[c.dc])
        self.dc_holder = dc_holders(plan.holds, c.dc_ranks)  # [D, E]
        self.can_spread = can_spread(self.dc_holder, c.dc_ranks)
        self.dc_cost = None
        if c.shaper is not None:
            bw = np.asarray(c.shaper.bandwidth_Bps, dtype=np.float64)
            self.dc_cost = np.where(np.eye(c.num_dcs, dtype=bool), 0.0, 1.0 / bw)
        # (world index, rank) of the other DCs' ranks whose bundles for this DC relay here
        self.relayed = relayed_sources(c)

    # ---- forward ----

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """``u`` [n, d] -> ``y`` [n, d] = sum_j w[t, j] * expert_{idx[t, j]}(u[t])."""
        logits = self.gate(u)  # [n, E]
        top, idx = torch.topk(logits, self.top_k, dim=-1)
        w = torch.softmax(top, dim=-1)  # [n, k]
        idx_np = idx.detach().cpu().numpy()
        self.counts = np.bincount(idx_np.reshape(-1), minlength=self.num_experts)
        if self.on_counts is not None:
            self.on_counts(self.counts)
        c = self.comm
        self._dc_counts, self._split, self.spread_seconds = None, None, 0.0
        self.counts_seconds = 0.0
        if self.balance and self.spread and self.cross and self.can_spread:
            dst = self._spread(idx_np).reshape(-1)
        else:
            dst = assign_destinations(
                c.rank, idx_np, self.plan.route, self.plan.holds, c.rank_dc
            ).reshape(-1)
        flat_e = idx_np.reshape(-1)
        key, num = np.unique(flat_e.astype(np.int64) * len(c.rank_dc) + dst, return_counts=True)
        self.routed = np.stack(
            [np.full_like(key, c.rank), key // len(c.rank_dc), key % len(c.rank_dc), num], 1
        )
        return self._dispatch_combine(u, w.reshape(-1), flat_e, dst)

    def _spread(self, idx: np.ndarray) -> np.ndarray:
        """Destinations of this rank's assignments ``idx`` [n, k] by the world's split by DC
        (:mod:`expertmesh.workers.dcspread`); keeps this DC's counts after the dispatch for
        :meth:`_balance` and, fused, the split for the dispatch's sizes."""
        sp = spread(self.comm, self.counts, idx, self.dc_holder, self.dc_cost, fused=self.fused)
        self.floor, self._dc_counts, self._split = sp.floor, sp.dc_counts, sp.tokens
        self.counts_seconds, self.spread_seconds = sp.counts_seconds, sp.seconds
        return sp.dst

    def _dispatch_combine(
        self, u: torch.Tensor, w: torch.Tensor, flat_e: np.ndarray, dst: np.ndarray
    ) -> torch.Tensor:
        c, dev = self.comm, self.comm.device
        n, d = u.shape
        k = self.top_k
        tok = np.repeat(np.arange(n), k)  # [n*k] token of each assignment
        world = c.world
        # stage A: one bundle per DC, to its relay (this rank itself for its own DC)
        bundles: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        dst_dc = c.rank_dc[dst]
        self.crossings[:] = 0
        fused = self._split is not None
        for b in np.unique(dst_dc).tolist():
            a_ids = np.flatnonzero(dst_dc == b)
            if fused and b != c.dc:  # one row per assignment: sizes known from the split
                uniq, pos = tok[a_ids], np.arange(a_ids.size)
            else:
                uniq, pos = np.unique(tok[a_ids], return_inverse=True)
            relay = c.rank if b == c.dc else relay_rank(c.rank, b, c.rank_dc)
            bundles[world.index[relay]] = (uniq, a_ids, pos)
            if b != c.dc:
                self.crossings[b] = uniq.size
        sizes = np.zeros((world.size, 2), np.int64)
        for i, (uniq, a_ids, _) in bundles.items():
            sizes[i] = (uniq.size, a_ids.size)
        if not self.cross and set(bundles) - {world.index[c.rank]}:
            raise ValueError(
                f"rank {c.rank}: tokens leave the DC under a plan that keeps them home"
            )
        # [G, 2] (tokens, assignments) from each rank; a plan that keeps tokens home: mine;
        # fused: what the split sends to this rank as relay (no sizes exchange)
        if fused:
            assert self._split is not None
            got = relay_sizes(c, self._split, self.relayed, sizes)
        else:
            got = c.exchange_counts(sizes, world) if self.cross else sizes
        order = sorted(bundles)
        out = [
            (uniq, a_ids, np.stack([pos, flat_e[a_ids], dst[a_ids]], 1))
            for uniq, a_ids, pos in (bundles[i] for i in order)
        ]
        parts = pack(u, w, out, dev)
        send, recv = lengths(sizes, d, _META), lengths(got, d, _META)
        flat = torch.cat(parts) if parts else u.reshape(-1)[:0]  # empty, still in the graph
        got_a = exchange(flat, c, send, recv, world, "tokens") if self.cross else flat
        # what each source sent to this rank (as relay of its DC): x_in [U, d] the tokens
        # this relay holds, w_in [M]; per assignment its row of x_in, expert, destination
        x_in, w_in, meta = unpack(got_a, got, d, _META)
        pos_in, e_in, dst_in = np.ascontiguousarray(meta.T)
        self.replicas, self.balance_seconds = 0, 0.0
        self.replica_fetch.clear_stats()
        if self.balance:
            dst_in = self._balance(e_in)
        z = self._fan_out(x_in, w_in, pos_in, e_in, dst_in)  # [U, d] summed per token
        # combine A: each source's rows back to it
        back = [int(g[0]) * d for g in got]
        y_parts = (
            exchange(z.reshape(-1), c, back, [int(s[0]) * d for s in sizes], world, "tokens")
            if self.cross
            else z.reshape(-1)
        )
        # one index_add over every bundle's rows: ``y`` depends on the exchange even when
        # nothing came back, so every rank's backward runs the same collectives
        rows = np.concatenate([bundles[i][0] for i in order] + [np.zeros(0, np.int64)])
        return u.new_zeros(n, d).index_add(0, ix(rows, dev), y_parts.reshape(-1, d))

    def _balance(self, experts: np.ndarray) -> np.ndarray:
        """The fast loop on this relay's assignments ``experts`` [M] (token order): the DC's
        exact counts, the same quota solve on every rank, replica weights fetched; returns
        the destination rank of each assignment."""
        t0 = time.perf_counter()
        c, base = self.comm, self.base
        grp = c.my_dc
        mine = np.bincount(experts, minlength=self.num_experts)
        if self._dc_counts is None:
            counts = c.all_gather_rows(mine, grp)  # [Rd, E]
        else:  # the world's split says what every rank of this DC holds now
            counts = self._dc_counts
            if not np.array_equal(counts[grp.index[c.rank]], mine):
                raise ValueError(f"rank {c.rank}: the tokens that arrived differ from the split")
        step = solve(counts, base)
        self.replicas = int(step.replicas.shape[0])
        self.replica_fetch.start(c, step.fetch, self.expert)
        i = grp.index[c.rank]
        rows = step.route[step.route[:, 0] == i]
        dst = np.empty(experts.size, np.int64)
        order = np.argsort(experts, kind="stable")
        starts = np.searchsorted(experts[order], np.arange(self.num_experts + 1))
        for e in np.unique(experts).tolist():
            r = rows[rows[:, 1] == e]
            ids = order[starts[e] : starts[e + 1]]
            dst[ids] = base.ranks[np.repeat(r[:, 2], r[:, 3])]
        self.balance_seconds = time.perf_counter() - t0 + self.spread_seconds
        return dst

    def _fan_out(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        pos: np.ndarray,
        experts: np.ndarray,
        dst: np.ndarray,
    ) -> torch.Tensor:
        """Stage B inside this rank's DC: the relay's tokens ``x`` [U, d] to the ranks that
        compute them (``pos``, ``experts``, ``dst``, ``w`` [M] per assignment); returns the
        results summed per token [U, d]."""
        c, dev = self.comm, self.comm.device
        d = x.shape[1]
        grp = c.my_dc
        per: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for q in np.unique(dst).tolist():
            sel = np.flatnonzero(dst == q)
            uniq, p = np.unique(pos[sel], return_inverse=True)
            per[grp.index[q]] = (uniq, sel, p)
        sizes = np.zeros((grp.size, 2), np.int64)
        for i, (uniq, sel, _) in per.items():
            sizes[i] = (uniq.size, sel.size)
        got = c.exchange_counts(sizes, grp)
        out = [
            (uniq, sel, np.stack([p, experts[sel]], 1))
            for uniq, sel, p in (per[i] for i in sorted(per))
        ]
        parts = pack(x, w, out, dev)
        send, recv = lengths(sizes, d, _META_B), lengths(got, d, _META_B)
        flat = torch.cat(parts) if parts else x.reshape(-1)[:0]  # empty, still in the graph
        got_b = exchange(flat, c, send, recv, grp, "tokens")
        xq, wq, meta = unpack(got_b, got, d, _META_B)
        pos_q, e_q = np.ascontiguousarray(meta.T)
        yq = self._compute(xq, wq, pos_q, e_q)
        # combine B: results back to each relay, summed there per token
        back = exchange(
            yq.reshape(-1), c, [int(g[0]) * d for g in got], [int(s[0]) * d for s in sizes],
            grp, "tokens",
        )  # fmt: skip
        rows = np.concatenate([per[i][0] for i in sorted(per)] + [np.zeros(0, np.int64)])
        return x.new_zeros(x.shape[0], d).index_add(0, ix(rows, dev), back.reshape(-1, d))

    def _compute(
        self, x: torch.Tensor, w: torch.Tensor, pos: np.ndarray, experts: np.ndarray
    ) -> torch.Tensor:
        """This rank's experts: ``y[t] = sum over assignments a at row t of w[a] *
        expert_{experts[a]}(x[t])``; ``x`` [u, d], ``w``/``pos``/``experts`` [m]."""
        t0 = time.perf_counter()
        # zeros that depend on ``x``: a rank computing nothing still sends its (empty)
        # gradient back through the exchange that brought ``x``, as every other rank does
        y = x * 0
        self.computed = int(experts.size)
        dev = self.comm.device
        held = set(self.held())
        mine = [e for e in np.unique(experts).tolist() if e in held]
        rest = [e for e in np.unique(experts).tolist() if e not in held]
        for e in [*mine, None, *rest]:  # held experts first, while replica weights travel
            if e is None:
                self.replica_fetch.wait()
                continue
            if e not in held and e not in self.temp:
                raise ValueError(f"rank {self.comm.rank}: tokens for expert {e}, not held here")
            ids = np.flatnonzero(experts == e)
            rows = ix(pos[ids], dev)
            weights = self.expert(e) if e in held else self.temp[e]
            out = expert_forward(x[rows], weights)  # [m_e, d]
            y = y.index_add(0, rows, w[ix(ids, dev), None] * out)
        self.expert_seconds += time.perf_counter() - t0
        return y
