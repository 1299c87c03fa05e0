"""``expertmesh certs``: a private CA and per-DC certificates for TLS and mutual TLS.

    expertmesh certs --out tls --topology deploy/topologies/onprem-3dc.yaml \\
        --hosts us-east=10.0.1.10,10.0.1.11 --hosts eu-west=10.0.2.10 --hosts controller=10.0.1.10

writes ``tls/ca.pem`` and ``tls/ca.key`` (kept on the operator's machine) and, per
DC of the topology and per ``--name``/``--hosts`` entry, ``tls/<name>.pem`` and
``tls/<name>.key`` signed by that CA. Each certificate authenticates both ends of a
connection: the DC's Ray nodes (``RAY_TLS_SERVER_CERT``/``_KEY``, ``RAY_TLS_CA_CERT``),
``expertmesh serve --tls-cert/--tls-key`` and the DC's trainers as TLS clients.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from expertmesh.cli.main import UsageError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "certs",
        help="make a private CA and per-DC certificates (TLS, mutual TLS, Ray's TLS)",
        description=(
            "Make a private certificate authority (OUT/ca.pem, OUT/ca.key) and one "
            "certificate per DC or name (OUT/<name>.pem, OUT/<name>.key), each usable as "
            "server and client certificate; every one names localhost, 127.0.0.1 and ::1 "
            "plus the hosts given for it. An existing CA in OUT (or --ca) is reused, so "
            "certificates can be added later. For tests and first runs; in production use "
            "your own PKI's files the same way."
        ),
    )
    p.add_argument("--out", type=Path, required=True, help="directory for the PEM files")
    p.add_argument("--topology", type=Path, default=None, help="one certificate per DC of it")
    p.add_argument(
        "--name", action="append", default=[], help="a certificate for NAME (repeatable)"
    )
    p.add_argument(
        "--hosts",
        action="append",
        default=[],
        metavar="NAME=HOST[,HOST...]",
        help="IP addresses or DNS names NAME's certificate also names (repeatable; adds NAME)",
    )
    p.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    p.add_argument(
        "--ca", type=Path, default=None, help="sign with the CA in this directory (ca.pem, ca.key)"
    )
    p.set_defaults(func=run)


def names_from(args: argparse.Namespace) -> dict[str, list[str]]:
    """Certificate name -> extra hosts, in the order given (topology DCs first)."""
    names: dict[str, list[str]] = {}
    if args.topology is not None:
        from expertmesh.formats import read_topology

        for dc in read_topology(args.topology).dcs:
            names.setdefault(dc.name, [])
    for name in args.name:
        names.setdefault(name, [])
    for item in args.hosts:
        name, sep, hosts = item.partition("=")
        if not sep or not name or not hosts:
            raise UsageError(f"--hosts wants NAME=HOST[,HOST...], got {item!r}")
        names.setdefault(name, []).extend(h for h in hosts.split(",") if h)
    if not names:
        raise UsageError("nothing to make: give --topology, --name or --hosts")
    return names


def run(args: argparse.Namespace) -> int:
    from expertmesh.controller.certs import make_certs

    names = names_from(args)
    ca, files = make_certs(args.out, names, days=args.days, ca_dir=args.ca)
    print(
        f"CA          {ca}"
        + ("" if args.ca else f"  (key {args.out / 'ca.key'}: keep it off the nodes)")
    )
    for f in files:
        hosts = ", ".join(names[f.name]) or "loopback only"
        print(f"{f.name:<11} {f.cert}  {f.key}  ({hosts})")
    return 0
