"""The slow loop of ``hybrid`` (:mod:`expertmesh.planner.hybrid`), step 2: per ordered DC pair,
how many of the experts one DC uses most to copy into it, scored with the cost model's pair
equations (docs/cost-model.md), and the choice per pair under each DC's free slots."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from expertmesh.planner.costmodel import expected_crossings, pair_links
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import Placement
from expertmesh.planner.topology import Topology

if TYPE_CHECKING:
    from expertmesh.planner.hybrid import HybridSettings

__all__ = ["DcPairs", "HybridInputs", "choose_copies"]


@dataclass(frozen=True, eq=False)
class HybridInputs:
    """What one hybrid solve works on. ``estimate`` [R, E] mean load, ``load`` [R, E] it
    rounded to tokens (what the guard composes quota on); ``dc_load`` [D, E] estimated
    assignments from DC d to expert e; ``dc_tokens`` [D] tokens from each DC;
    ``previous``: the placement running now."""

    topology: Topology
    model: ModelSpec
    cfg: HybridSettings
    estimate: np.ndarray
    load: np.ndarray
    dc_load: np.ndarray
    dc_tokens: np.ndarray
    previous: Placement | None

    @functools.cached_property
    def fill_order(self) -> tuple[np.ndarray, np.ndarray]:
        """``(d, e)`` [n] every DC and expert it sends load to, by DC, then heaviest first
        (``dc_load``), equal loads rotated by DC (DCs pick different experts); the order of
        the guard's compute-relief fills (:func:`~expertmesh.planner.hybrid._fills`) over
        any holder sets: the pairs a DC does not hold, in this order (a stable sort, so
        the same as sorting those alone)."""
        num_dcs, num_experts = self.dc_load.shape
        d, e = np.nonzero(self.dc_load > 0)
        rot = (e - d * num_experts // num_dcs) % num_experts
        o = np.lexsort((rot, -self.dc_load[d, e], d))
        return d[o], e[o]


def _link_time(nbytes: np.ndarray, lat: np.ndarray, bw: np.ndarray) -> np.ndarray:
    return np.where(nbytes > 0, lat + nbytes / bw, 0.0)


class DcPairs:
    """Every ordered DC pair ``(d, x)``: DC ``d``'s estimated assignments to the experts
    mastered in DC ``x``, those experts sorted by that load (heaviest first), and the
    cost-model score of copying the ``j`` heaviest into ``d``, for every ``j``.

    ``mdc`` [E] DC of each master; ``held_before`` [D, E] copies already in place (they
    cost no copy). Row arrays ([n], one per (pair, expert), sorted by pair then load):
    ``dc``, ``expert``, ``group`` (pair id), ``j`` (1-based position in the pair).
    """

    def __init__(self, inp: HybridInputs, mdc: np.ndarray, held_before: np.ndarray) -> None:
        self.inp = inp
        num_dcs = inp.dc_load.shape[0]
        d_idx, e_idx = np.nonzero(inp.dc_load > 0)
        keep = mdc[e_idx] != d_idx
        d_idx, e_idx = d_idx[keep], e_idx[keep]
        x_idx = mdc[e_idx]
        weight = inp.dc_load[d_idx, e_idx]
        order = np.lexsort((-weight, x_idx, d_idx))
        self.dc, self.expert = d_idx[order], e_idx[order]
        x_idx, weight = x_idx[order], weight[order]
        key = self.dc * num_dcs + x_idx
        start = np.r_[True, key[1:] != key[:-1]] if key.size else np.zeros(0, bool)
        self.group = np.cumsum(start) - 1
        self.first = np.flatnonzero(start)  # [G] first row of each pair
        self.num_groups = self.first.size
        self.j = np.arange(self.group.size) - self.first[self.group] + 1
        self.g_dc, self.g_x = self.dc[self.first], x_idx[self.first]
        self.total = np.bincount(self.group, weights=weight, minlength=self.num_groups)
        self.remaining = self.total[self.group] - _cumsum_in(weight, self.group, self.first)
        cfg, model = inp.cfg, inp.model
        copy = np.where(
            held_before[self.dc, self.expert], 0.0, cfg.encoding.copy_bytes(model, False)
        )
        self.copy = _cumsum_in(copy / cfg.period, self.group, self.first)  # amortized
        g_key = self.g_dc * num_dcs + self.g_x
        rev_key = self.g_x * num_dcs + self.g_dc
        at = np.minimum(np.searchsorted(g_key, rev_key), max(self.num_groups - 1, 0))
        self.rev = np.where(g_key[at] == rev_key, at, -1) if self.num_groups else at
        topo = inp.topology
        bw, lat = pair_links(topo)
        self.bw, self.lat = bw[self.g_dc, self.g_x], lat[self.g_dc, self.g_x]  # [G]
        per = float(cfg.cost.microbatches_per_update)
        self.w = cfg.encoding.refresh_bytes(model) / per if model.training else 0.0
        self.g = cfg.encoding.gradient_bytes(model) / per if model.training else 0.0
        # what every scoring shares: the option rows' order, by (pair, j)
        o_group = np.concatenate([np.arange(self.num_groups), self.group])
        o_j = np.concatenate([np.zeros(self.num_groups, np.int64), self.j])
        self.order = np.lexsort((o_j, o_group))
        # every option row's inputs, j = 0 rows first (as ``o_group``), scored in one pass:
        # crossing bytes with no copy ([G]) and after each prefix ([n])
        self.o_x = np.concatenate(
            [self._bytes(self.total, self.g_dc), self._bytes(self.remaining, self.dc)]
        )
        self.o_copy = np.concatenate([np.zeros(self.num_groups), self.copy])
        self.o_j, self.o_group = o_j, o_group
        o_exp = np.concatenate([np.full(self.num_groups, -1), self.expert])
        self.rows = {
            "group": o_group[self.order],
            "j": o_j[self.order],
            "expert": o_exp[self.order],
            "dc": self.g_dc[o_group[self.order]],
            "group_dc": self.g_dc.copy(),
            "starts": np.flatnonzero(
                np.r_[True, o_group[self.order][1:] != o_group[self.order][:-1]]
            ),
        }
        for a in self.rows.values():
            a.setflags(write=False)  # every options() call returns them

    def state(self, j_cur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per pair under choice ``j_cur`` [G]: crossing bytes and amortized copy bytes."""
        row = self.first + np.maximum(j_cur, 1) - 1
        rem = np.where(j_cur > 0, self.remaining[np.minimum(row, self.j.size - 1)], self.total)
        copy = np.where(j_cur > 0, self.copy[np.minimum(row, self.j.size - 1)], 0.0)
        return self._bytes(rem, self.g_dc), copy

    def _bytes(self, remaining: np.ndarray, dcs: np.ndarray) -> np.ndarray:
        k, tb = self.inp.model.top_k, float(self.inp.model.token_bytes)
        if not self.inp.cfg.cost.hierarchical:  # flat all-to-all: every assignment crosses
            return np.asarray(remaining, dtype=np.float64) * tb
        return expected_crossings(self.inp.dc_tokens[dcs], remaining, k) * tb

    def options(self, j_cur: np.ndarray | None) -> dict[str, np.ndarray]:
        """Score every prefix of every pair, the reverse pair held at ``j_cur`` [G]
        (``None``: each pair alone, as if the reverse pair sent nothing).

        Returns option rows sorted by (pair, j): ``group``, ``j``, ``cost`` (seconds),
        ``expert`` (-1 for j = 0), ``dc``; and ``group_dc`` [G]."""
        if j_cur is None:
            z = np.zeros(self.num_groups)
            rev: tuple[np.ndarray, np.ndarray, np.ndarray] = (z, z.astype(np.int64), z)
            return self._options(rev)
        xb, cb = self.state(j_cur)
        has_rev = self.rev >= 0
        rv = np.maximum(self.rev, 0)
        rev_x = np.where(has_rev, xb[rv], 0.0)  # reverse pair's crossing bytes
        rev_j = np.where(has_rev, j_cur[rv], 0)
        rev_c = np.where(has_rev, cb[rv], 0.0)
        return self._options((rev_x, rev_j, rev_c))

    def _options(self, rev: tuple[np.ndarray, np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
        # the j = 0 rows (no copy: x0, j 0, copy 0.0) and the prefixes in one pass of
        # element-wise operations: each row's floats as scored alone
        cost = self._score(self.o_x, self.o_j, self.o_copy, self.o_group, rev)
        return {**self.rows, "cost": cost[self.order]}

    def _score(
        self,
        x: np.ndarray,
        j: np.ndarray,
        copy: np.ndarray,
        gi: np.ndarray,
        rev: tuple[np.ndarray, np.ndarray, np.ndarray],
    ) -> np.ndarray:
        """docs/cost-model.md restricted to the two links of one DC pair: ``x`` crossing
        bytes of this pair's tokens, ``j`` copies (``copy`` amortized copy bytes)."""
        bw, lat = self.bw[gi], self.lat[gi]
        rx, rj, rc = rev[0][gi], rev[1][gi], rev[2][gi]
        tok = np.maximum(_link_time(x, lat, bw), _link_time(rx, lat, bw))
        both = x + rx
        if not self.inp.model.training:
            return np.maximum(2 * tok, (both + np.maximum(copy, rc)) / bw)
        w, g = self.w, self.g
        if self.inp.cfg.cost.microbatches_per_update == 1:
            tail = np.maximum(_link_time(x + rj * g, lat, bw), _link_time(rx + j * g, lat, bw))
        else:
            tail = tok
        chain = 3 * tok + tail
        out_link = 2 * both + j * g + rj * w + rc  # d -> x
        in_link = 2 * both + j * w + copy + rj * g  # x -> d
        return np.maximum(chain, np.maximum(out_link, in_link) / bw)


def _cumsum_in(v: np.ndarray, group: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Inclusive prefix sums of ``v`` [n] restarting at each group's first row."""
    if v.size == 0:
        return v.astype(np.float64)
    c = np.cumsum(v, dtype=np.float64)
    return c - (c[first] - v[first])[group]


def choose_copies(opts: dict[str, np.ndarray], free: np.ndarray) -> np.ndarray:
    """[G] copies per pair: each pair's fastest prefix, or, in a DC without the slots for
    all of them, the fewest copies that keep every pair of the DC under the smallest
    feasible threshold (bisection per DC over the DC's option costs)."""
    group, j, cost, odc = opts["group"], opts["j"], opts["cost"], opts["dc"]
    group_dc = opts["group_dc"]
    num_groups = group_dc.size
    if num_groups == 0:
        return np.zeros(0, np.int64)
    starts = opts.get("starts")  # each pair's first row (every pair has its j = 0 row)
    if starts is None:
        starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    # fastest prefix per pair (ties: fewer copies; options are sorted by j)
    best = np.minimum.reduceat(cost, starts)
    is_best = cost <= best[group] * (1 + 1e-12)
    pick = np.minimum.reduceat(np.where(is_best, j, np.iinfo(np.int64).max), starts)
    num_dcs = free.size
    need = np.bincount(group_dc, weights=pick, minlength=num_dcs)
    tight = need > free
    if not tight.any():
        return pick

    def minimal_j(thr: np.ndarray) -> np.ndarray:
        ok = cost <= thr[odc]
        jj = np.where(ok, j, np.iinfo(np.int64).max)
        return np.minimum.reduceat(jj, starts)

    # per tight DC, bisection over its sorted option costs
    sel = tight[odc]
    c_dc, c_cost = odc[sel], cost[sel]
    srt = np.lexsort((c_cost, c_dc))
    c_dc, c_cost = c_dc[srt], c_cost[srt]
    seg_start = np.searchsorted(c_dc, np.arange(num_dcs), "left")
    seg_end = np.searchsorted(c_dc, np.arange(num_dcs), "right")
    lo, hi = seg_start.copy(), seg_end - 1  # index of candidate thresholds
    big = np.iinfo(np.int64).max
    while True:
        active = tight & (lo < hi)
        if not active.any():
            break
        mid = (lo + hi) // 2
        thr = np.full(num_dcs, np.inf)
        thr[active] = c_cost[mid[active]]
        mj = minimal_j(thr)
        over = np.bincount(group_dc, weights=np.where(mj == big, 1e18, mj), minlength=num_dcs)
        feasible = over <= free
        hi = np.where(active & feasible, mid, hi)
        lo = np.where(active & ~feasible, mid + 1, lo)
    thr = np.full(num_dcs, np.inf)
    thr[tight] = c_cost[np.maximum(hi[tight], seg_start[tight])]
    mj = minimal_j(thr)
    out = np.where(tight[group_dc], np.where(mj == big, 0, mj), pick)
    return out.astype(np.int64)
