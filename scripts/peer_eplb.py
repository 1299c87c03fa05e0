#!/usr/bin/env python3
"""peer_eplb.py [DIR]: DeepSeek's EPLB algorithm as sglang ships it, for side-by-side tests and
benchmarks; puts it at DIR/deepseek_eplb.py (default: .cache/peers) and prints that path.

The module is not in this repository: it is fetched when first needed from the pinned sglang
wheel on PyPI (``pip download``, no dependencies installed, nothing executed) and one member,
``sglang/srt/eplb/eplb_algorithms/deepseek.py``, is extracted and checked against its SHA-256.
It needs only torch: ``rebalance_experts(weight, num_replicas, num_groups, num_nodes,
num_gpus, enable_hierarchical)``. ``tests/conftest.py`` (fixture ``peer_eplb``) and
``bench/bench_planner.py`` use :func:`fetch`.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SGLANG = "0.5.23"
MEMBER = "sglang/srt/eplb/eplb_algorithms/deepseek.py"
SHA256 = "7c42cd0cb0f03da5dc68d13d38833f2986625ac96813dae4853521341cc5219c"
DEFAULT_DIR = Path(__file__).resolve().parents[1] / ".cache" / "peers"


class PeerUnavailable(RuntimeError):
    """The peer could not be fetched (no network, PyPI refused, the member changed)."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(directory: Path = DEFAULT_DIR, timeout: float = 900.0) -> Path:
    """``directory/deepseek_eplb.py``, downloaded and extracted unless it is already there
    with the pinned content. :class:`PeerUnavailable` with the reason otherwise."""
    out = directory / "deepseek_eplb.py"
    if out.is_file() and _sha256(out.read_bytes()) == SHA256:
        return out
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--only-binary=:all:", "--dest", tmp, f"sglang=={SGLANG}"]  # fmt: skip
        try:
            run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise PeerUnavailable(f"pip download sglang=={SGLANG} failed: {err}") from None
        wheels = sorted(Path(tmp).glob("sglang-*.whl"))
        if run.returncode != 0 or not wheels:
            tail = " ".join(run.stderr.split()[-40:])
            raise PeerUnavailable(f"pip download sglang=={SGLANG} failed: {tail}")
        try:
            with zipfile.ZipFile(wheels[0]) as z:
                src = z.read(MEMBER)
        except (KeyError, zipfile.BadZipFile) as err:
            raise PeerUnavailable(f"{wheels[0].name}: {err}") from None
    if _sha256(src) != SHA256:
        raise PeerUnavailable(f"{MEMBER} in sglang {SGLANG} is not the pinned one (SHA-256)")
    tmp_out = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp_out.write_bytes(src)
    os.replace(tmp_out, out)
    return out


def main(argv: list[str]) -> int:
    try:
        path = fetch(Path(argv[0]) if argv else DEFAULT_DIR)
    except PeerUnavailable as err:
        print(f"peer_eplb: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
