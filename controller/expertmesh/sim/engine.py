"""The simulator's core: run policies over a trace and cost every step with the cost model.

For every step ``t`` and layer, each policy runs exactly what the planner runs
(``place``, then ``align_placement`` to the previous placement, then its route,
then ``plan_migration``, whose transfers come as arrays from
:func:`~expertmesh.planner.migration.migration_moves`: the plan a policy sees as its
previous one holds no :class:`Migration`), and
:func:`~expertmesh.planner.costmodel.step_cost` models the step: token streams of the
route, replica sync of the placement, and the migration into it streamed in the
background over the steps the previous placement ran (``1 / gap`` of its bytes charged
at the commit step; ``gap`` = steps since the previous change).

Fast path: no route rows. A policy with a ``route_traffic(ctx, placement)``
method (``quota``, ``hybrid``) gives its own aggregated view; one whose route is an
even split (``static``, ``eplb``, ``fastermoe``, ``hybrid`` with ``inside="split"``) is
costed with :func:`~expertmesh.planner.traffic.even_traffic`; any other is costed
from its route rows. No ``[R, R]`` array. ``solve_seconds`` is the CPU time of ``place``
(and of ``route`` when rows are built), not of the cost model.

Planning and costing are separate passes: a step's plans never depend on the cost of
the steps before, so planned layer-steps are held (traffic and expert streams, no
load) and costed together by one :func:`~expertmesh.planner.costmodel.step_costs`
call (one pass of array operations instead of one per policy-step; :data:`BATCH_CELLS`
bounds what is held). An even split's traffic is held as its load and placement
(:class:`_EvenSplit`) and computed then too, the held steps of one placement together
(:func:`~expertmesh.planner.traffic.even_traffic_steps`).

Steps run outer and policies inner, so one step's load is in memory at a time
and the history windows are shared by policies that ask for the same window. What
policies compute alike at a step is computed once: a placement's alignment, the
migration plan between two placements and a placement's replica streams are memoized
by value (:class:`_Memo`), the load's statistics by the traffic functions (the step's
layers are read-only views), and each context is checked once per window and layer.
A planned layer's weights (its migration's transfers, their bytes and streams, the replica
sync) are costed by :mod:`expertmesh.sim.costing`. ``PolicyRun.cost_parts``: the CPU
seconds of the cost model's parts (:data:`COST_PARTS`).
No file I/O, no printing: the caller passes a ``progress`` callback.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, cast

import numpy as np

from expertmesh.planner.costmodel import (
    CostSettings,
    ExpertStreams,
    StepCost,
    TransferEncoding,
    step_costs,
)
from expertmesh.planner.migration import align_placement
from expertmesh.planner.model import ModelSpec
from expertmesh.planner.plan import LayerPlan, Migration, Placement
from expertmesh.planner.policy import Policy, PolicyContext, make_policy
from expertmesh.planner.topology import Topology
from expertmesh.planner.traffic import (
    Domain,
    TokenTraffic,
    even_traffic,
    even_traffic_steps,
    traffic_from_route,
)
from expertmesh.sim.costing import (
    _fanout_seconds,
    _migration,
    _migration_bytes,
    _moved,
    _pkey,
    _sync_streams,
)
from expertmesh.sim.history import _History

__all__ = [
    "COLUMNS",
    "COST_PARTS",
    "LoadSource",
    "PolicyRun",
    "SimResult",
    "StepRow",
    "dense_source",
    "simulate",
]

log = logging.getLogger(__name__)

#: the even split of policies that do not say so themselves (checked by tests)
EVEN_SPLITS: dict[str, tuple[str, str]] = {"static": ("global", "spread"), "eplb": ("dc", "spread")}

#: the cost model's parts timed per policy (``PolicyRun.cost_parts``): the token traffic
#: of the route, the replica sync streams, the migration (its plan, bytes, streams and the
#: microbatch fan-out), and the step cost over all of them
COST_PARTS = ("traffic", "replica streams", "migration", "step cost")

#: planned layer-steps are costed together (one ``step_costs`` call) until they hold this
#: many array cells (:attr:`_Planned.cells`): a whole 64-rank EP group's run in one call,
#: a step at a time on thousands of ranks and DC pairs; deferred even splits are computed
#: with at most this many load cells stacked at once
BATCH_CELLS = 1 << 20

#: the route of a plan costed without route rows (read-only, shared)
_NO_ROUTE = np.zeros((0, 4), np.int64)
_NO_ROUTE.flags.writeable = False

COLUMNS = (
    "policy", "step", "seconds", "imbalance", "cross_dc_token_bytes", "cross_dc_weight_bytes",
    "migration_bytes", "replicas", "solve_seconds", "exposed_seconds", "bottleneck",
)  # fmt: skip


class LoadSource(Protocol):
    """Per-step loads: ``num_steps``, ``num_layers``, ``num_ranks``, ``num_experts`` and
    ``step(t)`` -> [L, R, E] int64 (deterministic: the same ``t`` gives the same array).
    The simulator keeps the arrays ``step`` returns for the rest of the run (a group's
    steps are costed together after planning; history windows may be views of them): a
    source returns a new array, or a view of data it never changes, not one buffer it
    refills from step to step."""

    @property
    def num_steps(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_ranks(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    def step(self, t: int) -> np.ndarray: ...


@dataclass(frozen=True)
class StepRow:
    """One policy at one step, summed (seconds, bytes) or averaged (imbalance) over layers."""

    policy: str
    step: int
    seconds: float
    imbalance: float
    cross_dc_token_bytes: float
    cross_dc_weight_bytes: float
    migration_bytes: float
    replicas: int
    solve_seconds: float
    exposed_seconds: float
    bottleneck: str

    def values(self) -> tuple[object, ...]:
        return tuple(getattr(self, c) for c in COLUMNS)


@dataclass
class PolicyRun:
    """Rows of one policy, or why it did not run (``skipped``)."""

    name: str
    rows: list[StepRow] = field(default_factory=list)
    skipped: str | None = None
    #: CPU seconds of this policy's steps in the simulator: its solves (``solve_seconds``)
    #: plus the cost model and bookkeeping of every step
    cpu_seconds: float = 0.0
    #: CPU seconds of the cost model's parts (:data:`COST_PARTS`) of this policy's steps
    cost_parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COST_PARTS, 0.0))

    def total(self, column: str) -> float:
        return float(sum(getattr(r, column) for r in self.rows))

    @property
    def mean_seconds(self) -> float:
        return self.total("seconds") / len(self.rows) if self.rows else float("nan")

    @property
    def median_seconds(self) -> float:
        return float(np.median([r.seconds for r in self.rows])) if self.rows else float("nan")


@dataclass
class SimResult:
    """Every policy's rows; ``num_groups`` EP groups (:mod:`expertmesh.sim.groups`) whose
    cross-group gradient all-reduce adds ``dp_seconds`` to every step."""

    runs: list[PolicyRun]
    wall_seconds: float = 0.0
    num_groups: int = 1
    dp_seconds: float = 0.0

    def run(self, name: str) -> PolicyRun | None:
        return next((r for r in self.runs if r.name == name and r.skipped is None), None)

    def speedup(self, name: str, baseline: str = "static") -> float:
        """Mean step time of ``baseline`` / mean step time of ``name`` (nan if missing)."""
        a, b = self.run(baseline), self.run(name)
        if a is None or b is None:
            return float("nan")
        return a.mean_seconds / b.mean_seconds


class _Memo:
    """The last few results of a pure function of placements, keyed by their arrays' bytes:
    policies that reach the same placement from the same one (``quota`` and ``hybrid``
    often do) share its alignment, migration and replica streams instead of computing
    them again (the same objects: nothing downstream modifies them)."""

    def __init__(self, kept: int = 16) -> None:
        self.kept = kept
        self.items: dict[tuple[object, ...], object] = {}
        self.hits = 0
        self.keys: weakref.WeakKeyDictionary[Placement, tuple[object, ...]] = (
            weakref.WeakKeyDictionary()
        )
        #: placements :func:`align_placement` has checked or made (a result of it is valid)
        self.checked: weakref.WeakSet[Placement] = weakref.WeakSet()

    def key(self, p: Placement) -> tuple[object, ...]:
        """:func:`_pkey` of ``p``, computed once per placement object: the engine takes a
        placement it holds to be unmodified (it tells a policy's unchanged placement by
        identity), and the memo's keys then share their bytes (hashed once)."""
        got = self.keys.get(p)
        if got is None:
            got = self.keys[p] = _pkey(p)
        return got

    def get(self, key: tuple[object, ...]) -> object | None:
        got = self.items.get(key)
        self.hits += got is not None
        return got

    def put(self, key: tuple[object, ...], value: object) -> None:
        if len(self.items) >= self.kept:
            self.items.pop(next(iter(self.items)))
        self.items[key] = value


@dataclass(frozen=True)
class _World:
    """What every policy shares: topology, model, cost model, history windows, and the
    memo of placement functions (:class:`_Memo`)."""

    topology: Topology
    model: ModelSpec
    cost: CostSettings
    hist: dict[tuple[int, int], _History]
    shape: tuple[int, int]
    memo: _Memo = field(default_factory=_Memo)
    #: this step's validated contexts without a previous plan, by (history window, layer)
    contexts: dict[tuple[int, int], PolicyContext] = field(default_factory=dict)


def _context(
    world: _World, t: int, key: tuple[int, int], load: np.ndarray, prev: LayerPlan | None
) -> PolicyContext:
    """Step ``t``'s context for layer ``key[1]`` with history window ``key[0]``. Its load is
    checked once per step, not once per policy or window (``PolicyContext`` scans it):
    another window's context of the layer has checked this load. Its history is never
    scanned (``PolicyContext`` checks an empty one; the window goes in unchecked): a
    history holds only loads checked at their own steps. A policy's own previous plan (the
    engine's, of this topology and model) goes into a copy."""
    base = world.contexts.get(key)
    if base is None:
        history = world.hist[key].view(world.shape)
        seen = next((c for (_, layer), c in world.contexts.items() if layer == key[1]), None)
        if seen is None:
            seen = PolicyContext(
                topology=world.topology, model=world.model, step=t, layer=key[1],
                load=load, history=history[:0],
            )  # fmt: skip
        base = _unchecked(seen, "history", history)
        world.contexts[key] = base
    return base if prev is None else _unchecked(base, "previous", prev)


def _unchecked(ctx: PolicyContext, name: str, value: object) -> PolicyContext:
    """A copy of ``ctx`` (``copy.copy``'s: a new object with its fields) with field ``name``
    set to ``value``, not checked again."""
    out: PolicyContext = object.__new__(type(ctx))
    out.__dict__.update(ctx.__dict__)
    object.__setattr__(out, name, value)
    return out


class _PolicyState:
    """One policy's running state: previous plans, receivers' last copies, cached streams."""

    def __init__(self, name: str, policy: Policy, num_layers: int) -> None:
        self.name, self.policy = name, policy
        self.prev: list[LayerPlan | None] = [None] * num_layers
        self.changed_at = [0] * num_layers
        self.last_held: list[np.ndarray | None] = [None] * num_layers
        self.streams: list[tuple[Placement, ExpertStreams] | None] = [None] * num_layers
        #: the policy's history window (read once: the engine's windows are made for it)
        self.window = policy.history_window()
        split = getattr(policy, "even_split", None) or EVEN_SPLITS.get(name)
        self.split = tuple(split) if split is not None else None
        enc = getattr(policy, "transfer_encoding", None)
        self.encoding = enc if isinstance(enc, TransferEncoding) else TransferEncoding()
        #: what the policy decides every microbatch on the critical path (None: nothing):
        #: "all" its copies, "in_dc" its copies inside a DC (cross-DC ones are the slow loop's)
        self.microbatch = getattr(policy, "microbatch_copies", None)
        self.run = PolicyRun(name)


def _make(
    names: list[str], settings: dict[str, dict[str, object]], cost: CostSettings
) -> Iterator[tuple[str, Policy | str]]:
    """Each policy, or the reason it cannot run. A policy with a ``cost`` setting gets the
    simulator's cost model unless its settings name one."""
    for name in names:
        try:
            pol = make_policy(name, settings.get(name))
            own = settings.get(name, {})
            if "cost" in pol.Settings.model_fields and "cost" not in own:
                pol = make_policy(name, {**own, "cost": cost.model_dump()})
            yield name, pol
        except ValueError as err:
            yield name, str(err)


def simulate(
    loads: LoadSource,
    topology: Topology,
    model: ModelSpec,
    policies: list[str],
    *,
    policy_settings: dict[str, dict[str, object]] | None = None,
    cost: CostSettings | None = None,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Run ``policies`` over ``loads`` on ``topology``; one :class:`StepRow` per policy and step.

    A policy that is not registered or whose settings are refused is reported as
    skipped; one that raises ``ValueError`` while planning is stopped and reported with
    the message. ``policy_settings`` maps a policy name to its settings; policies with a
    ``cost`` setting get ``cost`` unless they set it themselves. ``progress(n)`` is
    called after each step with the number of policy-steps planned.
    """
    if loads.num_ranks != topology.num_ranks:
        raise ValueError(f"trace has {loads.num_ranks} ranks, the topology {topology.num_ranks}")
    if loads.num_experts != model.num_experts:
        raise ValueError(f"trace has {loads.num_experts} experts, the model {model.num_experts}")
    cost = cost or CostSettings()
    settings = {k: dict(v) for k, v in (policy_settings or {}).items()}
    t_start = time.perf_counter()
    world = _World(topology, model, cost, {}, (loads.num_ranks, loads.num_experts))
    states: list[_PolicyState | None] = []  # None: cannot run
    runs: list[PolicyRun] = []
    for name, pol in _make(policies, settings, cost):
        if isinstance(pol, str):
            runs.append(PolicyRun(name, skipped=pol))
            states.append(None)
            continue
        st = _PolicyState(name, pol, loads.num_layers)
        _add_history(world, st)
        states.append(st)
        runs.append(st.run)
    pending: list[tuple[_PolicyState, int, list[_Planned]]] = []  # planned, not yet costed
    cells = 0
    for t in range(loads.num_steps):
        planned = _plan_step(world, states, t, loads.step(t))
        for state, layers in zip(states, planned, strict=True):
            if state is not None and layers is not None:
                pending.append((state, t, layers))
                cells += sum(p.cells for p in layers)
        if cells >= BATCH_CELLS:
            _cost_pending(pending, world)
            pending, cells = [], 0
        if progress is not None:
            progress(sum(state is not None for state in states))
    _cost_pending(pending, world)
    return SimResult(runs, time.perf_counter() - t_start)


def _add_history(world: _World, st: _PolicyState) -> None:
    """The history windows ``st``'s policy reads, one per layer (shared by equal windows)."""
    w = st.window
    for layer in range(len(st.prev)):
        world.hist.setdefault((w, layer), _History(w))


@dataclass(frozen=True)
class _EvenSplit:
    """The even split ``split`` = (domain, remote) of ``load`` [R, E] over ``placement``:
    traffic computed when its layer-step is costed, the steps of one placement together
    (:func:`~expertmesh.planner.traffic.even_traffic_steps`)."""

    load: np.ndarray
    placement: Placement
    split: tuple[Domain, Literal["spread", "master"]]


@dataclass(frozen=True)
class _Planned:
    """One layer of one policy at one step, planned and waiting for its cost."""

    traffic: TokenTraffic | _EvenSplit
    streams: ExpertStreams
    place_seconds: float
    fanout: float
    solve_seconds: float
    migration_bytes: float
    replicas: int

    @property
    def cells(self) -> int:
        """Array cells it holds for the cost model (ranks and DC pairs): what
        :data:`BATCH_CELLS` counts."""
        t = self.traffic
        held = t.load.shape[0] if isinstance(t, _EvenSplit) else t.num_ranks + t.pair_src.size
        return held + self.streams.pair_src.size


def _plan_step(
    world: _World, states: list[_PolicyState | None], t: int, step_load: np.ndarray
) -> list[list[_Planned] | None]:
    """Plan step ``t`` (``step_load`` [L, R, E]) for every policy still running on one source;
    ``None`` for one that is not (a ``ValueError`` stops it, as :func:`simulate` says)."""
    layers = _layer_views(step_load)
    world.contexts.clear()
    out: list[list[_Planned] | None] = []
    for st in states:
        if st is None or st.run.skipped is not None:
            out.append(None)
            continue
        t0 = time.process_time()
        try:
            out.append([_plan(st, world, t, layer, load) for layer, load in enumerate(layers)])
        except ValueError as err:
            out.append(None)
            _stop(st, t, err)
        st.run.cpu_seconds += time.process_time() - t0
    for (_, layer), h in world.hist.items():
        h.push(step_load[layer])
    return out


def _stop(st: _PolicyState, t: int, err: ValueError) -> None:
    st.run.skipped = f"failed at step {t}: {err}"
    log.warning("policy %s stopped at step %d: %s", st.name, t, err)


def _cost_pending(pending: list[tuple[_PolicyState, int, list[_Planned]]], world: _World) -> None:
    """Cost every planned ``(policy, step, layers)`` of ``pending`` with one ``step_costs``
    call and append each row (in ``pending``'s order: step by step); each policy's cost
    parts and CPU seconds get the call's CPU time in proportion to its layers. Deferred even
    splits (:class:`_EvenSplit`) are computed first (:func:`_even_splits`). When the call
    fails (``ValueError``), each entry is costed alone: one that fails stops its policy at
    its step (its later entries are dropped) and the other policies keep their rows."""
    pending = _even_splits(pending, world)
    if not pending:
        return
    try:
        _cost_rows(pending, world)
    except ValueError:
        for entry in pending:
            st, t, _ = entry
            if st.run.skipped is not None:
                continue
            try:
                _cost_rows([entry], world)
            except ValueError as err:
                _stop(st, t, err)


def _cost_rows(pending: list[tuple[_PolicyState, int, list[_Planned]]], world: _World) -> None:
    """The rows of ``pending`` from one ``step_costs`` call; appends nothing when it raises."""
    items = [p for _, _, layers in pending for p in layers]
    t0 = time.process_time()
    costs = step_costs(
        world.topology, world.model, [cast(TokenTraffic, p.traffic) for p in items],
        [p.streams for p in items], world.cost,
    )  # fmt: skip
    per_item = (time.process_time() - t0) / len(items)
    at = 0
    for st, t, layers in pending:
        st.run.rows.append(_row(st, t, layers, costs[at : at + len(layers)], world.cost))
        at += len(layers)
        st.run.cpu_seconds += per_item * len(layers)
        st.run.cost_parts["step cost"] += per_item * len(layers)


def _even_splits(
    pending: list[tuple[_PolicyState, int, list[_Planned]]], world: _World
) -> list[tuple[_PolicyState, int, list[_Planned]]]:
    """``pending`` with the traffic of every :class:`_EvenSplit` computed: the steps of one
    placement and split together (:func:`_split_traffic`), its CPU time the ``traffic`` part of their policies. A split that fails (``ValueError``)
    stops its policy at the first step that fails, as when it was computed while planning:
    that policy's layer-steps from that step on are dropped."""
    jobs: dict[tuple[object, ...], list[tuple[int, int]]] = {}  # (placement, split): [(i, layer)]
    for i, (_, _, layers) in enumerate(pending):
        for layer, p in enumerate(layers):
            if isinstance(p.traffic, _EvenSplit):
                key = (world.memo.key(p.traffic.placement), p.traffic.split)
                jobs.setdefault(key, []).append((i, layer))
    if not jobs:
        return pending
    done = [list(layers) for _, _, layers in pending]
    stopped: dict[str, int] = {}  # policy -> the step its split failed at
    for at in jobs.values():
        t0 = time.process_time()
        split = [cast(_EvenSplit, pending[i][2][layer].traffic) for i, layer in at]
        got = _split_traffic(split, world, pending, at, stopped)
        for (i, layer), traffic in zip(at, got, strict=True):
            done[i][layer] = replace(done[i][layer], traffic=traffic)
        share = (time.process_time() - t0) / len(at)
        for i, _ in at:
            pending[i][0].run.cost_parts["traffic"] += share
            pending[i][0].run.cpu_seconds += share
    return [
        (st, t, layers)
        for (st, t, _), layers in zip(pending, done, strict=True)
        if t < stopped.get(st.name, t + 1)
    ]


def _split_traffic(
    split: list[_EvenSplit],
    world: _World,
    pending: list[tuple[_PolicyState, int, list[_Planned]]],
    at: list[tuple[int, int]],
    stopped: dict[str, int],
) -> list[TokenTraffic | _EvenSplit]:
    """The traffic of ``split`` (deferred splits of one placement, at ``at`` in ``pending``),
    at most :data:`BATCH_CELLS` load cells stacked at once. When the steps together fail,
    each alone: a failing one stops its policy (recorded in ``stopped``: policy -> step)
    and stays deferred (it is dropped)."""
    topo, k = world.topology, world.model.top_k
    domain, remote = split[0].split
    per = max(1, BATCH_CELLS // split[0].load.size)  # steps stacked at once: [T, R, E] each
    placement = split[0].placement  # one placement: the caller groups by it
    out: list[TokenTraffic | _EvenSplit] = []
    try:
        for first in range(0, len(split), per):
            loads = _stacked([s.load for s in split[first : first + per]])  # [T, R, E]
            out += even_traffic_steps(loads, placement, topo, k, domain=domain, remote=remote)
        return out
    except ValueError:
        out.clear()
    for s, (i, _) in zip(split, at, strict=True):
        st, t = pending[i][0], pending[i][1]
        try:
            out.append(even_traffic(s.load, s.placement, topo, k, domain=domain, remote=remote))
        except ValueError as err:
            out.append(s)
            if t < stopped.get(st.name, t + 1):
                stopped[st.name] = t
                _stop(st, t, err)
    return out


def _stacked(loads: list[np.ndarray]) -> np.ndarray:
    """``np.stack(loads)``: a read-only view when the loads are evenly spaced views of one
    array with one shape and layout (a dense source's steps of one layer), else a copy."""
    first = loads[0]
    same = all(
        x.base is first.base and x.shape == first.shape and x.strides == first.strides
        and x.dtype == first.dtype
        for x in loads
    )  # fmt: skip
    if first.base is not None and len(loads) > 1 and same:
        at = [x.__array_interface__["data"][0] for x in loads]
        step = at[1] - at[0]
        if step > 0 and all(b - a == step for a, b in itertools.pairwise(at)):
            shape, strides = (len(loads), *first.shape), (step, *first.strides)
            view: np.ndarray = np.lib.stride_tricks.as_strided(
                first, shape, strides, writeable=False
            )
            return view
    return np.stack(loads)


def _plan(st: _PolicyState, world: _World, t: int, layer: int, load: np.ndarray) -> _Planned:
    """Plan one layer of one step for one policy: place, align, route, migrate; the traffic
    and expert streams its cost needs (``load``: the layer's [R, E] load)."""
    topology, model = world.topology, world.model
    w = st.window
    parts = st.run.cost_parts
    prev = st.prev[layer]
    ctx = _context(world, t, (w, layer), load, prev)
    t0 = time.process_time()
    placement = st.policy.place(ctx)
    place_seconds = time.process_time() - t0
    if prev is not None and placement is not prev.placement:
        relabel = bool(getattr(st.policy, "relabel_ranks", False))
        placement = _aligned(world, prev.placement, placement, relabel)
    clock = time.process_time()
    solve = clock - t0
    route = _NO_ROUTE
    route_seconds = 0.0
    traffic = _fast_traffic(st, ctx, placement)
    if traffic is None:  # the policy's route rows (timed: routing is part of planning)
        t0 = time.process_time()
        route = st.policy.route(ctx, placement)
        route_seconds = time.process_time() - t0
        solve += route_seconds
        traffic = traffic_from_route(route, load, topology, model.top_k)
    clock = _lap(parts, "traffic", clock, route_seconds)
    changed = (
        prev is not None
        and placement is not prev.placement
        and not np.array_equal(prev.placement.phy2log, placement.phy2log)
    )
    streams = _sync_streams(st, world, layer, placement)
    clock = _lap(parts, "replica streams", clock)
    mig_bytes = 0.0
    fanout = 0.0  # seconds until this microbatch's replica weights have landed
    if changed and prev is not None:
        moves = _migration(world, prev.placement, placement)
        gap = max(1, t - st.changed_at[layer])
        st.changed_at[layer] = t
        nbytes = _migration_bytes(st, world, (layer, t), moves, prev.placement)
        mig_bytes = float(nbytes.sum())
        streams = streams + _moved(world, moves.src, moves.dst, nbytes, 1.0 / gap)
        if st.microbatch is not None:
            fanout = _fanout_seconds(world, st.microbatch, st.policy, moves, nbytes)
    _lap(parts, "migration", clock)
    st.prev[layer] = LayerPlan(placement=placement, route=route, migration=Migration())
    replicas = int(np.count_nonzero(placement.phy2log >= 0)) - model.num_experts
    return _Planned(traffic, streams, place_seconds, fanout, solve, mig_bytes, replicas)


def _row(
    st: _PolicyState, t: int, layers: list[_Planned], costs: list[StepCost], cost: CostSettings
) -> StepRow:
    """One policy's row at step ``t``: its planned ``layers`` with their ``costs``, summed
    (seconds, bytes) or averaged (imbalance) over layers."""
    seconds = imb = tok_bytes = w_bytes = mig_bytes = solve = exposed = 0.0
    replicas = 0
    bottleneck = ""
    num_layers = len(layers)
    for layer, (p, c) in enumerate(zip(layers, costs, strict=True)):
        solve += p.solve_seconds
        mig_bytes += p.migration_bytes
        if st.microbatch is not None:
            # the microbatch's solve and replica fan-out run while the tokens for copies
            # already in place are dispatched (FEPLB's two-phase dispatch); what is left
            # over waits on the critical path (docs/cost-model.md: charging everything)
            fast = getattr(st.policy, "microbatch_seconds", None)
            fast = p.place_seconds if fast is None else float(fast)
            fast = fast if cost.solve_on_critical_path else 0.0
            lost = max(0.0, fast + p.fanout - c.phases.get("dispatch", 0.0))
            exposed += lost
            seconds += lost
        seconds += c.seconds
        imb += c.imbalance / num_layers
        tok_bytes += c.cross_dc_token_bytes
        w_bytes += c.cross_dc_weight_bytes
        replicas += p.replicas
        if layer == 0:
            bottleneck = c.bottleneck
    return StepRow(
        st.name, t, seconds, imb, tok_bytes, w_bytes, mig_bytes, replicas, solve, exposed,
        bottleneck,
    )  # fmt: skip


def _layer_views(step_load: np.ndarray) -> list[np.ndarray]:
    """Read-only [R, E] views of one step's layers, shared by every policy of the step (the
    traffic functions memoize what they derive from a read-only load: computed once per
    step and layer, not once per policy)."""
    views = []
    for layer in range(step_load.shape[0]):
        v = step_load[layer]
        v.flags.writeable = False
        views.append(v)
    return views


def _lap(parts: dict[str, float], part: str, since: float, minus: float = 0.0) -> float:
    """Add the CPU seconds since ``since`` (less ``minus``) to ``parts[part]``; the time now."""
    now = time.process_time()
    parts[part] += now - since - minus
    return now


def _aligned(world: _World, prev: Placement, placement: Placement, relabel: bool) -> Placement:
    """:func:`align_placement` of ``placement`` to ``prev``, memoized by value."""
    memo = world.memo
    key = ("align", relabel, memo.key(prev), memo.key(placement))
    got = cast(Placement | None, memo.get(key))
    if got is None:
        # ``prev`` is checked when an alignment made it or checked it as ``new`` before
        old_checked = prev in memo.checked
        got = align_placement(prev, placement, world.topology, relabel, old_checked=old_checked)
        memo.put(key, got)
        memo.checked.add(placement)
        memo.checked.add(got)
    return got


def _fast_traffic(
    st: _PolicyState, ctx: PolicyContext, placement: Placement
) -> TokenTraffic | _EvenSplit | None:
    """The traffic without route rows: the policy's own ``route_traffic`` view, or its even
    split (computed when costed: :class:`_EvenSplit`); ``None`` when neither applies."""
    summarize = getattr(st.policy, "route_traffic", None)
    if callable(summarize):
        traffic = summarize(ctx, placement)
        if traffic is not None:
            return traffic
    if st.split is None:
        return None
    return _EvenSplit(ctx.load, placement, st.split)


def dense_source(load: np.ndarray) -> LoadSource:
    """A :class:`LoadSource` over a [T, L, R, E] array."""
    return _ArraySource(load)


@dataclass(frozen=True)
class _ArraySource:
    load: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.load.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.load.shape[1])

    @property
    def num_ranks(self) -> int:
        return int(self.load.shape[2])

    @property
    def num_experts(self) -> int:
        return int(self.load.shape[3])

    def step(self, t: int) -> np.ndarray:
        return self.load[t]
