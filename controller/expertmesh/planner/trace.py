"""Synthetic gating traces calibrated to a target rank imbalance under static EP.

Published balancer evaluations (UltraEP, FEPLB, EPLB studies) skew expert
popularity with a Zipf law over a random order of experts and search the
exponent until plain expert parallelism shows the wanted max/mean. This module
does the same, per layer and per step:

- **popularity**: the expert at popularity position ``i`` (``perm[i]``) gets
  weight ``(i + 1) ** -s``; a token picks ``top_k`` *distinct* experts, so the
  probability that it picks expert ``e`` is the inclusion probability
  ``pi[e] = min(1, c * w[e])`` with ``c`` such that ``sum(pi) == top_k``.
- **calibration**: ``s`` is found by bisection so that the expected static-EP
  imbalance ``max_r sum_{e on r} pi[e] / mean_r(...)`` equals the target (the
  placement of :func:`expertmesh.planner.static.static_placement`). It is
  re-solved whenever the popularity order changes, so every step of every layer
  has the target in expectation; sampling noise adds a small upward bias (the
  max of noisy rank loads), about 1% at EP64 x 8192 tokens. A trace's steps share a
  memo (:class:`_Memo`) that settles the comparisons no order can change: the same
  exponents as a fresh bisection per step, in one evaluation per step once settled.
- **sampling**: every source rank sends ``tokens_per_rank`` tokens, each to
  ``top_k`` distinct experts, drawn with Madow's systematic design (one uniform
  ``u`` per token, expert ``e`` chosen iff ``u`` falls in its arc of length
  ``pi[e]`` on a circle where the arcs wind ``top_k`` times, in a fresh random
  order per source rank). A token's expert set depends only on which segment
  between arc ends its ``u`` falls in, so a multinomial over at most ``E``
  segments gives the exact counts of ``tokens_per_rank`` independent tokens in
  ``O(E)`` work per rank instead of ``O(tokens * top_k)``. Each token has
  exactly ``top_k`` distinct experts: ``load[t, l, r].sum() == tokens * top_k``.
  Every source rank shares the layer's popularity (no per-rank preference).
  The multinomial's binomial draws (``E - 1`` per rank and step) are most of the
  generator's time (2.2 of 3.2 ms per step at 64 ranks x 256 experts x 8192 tokens). Exact
  samplers from independent Poisson counts completed to ``n`` are faster on these draws
  (8% for ``bench/bench_scale_parts.py --draws``'s; 24% for a prototype kept out of the
  repository, docs/benchmarks.md) but give another random stream, so every trace would
  change.
- **drift** ``F``: each step about ``F * E / 2`` swaps (Poisson) of two experts
  whose popularity positions are at most ``max(1, E // 16)`` apart: the hot set
  moves slowly. **regime switches**: every ``regime_every`` steps the order is
  drawn afresh.

Seeded: layer ``l`` draws from its own stream of ``SeedSequence(seed)``, so a
trace with more steps or layers starts with the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from expertmesh.planner.static import static_placement

__all__ = [
    "MAX_TRACE_ELEMENTS",
    "SyntheticTrace",
    "TraceSettings",
    "generate_trace",
    "static_imbalance",
]

MAX_TRACE_ELEMENTS = 1 << 30  # 8 GiB of int64: more is refused, not attempted
_MAX_EXPONENT = 64.0
_FLAT_KEY_BITS = 23  # the sampler's sort keys: 40 bits of arc start, then the item's


class TraceSettings(BaseModel):
    """What to generate. Shapes: the trace is ``[num_steps, num_layers, num_ranks, num_experts]``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_ranks: int = Field(ge=1, le=1 << 20, description="source (and EP) ranks, R")
    num_experts: int = Field(ge=1, le=65536, description="logical experts per layer, E")
    num_layers: int = Field(default=1, ge=1, le=4096, description="MoE layers, L")
    num_steps: int = Field(default=1, ge=1, le=1_000_000, description="microbatches, T")
    top_k: int = Field(default=8, ge=1, le=64, description="distinct experts per token")
    tokens_per_rank: int = Field(default=8192, ge=1, le=1 << 30, description="tokens per rank")
    imbalance: float = Field(
        default=2.0, ge=1.0, le=1e6, description="target expected max/mean under static EP"
    )
    drift: float = Field(
        default=0.0, ge=0.0, le=1.0, description="expected share of experts swapped per step"
    )
    regime_every: int = Field(
        default=0, ge=0, description="new popularity order every N steps (0: never)"
    )
    seed: int = Field(default=0, ge=0, description="seed of numpy's SeedSequence")
    reference_ranks: int | None = Field(
        default=None,
        ge=1,
        le=1 << 20,
        description="ranks of the static EP that `imbalance` is calibrated on (default: "
        "num_ranks); num_experts keeps the same skew whatever the number of ranks",
    )

    @model_validator(mode="after")
    def _fits(self) -> TraceSettings:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds the {self.num_experts} experts")
        size = self.num_steps * self.num_layers * self.num_ranks * self.num_experts
        if size > MAX_TRACE_ELEMENTS:
            raise ValueError(
                f"trace of {self.num_steps}x{self.num_layers}x{self.num_ranks}x"
                f"{self.num_experts} = {size} counts exceeds the limit of {MAX_TRACE_ELEMENTS}"
            )
        return self


@dataclass(frozen=True, eq=False)
class SyntheticTrace:
    """A generated trace.

    - ``load``: [T, L, R, E] int64 tokens from source rank ``r`` to expert ``e``.
    - ``exponent``: [T, L] Zipf exponent used at each step and layer.
    - ``expected_imbalance``: [T, L] expected static-EP max/mean (the calibrated value).
    - ``meta``: JSON-able summary (the trace file's ``meta``).
    """

    load: np.ndarray
    exponent: np.ndarray
    expected_imbalance: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)


def inclusion_probabilities(weights: np.ndarray, top_k: int) -> np.ndarray:
    """[E] probability that a token picks each expert when it picks ``top_k`` distinct ones.

    ``weights``: [E] positive, sorted in non-increasing order. Returns ``pi`` [E] with
    ``pi = min(1, c * weights)`` and ``sum(pi) == top_k`` (the ``m`` heaviest experts are
    capped at 1 and the rest share ``top_k - m`` in proportion to their weights).
    """
    num_experts = weights.shape[0]
    tail = np.cumsum(weights[::-1])[::-1]  # [E] sum of weights[m:]
    m = np.arange(top_k)
    ok = (top_k - m) * weights[m] <= tail[m] * (1 + 1e-12)  # uncapped from position m on
    capped = int(np.argmax(ok)) if ok.any() else top_k
    pi = np.ones(num_experts)
    if capped < num_experts:
        pi[capped:] = (top_k - capped) * weights[capped:] / tail[capped]
    return np.minimum(pi, 1.0)


def _expert_rank(num_ranks: int, num_experts: int) -> np.ndarray:
    """[E] rank of each expert under static EP."""
    masters = -(-num_experts // num_ranks)
    return static_placement(num_ranks, masters, num_experts, masters).master_rank()


def _popularity(perm: np.ndarray, exponent: float, top_k: int) -> np.ndarray:
    """[E] inclusion probability of each expert; ``perm``: [E] expert at each position."""
    weights = (np.arange(perm.shape[0]) + 1.0) ** -exponent  # [E] by position
    pi = np.empty(perm.shape[0])
    pi[perm] = inclusion_probabilities(weights / weights[0], top_k)
    return pi


def _static_imbalance(pi: np.ndarray, expert_rank: np.ndarray, num_ranks: int) -> float:
    per_rank = np.bincount(expert_rank, weights=pi, minlength=num_ranks)
    return float(per_rank.max() / per_rank.mean())


def _calibrate(
    perm: np.ndarray,
    expert_rank: np.ndarray,
    num_ranks: int,
    top_k: int,
    target: float,
    *,
    memo: _Memo | None = None,
) -> tuple[float, float, np.ndarray]:
    """Zipf exponent whose expected static-EP imbalance is ``target``.

    Returns ``(s, imbalance, pi)`` with ``pi`` [E] = ``_popularity(perm, s, top_k)``.
    ``memo``: what earlier calibrations of the same trace (same experts, reference ranks,
    ``top_k`` and ``target``, other orders) found; the result is the same floats with or
    without it.
    """

    if memo is not None and memo.settled is not None:
        s = memo.settled
        by_position = memo.by_position.get(s)
        if by_position is not None and memo.one_each:  # _Imbalance(s) in one scatter
            pi = np.empty_like(by_position)
            pi[perm] = by_position  # by expert: by_position[pos] with pos[perm] = arange
            return s, float(pi.max()) / (float(pi.sum()) / pi.shape[0]), pi
        f = _Imbalance(perm, expert_rank, num_ranks, top_k, memo)
        return s, f(s), f.pi

    f = _Imbalance(perm, expert_rank, num_ranks, top_k, memo)

    lo = 0.0
    if not f.below(0.0, target - 1e-9):
        f_lo = f(0.0)
        if f_lo > target + 1e-6:
            raise ValueError(
                f"imbalance {target:g} is below {f_lo:.4g}, what uniform popularity already "
                f"gives with {perm.shape[0]} experts on {num_ranks} ranks"
            )
        return 0.0, f_lo, f.pi
    hi = 1.0
    while f.below(hi, target):
        if hi >= _MAX_EXPONENT:
            raise ValueError(
                f"imbalance {target:g} is out of reach: at most {f(hi):.4g} with "
                f"{perm.shape[0]} experts on {num_ranks} ranks and top-{top_k}"
            )
        lo, hi = hi, hi * 2
    while hi - lo > 1e-9 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f.below(mid, target) else (lo, mid)
    s = 0.5 * (lo + hi)
    if memo is not None and memo.one_each and not f.decided:
        memo.settled = s  # no comparison looked at this order: none ever will
    return s, f(s), f.pi


class _Memo:
    """What the calibrations of one trace share (the same experts, reference ranks,
    ``top_k`` and target; the popularity order changes from step to step).

    - ``by_position``: inclusion probabilities by popularity position at exponent ``s``;
      they do not depend on the order.
    - ``known``: the imbalance at ``s`` under some order, kept only with one expert per
      reference rank. Then the imbalance is ``max(pi) / (sum(pi) / E)`` and only the sum
      sees the order: the same ``E`` values summed in another order differ by at most
      ``2 (E - 1) u`` of the total (``u = 2^-53``), and the two divisions round once more
      each (``4 u``), so two orders' imbalances at ``s`` differ by less than ``slack``
      times either. A comparison with a threshold farther than that from a known value
      comes out the same under every order: :meth:`_Imbalance.below` takes it from here.
    - ``settled``: the exponent a bisection reached without computing any comparison (every
      one came from ``known``): every later bisection takes the same path to it.
    """

    #: entries of ``known`` kept at most (a bisection adds ~40, and they repeat)
    SIZE = 4096

    def __init__(self, expert_rank: np.ndarray, num_ranks: int, num_experts: int) -> None:
        self.arange = np.arange(num_experts)
        self.base = self.arange + 1.0  # [E] by position
        self.one_each = num_ranks == num_experts and bool(np.array_equal(expert_rank, self.arange))
        self.slack = 8 * num_experts * 2.0**-53
        self.known: dict[float, float] = {}
        self.by_position: dict[float, np.ndarray] = {}
        self.positions_kept = max(2, (1 << 22) // max(1, num_experts))  # <= 32 MiB
        self.settled: float | None = None


class _Imbalance:
    """``s -> _static_imbalance(_popularity(perm, s, top_k), expert_rank, num_ranks)`` with
    the same floating-point operations in the same order and fewer array passes (what
    depends only on ``perm`` is computed once per calibration, what depends only on ``s``
    once per trace with a :class:`_Memo`)."""

    def __init__(
        self,
        perm: np.ndarray,
        expert_rank: np.ndarray,
        num_ranks: int,
        top_k: int,
        memo: _Memo | None = None,
    ) -> None:
        num_experts = perm.shape[0]
        self.memo = memo if memo is not None else _Memo(expert_rank, num_ranks, num_experts)
        self.pos = np.empty_like(perm)
        self.pos[perm] = self.memo.arange  # [E] popularity position of each expert
        self.expert_rank, self.num_ranks, self.top_k = expert_rank, num_ranks, top_k
        self.head = min(top_k, num_experts)  # inclusion_probabilities' ``m``
        self.one_each = self.memo.one_each
        self.pi = np.empty(0)  # [E] inclusion probabilities of the last call, by expert
        self.decided = False  # whether below() has computed a comparison

    def below(self, s: float, threshold: float) -> bool:
        """``self(s) < threshold``: from ``memo.known`` where that holds under every order
        (see :class:`_Memo`), else computed."""
        memo = self.memo
        if memo.one_each:
            known = memo.known.get(s)
            if known is not None and abs(known - threshold) > known * memo.slack:
                return known < threshold
        self.decided = True
        return self(s) < threshold

    def _by_position(self, s: float) -> np.ndarray:
        """[E] inclusion probabilities by popularity position (``inclusion_probabilities``
        of the weights ``(i + 1) ** -s / 1``, the same floats)."""
        w = self.memo.base**-s
        if w[0] != 1.0:  # 1 ** -s is 1, and w / 1.0 is w: divide only if pow said otherwise
            w = w / w[0]
        tail = np.cumsum(w[::-1])[::-1]
        capped = self.top_k
        one = 1 + 1e-12
        head_w, head_tail = w[: self.head].tolist(), tail[: self.head].tolist()
        for m, (wm, tm) in enumerate(zip(head_w, head_tail, strict=True)):
            if (self.top_k - m) * wm <= tm * one:  # uncapped from position m on
                capped = m
                break
        num = w.shape[0]
        if capped < num:
            pi = w * (self.top_k - capped)  # (top_k - m) * w[m:] / tail[m], then 1 before m
            pi /= tail[capped]
            pi[:capped] = 1.0
            np.minimum(pi, 1.0, out=pi)
        else:
            pi = np.ones(num)
        return pi

    def __call__(self, s: float) -> float:
        # (The same IEEE operations as the plain form above, with fewer numpy calls on 256
        # elements; called once per step and layer with a settled memo.)
        memo = self.memo
        by_position = memo.by_position.get(s)
        if by_position is None:
            by_position = self._by_position(s)
            if len(memo.by_position) >= memo.positions_kept:
                memo.by_position.clear()
            memo.by_position[s] = by_position
        pi = by_position[self.pos]  # by expert
        if self.one_each:  # one expert per rank: the bincount is pi itself (0.0 + x is x)
            per_rank = pi
        else:
            per_rank = np.bincount(self.expert_rank, weights=pi, minlength=self.num_ranks)
        top, total = float(per_rank.max()), float(per_rank.sum())
        value = top / (total / per_rank.shape[0])
        self.pi = pi
        if self.one_each and s not in memo.known:
            if len(memo.known) >= memo.SIZE:
                memo.known.clear()
            memo.known[s] = value
        return value


def _drift(rng: np.random.Generator, perm: np.ndarray, drift: float) -> bool:
    """Swap a Poisson(drift * E / 2) number of nearby popularity positions in place."""
    num_experts = perm.shape[0]
    if drift <= 0 or num_experts < 2:
        return False
    swaps = int(rng.poisson(drift * num_experts / 2))
    if swaps == 0:
        return False
    window = max(1, num_experts // 16)
    if swaps <= 4:  # the same draws one by one: a call with ``size`` costs more than 4
        pos = [int(rng.integers(0, num_experts)) for _ in range(swaps)]
        gap = [int(rng.integers(1, window + 1)) for _ in range(swaps)]
    else:
        pos = rng.integers(0, num_experts, size=swaps).tolist()
        gap = rng.integers(1, window + 1, size=swaps).tolist()
    last = num_experts - 1
    for i, g in zip(pos, gap, strict=True):
        j = min(max(i + g if i + g < num_experts else i - g, 0), last)
        perm[i], perm[j] = perm[j], perm[i]
    return True


def systematic_arcs(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Arcs of Madow's systematic design on the unit circle.

    ``q``: [R, K] inclusion probabilities in ``[0, 1)`` of ``K`` items in each row's
    order, each row summing to an integer ``k``. Returns ``start`` [R, K] (arc start in
    ``[0, 1)``) and ``end`` [R, K] (the next item's start; the last item ends at 0). Item
    ``i`` is chosen by a token with uniform ``u`` iff ``u`` lies in ``[start, end)``
    (mod 1, wrapping when ``end < start``).
    """
    c = np.cumsum(q, axis=1) - q  # [R, K] exclusive cumulative sum
    # Snap to 1e-12: a cumulative sum that lands a hair below an integer would otherwise
    # give a start of 1 - 1e-16, and an empty arc there would look like a full wrap.
    start = np.round(c - np.floor(c), 12)  # in [0, 1]: c >= 0, so no -0.0
    start[start >= 1.0] = 0.0  # ``% 1.0``, the same floats, without its slow division
    end = np.roll(start, -1, axis=1)
    end[:, -1] = 0.0
    return start, end


def counts_from_segments(
    start: np.ndarray,
    end: np.ndarray,
    q: np.ndarray,
    seg_counts: np.ndarray,
    n: int,
    *,
    order: np.ndarray | None = None,
) -> np.ndarray:
    """[R, K] tokens choosing each item, given how many tokens fall in each circle segment.

    ``start``, ``end``, ``q``: [R, K] from :func:`systematic_arcs`; ``seg_counts``: [R, K]
    tokens whose ``u`` lies in ``[b_j, b_{j+1})`` where ``b`` is ``start`` sorted per row
    (stable) and ``b_K = 1``; ``n``: tokens per row; ``order``: ``argsort(start, axis=1,
    kind="stable")`` when the caller has it.
    """
    num_rows, num_items = start.shape
    if order is None:
        order = np.argsort(start, axis=1, kind="stable")  # [R, K] sorted position -> item
    rows = np.arange(num_rows)[:, None]
    cum = np.zeros((num_rows, num_items), dtype=np.int64)  # tokens before each segment
    np.cumsum(seg_counts[:, :-1], axis=1, out=cum[:, 1:])
    at = np.empty_like(cum)  # [R, K] tokens before each item's arc starts
    at[rows, order] = cum  # the item at sorted position p starts at segment p
    # the item after i starts where i ends
    inside = np.roll(at, -1, axis=1) - at  # [R, K]
    return np.where(
        end > start,
        inside,
        np.where(end < start, n + inside, np.where(q >= 0.5, n, 0)),
    )


class _Buffers:
    """Arrays of :func:`_systematic_sample` and :func:`_sample` for [R, K] samples, kept
    from step to step: fresh 128 KiB arrays for each numpy call cost a good part of a
    64 x 256 step. ``counts`` is a sample's result (overwritten by the next one)."""

    def __init__(self, num_rows: int, num_items: int) -> None:
        shape = (num_rows, num_items)
        size = num_rows * num_items
        # sort keys ``tick * 2^bits + flat item`` (``tick < 2^40``) order each row as
        # ``tick * 2^b + item`` do, and give the flat index of the item in one mask; with
        # more than 2^23 items, the item in its row (made flat after the sort)
        self.bits = max(1, (size - 1).bit_length())
        self.row_start = np.arange(0, size, num_items)[:, None]  # [R, 1] flat index of col 0
        self.key_item: np.ndarray
        self.to_flat: np.ndarray | None = None
        if self.bits <= _FLAT_KEY_BITS:
            self.key_item = np.arange(size, dtype=np.int64).reshape(shape)
        else:
            self.bits = max(1, (num_items - 1).bit_length())
            self.key_item = np.arange(num_items, dtype=np.int64)
            self.to_flat = self.row_start
        self.base: np.ndarray | None = None  # [R, K] each row 0..K-1 (_sample fills it)
        self.order = np.empty(shape, dtype=np.int64)
        self.q, self.c, self.ticks, self.seg = (np.empty(shape) for _ in range(4))
        self.total = np.empty((num_rows, 1))
        self.keys, self.at, self.counts = (np.empty(shape, dtype=np.int64) for _ in range(3))
        self.wrap = np.empty(shape, dtype=bool)


def _sample(
    rng: np.random.Generator,
    pi: np.ndarray,
    n: int,
    num_src: int,
    out: np.ndarray | None = None,
    *,
    buffers: dict[int, _Buffers] | None = None,
) -> np.ndarray:
    """[R, E] int64: ``n`` tokens per source rank, each to ``sum(pi)`` distinct experts.

    ``out``: an [R, E] int64 array to write into (returned), else a new one. ``buffers``:
    :class:`_Buffers` by number of sampled experts, kept from call to call (filled here).
    """
    num_experts = pi.shape[0]
    if out is None:
        out = np.empty((num_src, num_experts), dtype=np.int64)
    idx = None  # experts not chosen by every token: all of them (the usual case) ...
    if float(pi.max()) >= 1.0 - 1e-12:  # ... or these
        full = pi >= 1.0 - 1e-12
        idx = np.flatnonzero(~full)
        out[:] = 0
        out[:, full] = n  # chosen by every token
        if idx.size == 0 or pi[idx].sum() < 0.5:
            return out
    num_items = num_experts if idx is None else idx.size
    buf = None if buffers is None else buffers.get(num_items)
    if buf is None:
        buf = _Buffers(num_src, num_items)
        if buffers is not None:
            buffers[num_items] = buf
    if idx is not None:
        base = np.tile(idx, (num_src, 1))
    elif buf.base is None:
        base = buf.base = np.tile(np.arange(num_items), (num_src, 1))
    else:
        base = buf.base
    order = rng.permuted(base, axis=1, out=buf.order)  # [R, K] fresh order per rank
    np.take(pi, order, out=buf.q, mode="clip")  # pi[order]
    counts = _systematic_sample(rng, buf.q, n, buf)  # [R, K]
    if idx is None:
        order += buf.row_start  # flat index in out
    else:
        order += np.arange(0, num_src * num_experts, num_experts)[:, None]
    out.reshape(-1)[order.reshape(-1)] = counts.reshape(-1)  # out[r, order[r]] = counts[r]
    return out


def _systematic_sample(
    rng: np.random.Generator, q: np.ndarray, n: int, buf: _Buffers | None = None
) -> np.ndarray:
    """[R, K] int64: how many of ``n`` tokens per row choose each item under Madow's design.

    ``q``: [R, K] inclusion probabilities as :func:`systematic_arcs` takes them. The same
    floats and the same draw as :func:`systematic_arcs`, a stable ``argsort`` of the arc
    starts, ``rng.multinomial(n, segment lengths)`` and :func:`counts_from_segments`, with
    fewer passes: an arc start is ``N / 1e12`` for an integer ``N`` (``np.round(x, 12)``
    is ``rint(x * 1e12) / 1e12``), so the integers ``N * 2^b + item`` (all distinct) sort
    the items as the stable ``argsort`` of the starts does, and the ``N`` compare as the
    starts do. ``buf``: the arrays to work in (the result is ``buf.counts``), else new ones.
    Differences of neighbours are taken over the flattened rows (one contiguous pass), the
    last column then written over.
    """
    if buf is None:
        buf = _Buffers(*q.shape)
    c, ticks, keys, seg, wrap = buf.c, buf.ticks, buf.keys, buf.seg, buf.wrap
    np.cumsum(q, axis=1, out=c)
    c -= q  # [R, K] exclusive cumulative sum, as systematic_arcs
    np.floor(c, out=ticks)
    np.subtract(c, ticks, out=ticks)
    ticks *= 1e12
    np.rint(ticks, out=ticks)  # [R, K] start * 1e12: integers in [0, 1e12]
    if ticks.max() >= 1e12:
        ticks[ticks >= 1e12] = 0.0  # a start of 1.0 is 0.0
    t1 = ticks.reshape(-1)
    # an item's arc wraps past 1 where the next item's start (the last's end: 0) is below its own
    np.less(t1[1:], t1[:-1], out=wrap.reshape(-1)[:-1])
    np.greater(ticks[:, -1], 0.0, out=wrap[:, -1])
    np.copyto(keys, ticks, casting="unsafe")  # exact: integers below 2^40
    keys <<= buf.bits
    keys |= buf.key_item
    keys.sort(axis=1)  # [R, K] by (start, item): the stable argsort of the starts
    flat = keys
    flat &= (1 << buf.bits) - 1  # [R, K] sorted position -> (flat) item
    if buf.to_flat is not None:
        flat += buf.to_flat
    ticks /= 1e12  # [R, K] arc starts
    bounds = np.take(t1, flat, out=c, mode="clip")  # arc starts in sorted order
    b1, s1 = bounds.reshape(-1), seg.reshape(-1)  # seg: np.diff(bounds, append=1.0) >= 0
    np.subtract(b1[1:], b1[:-1], out=s1[:-1])
    np.subtract(1.0, bounds[:, -1], out=seg[:, -1])
    seg /= np.sum(seg, axis=1, keepdims=True, out=buf.total)
    some_empty = float(seg.min()) <= 0.0  # an arc of length 0 or 1 (q rounded)
    seg_counts = rng.multinomial(n, seg)  # [R, K] tokens per segment
    cum, at = buf.counts, buf.at  # tokens before each segment
    np.cumsum(seg_counts[:, :-1], axis=1, out=cum[:, 1:])
    cum[:, 0] = 0
    at.reshape(-1)[flat.reshape(-1)] = cum.reshape(-1)  # [R, K] tokens before each arc
    # the next item's ``at`` (item 0 starts at 0) minus its own
    counts, a1 = buf.counts, at.reshape(-1)
    np.subtract(a1[1:], a1[:-1], out=counts.reshape(-1)[:-1])
    np.subtract(at[:, 0], at[:, -1], out=counts[:, -1])
    np.add(counts, n, out=counts, where=wrap)  # the arc wraps past 1
    if some_empty:  # no token or every token
        empty = np.empty_like(wrap)  # the next item's start equals its own
        np.equal(t1[1:], t1[:-1], out=empty.reshape(-1)[:-1])
        np.equal(ticks[:, -1], 0.0, out=empty[:, -1])
        counts[empty] = np.where(q[empty] >= 0.5, n, 0)
    return counts


def generate_trace(settings: TraceSettings) -> SyntheticTrace:
    """Generate the trace ``settings`` describe (see the module docstring for the model).

    Returns :class:`SyntheticTrace` with ``load`` [T, L, R, E] int64.
    """
    s = settings
    load = np.empty((s.num_steps, s.num_layers, s.num_ranks, s.num_experts), dtype=np.int64)
    exponent = np.empty((s.num_steps, s.num_layers))
    expected = np.empty((s.num_steps, s.num_layers))
    ref_ranks = s.reference_ranks or s.num_ranks
    expert_rank = _expert_rank(ref_ranks, s.num_experts)
    streams = np.random.SeedSequence(s.seed).spawn(s.num_layers)
    memo = _Memo(expert_rank, ref_ranks, s.num_experts)  # shared by every calibration
    buffers: dict[int, _Buffers] = {}  # the sampler's arrays, shared by every step
    per_expert = np.empty((s.num_steps, s.num_layers, s.num_experts), dtype=np.int64)
    for layer, seq in enumerate(streams):
        rng = np.random.default_rng(seq)
        perm = rng.permutation(s.num_experts)
        changed = True
        pi, exp_t, imb_t = np.empty(0), 0.0, 1.0
        for t in range(s.num_steps):
            if t > 0 and s.regime_every > 0 and t % s.regime_every == 0:
                perm = rng.permutation(s.num_experts)
                changed = True
            elif t > 0:
                changed = _drift(rng, perm, s.drift)
            if changed:
                exp_t, imb_t, pi = _calibrate(
                    perm, expert_rank, ref_ranks, s.top_k, s.imbalance, memo=memo
                )
            exponent[t, layer], expected[t, layer] = exp_t, imb_t
            step = _sample(rng, pi, s.tokens_per_rank, s.num_ranks, load[t, layer], buffers=buffers)
            np.sum(step, axis=0, out=per_expert[t, layer])  # while the step is in cache
    realized = _rank_imbalance(per_expert, s.num_ranks)  # static_imbalance(load)
    meta: dict[str, Any] = {
        "format": "expertmesh-trace/1",
        "num_steps": s.num_steps,
        "num_layers": s.num_layers,
        "num_ranks": s.num_ranks,
        "num_experts": s.num_experts,
        "top_k": s.top_k,
        "tokens_per_rank": s.tokens_per_rank,
        "generator": {
            "name": "zipf-systematic",
            "settings": s.model_dump(),
            "exponent": _summary(exponent),
            "expected_imbalance": _summary(expected),
            "realized_imbalance": _summary(realized),
        },
    }
    return SyntheticTrace(load=load, exponent=exponent, expected_imbalance=expected, meta=meta)


def static_imbalance(load: np.ndarray) -> np.ndarray:
    """[T, L] max/mean rank load of trace ``load`` [T, L, R, E] under static EP."""
    return _rank_imbalance(load.sum(axis=2), load.shape[2])


def _rank_imbalance(per_expert: np.ndarray, num_ranks: int) -> np.ndarray:
    """:func:`static_imbalance` of a trace whose tokens per expert are ``per_expert``
    [T, L, E] (its load summed over source ranks) and with ``num_ranks`` ranks."""
    num_experts = per_expert.shape[2]
    cum = np.zeros((*per_expert.shape[:2], num_experts + 1))
    np.cumsum(per_expert, axis=2, out=cum[..., 1:])
    expert_rank = _expert_rank(num_ranks, num_experts)  # sorted
    first = np.searchsorted(expert_rank, np.arange(num_ranks + 1))  # [R + 1]
    per_rank = cum[..., first[1:]] - cum[..., first[:-1]]  # [T, L, R]
    mean = per_rank.mean(axis=2)
    return np.where(mean > 0, per_rank.max(axis=2) / np.where(mean > 0, mean, 1.0), 1.0)


def _summary(x: np.ndarray) -> dict[str, float]:
    return {
        "mean": round(float(x.mean()), 6),
        "min": round(float(x.min()), 6),
        "max": round(float(x.max()), 6),
    }
