"""The soak benchmark runs end to end at a tiny scale and its accounting reconciles."""

import json
import subprocess
import sys


def test_soak_smoke(repo, tmp_path):
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable, str(repo / "bench" / "bench_soak.py"), "--minutes", "0.15",
        "--ranks", "8", "--dcs", "2", "--experts", "8", "--step-hz", "10", "--every", "5",
        "--bad-every", "3", "--baseline-seconds", "1", "--sample-seconds", "0.5",
        "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    acc, client = res["accounting"], res["client"]
    assert acc["reconciles"] and acc["lost"] == 0 and acc["lost_server_side"] == 0
    assert client["bad_sent"] >= 2 and client["bad_refused"] == client["bad_sent"]
    assert acc["server_received"] == acc["applied"] + acc["rejected"]
    assert res["server"]["plans_committed"] >= 2
    assert res["rss"]["samples"] >= 3 and res["rest_latest"]["requests_200"] > 0
    assert res["control"]["requests_200"] > 0 and res["control"]["errors"] == 0
    assert res["config"]["planner_process"] and res["cpu"]["server_cores"] > 0
