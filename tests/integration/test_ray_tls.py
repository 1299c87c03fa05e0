"""Ray's own TLS (RAY_USE_TLS) runs with the certificates `expertmesh certs` makes: a local
Ray instance in a child process (Ray reads the variables at start), one task through it."""

from __future__ import annotations

import os
import subprocess
import sys

from expertmesh.controller.certs import make_certs

DRIVER = """
import ray
ray.init(address="local", num_cpus=1, include_dashboard=False)
@ray.remote
def f(x):
    return x + 1
assert ray.get(f.remote(41)) == 42
print("tls task ok")
ray.shutdown()
"""


def test_ray_runs_over_tls_with_our_certificates(tmp_path):
    import ray.util

    ip = ray.util.get_node_ip_address()  # the address Ray's processes dial: the cert names it
    make_certs(tmp_path, {"node": [ip]})
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(tmp_path / "node.pem"),
        "RAY_TLS_SERVER_KEY": str(tmp_path / "node.key"),
        "RAY_TLS_CA_CERT": str(tmp_path / "ca.pem"),
    }
    run = subprocess.run(
        [sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert run.returncode == 0 and "tls task ok" in run.stdout, run.stderr[-3000:]
