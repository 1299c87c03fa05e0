"""Load summed per DC over a window of microbatches (hierarchical load aggregation).

At 1,000 DCs x 8 ranks x 58 MoE layers a step is 464,000 per-rank load reports: more
than one controller ingests. A DC's aggregator (``expertmesh.workers.aggregate``) sums
its ranks' reports over an aligned window of ``N`` microbatches and sends one
:class:`WindowReport` per layer per window: the DC's ``[E]`` sum, or ``[n, E]`` sums per
rank of the DC when a policy needs the ranks apart. The controller assembles the DCs'
reports of a window into one ``[R, E]`` load per layer, the window's *mean per
microbatch* (:func:`window_mean`), which enters the layer's load window like one
microbatch's load: every policy plans on it unchanged (per-DC and per-expert sums exact
up to rounding; ranks inside a DC evenly split when only the DC's sum came).

Pure: numpy only. :func:`window_mean_reference` is the slow, obvious version the
tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from expertmesh.planner.topology import Topology

__all__ = [
    "MAX_COUNT",
    "WindowBlock",
    "WindowReport",
    "spread_table",
    "window_mean",
    "window_mean_reference",
]

MAX_COUNT = 2**40  # most tokens one rank sends one expert in one microbatch


@dataclass(frozen=True, eq=False)
class WindowReport:
    """One DC's load of one layer summed over the window ``[first_step, last_step]``.

    - ``dc``: index of the DC in the topology; ``layer``: the MoE layer.
    - ``steps``: microbatches summed (``1 <= steps <= last_step - first_step + 1``; fewer
      than the window when the aggregator closed it early, e.g. a rank died).
    - ``reports``: per-rank reports summed into it (for end-to-end accounting).
    - ``load``: ``[E]`` the DC's tokens per expert summed over its ranks and the window's
      microbatches, or ``[n, E]`` per rank of the DC (its ranks in topology order).

    Checked here (``ValueError``): ranges, shapes against nothing but themselves. The
    controller checks layer, DC, ``n`` and ``E`` against its topology and model.
    """

    first_step: int
    last_step: int
    layer: int
    dc: int
    steps: int
    reports: int
    load: np.ndarray

    def __post_init__(self) -> None:
        if not 0 <= self.first_step <= self.last_step < 2**62:
            raise ValueError(
                f"window must satisfy 0 <= first_step <= last_step < 2**62, got "
                f"[{self.first_step}, {self.last_step}]"
            )
        if not 1 <= self.steps <= self.last_step - self.first_step + 1:
            raise ValueError(
                f"steps must be in [1, {self.last_step - self.first_step + 1}], got {self.steps}"
            )
        if self.layer < 0 or self.dc < 0 or self.reports < 0:
            raise ValueError("layer, dc and reports must be >= 0")
        load = np.asarray(self.load)
        if load.ndim not in (1, 2) or load.dtype.kind not in "iu":
            raise ValueError(f"load must be integer [E] or [n, E], got {load.dtype} {load.shape}")
        if load.dtype != np.int64:
            load = load.astype(np.int64)
        rows = 1 if load.ndim == 1 else load.shape[0]
        if load.size and (load.min() < 0 or load.max() > MAX_COUNT * self.steps * rows):
            raise ValueError("load counts must be in [0, 2**40 * steps * rows]")
        object.__setattr__(self, "load", load)

    @property
    def per_rank(self) -> bool:
        return self.load.ndim == 2


@dataclass(frozen=True, eq=False)
class WindowBlock:
    """One DC's window ``[first_step, last_step]`` of ``K`` layers at once (what a DC's
    aggregator emits per window): stands for the ``K`` :class:`WindowReport` of
    :meth:`split` and is counted as ``K`` of them.

    - ``layers`` [K] distinct layers; ``steps`` [K] and ``reports`` [K] per layer.
    - ``load``: ``[K, E]`` the DC's sums, or ``[K, n, E]`` per rank of the DC.

    Checked here (``ValueError``), vectorized: what :class:`WindowReport` checks."""

    first_step: int
    last_step: int
    dc: int
    layers: np.ndarray
    steps: np.ndarray
    reports: np.ndarray
    load: np.ndarray

    def __post_init__(self) -> None:
        if not 0 <= self.first_step <= self.last_step < 2**62 or self.dc < 0:
            raise ValueError(
                f"window must satisfy 0 <= first_step <= last_step < 2**62 and dc >= 0, got "
                f"[{self.first_step}, {self.last_step}] of DC {self.dc}"
            )
        layers, steps, reports = (
            np.asarray(a, np.int64).reshape(-1) for a in (self.layers, self.steps, self.reports)
        )
        k = layers.shape[0]
        load = np.asarray(self.load)
        if not k or steps.shape[0] != k or reports.shape[0] != k:
            raise ValueError(f"layers, steps and reports must be [K], K >= 1; got {k}, "
                             f"{steps.shape[0]}, {reports.shape[0]}")  # fmt: skip
        if load.ndim not in (2, 3) or load.shape[0] != k or load.dtype.kind not in "iu":
            raise ValueError(f"load must be integer [K, E] or [K, n, E] with K = {k}, got "
                             f"{load.dtype} {list(load.shape)}")  # fmt: skip
        span = self.last_step - self.first_step + 1
        if layers.min() < 0 or np.unique(layers).size != k:
            raise ValueError("layers must be distinct and >= 0")
        if steps.min() < 1 or steps.max() > span or reports.min() < 0:
            raise ValueError(f"steps must be in [1, {span}] and reports >= 0")
        rows = 1 if load.ndim == 2 else load.shape[1]
        if load.dtype != np.int64:
            load = load.astype(np.int64)
        flat = load.reshape(k, -1)
        if flat.size and (flat.min() < 0 or (flat.max(axis=1) > MAX_COUNT * steps * rows).any()):
            raise ValueError("load counts must be in [0, 2**40 * steps * rows]")
        for name, a in (("layers", layers), ("steps", steps), ("reports", reports), ("load", load)):
            object.__setattr__(self, name, a)

    @property
    def per_rank(self) -> bool:
        return self.load.ndim == 3

    def __len__(self) -> int:
        return int(self.layers.shape[0])

    def split(self) -> list[WindowReport]:
        """The ``K`` window reports this block stands for."""
        cols = zip(self.layers.tolist(), self.steps.tolist(), self.reports.tolist(), strict=True)
        return [
            WindowReport(self.first_step, self.last_step, layer, self.dc, st, rp, self.load[i])
            for i, (layer, st, rp) in enumerate(cols)
        ]

    @staticmethod
    def of(reports: list[WindowReport]) -> list[WindowReport | WindowBlock]:
        """``reports`` with each run of consecutive ones of the same DC, window and shape
        (distinct layers) merged into one block (a run of one stays a report)."""
        out: list[WindowReport | WindowBlock] = []
        run: list[WindowReport] = []

        def close() -> None:
            if len(run) == 1:
                out.append(run[0])
            elif run:
                out.append(
                    WindowBlock(run[0].first_step, run[0].last_step, run[0].dc,
                                np.array([r.layer for r in run]), np.array([r.steps for r in run]),
                                np.array([r.reports for r in run]), np.stack([r.load for r in run]))
                )  # fmt: skip
            run.clear()

        layers: set[int] = set()  # the run's
        for rep in reports:
            head = run[0] if run else None
            same = head is not None and (
                (rep.first_step, rep.last_step, rep.dc, rep.load.shape)
                == (head.first_step, head.last_step, head.dc, head.load.shape)
                and rep.layer not in layers
            )
            if not same:
                close()
                layers.clear()
            run.append(rep)
            layers.add(rep.layer)
        close()
        return out


def spread_table(
    topology: Topology, live: np.ndarray, num_experts: int
) -> tuple[np.ndarray, np.ndarray]:
    """How :func:`window_mean` splits a DC's sum over its live ranks; depends only on
    membership, so compute it once per change.

    ``live``: [R] bool. Returns (``n_live`` [D] live ranks per DC, ``pos`` [R, E] int32:
    ``(j - e) mod n_live`` for live rank ``r`` at position ``j`` among its DC's live ranks,
    ``n_live`` for dead ranks, so that ``pos < rem`` never holds for them)."""
    live = np.asarray(live, bool)
    dc = topology.rank_dc
    n_live = np.bincount(dc, weights=live, minlength=topology.num_dcs).astype(np.int64)
    order = np.cumsum(live) - 1  # [R] running count of live ranks
    starts = np.concatenate([[0], np.cumsum(n_live)[:-1]])  # [D] first live index of each DC
    turn = order - starts[dc]  # [R] position among the DC's live ranks
    n = np.maximum(n_live, 1)[dc][:, None]  # [R, 1]
    pos = (turn[:, None] - np.arange(num_experts)[None, :]) % n  # [R, E]
    pos[~live] = n_live[dc][~live][:, None]
    return n_live, pos.astype(np.int32)


def window_mean(
    topology: Topology,
    live: np.ndarray,
    *,
    steps: np.ndarray,
    dc_sum: np.ndarray,
    rank_sum: np.ndarray | None,
    per_rank: np.ndarray,
    table: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """The window's mean load per microbatch, ``[R, E]`` int64.

    - ``live``: [R] bool, ranks taking part (dead ranks get 0).
    - ``steps``: [D] microbatches each DC summed (>= 1 where the DC has live ranks).
    - ``dc_sum``: [D, E] each DC's sum over its ranks and the window.
    - ``rank_sum``: [R, E] per-rank sums for the DCs with ``per_rank[d]``, else unused
      (may be None when no DC sent per-rank sums).
    - ``per_rank``: [D] bool, the DC sent its ranks apart.
    - ``table``: :func:`spread_table` of ``live`` (made here when None).

    Per-rank DCs: each rank's sum / steps, rounded half up. Others: each expert's DC total
    / steps, rounded half up, split over the DC's live ranks as evenly as integers allow;
    the remainder of expert ``e`` goes to the live ranks whose position ``j`` satisfies
    ``(j - e) mod n < rem`` (rotating with the expert, so no rank is favoured)."""
    live = np.asarray(live, bool)
    num_experts = dc_sum.shape[1]
    n_live, pos = table if table is not None else spread_table(topology, live, num_experts)
    sizes = np.array([d.num_ranks for d in topology.dcs])
    denom = np.maximum(np.asarray(steps, np.int64), 1)
    total = (2 * dc_sum + denom[:, None]) // (2 * denom[:, None])  # [D, E] rounded half up
    q, rem = np.divmod(total, np.maximum(n_live, 1)[:, None])  # [D, E]
    if live.all() and (sizes == sizes[0]).all():
        # every DC the same size and whole: DC-major blocks, broadcast instead of gathers
        d, n = topology.num_dcs, int(sizes[0])
        blocks = np.empty((d, n, num_experts), np.int64)  # [D, n, E]
        more = pos.reshape(d, n, num_experts) < rem.astype(np.int32)[:, None, :]
        np.add(q[:, None, :], more, out=blocks)
        out: np.ndarray = blocks.reshape(d * n, num_experts)
    else:
        out = np.repeat(q, sizes, axis=0)  # [R, E] (ranks are numbered DC by DC)
        out += pos < np.repeat(rem.astype(np.int32), sizes, axis=0)
        out[~live] = 0
    if rank_sum is not None and np.any(per_rank):
        rows = np.asarray(per_rank, bool)[topology.rank_dc] & live
        dd = np.repeat(denom, sizes)[rows][:, None]
        out[rows] = (2 * rank_sum[rows] + dd) // (2 * dd)
    return out


def window_mean_reference(
    topology: Topology,
    live: np.ndarray,
    *,
    steps: np.ndarray,
    dc_sum: np.ndarray,
    rank_sum: np.ndarray | None,
    per_rank: np.ndarray,
) -> np.ndarray:
    """:func:`window_mean`, one DC, rank and expert at a time."""
    num_experts = dc_sum.shape[1]
    out = np.zeros((topology.num_ranks, num_experts), np.int64)
    for d, ranks in enumerate(topology.dc_ranks):
        s = max(int(steps[d]), 1)
        alive = [int(r) for r in ranks if live[r]]
        if not alive:
            continue
        if per_rank[d]:
            assert rank_sum is not None
            for r in alive:
                for e in range(num_experts):
                    out[r, e] = (2 * int(rank_sum[r, e]) + s) // (2 * s)
            continue
        for e in range(num_experts):
            total = (2 * int(dc_sum[d, e]) + s) // (2 * s)
            base, rem = divmod(total, len(alive))
            for j, r in enumerate(alive):
                out[r, e] = base + (1 if (j - e) % len(alive) < rem else 0)
    return out
