"""``hybrid``: move experts to the data where that beats moving data to the experts (HybridEP).

Across a slow link a token costs its activation on every crossing of every
step; an expert copy costs its weights out and its gradient back once per
update, and placing it costs one copy amortized over the placement period.
Two time scales. **The slow loop** (step 0 on the batch size spread evenly over
the experts, step 1, then every ``period`` steps, on the mean of the last
``window`` microbatches, never on the current one) decides what crosses DCs:

1. **moves masters** to the DC that sends them the most tokens when the tokens
   saved over a period outweigh one move of weights plus optimizer state;
2. **picks, per ordered DC pair, the share of traffic that travels as copies**:
   DC ``d``'s tokens for experts mastered in DC ``x`` are the pair's traffic;
   copying the ``j`` experts ``d`` uses most into ``d`` removes their tokens from
   the pair (hierarchical dispatch: a token still crosses while any of its
   experts stays remote) and adds ``j`` replica syncs. For every pair all
   ``j = 0..J`` are scored with the cost model's pair equations
   (docs/cost-model.md) and the fastest kept; where a DC lacks the slots for
   every pair's choice, its pairs share the slots so that the slowest pair is
   as fast as it can be (minimax over a threshold, found by bisection);
3. **lays each DC's copies onto its ranks** (domain-based partition,
   :mod:`~expertmesh.planner.partition`): one copy per expert a DC holds (with
   ``inside="split"`` also extra local copies of heavy experts); copies that stay
   keep their rank, new ones go heaviest first to the rank with the least
   predicted work and a free slot. The slots left free are quota's;
4. **guards**: the candidate plans (per-pair choices, with and without
   compute-relief copies that take free slots, masters only) are scored with the
   full cost model on the estimate, as they will run (with ``inside="quota"``:
   quota composed inside the DCs, below), the migration into them streamed over
   the period; the fastest replaces the running plan (plain EP at first) only if
   it is faster by ``min_gain``, so the policy never picks a plan its model says is
   slower than the one it has. Which experts a DC holds, and so how many of its
   slots stay free for balancing inside it, is the guard's choice.

**Every microbatch** (``inside="quota"``, the default), on its exact load, the
holder sets stay fixed and :mod:`~expertmesh.planner.domainquota` balances inside
each DC: a token whose DC holds its expert stays in the DC, one whose DC does not
goes evenly to the DCs that hold it (whole tokens, rotated), and ``quota`` (smallest
feasible ``T`` per DC, replicas on the DC's free slots, own rank first, largest
remainder) splits each DC's work over its ranks. Between re-plans the base is
recovered from the previous microbatch's placement
(:func:`~expertmesh.planner.domainquota.rehome`: one of each DC's copies of an
expert stays home, nothing moves). The replicas are kept only when the cost model says they pay on this
load (their copies from the home and their sync against the compute they save);
else every DC expert computes at its home. The route and the simulator's charge
are quota's (:func:`~expertmesh.planner.domainquota.domain_route`,
:func:`~expertmesh.planner.domainquota.domain_traffic`).

With ``inside="split"`` the plan itself carries extra local copies and tokens go
evenly to the copies in their own DC, else evenly to every copy, and the plan
stays as it is between re-plans. Parameter-efficient migration: copies come from
the nearest holder through relays (the migration planner), and ``encoding`` sets
reduced precision and changed-bytes-only transfers, which the cost model and the
simulator charge.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import ClassVar, Literal, cast

import numpy as np
from pydantic import Field

from expertmesh.planner.costmodel import (
    CostSettings,
    ExpertStreams,
    TransferEncoding,
    copy_streams,
    crossings,
    migration_streams,
    modeled_step,
    transfer_seconds,
)
from expertmesh.planner.dcfloor import even_dcs
from expertmesh.planner.domainquota import (
    DomainSolution,
    at_home,
    dc_holds,
    domain_quota,
    domain_route,
    domain_sizes,
    domain_traffic,
    merge_dcs,
    rehome,
    sum_rows,
)
from expertmesh.planner.hybridguard import GuardCosts, plain_floor
from expertmesh.planner.hybridpairs import DcPairs as _Pairs
from expertmesh.planner.hybridpairs import HybridInputs as _Inputs
from expertmesh.planner.hybridpairs import choose_copies as _choose
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.partition import DomainDemand, partition_domains
from expertmesh.planner.plan import Placement
from expertmesh.planner.policy import Policy, PolicyContext, PolicySettings, register
from expertmesh.planner.routing import route_even
from expertmesh.planner.static import static_placement
from expertmesh.planner.topology import Topology
from expertmesh.planner.traffic import TokenTraffic, even_traffic, traffic_from_route

__all__ = ["HybridPolicy", "plan_hybrid"]


class HybridSettings(PolicySettings):
    """Settings of :class:`HybridPolicy`."""

    period: int = Field(default=10, ge=1, le=10_000_000, description="re-plan every `period` steps")
    window: int = Field(
        default=10,
        ge=1,
        le=1_000_000,
        description="history microbatches averaged into the estimate",
    )
    move_masters: bool = Field(
        default=True, description="move a master (with optimizer state) to its heaviest DC"
    )
    rounds: int = Field(
        default=3,
        ge=1,
        le=20,
        description="coordinate-descent rounds: each DC pair re-scored against the reverse "
        "pair's choice (they share the two links)",
    )
    fill: list[float] = Field(
        default_factory=lambda: [0.25, 0.5, 1.0],
        description="shares of each DC's free slots the guard also tries filling with its "
        "heaviest remote experts (compute relief for masters many DCs send to)",
    )
    min_gain: float = Field(
        default=0.01,
        ge=0.0,
        lt=1.0,
        description="a new plan must beat the running one (plain EP at first) by this share "
        "of its modeled step time",
    )
    reserve_slots: int = Field(
        default=0,
        ge=0,
        le=64,
        description="slots per rank the slow loop leaves free for the fast loop's replicas "
        "(quota inside each DC on every microbatch's exact load; UltraEP's spare slots)",
    )
    even_dcs: bool = Field(
        default=False,
        description="after the guard, move copies between DCs while that lowers the floor of "
        "the split by DC on the estimate (the busiest DC's tokens per rank over the mean) "
        "without more crossing assignments (planner/dcfloor.py); kept when its modeled step "
        "is within even_tolerance of the guard's choice",
    )
    even_tolerance: float = Field(
        default=0.01,
        ge=0.0,
        le=1.0,
        description="with even_dcs: the share of modeled step time the evened plan may add",
    )
    inside: Literal["quota", "split"] = Field(
        default="quota",
        description="balance inside each DC: 'quota' every microbatch on the exact load over "
        "the plan's holder sets (module doc), or 'split': extra local copies in the plan "
        "and an even split (the plan's own in-DC layout)",
    )
    domain: Literal["auto"] | int = Field(
        default="auto",
        description="with inside='quota': the domain quota copies experts inside every "
        "microbatch, in DCs (1: a DC, k: k consecutive DCs); 'auto' picks, at every re-plan, "
        "the size the cost model says is fastest on the estimate (docs/cost-model.md)",
    )
    max_domain: int = Field(
        default=8,
        ge=1,
        le=100_000,
        description="with domain='auto': the largest domain tried, in DCs",
    )
    domain_tolerance: float = Field(
        default=0.05,
        ge=0.0,
        le=1.0,
        description="with domain='auto': a re-plan scores the domain sizes again only when "
        "its plan holds other experts in some DC than the plan they were last scored on, or "
        "its estimate has moved by this share (L1 over ranks and experts) or more since; "
        "0: at every re-plan",
    )
    domain_cells: int = Field(
        default=1 << 20,
        ge=0,
        description="with domain='auto': the largest ranks x experts whose domains larger "
        "than a DC are scored (they are costed from route rows); above it the domain is a DC",
    )
    cost: CostSettings = Field(default_factory=CostSettings, description="the cost model")
    encoding: TransferEncoding = Field(
        default_factory=TransferEncoding,
        description="parameter-efficient migration: bytes on the wire per weight and "
        "gradient, changed-bytes-only refresh",
    )


def plan_hybrid(
    estimate: np.ndarray,
    masters: Placement,
    topology: Topology,
    model: ModelSpec,
    cfg: HybridSettings,
    *,
    previous: Placement | None = None,
) -> Placement:
    """The hybrid placement for estimated load ``estimate`` [R, E] (mean tokens per step).

    ``masters``: the placement whose masters to start from (slots other than masters are
    ignored); ``previous``: the placement running now (its copies stay where they are
    when chosen again, and it is a candidate of the guard). The result may be read-only
    and shared (a masters-only plan kept between calls is one frozen object): copy it
    before changing it in place.
    """
    return _plan_hybrid(estimate, masters, topology, model, cfg, previous=previous)[0]


def _plan_hybrid(
    estimate: np.ndarray,
    masters: Placement,
    topology: Topology,
    model: ModelSpec,
    cfg: HybridSettings,
    *,
    previous: Placement | None = None,
) -> tuple[Placement, float | None]:
    """:func:`plan_hybrid`, and when it keeps the running plan (the candidate nothing is
    copied into), that plan's :func:`compose` cost on ``rint(estimate)`` as the guard
    scored it: with ``before`` its holdings and no other stream, the cost
    :func:`choose_domain` gives it in a DC's domain (else ``None``)."""
    num_experts = estimate.shape[1]
    num_dcs, slots = topology.num_dcs, topology.slots_per_rank
    rank_dc = topology.rank_dc
    dc_load = sum_rows(estimate, rank_dc, num_dcs)  # [D, E] (np.add.at's floats, faster)
    dc_tokens = dc_load.sum(axis=1) / model.top_k
    mrank = masters.master_rank()
    mdc = rank_dc[mrank]
    dc_slots = np.bincount(rank_dc, minlength=num_dcs) * slots
    move = np.zeros(num_experts, bool)
    if cfg.move_masters:
        move, mdc = _move_masters(dc_load, mdc, dc_slots, model, cfg)
    held_before = (
        dc_holds(previous, topology)
        if previous is not None
        else np.zeros((num_dcs, num_experts), bool)
    )
    load = np.rint(estimate).astype(np.int64)
    inp = _Inputs(topology, model, cfg, estimate, load, dc_load, dc_tokens, previous)
    pairs = _Pairs(inp, mdc, held_before)
    reserve = np.bincount(rank_dc, minlength=num_dcs) * cfg.reserve_slots  # the fast loop's
    free = np.maximum(dc_slots - np.bincount(mdc, minlength=num_dcs) - reserve, 0)
    # coordinate descent: each pair against the reverse pair's current choice
    j_cur = _choose(pairs.options(None), free)  # each pair alone
    choices = [j_cur]
    for _ in range(cfg.rounds):
        j_new = _choose(pairs.options(j_cur), free)
        choices.append(j_new)
        if np.array_equal(j_new, j_cur):
            break
        j_cur = j_new
    # the plan to beat: the running one, else plain EP on the masters; a new plan must be
    # faster by min_gain (on an estimate, a hair's gain is noise and costs a migration)
    keep = previous if previous is not None else _masters_only(masters)
    if cfg.inside == "quota":
        # last microbatch's replicas are not the plan
        keep = rehome(keep, load, topology, cfg.reserve_slots)
    # equal candidates scored once, hopeless ones neither laid out nor scored
    guard = GuardCosts(inp, _guard_cost, lambda h: _build(inp, masters, move, mdc, h), mdc)
    keep_cost = guard(keep)
    pair_sets = [_replicas(pairs, jc) for jc in _unique(choices)]
    pair_holds = [_holds(num_dcs, mdc, reps) for reps in pair_sets]
    empty = np.zeros(0, np.int64)
    plain = _holds(num_dcs, mdc, (empty, empty))
    # nothing can beat the running plan when every candidate's bound is above the bar:
    # the pair choices, plain EP and the fills of every pair choice (the fills build on
    # the fastest pair choice, unknown unless they are scored); all bounded in one batch
    bar = (1.0 - cfg.min_gain) * keep_cost
    fill_sets = [list(_fills(inp, mdc, reps, cfg.fill)) for reps in pair_sets]
    every_fill = [h for fills in fill_sets for h in fills]
    if guard.above([*pair_holds, plain, *every_fill], bar):
        return _kept(
            _evened(inp, keep, keep_cost, guard) if cfg.even_dcs else keep, keep, keep_cost
        )
    pair_costs = guard.scores(pair_holds)  # the fastest of them exactly: fills build on it
    fills = fill_sets[int(np.argmin(pair_costs))]
    candidates = [*pair_holds, *fills, plain]
    # a candidate above the bar to beat, or above a faster one, cannot be the answer
    bar = min(bar, *pair_costs)
    costs = pair_costs + guard.scores(candidates[len(pair_holds) :], bar)
    i = int(np.argmin(costs))
    if costs[i] > (1.0 - cfg.min_gain) * keep_cost:
        chosen, cost = keep, keep_cost
    else:
        chosen, cost = guard.placement(candidates[i]), costs[i]
    return _kept(_evened(inp, chosen, cost, guard) if cfg.even_dcs else chosen, keep, keep_cost)


def _kept(plan: Placement, keep: Placement, keep_cost: float) -> tuple[Placement, float | None]:
    """``(plan, keep_cost)`` when ``plan`` is the running plan ``keep`` (rehomed: it holds
    nothing ``previous`` lacks, so the guard charged it no copy), else ``(plan, None)``."""
    return plan, keep_cost if plan is keep else None


def _evened(inp: _Inputs, chosen: Placement, cost: float, guard: GuardCosts) -> Placement:
    """``chosen`` with its copies moved between DCs by :func:`~expertmesh.planner.dcfloor.even_dcs`
    (masters stay), if its modeled step is within ``even_tolerance`` of ``cost``."""
    topo, cfg = inp.topology, inp.cfg
    rank_dc = topo.rank_dc
    holds = dc_holds(chosen, topo)
    mdc = rank_dc[chosen.master_rank()]
    cap = np.bincount(rank_dc, minlength=topo.num_dcs) * (topo.slots_per_rank - cfg.reserve_slots)
    new = even_dcs(inp.load, holds, mdc, cap, rank_dc)
    if np.array_equal(new, holds):
        return chosen
    new[mdc, np.arange(mdc.size)] = True  # the masters stay
    cand = _build(inp, chosen, np.zeros(mdc.size, bool), mdc, new)
    return cand if guard(cand) <= (1.0 + cfg.even_tolerance) * cost else chosen


def _masters_only(masters: Placement) -> Placement:
    """``masters`` with every slot but the masters' emptied (plain EP)."""
    phy2log = np.full_like(masters.phy2log, -1)
    phy2log.reshape(-1)[masters.master] = np.arange(masters.master.size)
    return Placement(phy2log=phy2log, master=masters.master.copy())


def _replicas(pairs: _Pairs, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(DC, expert) of every copy when pair ``g`` copies its ``j[g]`` heaviest experts."""
    row = pairs.j <= j[pairs.group] if pairs.group.size else np.zeros(0, bool)
    return pairs.dc[row], pairs.expert[row]


def _unique(arrays: list[np.ndarray]) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for a in arrays:
        if not any(np.array_equal(a, b) for b in out):
            out.append(a)
    return out


def _move_masters(
    dc_load: np.ndarray,
    mdc: np.ndarray,
    dc_slots: np.ndarray,
    model: ModelSpec,
    cfg: HybridSettings,
) -> tuple[np.ndarray, np.ndarray]:
    """Masters that move to their heaviest DC: ``(moved [E] bool, new master DC [E])``."""
    num_experts = mdc.size
    best = np.argmax(dc_load, axis=0)
    gain = dc_load[best, np.arange(num_experts)] - dc_load[mdc, np.arange(num_experts)]
    saved = gain * model.token_crossings * model.token_bytes * cfg.period
    want = (best != mdc) & (saved > cfg.encoding.copy_bytes(model, master=True))
    count = np.bincount(mdc, minlength=dc_slots.size)
    moved = np.zeros(num_experts, bool)
    for e in np.flatnonzero(want)[np.argsort(-saved[want], kind="stable")]:
        b = best[e]
        if count[b] < dc_slots[b]:
            count[b] += 1
            count[mdc[e]] -= 1
            moved[e] = True
    return moved, np.where(moved, best, mdc)


def _holds(num_dcs: int, mdc: np.ndarray, replicas: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """[D, E] bool holder sets: every master's DC ``mdc`` [E] and one replica per
    ``replicas`` (DC, expert) pair."""
    out = np.zeros((num_dcs, mdc.size), bool)
    out[mdc, np.arange(mdc.size)] = True
    out[replicas[0], replicas[1]] = True
    return out


def _build(
    inp: _Inputs,
    masters: Placement,
    move: np.ndarray,
    mdc: np.ndarray,
    holds: np.ndarray,
) -> Placement:
    """Placement with the masters (``move`` [E] ones re-placed in DC ``mdc`` [E]) and one
    copy of every other held ``(d, e)`` of ``holds`` [D, E] (masters' DCs included), laid
    out by the domain-based partition."""
    dc_load = inp.dc_load
    demand = DomainDemand(
        count=holds.astype(np.int64),
        local=np.where(holds, dc_load, 0.0),
        remote=np.where(holds, 0.0, dc_load).sum(axis=0),
        master_dc=mdc,
        master_slot=np.where(move, -1, masters.master),
        gain=_split_gain(inp) if inp.cfg.inside == "split" else np.full(dc_load.shape[0], np.inf),
        reserve=inp.cfg.reserve_slots,
    )
    return partition_domains(inp.topology, demand, inp.previous)


def _split_gain(inp: _Inputs) -> np.ndarray:
    """[D] tokens an extra copy inside a DC must take off its expert's busiest copy to pay
    for itself: its per-step sync (training) or its copy over one period (forward-only) on
    a rank port, in the time those tokens take to compute."""
    topo, model, cfg = inp.topology, inp.model, inp.cfg
    one_node = np.array([d.nodes == 1 for d in topo.dcs])
    bw = np.where(one_node, topo.intra_node.bytes_per_second, topo.intra_dc.bytes_per_second)
    enc = cfg.encoding
    if model.training:
        per = float(cfg.cost.microbatches_per_update)
        nbytes = max(enc.refresh_bytes(model), enc.gradient_bytes(model)) / per
    else:
        nbytes = enc.copy_bytes(model, master=False) / cfg.period
    token_seconds = model.flops_per_token / cfg.cost.flops_per_second
    return np.asarray(nbytes / bw / token_seconds)


def _fills(
    inp: _Inputs, mdc: np.ndarray, replicas: tuple[np.ndarray, np.ndarray], fracs: list[float]
) -> Iterator[np.ndarray]:
    """For each share ``frac`` of ``fracs``, the holder sets [D, E] of ``replicas`` plus, in
    every DC, copies of its heaviest experts it does not hold yet, in ``frac`` of its
    remaining free slots (compute relief for overloaded masters); the order sorted once per
    solve (:attr:`~expertmesh.planner.hybridpairs.HybridInputs.fill_order`)."""
    topo, dc_load = inp.topology, inp.dc_load
    num_dcs = dc_load.shape[0]
    held = _holds(num_dcs, mdc, replicas)
    ranks = np.bincount(topo.rank_dc, minlength=num_dcs)
    slots = ranks * (topo.slots_per_rank - inp.cfg.reserve_slots)  # the reserve stays free
    free = np.maximum(slots - held.sum(axis=1), 0)
    d, e = inp.fill_order
    lack = ~held[d, e]
    d, e = d[lack], e[lack]
    pos = np.arange(d.size) - np.searchsorted(d, d, "left")
    for frac in fracs:
        take = pos < np.floor(frac * free).astype(np.int64)[d]
        out = held.copy()
        out[d[take], e[take]] = True
        yield out


def _guard_cost(inp: _Inputs, cand: Placement) -> float:
    """Modeled seconds of ``cand`` on the estimate, with the copies it adds over
    ``previous`` streamed over one period (each from its master's rank); with
    ``inside="quota"``, of what :func:`compose` makes of it on the estimate."""
    topology, model, cfg, previous = inp.topology, inp.model, inp.cfg, inp.previous
    migrate = None
    if previous is not None:
        migrate = copy_streams(
            previous, cand, topology, model, encoding=cfg.encoding, scale=1.0 / cfg.period
        )
    if cfg.inside == "quota":
        return compose(inp.load, cand, topology, model, cfg, before=previous, extra=migrate)[2]
    traffic = even_traffic(inp.estimate, cand, topology, model.top_k, domain="dc", remote="spread")
    return modeled_step(
        topology, model, traffic, cand, settings=cfg.cost, encoding=cfg.encoding, extra=migrate
    ).seconds


def compose(
    load: np.ndarray,
    base: Placement,
    topology: Topology,
    model: ModelSpec,
    cfg: HybridSettings,
    *,
    before: np.ndarray | Placement | None = None,
    extra: ExpertStreams | None = None,
    domain: Topology | None = None,
    plain: bool = True,
) -> tuple[DomainSolution, TokenTraffic, float]:
    """``quota`` inside every domain over ``base`` (:func:`~expertmesh.planner.domainquota.domain_quota`)
    on ``load`` [R, E], or no replicas when the cost model says they do not pay: the
    replicas' copies (from their home; ``before`` [R, E] bool, or the placement that holds
    them: copies already in place),
    the time those copies take to land beyond the dispatch (they must arrive before their
    tokens compute), and their sync, against the compute they save. ``domain``: the DCs
    merged into domains (:func:`~expertmesh.planner.domainquota.merge_dcs`; ``None``: each
    DC), ``base`` holding one copy per domain and expert. Returns the solution, its traffic
    on ``topology`` and its modeled seconds (``extra``: more background streams).
    ``plain=False``: the solution with replicas, not compared with the one without."""
    dom = topology if domain is None else domain

    def option(
        sol: DomainSolution,
    ) -> tuple[tuple[DomainSolution, TokenTraffic, float], np.ndarray]:
        """The solution, its traffic and seconds; and its DC pair crossings (computed once
        for step_cost and plain_floor)."""
        if dom is topology:
            traffic = domain_traffic(load, sol, topology, model.top_k)
        else:  # domains span DCs: the route's exact streams on the real links
            route = domain_route(load, sol, dom)
            traffic = traffic_from_route(route, load, topology, model.top_k)
        copies = _replica_copies(sol, before, topology, model, cfg.encoding)
        streams = copies if extra is None else copies + extra
        cross = crossings(traffic, model.top_k, cfg.cost.hierarchical)
        step = modeled_step(
            topology, model, traffic, sol.placement,
            settings=cfg.cost, encoding=cfg.encoding, extra=streams, cross=cross,
        )  # fmt: skip
        late = transfer_seconds(copies, topology) - step.phases.get("dispatch", 0.0)
        return (sol, traffic, step.seconds + max(0.0, late)), cross

    balanced, cross = option(domain_quota(load, base, dom))
    if balanced[0].replicas[0].size == 0 or not plain:
        return balanced  # no replica needed (or the caller knows it cannot do without)
    # the floor takes the homes and demands alone: those of at_home's solution, the same
    if dom is topology and (
        plain_floor(*balanced[:2], topology, model, cfg.cost, cross=cross) > balanced[2]
    ):
        return balanced  # without replicas it cannot be as fast: not scored
    bare = option(at_home(balanced[0], base, dom))[0]
    return bare if bare[2] <= balanced[2] else balanced  # ties: no replicas


def choose_domain(
    load: np.ndarray,
    base: Placement,
    topology: Topology,
    model: ModelSpec,
    cfg: HybridSettings,
    *,
    before: np.ndarray | Placement | None = None,
    known: float | None = None,
) -> int:
    """Domain size in DCs (:func:`~expertmesh.planner.domainquota.domain_sizes`) whose
    :func:`compose` on ``load`` [R, E] over ``base`` is fastest; ties: the smaller domain.
    ``cfg.domain`` fixes it unless ``"auto"``. ``known``: the cost of a DC's domain (the
    compose of ``base`` itself) when the caller has scored it (the guard: the same call)."""
    if cfg.domain != "auto":
        if merge_dcs(topology, cfg.domain) is None:
            raise ValueError(f"domain {cfg.domain}: does not divide the DCs into equal domains")
        return int(cfg.domain)
    if load.size > cfg.domain_cells:
        return 1
    # every expert in one DC at most (plain EP's holder sets): in every domain the plan
    # without replicas sends each token where a DC's does, at least as slow as a DC's
    # choice; a larger domain can win only with replicas
    single = bool((dc_holds(base, topology).sum(axis=0) <= 1).all())
    best, best_cost = 1, np.inf
    for k in domain_sizes(topology):
        if k > cfg.max_domain:
            break
        dom = merge_dcs(topology, k)
        if dom is None:
            continue
        kbase = base if k == 1 else rehome(base, load, dom)
        plain = k == 1 or not single
        if k == 1 and known is not None:
            cost = known
        else:
            cost = compose(
                load, kbase, topology, model, cfg, before=before, domain=dom, plain=plain
            )[2]
        if cost < best_cost * (1 - 1e-9):
            best, best_cost = k, cost
    return best


def _same_holds(a: Placement, b: Placement) -> bool:
    """Whether ``a.holds()`` equals ``b.holds()``: at once where every rank's slots, sorted,
    are the same (the simulator's alignment permutes slots within ranks), else by
    ``holds()``."""
    same_shape = a.phy2log.shape == b.phy2log.shape and a.master.shape == b.master.shape
    if same_shape and np.array_equal(np.sort(a.phy2log, axis=1), np.sort(b.phy2log, axis=1)):
        return True
    return bool(np.array_equal(a.holds(), b.holds()))


def _replica_copies(
    sol: DomainSolution,
    before: np.ndarray | Placement | None,
    topology: Topology,
    model: ModelSpec,
    encoding: TransferEncoding,
) -> ExpertStreams:
    """Background streams of the replicas of ``sol`` not already in place (``before`` [R, E]
    bool, or the placement that holds them, ``None``: none), each copied from its home in
    the same DC this step."""
    v, rank, _ = sol.replicas
    e = sol.v_expert[v]
    if before is None:
        new = np.ones(v.size, bool)
    elif isinstance(before, Placement):  # its holds()[rank, e], from the replicas' ranks alone
        new = ~(before.phy2log[rank] == e[:, None]).any(axis=1)
    else:
        new = ~before[rank, e]
    nbytes = np.full(int(new.sum()), encoding.copy_bytes(model, master=False))
    return migration_streams(sol.home[v[new]], rank[new], nbytes, topology)


@register
class HybridPolicy(Policy):
    """HybridEP's planner: per DC pair, the share of traffic moved as expert copies; with
    ``inside="quota"``, quota inside every DC each microbatch (see the module doc).

    ``place`` remembers the last context's in-DC solution; ``route`` and ``route_traffic``
    serve it when given its placement (slots may have been permuted, ranks not), and
    ``route`` falls back to an even split inside DCs otherwise (like ``quota``).
    """

    name = "hybrid"
    Settings = HybridSettings
    relabel_ranks = False
    #: the even split its route uses with ``inside="split"``: copies in the token's DC,
    #: else every copy
    even_split: ClassVar[tuple[str, str]] = ("dc", "spread")

    def __init__(self, settings: PolicySettings | None = None) -> None:
        super().__init__(settings)
        self._last: tuple[PolicyContext, DomainSolution, TokenTraffic, Topology] | None = None
        #: CPU seconds of the last ``place``'s microbatch part (quota inside the domains);
        #: the slow loop's solve runs beside training and is not in it
        self.microbatch_seconds = 0.0
        self._size = 1  # the domain, in DCs, chosen at the last re-plan
        self._replanned: dict[int, int] = {}  # per layer, the step of its last re-plan
        #: per layer, what the domain sizes were last scored on and chose: (estimate [R, E],
        #: holder sets [D, E], size)
        self._scored: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}
        #: the domains of ``_size`` on the last topology: (topology, size, merged or None)
        self._merged: tuple[Topology, int, Topology | None] | None = None
        #: [R] the domain of each rank in the last ``place`` (copies inside one are the
        #: microbatch's)
        self.copy_domain: np.ndarray | None = None

    @property
    def domain_size(self) -> int:
        """DCs per domain chosen at the last re-plan (:func:`choose_domain`)."""
        return self._size

    @property
    def microbatch_copies(self) -> str | None:
        """What is decided every microbatch: with ``inside="quota"``, replicas inside
        domains (:attr:`copy_domain`)."""
        return "in_domain" if self.cfg.inside == "quota" else None

    @property
    def cfg(self) -> HybridSettings:
        return cast(HybridSettings, self.settings)

    @property
    def transfer_encoding(self) -> TransferEncoding:
        """How this policy sends expert weights and gradients (the simulator charges it)."""
        return self.cfg.encoding

    def history_window(self) -> int:
        return self.cfg.window

    def place(self, ctx: PolicyContext) -> Placement:
        prev = ctx.previous.placement if ctx.previous is not None else None
        # re-plan every period, and at step 1: the first microbatch of history replaces the
        # uniform guess step 0 had to make; also `period` steps after this layer's last
        # re-plan (a controller planning every N steps may never ask at a multiple of
        # `period`: every_n:5 plans after steps 4, 9, 14, ...)
        last = self._replanned.get(ctx.layer)
        replan = (
            prev is None
            or not ctx.step % self.cfg.period
            or ctx.step == 1
            or (last is not None and ctx.step - last >= self.cfg.period)
        )
        if replan:
            self._replanned[ctx.layer] = ctx.step
        t = ctx.topology
        if not replan and self.cfg.inside == "split":
            return cast(Placement, prev)
        before = prev  # what it holds is in place (compose reads it rank by rank)
        # between re-plans the base is last microbatch's holder sets, nothing moved
        base = None
        if replan:
            base, estimate, known = self._plan(ctx, prev)
            if self.cfg.inside == "split":
                return base
            self._size = self._domain(ctx, (estimate, known), base, before)
        t0 = time.process_time()
        dom = self._domains(t)
        if base is None or dom is not None:
            base = rehome(cast(Placement, base or prev), ctx.load, dom or t, self.cfg.reserve_slots)
        sol, traffic, _ = compose(ctx.load, base, t, ctx.model, self.cfg, before=before, domain=dom)
        self._last = (ctx, sol, traffic, dom or t)
        self.copy_domain = (dom or t).rank_dc
        self.microbatch_seconds = time.process_time() - t0
        return sol.placement

    def _domain(
        self,
        ctx: PolicyContext,
        scored: tuple[np.ndarray, float | None],
        base: Placement,
        before: Placement | None,
    ) -> int:
        """The domain size of this re-plan (:func:`choose_domain`; ``scored``: the estimate
        [R, E] and the cost of ``base`` in a DC's domain if the guard scored it), scored
        again only when needed: a fixed ``domain`` always (it only checks it); ``"auto"``
        when this layer's plan ``base`` holds other experts in some DC than the plan the
        sizes were last scored on, or its estimate has moved by ``domain_tolerance`` (L1
        share) or more since (0: always); else the size chosen then. The scores of the sizes move with the
        estimate and the holder sets; between windows of the same traffic they move by the
        sampling noise (about 2% L1 at 8,192 tokens per rank)."""
        t = ctx.topology
        estimate, known = scored
        holds = dc_holds(base, t) if self.cfg.domain == "auto" else None
        seen = self._scored.get(ctx.layer)
        same = seen is not None and seen[0].shape == estimate.shape
        if holds is not None and seen is not None and same and np.array_equal(seen[1], holds):
            moved = float(np.abs(estimate - seen[0]).sum())
            if moved < self.cfg.domain_tolerance * max(float(np.abs(seen[0]).sum()), 1.0):
                return seen[2]
        size = choose_domain(estimate, base, t, ctx.model, self.cfg, before=before, known=known)
        if holds is not None:
            self._scored[ctx.layer] = (estimate.copy(), holds, size)
        return size

    def _domains(self, topology: Topology) -> Topology | None:
        """The domains of the chosen size on ``topology`` (``None``: each DC), merged once
        per topology and size."""
        m = self._merged
        if m is None or m[0] is not topology or m[1] != self._size:
            dom = merge_dcs(topology, self._size) if self._size > 1 else None
            self._merged = m = (topology, self._size, dom)
        return m[2]

    def _plan(
        self, ctx: PolicyContext, prev: Placement | None
    ) -> tuple[Placement, np.ndarray, float | None]:
        """The slow loop: :func:`plan_hybrid` on the history window (never this load); the
        plan, the estimate rounded to tokens and the plan's cost if the guard kept it."""
        t = ctx.topology
        masters = (
            prev
            if prev is not None
            else static_placement(
                t.num_ranks, t.slots_per_rank, ctx.model.num_experts, t.masters_per_rank
            )
        )
        if ctx.history.shape[0] == 0:
            # nothing seen yet: each rank's token count (the batch size, known before the
            # gate runs) spread evenly over the experts, as EPLB starts from uniform load
            per_rank = ctx.load.sum(axis=1, dtype=np.float64)
            estimate = np.repeat(
                per_rank[:, None] / ctx.model.num_experts, ctx.model.num_experts, 1
            )
        else:
            estimate = ctx.history.mean(axis=0)  # [R, E]
        plan, known = _plan_hybrid(estimate, masters, t, ctx.model, self.cfg, previous=prev)
        return plan, np.rint(estimate).astype(np.int64), known

    def _solved(
        self, ctx: PolicyContext, placement: Placement
    ) -> tuple[DomainSolution, TokenTraffic, Topology] | None:
        if self._last is None or self._last[0] is not ctx:
            return None
        sol = self._last[1]
        if placement is sol.placement or _same_holds(sol.placement, placement):
            return sol, self._last[2], self._last[3]
        return None

    def route_traffic(self, ctx: PolicyContext, placement: Placement) -> TokenTraffic | None:
        """The cost model's view of the route (:func:`~expertmesh.planner.domainquota.domain_traffic`)
        without its rows, or ``None`` when ``placement`` is not the one ``ctx`` was placed to
        (then the simulator uses :attr:`even_split`)."""
        solved = self._solved(ctx, placement)
        return None if solved is None else solved[1]

    def route(self, ctx: PolicyContext, placement: Placement) -> np.ndarray:
        solved = self._solved(ctx, placement)
        if solved is None:
            return route_even(ctx.load, placement, ctx.topology.rank_dc)
        return domain_route(ctx.load, solved[0], solved[2])
