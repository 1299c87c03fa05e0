"""The 1,000-DC ingestion benchmark runs end to end at a tiny scale and reconciles."""

import subprocess
import sys


def test_ingest_bench_smoke(repo):
    cmd = [
        sys.executable, str(repo / "bench" / "bench_ingest.py"), "--dcs", "6", "--ranks-per-dc",
        "2", "--layers", "3", "--experts", "8", "--window", "3", "--repeats", "1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "nothing lost: yes" in out and "output equals the numpy sums: yes" in out
    rows = [line for line in out.splitlines() if line.startswith(("per-rank", "windows"))]
    # every path the bench measures: 3 per-rank, 2 core windows, 4 gRPC window forms
    # (varints, int64, the narrowest width, several DCs a message)
    assert len(rows) == 9 and all(line.endswith("yes") for line in rows)
    assert any("DCs a message" in line for line in rows)
