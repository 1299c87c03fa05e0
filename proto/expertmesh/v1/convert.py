"""Converters between ``expertmesh.v1`` messages and domain types (numpy, planner types).

The only module besides the generated code that touches protobuf messages:
the gRPC service and the client call these and work with domain types.
Decoders validate what arrives (shapes, ranges, sizes) and raise ``ValueError``
with a one-line message; the service turns that into ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from expertmesh.planner import LayerPlan, Migration, Placement, Transfer, TransferKind
from expertmesh.planner.window import WindowBlock, WindowReport
from expertmesh.v1 import expertmesh_pb2 as pb

__all__ = [
    "MAX_COUNT",
    "PlanLike",
    "ReceivedPlan",
    "Report",
    "SolveArgs",
    "WindowBlock",
    "WindowReport",
    "block_to_msg",
    "count_width",
    "layer_plan_from_msg",
    "layer_plan_to_msg",
    "pack_counts",
    "plan_from_msg",
    "plan_to_msg",
    "report_batch_from_msg",
    "report_from_msg",
    "report_to_msg",
    "reports_from_msg",
    "solve_args_from_msg",
    "solve_args_to_msg",
    "window_count",
    "window_to_msg",
    "windows_from_msg",
    "windows_to_msg",
]

MAX_COUNT = 2**40  # larger token counts are refused as implausible
MAX_POLICY_SETTINGS_BYTES = 64 * 1024

_STATE_TO_PB = {
    "prepared": pb.PLAN_STATE_PREPARED,
    "committed": pb.PLAN_STATE_COMMITTED,
    "rolled_back": pb.PLAN_STATE_ROLLED_BACK,
}
_STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}
_KIND_TO_PB = {
    TransferKind.REPLICA: pb.TRANSFER_KIND_REPLICA,
    TransferKind.MASTER: pb.TRANSFER_KIND_MASTER,
}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}


class PlanLike(Protocol):
    """What :func:`plan_to_msg` reads (the controller's ``PlanVersion`` fits)."""

    version: int
    step: int
    policy: str
    layers: list[LayerPlan]
    imbalance_before: list[float]
    imbalance_after: list[float]
    created_at: float
    committed_at: float | None

    @property
    def state(self) -> Any: ...


@dataclass(frozen=True)
class Report:
    """One load report: ``load`` [E] int64 tokens ``rank`` sent in ``step`` of ``layer``."""

    step: int
    layer: int
    rank: int
    load: np.ndarray


@dataclass(frozen=True, eq=False)
class ReceivedPlan:
    """A plan as a client receives it. ``layers[l].route`` is [0, 4] unless asked for."""

    version: int
    step: int
    policy: str
    state: str
    created_at: float
    committed_at: float | None
    imbalance_before: list[float]
    imbalance_after: list[float]
    layers: list[LayerPlan]


@dataclass(frozen=True)
class SolveArgs:
    """A what-if request: plan ``load`` [R, E] of ``layer`` with ``policy`` (None: active)."""

    load: np.ndarray
    layer: int = 0
    policy: str | None = None
    policy_settings: dict[str, Any] | None = None
    from_committed: bool = True


# ---- reports ----


def report_to_msg(step: int, layer: int, rank: int, load: np.ndarray) -> pb.LoadReport:
    """``load``: [E] non-negative integer counts."""
    arr = np.asarray(load)
    if arr.ndim != 1:
        raise ValueError(f"load must be [E], got shape {arr.shape}")
    return pb.LoadReport(step=step, layer=layer, rank=rank, load=arr.astype(np.int64).tolist())


def report_from_msg(r: pb.LoadReport) -> Report:
    """Decode one report; ``ValueError`` on a negative or implausibly large count (the core
    checks shapes, layers and ranks)."""
    load = np.array(r.load, dtype=np.int64)
    if load.size and (load.min() < 0 or load.max() > MAX_COUNT):
        raise ValueError(
            f"report (step {r.step}, layer {r.layer}, rank {r.rank}): counts must be in [0, 2**40]"
        )
    return Report(step=int(r.step), layer=int(r.layer), rank=int(r.rank), load=load)


def report_batch_from_msg(
    msg: pb.ReportLoadRequest, num_experts: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The message's reports as arrays: steps, layers, ranks [K] int64 and loads [K, E] int64
    (values unchecked: the core checks them). None when some report is not [E] long (decode
    those one by one to find which)."""
    reports = msg.reports
    if any(len(r.load) != num_experts for r in reports):
        return None
    num = len(reports)
    steps = np.fromiter((r.step for r in reports), np.uint64, num)
    if num and int(steps.max()) >= 2**62:
        return None
    loads = (
        np.concatenate([np.array(r.load, np.int64) for r in reports]).reshape(num, num_experts)
        if num
        else np.zeros((0, num_experts), np.int64)
    )
    return (
        steps.astype(np.int64),
        np.fromiter((r.layer for r in reports), np.int64, num),
        np.fromiter((r.rank for r in reports), np.int64, num),
        loads,
    )


# count_width -> numpy dtype of packed counts (little-endian)
_WIDTHS: dict[int, np.dtype[Any]] = {
    pb.COUNT_WIDTH_UNSPECIFIED: np.dtype("<i8"),
    pb.COUNT_WIDTH_INT64: np.dtype("<i8"),
    pb.COUNT_WIDTH_UINT32: np.dtype("<u4"),
    pb.COUNT_WIDTH_UINT16: np.dtype("<u2"),
    pb.COUNT_WIDTH_UINT8: np.dtype("<u1"),
}


def count_width(counts: np.ndarray) -> pb.CountWidth.ValueType:
    """The narrowest :data:`CountWidth` that holds every one of ``counts`` (>= 0)."""
    top = int(counts.max()) if counts.size else 0
    for width, limit in (
        (pb.COUNT_WIDTH_UINT8, 2**8),
        (pb.COUNT_WIDTH_UINT16, 2**16),
        (pb.COUNT_WIDTH_UINT32, 2**32),
    ):
        if top < limit:
            return width
    return pb.COUNT_WIDTH_INT64


def pack_counts(
    counts: np.ndarray, width: pb.CountWidth.ValueType | None = None
) -> tuple[bytes, pb.CountWidth.ValueType]:
    """``counts`` (integers >= 0) as little-endian bytes of ``width`` (default: the narrowest
    that holds them, :func:`count_width`), and the width."""
    width = count_width(counts) if width is None else width
    return counts.astype(_WIDTHS[width], copy=False).tobytes(), width


def window_to_msg(
    rep: WindowReport, *, packed: bool = False, width: pb.CountWidth.ValueType | None = None
) -> pb.WindowReport:
    """A DC's window report (``load`` [E] or [n, E]) as a message; ``packed``: the counts as
    little-endian bytes (``counts``, read in bulk; servers before it read ``load``) of
    ``width`` (default: the narrowest that holds them; servers before ``count_width`` read
    int64 only: pass ``pb.COUNT_WIDTH_INT64`` for them)."""
    flat = rep.load.ravel()
    counts, width = pack_counts(flat, width) if packed else (b"", pb.COUNT_WIDTH_UNSPECIFIED)
    return pb.WindowReport(
        first_step=rep.first_step,
        last_step=rep.last_step,
        layer=rep.layer,
        dc=rep.dc,
        steps=rep.steps,
        reports=rep.reports,
        rows=rep.load.shape[0] if rep.per_rank else 1,
        load=[] if packed else flat.tolist(),
        counts=counts,
        count_width=width,
    )


def block_to_msg(
    block: WindowBlock, *, width: pb.CountWidth.ValueType | None = None
) -> pb.DcWindowReport:
    """One DC's window of several layers (:class:`WindowBlock`) as one message, counts as
    little-endian bytes of ``width`` (default: the narrowest that holds them)."""
    counts, width = pack_counts(block.load, width)
    return pb.DcWindowReport(
        first_step=block.first_step,
        last_step=block.last_step,
        dc=block.dc,
        rows=block.load.shape[1] if block.per_rank else 1,
        layers=block.layers.tolist(),
        steps=block.steps.tolist(),
        reports=block.reports.tolist(),
        counts=counts,
        count_width=width,
    )


def windows_to_msg(
    items: list[WindowReport | WindowBlock], *, width: pb.CountWidth.ValueType | None = None
) -> pb.ReportWindowsRequest:
    """Window reports and blocks as one request (reports before blocks, as applied); a
    block's counts packed ``width`` (default: the narrowest that holds them)."""
    return pb.ReportWindowsRequest(
        reports=[window_to_msg(x) for x in items if isinstance(x, WindowReport)],
        dc_windows=[block_to_msg(x, width=width) for x in items if isinstance(x, WindowBlock)],
    )


def window_count(msg: pb.ReportWindowsRequest) -> int:
    """Window reports ``msg`` stands for: its reports, and each block's layers (at least 1)."""
    return len(msg.reports) + sum(max(len(b.layers), 1) for b in msg.dc_windows)


def _counts(packed: bytes, listed: Any, size: int, width: int) -> np.ndarray:
    """``size`` int64 counts from ``packed`` (little-endian bytes of ``width``) or ``listed``
    (varints)."""
    if packed and len(listed):
        raise ValueError("set either load or counts, not both")
    dtype = _WIDTHS.get(width)
    if dtype is None:
        raise ValueError(f"unknown count_width {width}")
    if packed:
        if len(packed) != dtype.itemsize * size:
            raise ValueError(
                f"counts must hold {size} little-endian {dtype.name}, got {len(packed)} bytes"
            )
        return np.frombuffer(packed, dtype).astype(np.int64)
    load = np.array(listed, np.int64)
    if load.size != size:
        raise ValueError(f"load must hold {size} counts, got {load.size}")
    return load


def windows_from_msg(
    msg: pb.ReportWindowsRequest, num_experts: int
) -> tuple[list[WindowReport | WindowBlock], tuple[int, str] | None]:
    """Decode a message's window reports, then its blocks, in order: (the items before the
    first bad one, (its index among them, why) or None). ``rows`` 1 gives ``[E]`` loads,
    ``n`` gives ``[n, E]``; the core checks the rest against its topology."""
    out: list[WindowReport | WindowBlock] = []
    for i, r in enumerate(msg.reports):
        try:
            rows = int(r.rows)
            if rows < 1:
                raise ValueError(f"rows must be >= 1, got {rows}")
            load = _counts(r.counts, r.load, rows * num_experts, r.count_width)
            out.append(
                WindowReport(
                    first_step=int(r.first_step),
                    last_step=int(r.last_step),
                    layer=int(r.layer),
                    dc=int(r.dc),
                    steps=int(r.steps),
                    reports=int(r.reports),
                    load=load if rows == 1 else load.reshape(rows, num_experts),
                )
            )
        except ValueError as err:
            return out, (i, str(err))
    for i, b in enumerate(msg.dc_windows, start=len(msg.reports)):
        try:
            rows, k = int(b.rows), len(b.layers)
            if rows < 1 or k < 1:
                raise ValueError(f"a block needs rows >= 1 and a layer, got {rows} and {k}")
            load = _counts(b.counts, (), k * rows * num_experts, b.count_width)
            out.append(
                WindowBlock(
                    first_step=int(b.first_step),
                    last_step=int(b.last_step),
                    dc=int(b.dc),
                    layers=np.array(b.layers, np.int64),
                    steps=np.array(b.steps, np.int64),
                    reports=np.array(b.reports, np.int64),
                    load=load.reshape((k, num_experts) if rows == 1 else (k, rows, num_experts)),
                )
            )
        except ValueError as err:
            return out, (i, str(err))
    return out, None


def reports_from_msg(msg: pb.ReportLoadRequest, max_reports: int = 4096) -> list[Report]:
    """Decode a batch of at most ``max_reports`` reports (``ValueError`` otherwise)."""
    if len(msg.reports) > max_reports:
        raise ValueError(
            f"a message may hold at most {max_reports} reports, got {len(msg.reports)}"
        )
    return [report_from_msg(r) for r in msg.reports]


# ---- plans ----


def layer_plan_to_msg(layer: int, lp: LayerPlan, *, include_route: bool = False) -> pb.LayerPlan:
    num_ranks, slots = lp.phy2log.shape
    return pb.LayerPlan(
        layer=layer,
        num_ranks=num_ranks,
        slots_per_rank=slots,
        phy2log=lp.phy2log.astype(np.int32).ravel().tolist(),
        master=lp.placement.master.astype(np.int64).tolist(),
        route=np.asarray(lp.route, np.int64).ravel().tolist() if include_route else [],
        migrations=[
            pb.Transfer(
                expert=t.expert,
                src_rank=t.src_rank,
                dst_rank=t.dst_rank,
                dst_slot=t.dst_slot,
                nbytes=t.nbytes,
                round=t.round,
                kind=_KIND_TO_PB[TransferKind(t.kind)],
            )
            for t in lp.migration.transfers
        ],
        solve_seconds=float(lp.solve_seconds),
    )


def layer_plan_from_msg(msg: pb.LayerPlan) -> LayerPlan:
    """Decode and check shapes: phy2log [R, S] in [-1, E), master [E] pointing at its slots."""
    num_ranks, slots = int(msg.num_ranks), int(msg.slots_per_rank)
    phy2log = np.array(msg.phy2log, dtype=np.int32)
    if num_ranks < 1 or slots < 1 or phy2log.size != num_ranks * slots:
        raise ValueError(
            f"layer {msg.layer}: phy2log has {phy2log.size} entries, not R*S = {num_ranks}*{slots}"
        )
    phy2log = phy2log.reshape(num_ranks, slots)
    master = np.array(msg.master, dtype=np.int64)
    num_experts = master.size
    if phy2log.min() < -1 or phy2log.max() >= num_experts:
        raise ValueError(
            f"layer {msg.layer}: phy2log holds an expert id outside [-1, {num_experts})"
        )
    if num_experts and (master.min() < 0 or master.max() >= phy2log.size):
        raise ValueError(f"layer {msg.layer}: master slot index out of range")
    if num_experts and not np.array_equal(phy2log.ravel()[master], np.arange(num_experts)):
        raise ValueError(f"layer {msg.layer}: a master slot does not hold its expert")
    route = np.array(msg.route, dtype=np.int64)
    if route.size % 4:
        raise ValueError(f"layer {msg.layer}: route length {route.size} is not a multiple of 4")
    transfers = []
    for t in msg.migrations:
        if t.kind not in _KIND_FROM_PB:
            raise ValueError(f"layer {msg.layer}: transfer kind {t.kind} is not set")
        transfers.append(
            Transfer(
                expert=t.expert,
                src_rank=t.src_rank,
                dst_rank=t.dst_rank,
                dst_slot=t.dst_slot,
                nbytes=t.nbytes,
                round=t.round,
                kind=_KIND_FROM_PB[t.kind],
            )
        )
    return LayerPlan(
        placement=Placement(phy2log=phy2log, master=master),
        route=route.reshape(-1, 4),
        migration=Migration(transfers=tuple(transfers)),
        solve_seconds=float(msg.solve_seconds),
    )


def plan_to_msg(pv: PlanLike, *, include_route: bool = False) -> pb.Plan:
    return pb.Plan(
        version=pv.version,
        step=pv.step,
        policy=pv.policy,
        state=_STATE_TO_PB.get(str(pv.state), pb.PLAN_STATE_UNSPECIFIED),
        created_at=pv.created_at,
        committed_at=pv.committed_at or 0.0,
        imbalance_before=[float(x) for x in pv.imbalance_before],
        imbalance_after=[float(x) for x in pv.imbalance_after],
        layers=[
            layer_plan_to_msg(i, lp, include_route=include_route) for i, lp in enumerate(pv.layers)
        ],
    )


def plan_from_msg(msg: pb.Plan) -> ReceivedPlan:
    if msg.state not in _STATE_FROM_PB:
        raise ValueError(f"plan {msg.version}: state is not set")
    layers = [layer_plan_from_msg(m) for m in msg.layers]
    if [m.layer for m in msg.layers] != list(range(len(layers))):
        raise ValueError(f"plan {msg.version}: layers are not numbered 0..L-1 in order")
    return ReceivedPlan(
        version=int(msg.version),
        step=int(msg.step),
        policy=msg.policy,
        state=_STATE_FROM_PB[msg.state],
        created_at=msg.created_at,
        committed_at=msg.committed_at or None,
        imbalance_before=list(msg.imbalance_before),
        imbalance_after=list(msg.imbalance_after),
        layers=layers,
    )


# ---- what-if ----


def solve_args_to_msg(args: SolveArgs) -> pb.SolveRequest:
    load = np.asarray(args.load)
    if load.ndim != 2:
        raise ValueError(f"load must be [R, E], got shape {load.shape}")
    return pb.SolveRequest(
        layer=args.layer,
        num_ranks=load.shape[0],
        num_experts=load.shape[1],
        load=load.astype(np.int64).ravel().tolist(),
        policy=args.policy or "",
        policy_settings_json=json.dumps(args.policy_settings) if args.policy_settings else "",
        from_scratch=not args.from_committed,
    )


def _no_constant(name: str) -> Any:
    raise ValueError(f"policy_settings_json holds {name}; settings must be finite numbers")


def solve_args_from_msg(msg: pb.SolveRequest) -> SolveArgs:
    num_ranks, num_experts = int(msg.num_ranks), int(msg.num_experts)
    load = np.array(msg.load, dtype=np.int64)
    if load.size != num_ranks * num_experts or load.size == 0:
        raise ValueError(
            f"load has {load.size} counts, not num_ranks*num_experts = {num_ranks}*{num_experts}"
        )
    if load.min() < 0 or load.max() > MAX_COUNT:
        raise ValueError("load counts must be in [0, 2**40]")
    settings: dict[str, Any] | None = None
    if msg.policy_settings_json:
        if len(msg.policy_settings_json) > MAX_POLICY_SETTINGS_BYTES:
            raise ValueError("policy_settings_json is too large")
        try:
            parsed = json.loads(msg.policy_settings_json, parse_constant=_no_constant)
        except json.JSONDecodeError as err:
            raise ValueError(f"policy_settings_json is not JSON: {err.msg}") from None
        except RecursionError:
            raise ValueError("policy_settings_json is nested too deeply") from None
        if not isinstance(parsed, dict):
            raise ValueError("policy_settings_json must be a JSON object")
        settings = parsed
    return SolveArgs(
        load=load.reshape(num_ranks, num_experts),
        layer=int(msg.layer),
        policy=msg.policy or None,
        policy_settings=settings,
        from_committed=not msg.from_scratch,
    )
