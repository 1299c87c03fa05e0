"""Settings of the control-plane surfaces (REST, gRPC, dashboard, plan store).

Read from the environment with the ``EXPERTMESH_`` prefix (``EXPERTMESH_TOKEN``,
``EXPERTMESH_REST_PORT``, ...) or passed explicitly; explicit values win.
Defaults bind to loopback on fixed ports that Ray does not use: 8700 for REST,
the dashboard and ``/metrics``; 8701 for gRPC.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["DEFAULT_GRPC_PORT", "DEFAULT_REST_PORT", "SurfaceSettings", "is_loopback"]

DEFAULT_REST_PORT = 8700
DEFAULT_GRPC_PORT = 8701
_REPO_WEB = Path(__file__).resolve().parents[3] / "dashboards" / "web"


class SurfaceSettings(BaseSettings):
    """Where the surfaces listen, who may write, and how much they accept."""

    model_config = SettingsConfigDict(env_prefix="EXPERTMESH_", extra="forbid", frozen=True)

    host: str = Field(default="127.0.0.1", description="address REST and gRPC bind to")
    rest_port: int = Field(default=DEFAULT_REST_PORT, ge=0, le=65535, description="0: any free")
    grpc_port: int = Field(default=DEFAULT_GRPC_PORT, ge=0, le=65535, description="0: any free")
    token: SecretStr | None = Field(
        default=None,
        description="bearer token for writes; without one, policy changes are refused",
    )
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, le=1 << 30, description="largest REST request body"
    )
    max_message_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, le=1 << 30, description="largest gRPC message"
    )
    max_page: int = Field(default=200, ge=1, le=10_000, description="largest page of plans")
    db_path: str = Field(default=":memory:", description="SQLite plan store (':memory:' = none)")
    plan_retention: int = Field(default=1000, ge=1, le=10_000_000, description="plans kept")
    dashboard_dir: Path = Field(default=_REPO_WEB, description="static files of the dashboard")
    grpc_workers: int = Field(default=16, ge=1, le=1024, description="gRPC handler threads")
    max_concurrent_rpcs: int = Field(
        default=8192, ge=1, le=1_000_000, description="open gRPC calls (streams included)"
    )
    tls_cert: Path | None = Field(
        default=None,
        description="PEM certificate (chain) REST and gRPC present; with tls_key, both speak "
        "only TLS",
    )
    tls_key: Path | None = Field(default=None, description="PEM private key of tls_cert")
    tls_client_ca: Path | None = Field(
        default=None,
        description="PEM CA certificate(s): when set, every REST and gRPC client must present "
        "a certificate signed by one of them (mutual TLS)",
    )

    @model_validator(mode="after")
    def _tls_files(self) -> SurfaceSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        for path in (self.tls_cert, self.tls_key, self.tls_client_ca):
            if path is not None and not path.is_file():
                raise ValueError(f"no such file: {path}")
        return self

    @property
    def tls(self) -> bool:
        """Whether REST and gRPC speak TLS (and only TLS)."""
        return self.tls_cert is not None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def token_value(self) -> str | None:
        if self.token is None:
            return None
        value = self.token.get_secret_value()
        return value or None


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts local connections."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
