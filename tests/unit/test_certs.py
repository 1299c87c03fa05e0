"""`expertmesh certs` and the TLS settings: what the files hold, CA reuse, bad input."""

from __future__ import annotations

import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from pydantic import ValidationError

from expertmesh.cli.main import main
from expertmesh.controller.certs import make_certs
from expertmesh.controller.settings import SurfaceSettings


def _load(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_certificates_are_signed_by_the_ca_and_name_their_hosts(tmp_path):
    ca_path, files = make_certs(tmp_path, {"us-east": ["10.0.1.10", "node1.example"], "b": []})
    ca = _load(ca_path)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for f in files:
        cert = _load(f.cert)
        cert.verify_directly_issued_by(ca)  # raises if not
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(usage) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        assert stat.S_IMODE(f.key.stat().st_mode) == 0o600
    san = _load(files[0].cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    ips = set(san.value.get_values_for_type(x509.IPAddress))
    assert ips == {ipaddress.ip_address(a) for a in ("10.0.1.10", "127.0.0.1", "::1")}
    assert set(san.value.get_values_for_type(x509.DNSName)) == {"node1.example", "localhost"}
    assert stat.S_IMODE((tmp_path / "ca.key").stat().st_mode) == 0o600


def test_a_second_run_reuses_the_ca(tmp_path):
    make_certs(tmp_path, {"a": []})
    before = (tmp_path / "ca.pem").read_bytes()
    make_certs(tmp_path, {"b": []})
    assert (tmp_path / "ca.pem").read_bytes() == before
    _load(tmp_path / "b.pem").verify_directly_issued_by(_load(tmp_path / "ca.pem"))
    # signing from another directory's CA: the key stays there
    out = tmp_path / "node"
    make_certs(out, {"n": ["10.0.0.7"]}, ca_dir=tmp_path)
    assert not (out / "ca.key").exists()
    _load(out / "n.pem").verify_directly_issued_by(_load(tmp_path / "ca.pem"))


@pytest.mark.parametrize(
    ("names", "kw"),
    [
        ({"ca": []}, {}),
        ({"../x": []}, {}),
        ({"a": ["not a host!"]}, {}),
        ({"a": []}, {"days": 0}),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path, names, kw):
    with pytest.raises(ValueError):
        make_certs(tmp_path / "out", names, **kw)
    assert not (tmp_path / "out").exists()


def test_cli_makes_per_dc_certificates_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "tls"
    topo = "deploy/topologies/two-dc.yaml"
    assert main(["certs", "--out", str(out), "--topology", topo, "--hosts", "ctl=10.0.0.1"]) == 0
    assert {p.name for p in out.iterdir()} == {
        f"{n}.{x}" for n in ("ca", "us-east", "eu-west", "ctl") for x in ("pem", "key")
    }
    capsys.readouterr()
    assert main(["certs", "--out", str(out), "--hosts", "nohosts"]) == 2
    assert main(["certs", "--out", str(out), "--name", "bad/name"]) == 2
    assert main(["certs", "--out", str(tmp_path / "x"), "--name", "a", "--ca", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("expertmesh certs: error:") for line in err)


def test_tls_settings_go_together(tmp_path):
    make_certs(tmp_path, {"c": []})
    cert, key, ca = tmp_path / "c.pem", tmp_path / "c.key", tmp_path / "ca.pem"
    assert SurfaceSettings(tls_cert=cert, tls_key=key, tls_client_ca=ca).tls
    assert not SurfaceSettings().tls
    for bad in (
        {"tls_cert": cert},
        {"tls_key": key},
        {"tls_client_ca": ca},
        {"tls_cert": cert, "tls_key": tmp_path / "missing.key"},
    ):
        with pytest.raises(ValidationError):
            SurfaceSettings(**bad)


def test_serve_refuses_half_a_tls_setting_on_one_line(tmp_path, capsys):
    make_certs(tmp_path, {"c": []})
    assert main(["serve", "--tls-cert", str(tmp_path / "c.pem"), "--seconds", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tls_cert and tls_key go together" in err[0]
