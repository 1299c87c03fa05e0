"""TLS and mutual TLS on real loopback servers, with certificates the test makes
(``expertmesh.controller.certs``): REST, the dashboard and gRPC speak only TLS when a
certificate is configured; a client without the CA's certificate is refused; with mutual
TLS a client without a certificate (or with one from another CA) is refused; the token
is never accepted over plain HTTP or plaintext gRPC (docs/security.md)."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import torch

from expertmesh.controller.certs import make_certs
from expertmesh.controller.core import ControllerCore
from expertmesh.controller.server import Surfaces
from expertmesh.controller.settings import SurfaceSettings
from expertmesh.planner import ModelSpec, Topology
from expertmesh.v1 import convert
from expertmesh.workers.client import ClientTls, ExpertMeshClient
from expertmesh.workers.hook import LoadHook

TOKEN = "tls-token"
E = 8


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Our CA with a controller and a DC certificate, and a second, unrelated CA."""
    ours = tmp_path_factory.mktemp("pki")
    make_certs(ours, {"controller": [], "us-east": []})
    other = tmp_path_factory.mktemp("other")
    make_certs(other, {"us-east": []})
    return {"dir": ours, "other": other}


def _core() -> ControllerCore:
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    return ControllerCore(topo, ModelSpec(num_layers=1, num_experts=E, top_k=2))


def _settings(pki: dict[str, Path], *, mutual: bool) -> SurfaceSettings:
    d = pki["dir"]
    return SurfaceSettings(
        rest_port=0,
        grpc_port=0,
        token=TOKEN,
        tls_cert=d / "controller.pem",
        tls_key=d / "controller.key",
        tls_client_ca=d / "ca.pem" if mutual else None,
    )


def _ctx(ca: Path | None, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def _refused_rest(url: str, ctx: ssl.SSLContext) -> bool:
    """True when the request gets no HTTP answer (handshake refused or connection closed)."""
    try:
        httpx.get(f"{url}/api/v1/health", verify=ctx, timeout=5)
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return True
    return False


def _refused_grpc(target: str, tls: ClientTls | None) -> grpc.StatusCode | None:
    """The status a health check gets, or None when it is answered."""
    with ExpertMeshClient(target, tls=tls, timeout=5) as c:
        try:
            c.healthy()
        except grpc.RpcError as err:
            return err.code()
    return None


def _report(step: int, rank: int) -> convert.Report:
    return convert.Report(step=step, layer=0, rank=rank, load=np.arange(E, dtype=np.int64))


def test_a_client_without_the_ca_is_refused(pki):
    d, other = pki["dir"], pki["other"]
    with Surfaces(_core(), _settings(pki, mutual=False)) as s:
        assert s.rest_url.startswith("https://")
        # with our CA: REST, the dashboard page and gRPC answer
        assert (
            httpx.get(f"{s.rest_url}/api/v1/health", verify=_ctx(d / "ca.pem")).status_code == 200
        )
        assert httpx.get(f"{s.rest_url}/", verify=_ctx(d / "ca.pem")).status_code == 200
        assert _refused_grpc(s.grpc_target, ClientTls(ca=d / "ca.pem")) is None
        # without it (the system's roots, or another CA): refused before any request
        assert _refused_rest(s.rest_url, _ctx(None))
        assert _refused_rest(s.rest_url, _ctx(other / "ca.pem"))
        assert _refused_grpc(s.grpc_target, ClientTls()) == grpc.StatusCode.UNAVAILABLE
        assert _refused_grpc(s.grpc_target, ClientTls(ca=other / "ca.pem")) == (
            grpc.StatusCode.UNAVAILABLE
        )
        # a TLS client that checks the name refuses a certificate for another name
        named = ClientTls(ca=d / "ca.pem", server_name="not-the-controller.example")
        assert _refused_grpc(s.grpc_target, named) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_a_client_without_a_certificate(pki):
    d, other = pki["dir"], pki["other"]
    core = _core()
    ours = (d / "us-east.pem", d / "us-east.key")
    theirs = (other / "us-east.pem", other / "us-east.key")
    with Surfaces(core, _settings(pki, mutual=True)) as s:
        # no client certificate, or one another CA signed: refused on both surfaces
        assert _refused_rest(s.rest_url, _ctx(d / "ca.pem"))
        assert _refused_rest(s.rest_url, _ctx(d / "ca.pem", theirs))
        assert _refused_grpc(s.grpc_target, ClientTls(ca=d / "ca.pem")) == (
            grpc.StatusCode.UNAVAILABLE
        )
        bad = ClientTls(ca=d / "ca.pem", cert=theirs[0], key=theirs[1])
        assert _refused_grpc(s.grpc_target, bad) == grpc.StatusCode.UNAVAILABLE
        assert core.reports_received == 0
        # with our DC's certificate: REST writes with the token, gRPC reports, the hook
        ctx = _ctx(d / "ca.pem", ours)
        body = {"step": 0, "layer": 0, "rank": 0, "load": list(range(E))}
        r = httpx.post(
            f"{s.rest_url}/api/v1/reports",
            json=body,
            verify=ctx,
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.status_code == 200, r.text
        tls = ClientTls(ca=d / "ca.pem", cert=ours[0], key=ours[1])
        with ExpertMeshClient(s.grpc_target, token=TOKEN, tls=tls) as c:
            assert c.healthy()
            assert c.report([_report(0, 1), _report(0, 2)]) == 2
        hook = LoadHook.connect(
            s.grpc_target, rank=3, num_experts=E, token=TOKEN, tls=tls, watch=False
        )
        try:
            hook.count(0, torch.tensor([[0, 1], [1, 2]]))
            hook.step(0)
        finally:
            hook.close()  # flushes the stream: the controller has the report now
        assert core.reports_received == 4
        assert core.reports_rejected == 0
        assert core.window(0).shape[0] == 1  # every rank reported: step 0 complete


def test_the_token_is_never_accepted_over_plain_http_when_tls_is_on(pki):
    core = _core()
    with Surfaces(core, _settings(pki, mutual=False)) as s:
        policy = core.settings
        # plain HTTP with a valid token to the REST port: no HTTP answer, nothing changes
        for method, path, body in (
            ("PUT", "/api/v1/policy", b'{"policy": "eplb"}'),
            ("POST", "/api/v1/reports", b'{"step": 0, "layer": 0, "rank": 0, "load": [1]}'),
        ):
            with socket.create_connection(("127.0.0.1", s.rest_port), timeout=5) as sock:
                sock.sendall(
                    f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                got = b""
                try:
                    while chunk := sock.recv(4096):
                        got += chunk
                except (ConnectionResetError, TimeoutError):
                    pass
            assert not got.startswith(b"HTTP/"), got[:200]
        # plaintext gRPC with the token: no call reaches the service
        with ExpertMeshClient(s.grpc_target, token=TOKEN, timeout=5) as c:
            with pytest.raises(grpc.RpcError) as err:
                c.report([_report(0, 0)])
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert core.settings == policy
        assert core.reports_received == 0
        # the same token over TLS is accepted (the refusals above were about the channel)
        r = httpx.put(
            f"{s.rest_url}/api/v1/policy",
            json={"policy": "eplb"},
            verify=_ctx(pki["dir"] / "ca.pem"),
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.status_code == 200, r.text
        assert core.settings.policy == "eplb"
