"""The step driver: which phases run, in which order, and how packets move between ranks.

The driver talks to ranks through an :class:`Executor`. :class:`LocalExecutor`
runs every :class:`RankState` in this process (tests, no Ray); the Ray
executor in ``expertmesh.runtime.cluster`` runs them as actors and passes
packets as object refs, so a whole step is submitted at once and data flows
worker to worker. A step is phases only (the step number rides on the first,
each rank's statistics come back as the last phase's packet to itself), so the
driver waits once per step.

:func:`migration_rounds` turns a plan's migrations into the rounds the ranks
execute during *prepare*; it checks the planner's transfers (a source must
hold the expert when its round starts) and adds what they miss, so a commit
never finds a rank without its weights.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from expertmesh.planner.costmodel import TransferEncoding
from expertmesh.planner.plan import Migration, Placement
from expertmesh.planner.stepmodel import StepLayout
from expertmesh.planner.topology import Topology
from expertmesh.workers.rank import RankState

__all__ = [
    "FORWARD",
    "REDUCE",
    "Executor",
    "LocalExecutor",
    "Transfer",
    "apply_plan",
    "migration_rounds",
    "recovery_rounds",
    "step_deadline_seconds",
    "step_phases",
    "train_step",
]

FORWARD = ("fan", "expert", "gather", "next")
BACKWARD = ("bfan", "bexpert", "bgather", "bnext")
REDUCE = ("red1", "red2", "red3", "red4", "red5")
Transfer = tuple[int, int, int, int, str]  # (layer, expert, src_rank, dst_rank, "w" | "opt")


class Executor(Protocol):
    """Runs phases on every rank. ``outs[p][q]`` is the packet (or a handle to it) from
    ``p`` to ``q``."""

    num_ranks: int

    def phase(self, name: str, layer: int, outs: list[list[Any]] | None, arg: Any = None) -> Any:
        """Run phase ``name`` on every rank with inbox ``[outs[p][q] for p]``; returns outs."""
        ...

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every rank (after everything submitted), wait, return."""
        ...

    def results(self, outs: list[list[Any]]) -> list[Any]:
        """Wait for the last phase; returns each rank's packet to itself ``outs[q][q]``."""
        ...


class LocalExecutor:
    """Every rank in this process, phases run rank by rank (for tests and the reference).

    Ranks not ``live`` are never run; their packets are ``None``."""

    def __init__(self, ranks: list[RankState], live: np.ndarray | None = None) -> None:
        self.ranks = ranks
        self.num_ranks = len(ranks)
        self.live = np.ones(self.num_ranks, bool) if live is None else np.asarray(live, bool)

    def phase(
        self, name: str, layer: int, outs: list[list[Any]] | None, arg: Any = None
    ) -> list[list[Any]]:
        n = self.num_ranks
        return [
            r.phase(name, layer, [outs[p][q] for p in range(n)] if outs else [], arg)
            if self.live[q]
            else [None] * n
            for q, r in enumerate(self.ranks)
        ]

    def call_all(self, method: str, *args: Any) -> list[Any]:
        return [
            getattr(r, method)(*args) for r, ok in zip(self.ranks, self.live, strict=True) if ok
        ]

    def results(self, outs: list[list[Any]]) -> list[Any]:
        return [outs[q][q] for q in range(self.num_ranks) if self.live[q]]


def step_phases(layout: StepLayout) -> list[tuple[str, int]]:
    """The rounds of a training step after ``begin``: ``(phase, layer)``. A round a layout
    skips is joined to the next (``"fan+expert"``: the rank runs both, and refuses if the
    first sent anything, so a layout that skips a needed round fails, never loses data).
    The backward of layer 0 sends nothing (the dense gradients are complete), so the first
    gradient round always joins it."""
    num_layers = len(layout.relay)
    out: list[tuple[str, int]] = []
    for layer in range(num_layers):
        a, b, c, d = FORWARD
        out += [(a, layer), (b, layer), (c, layer), (d, layer)] if layout.relay[layer] else [
            (f"{a}+{b}", layer), (f"{c}+{d}", layer)
        ]  # fmt: skip
    for layer in reversed(range(num_layers)):
        a, b, c, d = BACKWARD
        out += [(a, layer), (b, layer), (c, layer), (d, layer)] if layout.relay[layer] else [
            (f"{a}+{b}", layer), (f"{c}+{d}", layer)
        ]  # fmt: skip
    last, _ = out[-1]  # layer 0's last backward round
    out[-1] = (f"{last}+{REDUCE[0]}", 0)
    red = list(REDUCE[1:]) if layout.fanout else [*REDUCE[1:3], "+".join(REDUCE[3:])]
    return out + [(name, 0) for name in red]


def train_step(
    ex: Executor, step: int, num_layers: int, layout: StepLayout | None = None
) -> list[dict[str, Any]]:
    """One training step on every rank; returns each rank's :meth:`RankState.stats`.

    ``layout``: the rounds the committed plan needs (:func:`~expertmesh.planner.stepmodel.
    step_layout`); None: every round (right for any plan)."""
    layout = layout or StepLayout.full(num_layers)
    if len(layout.relay) != num_layers:
        raise ValueError(f"layout has {len(layout.relay)} layers, the model {num_layers}")
    outs = ex.phase("begin", 0, None, step)
    for name, layer in step_phases(layout):
        outs = ex.phase(name, layer, outs)
    return ex.results(outs)


def step_deadline_seconds(
    topology: Topology, lm: Any, *, factor: float = 20.0, floor_s: float = 60.0
) -> float:
    """A bound on one training step of ``lm`` (a ``LMConfig``) on ``topology``, generous on
    purpose: ``factor`` times the time the slowest DC link needs for a worst case (every
    token of the busiest DC crosses it four times a layer: dispatch, combine and their
    backward; every expert's weights and gradients cross it once), plus one latency per
    phase; never under ``floor_s`` (the first step warms up; a loaded machine is slow).

    A step over its deadline is not a failure by itself: the runtime then probes the DC
    links, and only a cut ends the step (``expertmesh.runtime.faults``)."""
    if factor <= 0 or floor_s < 0:
        raise ValueError(f"factor must be > 0 and floor_s >= 0, got {factor}, {floor_s}")
    if topology.num_dcs < 2:
        return float(floor_s)
    spec = lm.spec()
    off = ~np.eye(topology.num_dcs, dtype=bool)
    ranks = int(np.bincount(topology.rank_dc).max())
    token_bytes = 4 * ranks * lm.tokens_per_rank * spec.token_bytes * lm.num_layers
    expert_bytes = lm.num_layers * lm.num_experts * spec.expert_params * 2 * 4
    seconds = (token_bytes + expert_bytes) * 8 / (float(topology.dc_gbps[off].min()) * 1e9)
    phases = 1 + lm.num_layers * (len(FORWARD) + len(BACKWARD)) + len(REDUCE)
    seconds += phases * float(topology.dc_latency_ms[off].max()) / 1e3
    return max(float(floor_s), factor * seconds)


def apply_plan(
    ex: Executor,
    version: int,
    layers: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    rounds: list[list[Transfer]],
    encoding: TransferEncoding | None = None,
) -> np.ndarray:
    """Prepare plan ``version`` on every rank (run the migration ``rounds``, then check each
    rank holds what it needs). Commit is separate (:meth:`RankState.commit`). ``encoding``:
    the plan's transfer encoding (None: float32), see :class:`~expertmesh.workers.wire.WireFormat`.

    Returns [D, D] bytes the migration sent between DCs."""
    ex.call_all("prepare", version, layers, encoding)
    outs = None
    for rnd in [*rounds, []]:
        outs = ex.phase("mig", 0, outs, rnd)
    if outs is not None:  # the last round is done everywhere (Ray may run calls out of order)
        ex.results(outs)
    sent: np.ndarray = np.sum(ex.call_all("prepare_end", version), axis=0)
    return sent


def migration_rounds(
    old: list[Placement],
    new: list[Placement],
    migrations: list[Migration],
    topology: Topology,
) -> list[list[Transfer]]:
    """Rounds of transfers that turn ``old`` into ``new`` (one entry per layer each).

    The planner's transfers are kept in their rounds (relays included) when their
    source holds the expert by then; every copy they do not deliver is sent from the
    nearest holder of the old placement in one more round; a master that moves gets
    its Adam state from the old master in that round too.
    """
    if not (len(old) == len(new) == len(migrations)):
        raise ValueError("old, new and migrations need one entry per layer")
    rounds: dict[int, list[Transfer]] = {}
    extra: list[Transfer] = []
    for layer, (a, b, mig) in enumerate(zip(old, new, migrations, strict=True)):
        have = a.holds().copy()  # [R, E]
        want = b.holds()
        for k in sorted({t.round for t in mig.transfers}):
            batch = [t for t in mig.transfers if t.round == k]
            ok = [t for t in batch if have[t.src_rank, t.expert] and not have[t.dst_rank, t.expert]]
            for t in ok:
                rounds.setdefault(k, []).append((layer, t.expert, t.src_rank, t.dst_rank, "w"))
            for t in ok:
                have[t.dst_rank, t.expert] = True
        old_holders = a.holds()
        for r, e in zip(*np.nonzero(want & ~have), strict=True):
            src = np.flatnonzero(old_holders[:, e])
            near = src[np.argmin(topology.distance(src, np.full_like(src, r)))]
            extra.append((layer, int(e), int(near), int(r), "w"))
        moved = np.flatnonzero(a.master_rank() != b.master_rank())
        for e in moved.tolist():
            extra.append((layer, e, int(a.master_rank()[e]), int(b.master_rank()[e]), "opt"))
    out = [rounds[k] for k in sorted(rounds)]
    if extra:
        out.append(extra)
    return out


def recovery_rounds(
    old: list[Placement], new: list[Placement], live: np.ndarray, topology: Topology
) -> tuple[list[list[Transfer]], list[tuple[int, int, int, str]]]:
    """The transfers that turn ``old`` into ``new`` after the ranks not ``live`` [R] died.

    A copy ``new`` needs is sent from the nearest live holder in ``old`` (a replica, exact
    weights); a master whose old master is alive gets its Adam state from it. What no live
    rank has is listed in the second value as ``(layer, expert, rank, "w" | "opt")``: the
    weights of an expert with no live copy, and the Adam state of a master whose old master
    died; the caller restores those from a checkpoint. Returns ``(rounds, restore)``."""
    if not len(old) == len(new):
        raise ValueError("old and new need one entry per layer")
    live = np.asarray(live, dtype=bool)
    transfers: list[Transfer] = []
    restore: list[tuple[int, int, int, str]] = []
    for layer, (a, b) in enumerate(zip(old, new, strict=True)):
        if (b.phy2log[~live] >= 0).any():
            raise ValueError(f"layer {layer}: the new placement has copies on dead ranks")
        have = a.holds() & live[:, None]  # [R, E]
        want = b.holds()
        for r, e in zip(*np.nonzero(want & ~have), strict=True):
            src = np.flatnonzero(have[:, e])
            if src.size:
                near = src[np.argmin(topology.distance(src, np.full_like(src, r)))]
                transfers.append((layer, int(e), int(near), int(r), "w"))
            else:
                restore.append((layer, int(e), int(r), "w"))
        am, bm = a.master_rank(), b.master_rank()
        for e in np.flatnonzero(am != bm).tolist():
            if live[am[e]]:
                transfers.append((layer, e, int(am[e]), int(bm[e]), "opt"))
            else:
                restore.append((layer, e, int(bm[e]), "opt"))
    return ([transfers] if transfers else []), restore
