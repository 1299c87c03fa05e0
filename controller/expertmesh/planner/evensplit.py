"""The even split: :class:`~expertmesh.planner.trafficbase.TokenTraffic` of policies that
split each ``load[r, e]`` evenly among copies, without route rows.

- :func:`even_traffic`: the fast path for policies that split each ``load[r, e]`` evenly
  among the copies of ``e`` in ``r``'s domain (else evenly among all copies, or all to
  the master): the same numbers as
  :func:`~expertmesh.planner.traffic.traffic_from_route` of such a route, with
  fractional splits instead of integer rounding, in ``O(R * E + D^2 * E)`` time and no
  ``[R, R]`` or ``[N, 4]`` array.
- :func:`even_traffic_steps`: :func:`even_traffic` of many steps' loads on one
  placement, the same floats, in one pass of array operations (on a placement with one
  copy per expert, static EP, from a rank-to-rank matrix of whole tokens).

Both are re-exported by :mod:`expertmesh.planner.traffic`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from expertmesh.planner.plan import Placement
from expertmesh.planner.topology import Topology
from expertmesh.planner.trafficbase import (
    _EXACT,
    _LEVEL,
    _SHORT_RUN,
    Domain,
    TokenTraffic,
    _dc_sums,
    _dc_tokens,
    _groups,
    _level_index,
    _load_stats,
    _LoadStats,
    _node_is_dc,
    _pairs_steps,
    _rank_shell,
    _remember,
    _shell_key,
    _shell_sums,
    _whole_runs,
    level_sums,
)

__all__ = ["even_traffic", "even_traffic_steps"]


def _float_load(load: np.ndarray, stats: _LoadStats | None) -> tuple[np.ndarray, np.ndarray]:
    """``load`` as float64 [R, E] and its per-expert sums [E] (read-only when memoized)."""
    got = stats.memo.get(("float",)) if stats is not None else None
    if got is None:
        lf = load.astype(np.float64)
        got = (lf, lf.sum(axis=0))
        if stats is not None:
            for a in got:
                a.flags.writeable = False
            stats.memo[("float",)] = got
    return got  # type: ignore[return-value]


@dataclass(eq=False)
class _Copies:
    """What :func:`even_traffic` needs of a placement alone (the same for every load):
    every copy's ``rank``, ``slot``, ``expert`` [C]; ``count[j]`` [groups at level j, E]
    copies of each expert in each rank, node, DC; ``total`` [E]; and, gathered on first
    use, :meth:`k`."""

    rank: np.ndarray
    slot: np.ndarray
    expert: np.ndarray
    group: list[np.ndarray]
    count: list[np.ndarray]
    total: np.ndarray
    safe_total: np.ndarray
    gathered: dict[int, np.ndarray]
    divisors: dict[tuple[int, bool], np.ndarray] = field(default_factory=dict)
    steps: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def step_keys(self, num_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """[T * C] the (step, rank) of every copy in each of ``num_steps`` steps, and its
        :func:`~expertmesh.planner.trafficbase._shell_key` (read-only, kept per step count:
        the simulator splits a placement's steps in a few sizes)."""
        got = self.steps.get(num_steps)
        if got is None:
            num_ranks = int(self.group[0].size)
            step_rank = (np.arange(num_steps)[:, None] * num_ranks + self.rank).ravel()
            got = (step_rank, _shell_key(step_rank))
            for a in got:
                a.flags.writeable = False
            _remember(self.steps, num_steps, got, 4)
        return got

    def k(self, j: int) -> np.ndarray:
        """[R, E] copies of each expert within level ``j`` of each source rank (read-only)."""
        if j not in self.gathered:
            if j < 3:
                self.gathered[j] = self.count[j][self.group[j]]
                self.gathered[j].flags.writeable = False
            else:
                self.gathered[j] = np.broadcast_to(self.total, self.gathered_shape)
        return self.gathered[j]

    def divisor(self, level: int, local: bool) -> np.ndarray:
        """[R, E] (read-only) what a load of whole tokens divides by for its per-copy shares
        at ``level`` < 3 (:func:`_even_split`): where the source's domain holds the expert,
        its copies there (``local``) or infinity, elsewhere infinity or every copy (the
        safe total). A count over infinity is the exact zero ``np.where`` puts there."""
        got = self.divisors.get((level, local))
        if got is None:
            k = self.k(level)
            got = np.where(k > 0, k, np.inf) if local else np.where(k > 0, np.inf, self.safe_total)
            got.flags.writeable = False
            self.divisors[(level, local)] = got
        return got

    @property
    def gathered_shape(self) -> tuple[int, int]:
        return (int(self.group[0].size), int(self.total.size))


#: per topology: the last few placements' :class:`_Copies`, keyed by their arrays' bytes
#: (the simulator asks for the same placement step after step)
_COPIES: weakref.WeakKeyDictionary[Topology, dict[bytes, _Copies]] = weakref.WeakKeyDictionary()
_COPIES_KEPT = 8


def _copies(placement: Placement, topology: Topology, num_experts: int) -> _Copies:
    p2l = placement.phy2log
    key = b"%d|%d|%s|" % (num_experts, p2l.shape[1], p2l.dtype.str.encode()) + p2l.tobytes()
    per = _COPIES.setdefault(topology, {})
    got = per.get(key)
    if got is not None:
        return got
    num_ranks = placement.num_ranks
    cr, cs = np.nonzero(p2l >= 0)
    ce = p2l[cr, cs].astype(np.int64)
    group = [np.arange(num_ranks), topology.rank_node, topology.rank_dc]
    sizes = [num_ranks, topology.num_nodes, topology.num_dcs]
    count = [
        np.bincount(group[j][cr] * num_experts + ce, minlength=sizes[j] * num_experts)
        .reshape(sizes[j], num_experts)
        .astype(np.float64)
        for j in range(3)
    ]
    total = np.bincount(ce, minlength=num_experts).astype(np.float64)
    got = _Copies(cr, cs, ce, group, count, total, np.where(total > 0, total, 1.0), {})
    for a in (cr, cs, ce, total, got.safe_total, *count):
        a.flags.writeable = False
    _remember(per, key, got, _COPIES_KEPT)
    return got


def even_traffic(
    load: np.ndarray,
    placement: Placement,
    topology: Topology,
    top_k: int,
    *,
    domain: Domain = "global",
    remote: Literal["spread", "master"] = "spread",
) -> TokenTraffic:
    """:class:`TokenTraffic` of an even split, without building the route.

    ``load`` [R, E]: tokens of source rank ``r`` for expert ``e``. Each ``load[r, e]``
    goes evenly to the copies (slots) of ``e`` inside ``r``'s ``domain`` (its own rank,
    node, DC, or everywhere for ``"global"``); if that domain holds none, it goes evenly to
    every copy of ``e`` (``remote="spread"``, what :func:`~expertmesh.planner.routing.route_even`
    does) or all to the master (``remote="master"``). Every expert with load needs a copy.
    """
    level = _check_even(load.shape[0], placement, topology, domain, remote)
    stats = _load_stats(load)
    memo_key = None
    if stats is not None:  # the same load and placement asked again (fastermoe: place, cost)
        p2l, master = placement.phy2log, placement.master
        memo_key = ("even", topology, top_k, level, remote, p2l.shape, p2l.dtype.str,
                    p2l.tobytes(), master.dtype.str, master.tobytes())  # fmt: skip
        got = stats.memo.get(memo_key)
        if got is not None:
            return got  # type: ignore[return-value]
    lf, per_expert = _float_load(load, stats)  # [R, E], [E]
    one = _Loads(
        lf[None], per_expert[None], [x[None] for x in _level_sums_of(lf, topology, stats)],
        _dc_tokens(load, topology, top_k)[None],
    )  # fmt: skip
    out = _even_split(one, placement, topology, level, remote)[0]
    if stats is not None and memo_key is not None:
        for a in (out.rank_tokens, out.rank_out, out.rank_in, out.pair_src, out.pair_dst,
                  out.pair_tokens):  # fmt: skip
            a.flags.writeable = False
        stats.memo[memo_key] = out
    return out


def even_traffic_steps(
    loads: np.ndarray,
    placement: Placement,
    topology: Topology,
    top_k: int,
    *,
    domain: Domain = "global",
    remote: Literal["spread", "master"] = "spread",
) -> list[TokenTraffic]:
    """:func:`even_traffic` of each ``loads[t]`` ([T, R, E]: the loads of ``T`` steps on one
    placement), the same floats, in one pass of array operations over every step instead
    of ``T`` passes of small ones (the simulator costs a placement's steps together)."""
    if loads.ndim != 3:
        raise ValueError(f"loads must be [T, R, E], got {loads.shape}")
    level = _check_even(loads.shape[1], placement, topology, domain, remote)
    cp = _copies(placement, topology, loads.shape[2])  # replicas: no one-copy split, no sum
    if loads.dtype.kind in "iu" and cp.total.max(initial=0) <= 1:
        one = _one_copy_split(loads, cp, topology, top_k)
        if one is not None:
            return one
    runs = _whole_runs(topology)
    if loads.dtype.kind in "iu" and runs is not None and remote == "spread" and level in (1, 2):
        out: list[TokenTraffic] = []
        for first in range(0, loads.shape[0], _WHOLE_STEPS):
            whole = _whole_loads(loads[first : first + _WHOLE_STEPS], topology, top_k, runs)
            if whole is None:
                break
            out += _even_split(whole, placement, topology, level, remote)
        else:
            return out
    dc_tokens = _dc_sums(loads, topology) / top_k  # [T, D]: _dc_tokens of each step
    lf = loads.astype(np.float64)  # [T, R, E]
    many = _Loads(lf, None, _level_sums_steps(lf, topology), dc_tokens)
    return _even_split(many, placement, topology, level, remote)


#: steps split together on the whole-token path (:func:`even_traffic_steps`): its [T, R, E]
#: shares (2 MB) stay in cache between the division and the einsums that read them
_WHOLE_STEPS = 16


def _whole_loads(
    loads: np.ndarray, topology: Topology, top_k: int, runs: tuple[int, int]
) -> _Loads | None:
    """:class:`_Loads` of integer token counts ``loads`` [T, R, E] (``lf``: the counts
    themselves, ``whole``) on a topology of :func:`_whole_runs` ``runs``, else ``None``
    when their total reaches 2**53. Sums of whole tokens below 2**53 are exact in any
    order: summed by node over a reshaped view (integers), by DC, everything and DC totals
    from those, the floats of :func:`_level_sums_steps` and :func:`_dc_sums` with one pass
    over the loads instead of three."""
    num_steps, _, num_experts = loads.shape
    per_node, per_dc = runs
    by_node = loads.reshape(num_steps, topology.num_nodes, per_node, num_experts).sum(axis=2)
    if not int(by_node.sum()) < _EXACT:
        return None
    node = by_node.astype(np.float64)  # [T, Nn, E]
    dc = (
        node.reshape(num_steps, topology.num_dcs, per_dc, num_experts).sum(axis=2)
        if per_dc
        else node
    )
    every = dc.sum(axis=1, keepdims=True)  # [T, 1, E]
    return _Loads(loads, None, [loads, node, dc, every], dc.sum(axis=2) / top_k, whole=True)


def _one_copy_split(
    loads: np.ndarray, cp: _Copies, topology: Topology, top_k: int
) -> list[TokenTraffic] | None:
    """:func:`even_traffic_steps` of integer ``loads`` [T, R, E] (token counts) on a
    placement with :func:`_copies` ``cp``, at most one copy of each expert (static EP), else
    ``None`` (also when their total reaches 2**53). Every split
    sends ``loads[t, r, e]`` whole to the one copy of ``e``, so each float of
    :func:`_even_split` is a sum of whole tokens, exact in any order: summed here from a
    [T, R, R] rank-to-rank matrix with a few passes and small matrix products (the same
    floats, instead of dozens of passes over [T, R, E])."""
    num_steps, num_ranks = loads.shape[:2]
    if cp.total.size and cp.total.max() > 1:
        return None
    if (cp.total == 0).any() and (loads.sum(axis=1)[:, cp.total == 0] > 0).any():
        return None  # _even_split raises the error
    m = _rank_to_rank(loads.astype(np.int64, copy=False), cp)
    out_of = m.sum(axis=2)  # [T, R] what each rank sends (below 2**53: exact)
    if not float(out_of.sum()) < _EXACT:  # (counts: a float sum reaching it is no less)
        return None
    # one-hot [R, groups] of each rank's node and DC: sums by group are exact products
    (_, node, _), (_, dc, _) = _groups(topology)
    everyone = np.arange(num_ranks)
    own = m[:, everyone, everyone]  # [T, R] to the own rank
    mt = m.transpose(0, 2, 1)
    sent = [own, (m @ node)[:, everyone, topology.rank_node]]
    came = [own, (mt @ node)[:, everyone, topology.rank_node]]
    if _node_is_dc(topology):  # the same one-hot matrix: the same sums
        sent.append(sent[1])
        came.append(came[1])
    else:
        sent.append((m @ dc)[:, everyone, topology.rank_dc])
        came.append((mt @ dc)[:, everyone, topology.rank_dc])
    sent.append(out_of)
    came.append(m.sum(axis=1))
    rank_out = np.stack([sent[j] - sent[j - 1] for j in (1, 2, 3)], axis=2)  # [T, R, 3]
    rank_in = np.stack([came[j] - came[j - 1] for j in (1, 2, 3)], axis=2)
    rank_tokens = came[3]
    # _dc_tokens of each step: the per-rank sums are whole tokens, added DC by DC in order
    key = np.arange(num_steps)[:, None] * topology.num_dcs + topology.rank_dc
    sums = np.bincount(key.ravel(), weights=sent[3].ravel(), minlength=num_steps * topology.num_dcs)
    dc_tokens = sums.reshape(num_steps, topology.num_dcs) / top_k
    dense = dc.T @ m @ dc  # [T, D, D] source DC -> destination DC
    return [
        TokenTraffic(rank_tokens[t], rank_out[t], rank_in[t], ps, pd, pt, dc_tokens[t])
        for t, (ps, pd, pt) in enumerate(_pairs_steps(dense))
    ]


def _rank_to_rank(x: np.ndarray, cp: _Copies) -> np.ndarray:
    """[T, R, R] float64: what each source rank sends to each rank, every expert of ``x``
    [T, R, E] to the rank of its one copy (``cp``; experts without a copy have no load):
    sums of whole tokens, exact while below 2**53 (the caller checks their total)."""
    num_steps, num_ranks, num_experts = x.shape
    owner = np.full(num_experts, -1, np.int64)
    owner[cp.expert] = cp.rank
    held = np.flatnonzero(owner >= 0)
    by_owner = held[np.argsort(owner[held], kind="stable")]
    ranks = owner[by_owner]
    if ranks.size == 0:
        return np.zeros((num_steps, num_ranks, num_ranks))
    cols = x if np.array_equal(by_owner, np.arange(num_experts)) else x[:, :, by_owner]
    per = num_experts // num_ranks
    if 0 < per <= 8 and np.array_equal(ranks, np.repeat(np.arange(num_ranks), per)):
        # static EP: ``per`` experts in order on every rank, added in floats (whole tokens),
        # 8 steps at a time (each pass over every ``per``-th column reads every cache line:
        # the later passes find them in cache)
        out = np.empty((num_steps, num_ranks, num_ranks))
        for first in range(0, num_steps, 8):
            part = cols[first : first + 8]
            np.copyto(out[first : first + 8], part[:, :, ::per])
            for k in range(1, per):
                out[first : first + 8] += part[:, :, k::per]
        return out
    m = np.zeros((num_steps, num_ranks, num_ranks), np.int64)
    ends = np.flatnonzero(np.r_[ranks[1:] != ranks[:-1], True])  # last expert of each rank
    cum = np.cumsum(cols, axis=2)[:, :, ends]
    cum[:, :, 1:] -= cum[:, :, :-1].copy()
    m[:, :, ranks[ends]] = cum
    return m.astype(np.float64)


def _check_even(num_ranks: int, placement: Placement, topology: Topology, domain: str,
                remote: str) -> int:  # fmt: skip
    """The level of ``domain`` once the arguments of an even split are checked."""
    if placement.num_ranks != num_ranks or num_ranks != topology.num_ranks:
        raise ValueError("load, placement and topology disagree on the number of ranks")
    if domain not in _LEVEL:
        raise ValueError(f"domain must be one of {', '.join(_LEVEL)}")
    if remote not in ("spread", "master"):
        raise ValueError("remote must be 'spread' or 'master'")
    return _LEVEL[domain]


@dataclass(frozen=True)
class _Loads:
    """The loads of ``T`` steps as an even split needs them: ``lf`` [T, R, E] float64,
    ``per_expert`` [T, E] their sums over ranks (``None``: summed when needed), ``lsum`` their :func:`level_sums`
    ([T, groups at level j, E] each) and ``dc_tokens`` [T, D] (:func:`_dc_tokens`).
    ``whole``: ``lf`` and ``lsum[0]`` are the integer token counts themselves (non-negative,
    as :func:`~expertmesh.planner.plan.check_load` has them) and every sum is exact
    (:func:`_whole_loads`): only for a split at the node or DC level that spreads."""

    lf: np.ndarray
    per_expert: np.ndarray | None
    lsum: list[np.ndarray]
    dc_tokens: np.ndarray
    whole: bool = False


def _even_split(
    loads: _Loads, placement: Placement, topology: Topology, level: int, remote: str
) -> list[TokenTraffic]:
    """The even split of :func:`even_traffic` for the ``T`` steps of ``loads`` on one
    placement. Every operation is the one-step operation with a leading step axis (the
    same floats)."""
    lf, per_expert, lsum, dc_tokens = loads.lf, loads.per_expert, loads.lsum, loads.dc_tokens
    num_steps, num_ranks, num_experts = lf.shape
    cp = _copies(placement, topology, num_experts)
    cr, cs, ce, group, cnt, total = cp.rank, cp.slot, cp.expert, cp.group, cp.count, cp.total
    if (total == 0).any():  # an expert without a copy must have no load
        per_expert = lf.sum(axis=1) if per_expert is None else per_expert
        if ((per_expert > 0) & (total == 0)).any():
            missing = np.flatnonzero(((per_expert > 0) & (total == 0)).any(axis=0))
            raise ValueError(f"experts with load but no copy: {missing[:8].tolist()}")
    safe_total = cp.safe_total
    k = cp.k

    # [R, E] does r's domain hold e? ("global": no locality, everything spreads)
    local = k(level) > 0 if level < 3 else None
    if loads.whole:  # the same shares of the counts, with no masked copy
        nonlocal_load = None
        lf = lf.astype(np.float64)  # the counts' floats (lsum[0] stays the counts)
        w_nl = lf / cp.divisor(level, False)  # 0 where local, as below
    else:
        # "global": every load is non-local, the same floats as ``lf`` (not modified below)
        nonlocal_load = lf if local is None else np.where(local, 0.0, lf)  # [T, R, E]
        w_nl = nonlocal_load / safe_total  # per-copy share of a spread (r, e)

    # ---- what each source sends, by shell: cumulative copies reached up to shell j ----
    rank_out = np.zeros((num_steps, num_ranks, 3))
    same = _node_is_dc(topology)  # k(1) and k(2) are equal: so are their reaches
    if local is not None:
        # per local copy (faster than np.divide(..., where=local), a masked loop)
        if loads.whole:
            w_loc = lf / cp.divisor(level, True)  # 0 where not local, as np.where puts
        else:
            w_loc = np.where(local, lf / np.where(local, k(level), 1.0), 0.0)
        reach: list[np.ndarray | float] = []
        for j in range(level + 1):
            reach.append(reach[1] if j == 2 and same else np.einsum("tre,re->tr", w_loc, k(j)))
        for j in range(1, level + 1):
            rank_out[:, :, j - 1] = reach[j] - reach[j - 1]
    mrank = placement.master_rank()  # [E]
    # a spread source has no copy inside its domain: what it reaches in the shells up to the
    # domain's, and what copies there get of spreads, are exact zeros (not computed)
    inside = level if level < 3 else -1
    if remote == "spread":
        reach = []
        for j in range(4):
            if j <= inside:
                reach.append(0.0)
            elif j == 2 and same and inside < 1:
                reach.append(reach[1])
            else:
                reach.append(np.einsum("tre,re->tr", w_nl, k(j)))
        for j in range(max(1, inside + 1), 4):
            rank_out[:, :, j - 1] += reach[j] - reach[j - 1]
    else:
        assert nonlocal_load is not None  # whole loads: spreads only
        shell = _rank_shell(topology, np.arange(num_ranks)[:, None], mrank[None, :])  # [R, E]
        for j in (1, 2, 3):
            rank_out[:, :, j - 1] += np.where(shell == j, nonlocal_load, 0.0).sum(axis=2)

    # ---- what each copy receives, by shell ----
    qg = [group[j][cr] for j in range(3)] + [np.zeros(cr.size, np.int64)]
    in_shell = np.zeros((num_steps, cr.size, 4))
    if level < 3:
        # sources inside the copy's domain are all local: their load splits over its copies
        kq = cnt[level][qg[level], ce]
        at = [_cells(lsum[j], qg[j], ce) for j in range(level + 1)]  # lsum[j][:, qg[j], ce]
        at[0] = at[0].astype(np.float64, copy=False)  # whole: the counts' floats
        for j in range(level + 1):
            inner = at[j] - (at[j - 1] if j else 0.0)
            in_shell[:, :, j] += inner / np.where(kq > 0, kq, 1.0)
    if level == 3:
        nsum = lsum
    elif nonlocal_load is None:
        nsum = _nonlocal_sums(lsum, cnt, level, topology)
    else:
        nsum = _level_sums_steps(nonlocal_load, topology)
    if remote == "spread":
        at = [_cells(nsum[j], qg[j], ce) if j >= inside else ce for j in range(4)]
        for j in range(inside + 1, 4):
            inner = at[j] - (at[j - 1] if j else 0.0)
            in_shell[:, :, j] += inner / safe_total[ce]
    else:
        is_master = (cr * placement.slots_per_rank + cs) == placement.master[ce]
        mq, me = cr[is_master], ce[is_master]
        mg = [group[j][mq] for j in range(3)] + [np.zeros(mq.size, np.int64)]
        for j in range(4):
            prev = nsum[j - 1][:, mg[j - 1], me] if j else 0.0
            in_shell[:, is_master, j] += nsum[j][:, mg[j], me] - prev
    step_rank, shell_key = cp.step_keys(num_steps)  # [T * C] (step, rank), its shell bins
    rank_tokens = np.bincount(
        step_rank, weights=in_shell.sum(axis=2).ravel(), minlength=num_steps * num_ranks
    ).reshape(num_steps, num_ranks)
    rank_in = _shell_sums(step_rank, in_shell.reshape(-1, 4), num_steps * num_ranks, shell_key)
    rank_in = rank_in.reshape(num_steps, num_ranks, 3)

    # ---- DC pairs ----
    nl_dc = nsum[2]  # [T, D, E] non-local assignments per source DC
    if remote == "spread":
        share = nl_dc / safe_total
        dense = [share[t] @ cnt[2].T for t in range(num_steps)]  # [D, D] s -> copies in x
    else:
        mdc = topology.rank_dc[mrank]  # [E]
        dense = [np.zeros((topology.num_dcs, topology.num_dcs)) for _ in range(num_steps)]
        for t in range(num_steps):
            np.add.at(dense[t].T, mdc, nl_dc[t].T)  # dense[s, mdc[e]] += nl_dc[s, e]
    return [
        TokenTraffic(rank_tokens[t], rank_out[t], rank_in[t], ps, pd, pt, dc_tokens[t])
        for t, (ps, pd, pt) in enumerate(_pairs_steps(np.stack(dense)))
    ]


def _nonlocal_sums(
    lsum: list[np.ndarray], count: list[np.ndarray], level: int, topology: Topology
) -> list[np.ndarray]:
    """:func:`_level_sums_steps` of the non-local load at ``level`` (1 node, 2 DC) from the
    whole :func:`_whole_loads` sums ``lsum``: whether a source's domain holds an expert
    depends on its group at ``level`` alone, so its group's sums are all local or all not
    (exact zeros); the levels above sum those (exact: whole tokens). Entries below
    ``level`` (never read by a spread) are the level's."""
    masked = np.where(count[level] > 0, 0.0, lsum[level])  # [T, groups at level, E]
    runs = _whole_runs(topology)
    per_dc = runs[1] if runs is not None else 0
    dc = masked
    if level == 1 and per_dc:
        num_steps, _, num_experts = masked.shape
        dc = masked.reshape(num_steps, topology.num_dcs, per_dc, num_experts).sum(axis=2)
    every = dc.sum(axis=1, keepdims=True)
    return [masked, masked, dc, every]


def _cells(x: np.ndarray, group: np.ndarray, expert: np.ndarray) -> np.ndarray:
    """``x[:, group, expert]`` of ``x`` [T, G, E]: a take on flat indices (the same values)."""
    return np.take(x.reshape(x.shape[0], -1), group * x.shape[2] + expert, axis=1)


def _level_sums_steps(x: np.ndarray, topology: Topology) -> list[np.ndarray]:
    """:func:`level_sums` of each ``x[t]`` ([T, R, E]): with equal nodes of at most 8 ranks
    and equal DCs of at most 8 nodes (or one node each), the same sums over a [T, G, p, E]
    view (each a first row plus the plain loop over the rest, as :func:`_run_sums`), else
    one :func:`level_sums` call over [R, T * E]."""
    num_steps, num_ranks, num_experts = x.shape
    (r_starts, r_at, r_len), (n_starts, n_at, n_len) = _level_index(topology)
    one_node = n_starts.size == topology.num_dcs == topology.num_nodes
    if num_ranks and 0 < r_len <= _SHORT_RUN and (one_node or 0 < n_len <= _SHORT_RUN):
        node = np.zeros((num_steps, topology.num_nodes, num_experts))
        node[:, r_at] += _run_sums_steps(x, r_starts.size, r_len)
        if one_node:
            dc = node.copy()  # 0.0 + (0.0 + s) is 0.0 + s, as level_sums
        else:
            dc = np.zeros((num_steps, topology.num_dcs, num_experts))
            dc[:, n_at] += _run_sums_steps(node, n_starts.size, n_len)
        # everything: level_sums' sum over the DCs of a C-ordered [D, T * E] (its floats)
        by_dc = np.ascontiguousarray(dc.transpose(1, 0, 2)).reshape(topology.num_dcs, -1)
        every = by_dc.sum(axis=0)
        return [x, node, dc, every.reshape(num_steps, 1, num_experts)]
    flat = level_sums(x.transpose(1, 0, 2).reshape(num_ranks, -1), topology)
    return [a.reshape(a.shape[0], num_steps, num_experts).transpose(1, 0, 2) for a in flat]


def _run_sums_steps(x: np.ndarray, groups: int, length: int) -> np.ndarray:
    """:func:`_run_sums` of each ``x[t]`` ([T, groups * length, E]), runs of ``length``."""
    v = x.reshape(x.shape[0], groups, length, x.shape[2])
    if length == 1:
        return v[:, :, 0].copy()
    out: np.ndarray = v[:, :, 0] + v[:, :, 1:].sum(axis=2)
    return out


def _level_sums_of(
    lf: np.ndarray, topology: Topology, stats: _LoadStats | None
) -> list[np.ndarray]:
    """:func:`level_sums` of the float load, memoized with the load."""
    key = ("level_sums", topology)
    got = stats.memo.get(key) if stats is not None else None
    if got is None:
        got = level_sums(lf, topology)
        if stats is not None:
            for a in got:
                a.flags.writeable = False
            stats.memo[key] = got
    return got  # type: ignore[return-value]
