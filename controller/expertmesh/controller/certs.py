"""A private certificate authority and per-DC certificates, for TLS on every surface.

``expertmesh certs`` calls :func:`make_certs`: a CA (``ca.pem``, ``ca.key``) and, per
name (a DC, a node, a trainer), a certificate signed by it (``<name>.pem``,
``<name>.key``) that serves both ends of a connection (server and client
authentication), so one file set per DC covers its Ray nodes' mutual TLS, the
controller's REST and gRPC listeners, and the trainers' client certificates.
Every certificate names ``localhost``, ``127.0.0.1`` and ``::1`` besides the hosts
given for it. Keys are ECDSA P-256, written with mode 0600. Meant for tests and
first runs; in production the operator's own PKI provides the same files.

No network, no global state: the ``cryptography`` package does the work.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CertFiles", "make_certs", "san_hosts"]

CA_NAME = "ca"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
ALWAYS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class CertFiles:
    """The PEM files of one certificate: ``cert`` signed by ``ca``, its private ``key``."""

    name: str
    cert: Path
    key: Path
    ca: Path


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def san_hosts(hosts: list[str]) -> list[x509.GeneralName]:
    """Subject alternative names for ``hosts`` (IP addresses as IPs, the rest as DNS names);
    ``ValueError`` on an empty or malformed name."""
    out: list[x509.GeneralName] = []
    for h in dict.fromkeys(x.strip() for x in hosts):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
            continue
        except ValueError:
            pass
        if not h or not re.fullmatch(r"[A-Za-z0-9*]([A-Za-z0-9.-]{0,252})", h):
            raise ValueError(f"not an IP address or DNS name: {h!r}")
        out.append(x509.DNSName(h))
    return out


def _load_ca(out: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate] | None:
    cert_path, key_path = out / f"{CA_NAME}.pem", out / f"{CA_NAME}.key"
    if not cert_path.exists() and not key_path.exists():
        return None
    if not (cert_path.exists() and key_path.exists()):
        raise ValueError(f"{out} holds only one of {CA_NAME}.pem and {CA_NAME}.key")
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{key_path}: not an ECDSA key (made by `expertmesh certs`?)")
    return key, cert


def _new_ca(days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "expertmesh private CA")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    name: str,
    hosts: list[str],
    days: int,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(san_hosts([*hosts, *ALWAYS])), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def make_certs(
    out: Path, names: dict[str, list[str]], *, days: int = 365, ca_dir: Path | None = None
) -> tuple[Path, list[CertFiles]]:
    """Write a CA and one certificate per entry of ``names`` (name -> extra hosts) to ``out``.

    The CA is reused when ``ca_dir`` (or ``out`` itself) already holds ``ca.pem`` and
    ``ca.key``, so certificates for new DCs or nodes can be added later; otherwise a new
    one is made in ``out``. Certificates of the given names are (re)issued. Returns the
    CA certificate's path and the files written. ``ValueError`` on a bad name, host or
    ``days``."""
    if not 1 <= days <= 3650:
        raise ValueError(f"days must be in [1, 3650], got {days}")
    for name in names:
        if not _NAME.match(name) or name == CA_NAME:
            raise ValueError(
                f"certificate name must match {_NAME.pattern} and not be 'ca': {name!r}"
            )
    for hosts in names.values():
        san_hosts(hosts)  # refuse bad hosts before writing anything
    out.mkdir(parents=True, exist_ok=True)
    found = _load_ca(ca_dir or out)
    if found is None:
        if ca_dir is not None:
            raise ValueError(f"no {CA_NAME}.pem and {CA_NAME}.key in {ca_dir}")
        ca_key, ca_cert = _new_ca(days)
        _write(out / f"{CA_NAME}.key", _key_pem(ca_key), 0o600)
    else:
        ca_key, ca_cert = found
    ca_path = out / f"{CA_NAME}.pem"
    _write(ca_path, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    files = []
    for name, hosts in names.items():
        key, cert = _leaf(ca_key, ca_cert, name, hosts, days)
        key_path, cert_path = out / f"{name}.key", out / f"{name}.pem"
        _write(key_path, _key_pem(key), 0o600)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        files.append(CertFiles(name, cert_path, key_path, ca_path))
    return ca_path, files
