#!/usr/bin/env python3
"""A tiny, time-bounded TCP sender/receiver to measure goodput between two namespaces.

    tcpprobe.py recv IP READY_FILE RESULT_FILE   # bind IP:0, write the port to READY_FILE,
                                                # take one connection, write JSON to RESULT_FILE
    tcpprobe.py send IP PORT SECONDS             # send as fast as the link allows for SECONDS

The receiver reports ``steady_mbit``: payload bits per second after the first
0.5 s (which an htb bucket's initial burst would inflate), and ``total_bytes``.
It gives up after 120 s without data.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

WARMUP_S = 0.5


def recv(ip: str, ready: Path, result: Path) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((ip, 0))
    srv.listen(1)
    srv.settimeout(120)
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(str(srv.getsockname()[1]))
    tmp.rename(ready)
    conn, _ = srv.accept()
    conn.settimeout(120)
    total, t0 = 0, time.monotonic()
    mark: tuple[float, int] | None = None
    last = (0.0, 0)
    while True:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        total += len(chunk)
        last = (time.monotonic() - t0, total)
        if mark is None and last[0] >= WARMUP_S:
            mark = last
    conn.close()
    srv.close()
    if mark is None or last[0] <= mark[0]:
        raise SystemExit("tcpprobe: the transfer was shorter than the warm-up; send longer")
    steady = (last[1] - mark[1]) * 8 / (last[0] - mark[0]) / 1e6
    result.write_text(json.dumps({"steady_mbit": steady, "total_bytes": total, "seconds": last[0]}))


def send(ip: str, port: int, seconds: float) -> None:
    buf = b"\0" * (1 << 16)
    with socket.create_connection((ip, port), timeout=30) as sock:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sock.sendall(buf)


def main(argv: list[str]) -> None:
    if len(argv) == 4 and argv[0] == "recv":
        recv(argv[1], Path(argv[2]), Path(argv[3]))
    elif len(argv) == 4 and argv[0] == "send":
        send(argv[1], int(argv[2]), float(argv[3]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
