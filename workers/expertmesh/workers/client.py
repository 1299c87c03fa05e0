"""A Python client of the controller's gRPC service, for trainers outside Ray.

Speaks domain types (numpy arrays, :class:`~expertmesh.v1.convert.ReceivedPlan`);
messages stay inside :mod:`expertmesh.v1.convert`. Load reports go over one
long-lived client stream per :class:`ReportStream`, batched; plans arrive over
a server stream (:meth:`ExpertMeshClient.watch_plans`).
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertmesh.planner import LayerPlan
from expertmesh.planner.window import WindowBlock, WindowReport
from expertmesh.v1 import convert
from expertmesh.v1 import expertmesh_pb2 as pb
from expertmesh.v1 import expertmesh_pb2_grpc as pb_grpc

__all__ = ["ClientTls", "ExpertMeshClient", "ReportStream", "SolveResult"]

log = logging.getLogger(__name__)

_CLOSE = object()


@dataclass(frozen=True)
class ClientTls:
    """TLS for the client's channel: which CA signed the controller's certificate, and the
    client certificate to present when the controller asks for one (mutual TLS).

    - ``ca``: PEM file of the CA to verify the server with (None: the system's roots).
    - ``cert``, ``key``: PEM client certificate and its key (both or neither).
    - ``server_name``: the name to check the server's certificate against, when it is not
      the host part of the target (e.g. connecting by an IP its certificate does not name).
    """

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its key (cert and key go together)")
        for path in (self.ca, self.cert, self.key):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"no such file: {path}")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(p: Path | None) -> bytes | None:
            return Path(p).read_bytes() if p is not None else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca),
            private_key=read(self.key),
            certificate_chain=read(self.cert),
        )


@dataclass(frozen=True, eq=False)
class SolveResult:
    policy: str
    imbalance_before: float
    imbalance_after: float
    plan: LayerPlan


class ReportStream:
    """One open ``ReportLoad`` call. :meth:`send` queues a report (batched into messages of
    up to ``batch`` reports); :meth:`close` ends the stream and returns how many the
    controller accepted. A rejection by the controller surfaces as ``grpc.RpcError`` from
    the next :meth:`send` or from :meth:`close`."""

    def __init__(self, stub: pb_grpc.ExpertMeshServiceStub, metadata: Any, batch: int) -> None:
        if batch < 1:
            raise ValueError("batch must be >= 1")
        self._batch = batch
        self._q: queue.Queue[Any] = queue.Queue(maxsize=64)
        self._pending: list[pb.LoadReport] = []
        self._lock = threading.Lock()
        self._closed = False
        self.sent = 0
        self._future = stub.ReportLoad.future(self._messages(), metadata=metadata)

    def _messages(self) -> Iterator[pb.ReportLoadRequest]:
        while True:
            item = self._q.get()
            if item is _CLOSE:
                return
            yield pb.ReportLoadRequest(reports=item)

    def _check(self) -> None:
        if self._future.done():
            self._future.result()  # raises the controller's error
            raise RuntimeError("the report stream ended")

    def send(self, step: int, layer: int, rank: int, load: np.ndarray) -> None:
        """Queue ``load`` [E] (tokens ``rank`` sent to each expert in ``step`` of ``layer``)."""
        msg = convert.report_to_msg(step, layer, rank, load)
        with self._lock:
            if self._closed:
                raise RuntimeError("the report stream is closed")
            self._pending.append(msg)
            self.sent += 1
            if len(self._pending) >= self._batch:
                self._flush()

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        while True:
            self._check()
            try:
                self._q.put(batch, timeout=0.5)
                return
            except queue.Full:
                continue

    def close(self, timeout: float | None = 30.0) -> int:
        """Send what is queued, end the stream; returns the reports the controller accepted."""
        with self._lock:
            if not self._closed:
                self._flush()
                self._closed = True
                self._q.put(_CLOSE)
        resp: pb.ReportLoadResponse = self._future.result(timeout=timeout)
        return int(resp.accepted)

    def cancel(self) -> None:
        with self._lock:
            self._closed = True
        self._future.cancel()


class ExpertMeshClient:
    """Client of ``expertmesh.v1.ExpertMeshService`` at ``target`` (``host:port``)."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        max_message_bytes: int = 64 * 1024 * 1024,
        tls: ClientTls | None = None,
    ) -> None:
        self.target, self.timeout, self.tls = target, timeout, tls
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if tls is None:
            if token and not _loopback_target(target):
                log.warning("sending the bearer token to %s in clear text (no TLS)", target)
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.secure_channel(target, tls.credentials(), options=options)
        self._stub = pb_grpc.ExpertMeshServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None

    def __enter__(self) -> ExpertMeshClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the channel connects (``grpc.FutureTimeoutError`` otherwise)."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def healthy(self, service: str = "") -> bool:
        req = health_pb2.HealthCheckRequest(service=service)
        resp = self._health.Check(req, timeout=self.timeout)
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    # ---- load reports ----

    def open_report_stream(self, batch: int = 64) -> ReportStream:
        return ReportStream(self._stub, self._metadata, batch)

    def report(self, reports: list[convert.Report], batch: int = 256) -> int:
        """Send ``reports`` over one stream; returns how many were accepted."""
        stream = self.open_report_stream(batch)
        for r in reports:
            stream.send(r.step, r.layer, r.rank, r.load)
        return stream.close(timeout=self.timeout + len(reports) * 1e-3)

    def report_windows(
        self,
        reports: list[WindowReport],
        batch: int = 512,
        *,
        blocks: bool = True,
        count_width: int | None = None,
    ) -> tuple[int, int]:
        """Send DC window reports (what :class:`~expertmesh.workers.aggregate.DcAggregator`
        returns) in messages of up to ``batch``; returns (accepted, windows completed). A
        refusal raises ``grpc.RpcError`` (reports of earlier messages stay applied).

        ``blocks``: consecutive reports of one DC's window travel as one
        ``DcWindowReport`` with the counts as packed bytes (the fast path; a server that
        predates it accepts none of them, and this raises ``RuntimeError``); off: one
        ``WindowReport`` each. ``count_width``: the packed counts' ``CountWidth`` (default:
        the narrowest that holds a block's counts; a server that predates ``count_width``
        refuses narrower ones with INVALID_ARGUMENT: send it ``pb.COUNT_WIDTH_INT64``)."""
        if not 1 <= batch <= 4096:
            raise ValueError("batch must be in [1, 4096]")
        accepted = completed = 0
        for i in range(0, len(reports), batch):
            part = reports[i : i + batch]
            msg = (
                convert.windows_to_msg(WindowBlock.of(part), width=count_width)  # type: ignore[arg-type]
                if blocks
                else pb.ReportWindowsRequest(reports=[convert.window_to_msg(r) for r in part])
            )
            resp = self._stub.ReportWindows(msg, metadata=self._metadata, timeout=self.timeout)
            if blocks and int(resp.accepted) < len(part):
                raise RuntimeError(
                    f"the server accepted {resp.accepted} of {len(part)} window reports without "
                    "an error: it predates DcWindowReport; send with blocks=False"
                )
            accepted += int(resp.accepted)
            completed += int(resp.completed)
        return accepted, completed

    # ---- plans ----

    def get_plan(
        self, version: int = 0, *, include_route: bool = False
    ) -> convert.ReceivedPlan | None:
        """Plan ``version`` (0: the committed one); None if there is none."""
        try:
            resp = self._stub.GetPlan(
                pb.GetPlanRequest(version=version, include_route=include_route),
                timeout=self.timeout,
            )
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        return convert.plan_from_msg(resp.plan)

    def watch_plans(self, *, include_route: bool = False) -> PlanWatch:
        """Iterate the committed plan and every newer one as it commits; ``cancel()`` stops."""
        call = self._stub.WatchPlans(pb.WatchPlansRequest(include_route=include_route))
        return PlanWatch(call)

    def solve(
        self,
        load: np.ndarray,
        *,
        layer: int = 0,
        policy: str | None = None,
        policy_settings: dict[str, Any] | None = None,
        from_committed: bool = True,
    ) -> SolveResult:
        """What-if plan of ``load`` [R, E]; nothing is applied."""
        args = convert.SolveArgs(
            load=np.asarray(load),
            layer=layer,
            policy=policy,
            policy_settings=policy_settings,
            from_committed=from_committed,
        )
        resp = self._stub.Solve(convert.solve_args_to_msg(args), timeout=self.timeout)
        return SolveResult(
            policy=resp.policy,
            imbalance_before=resp.imbalance_before,
            imbalance_after=resp.imbalance_after,
            plan=convert.layer_plan_from_msg(resp.plan),
        )


def _loopback_target(target: str) -> bool:
    host = target.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PlanWatch:
    """Iterator over plans from a ``WatchPlans`` call."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[convert.ReceivedPlan]:
        try:
            for resp in self._call:
                yield convert.plan_from_msg(resp.plan)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                raise

    def cancel(self) -> None:
        self._call.cancel()
