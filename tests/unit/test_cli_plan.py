"""`expertmesh trace` and `expertmesh plan` in-process: happy paths and bad input."""

from pathlib import Path

import numpy as np
import pytest

from expertmesh.cli.main import UsageError, main
from expertmesh.cli.plan import parse_settings
from expertmesh.formats import read_plan, read_trace, validate_plan, write_trace
from expertmesh.planner import available_policies

TOPO = """\
dcs:
  - {name: east, nodes: 1, ranks_per_node: 4}
  - {name: west, nodes: 2, ranks_per_node: 2}
slots_per_rank: {masters: 2, spare: 1}
links:
  inter_dc: {gbps: 1, latency_ms: 20}
"""


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    topo = tmp_path / "topo.yaml"
    topo.write_text(TOPO)
    trace = tmp_path / "trace.npz"
    rc = main(["trace", "generate", "--out", str(trace), "--topology", str(topo),
               "--experts", "16", "--layers", "2", "--steps", "4", "--top-k", "2",
               "--tokens-per-rank", "256", "--imbalance", "1.8", "--seed", "3"])  # fmt: skip
    assert rc == 0
    return {"topo": topo, "trace": trace, "dir": tmp_path}


def plan_args(files: dict[str, Path], policy: str = "static", out: str = "p.npz") -> list[str]:
    return ["plan", "--trace", str(files["trace"]), "--topology", str(files["topo"]),
            "--policy", policy, "--out", str(files["dir"] / out)]  # fmt: skip


def fails(argv: list[str], capsys: pytest.CaptureFixture[str], match: str) -> str:
    """Run ``argv``: exit code 2, one stderr line that contains ``match``, no traceback."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert match in lines[0], lines[0]
    return lines[0]


# ---- trace generate ----


def test_trace_generate_writes_a_trace_with_meta(files, capsys):
    tr = read_trace(files["trace"])
    assert tr.load.shape == (4, 2, 8, 16)
    assert (tr.load.sum(axis=-1) == 256 * 2).all()
    assert tr.meta["top_k"] == 2 and tr.meta["ranks_per_dc"] == [4, 4]
    assert tr.meta["dcs"] == ["east", "west"]
    assert tr.meta["generator"]["settings"]["imbalance"] == 1.8
    assert main(["trace", "inspect", str(files["trace"])]) == 0
    assert "4 x 2 x 8 x 16" in capsys.readouterr().out


def test_trace_generate_is_reproducible(tmp_path, capsys):
    args = ["trace", "generate", "--ranks", "4", "--experts", "8", "--steps", "3", "--top-k",
            "2", "--tokens-per-rank", "100", "--drift", "0.2", "--seed", "5", "--hidden", "64"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "a.npz")]) == 0
    assert main([*args, "--out", str(tmp_path / "b.npz")]) == 0
    a, b = read_trace(tmp_path / "a.npz"), read_trace(tmp_path / "b.npz")
    assert np.array_equal(a.load, b.load)
    assert a.meta["hidden"] == 64 and "ranks_per_dc" not in a.meta


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--imbalance", "0.5"], "--imbalance: Input should be greater than or equal to 1"),
        (["--top-k", "20"], "top_k 20 exceeds the 16 experts"),
        (["--steps", "0"], "--steps:"),
        (["--drift", "2"], "--drift:"),
        (["--imbalance", "50"], "out of reach"),
        (["--hidden", "0"], "--hidden must be >= 1"),
    ],
)
def test_trace_generate_bad_values(tmp_path, capsys, extra, match):
    argv = ["trace", "generate", "--out", str(tmp_path / "t.npz"), "--ranks", "4",
            "--experts", "16", "--top-k", "2", "--tokens-per-rank", "64", *extra]  # fmt: skip
    fails(argv, capsys, match)
    assert not (tmp_path / "t.npz").exists()


def test_trace_generate_experts_must_fit_the_master_slots(files, capsys):
    argv = ["trace", "generate", "--out", str(files["dir"] / "t.npz"),
            "--topology", str(files["topo"]), "--experts", "17"]  # fmt: skip
    fails(argv, capsys, "--experts 17 do not fit")


def test_trace_generate_bad_topology(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("dcs: nope\n")
    line = fails(["trace", "generate", "--out", str(tmp_path / "t.npz"), "--topology", str(bad)],
                 capsys, str(bad))  # fmt: skip
    assert "dcs" in line


# ---- plan, inspect, compare ----


def test_plan_writes_a_valid_plan_with_its_policy(files, capsys):
    assert main(plan_args(files)) == 0
    assert "plan written to" in capsys.readouterr().out
    plan = read_plan(files["dir"] / "p.npz")
    trace = read_trace(files["trace"])
    validate_plan(plan, trace.load, "p.npz", "trace.npz")
    assert plan.meta["policy"] == "static" and plan.meta["settings"] == {}
    assert plan.meta["model"]["top_k"] == 2 and plan.meta["model"]["num_experts"] == 16
    assert plan.shape == (4, 2, 8, 3)


def test_plan_spare_slots_and_settings_are_recorded(files, capsys):
    if "eplb" not in available_policies():
        pytest.skip("eplb not registered")
    argv = [*plan_args(files, "eplb", "e.npz"), "--spare-slots", "2",
            "--set", "period=2", "--set", "window=1"]  # fmt: skip
    assert main(argv) == 0
    plan = read_plan(files["dir"] / "e.npz")
    assert plan.shape[3] == 4  # 2 masters + 2 spare
    assert plan.meta["settings"]["period"] == 2 and plan.meta["settings"]["window"] == 1
    assert plan.meta["topology"]["slots_per_rank"] == {"masters": 2, "spare": 2}
    validate_plan(plan, read_trace(files["trace"]).load, "e.npz", "trace.npz")


def test_inspect_and_compare(files, capsys):
    assert main(plan_args(files)) == 0
    names = ["p.npz"]
    if "eplb" in available_policies():
        assert main([*plan_args(files, "eplb", "e.npz"), "--set", "period=2"]) == 0
        names.append("e.npz")
    capsys.readouterr()
    plan = str(files["dir"] / "p.npz")
    assert main(["plan", "inspect", plan, "--trace", str(files["trace"])]) == 0
    out = capsys.readouterr().out
    assert "policy static" in out
    assert main(["plan", "inspect", plan, "--trace", str(files["trace"]), "--per-layer",
                 "--topology", str(files["topo"])]) == 0  # fmt: skip
    capsys.readouterr()
    paths = [str(files["dir"] / n) for n in names]
    assert main(["plan", "compare", "--trace", str(files["trace"]), *paths]) == 0
    out = capsys.readouterr().out
    for n in names:
        assert n in out
    if "e.npz" in names:
        assert "period=2" in out


def test_policies_lists_the_registry(capsys):
    assert main(["plan", "policies", "--names"]) == 0
    assert capsys.readouterr().out.split() == available_policies()
    assert main(["plan", "policies"]) == 0


# ---- bad input: one line, exit 2 ----


def test_plan_missing_files(files, capsys):
    argv = plan_args(files)
    argv[argv.index("--trace") + 1] = str(files["dir"] / "nope.npz")
    fails(argv, capsys, "trace file not found: ")
    argv = plan_args(files)
    argv[argv.index("--topology") + 1] = str(files["dir"] / "nope.yaml")
    fails(argv, capsys, "topology file not found: ")


@pytest.mark.parametrize(
    ("load", "match"),
    [
        (np.zeros((4, 2, 8, 16)), "must hold integer token counts"),
        (np.zeros((2, 8, 16), np.int64), "must be [T, L, R, E]"),
        (-np.ones((4, 2, 8, 16), np.int64), "negative token counts"),
    ],
)
def test_plan_bad_trace_arrays(files, capsys, load, match):
    bad = files["dir"] / "bad.npz"
    import zipfile

    with zipfile.ZipFile(bad, "w") as zf, zf.open("load.npy", "w") as f:
        np.save(f, load)
    argv = plan_args(files)
    argv[argv.index("--trace") + 1] = str(bad)
    line = fails(argv, capsys, match)
    assert str(bad) in line


def test_plan_topology_that_does_not_add_up(files, capsys):
    # trace with 6 ranks against an 8-rank topology
    load = np.ones((2, 1, 6, 16), np.int64)
    write_trace(files["dir"] / "six.npz", load)
    argv = plan_args(files)
    argv[argv.index("--trace") + 1] = str(files["dir"] / "six.npz")
    fails(argv, capsys, "has 6 ranks but")
    # 20 experts do not fit 8 ranks x 2 master slots
    write_trace(files["dir"] / "wide.npz", np.ones((2, 1, 8, 20), np.int64))
    argv[argv.index("--trace") + 1] = str(files["dir"] / "wide.npz")
    fails(argv, capsys, "20 experts, which do not fit the master slots")


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--set", "period"], "--set expects KEY=VALUE"),
        (["--set", "=3"], "--set expects KEY=VALUE"),
        (["--set", "period=2", "--set", "period=3"], "--set period given twice"),
        (["--set", "nope=1"], "policy static: setting nope"),
        (["--spare-slots", "-1"], "--spare-slots must be >= 0"),
        (["--top-k", "0"], "model top_k"),
    ],
)
def test_plan_bad_flags(files, capsys, extra, match):
    fails(plan_args(files) + extra, capsys, match)


def test_plan_unknown_policy_and_bad_setting_value(files, capsys):
    fails(plan_args(files, "nope"), capsys, "unknown policy 'nope'; choose from")
    if "eplb" in available_policies():
        fails([*plan_args(files, "eplb"), "--set", "period=soon"], capsys, "setting period")


def test_plan_needs_its_flags(files, capsys):
    fails(["plan", "--trace", str(files["trace"])], capsys, "plan needs --topology, --policy")
    fails(["plan", "inspect", str(files["dir"] / "p.npz")], capsys, "needs --trace")


def test_inspect_refuses_a_plan_of_another_trace(files, capsys):
    assert main(plan_args(files)) == 0
    other = files["dir"] / "other.npz"
    assert main(["trace", "generate", "--out", str(other), "--topology", str(files["topo"]),
                 "--experts", "16", "--layers", "2", "--steps", "4", "--top-k", "2",
                 "--tokens-per-rank", "256", "--seed", "4"]) == 0  # fmt: skip
    fails(["plan", "inspect", str(files["dir"] / "p.npz"), "--trace", str(other)], capsys,
          "does not route")  # fmt: skip
    fails(["plan", "compare", "--trace", str(files["trace"]), str(other)], capsys,
          "missing array 'phy2log'")  # fmt: skip


def test_parse_settings_nests_dotted_keys():
    got = parse_settings(["cost.pipeline_chunks=4", "cost.hierarchical=false", "mode=global",
                          "x=[1, 2]"])  # fmt: skip
    assert got == {"cost": {"pipeline_chunks": 4, "hierarchical": False}, "mode": "global",
                   "x": [1, 2]}  # fmt: skip
    with pytest.raises(UsageError, match="not a group"):
        parse_settings(["cost=1", "cost.x=2"])


def _raw_trace(path: Path, load: np.ndarray) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as zf, zf.open("load.npy", "w") as f:
        np.save(f, load)
    return path


@pytest.mark.parametrize(
    ("cell", "steps", "match"),
    [
        (2**58, 1, "above 2**40"),  # crashed quota with an IndexError (int64 overflow)
        (2**52, 1, "above 2**40"),  # planned, then `plan inspect` refused its own plan
        (2**40 + 1, 1, "above 2**40"),
        (2**40, 33, "more than 2**52"),  # each cell fine, 1.03 * 2**52 in all
    ],
)
@pytest.mark.parametrize("policy", ["static", "quota"])
def test_plan_refuses_a_trace_too_large_to_count(files, capsys, cell, steps, match, policy):
    trace = _raw_trace(files["dir"] / "huge.npz", np.full((steps, 1, 8, 16), cell, np.int64))
    argv = plan_args(files, policy)
    argv[argv.index("--trace") + 1] = str(trace)
    fails(argv, capsys, match)
    assert not (files["dir"] / "p.npz").exists()


@pytest.mark.parametrize("policy", ["static", "quota"])
def test_what_plan_accepts_inspect_accepts(files, capsys, policy):
    # 32 x 8 x 16 cells of 2**40: exactly the 2**52 tokens a trace may hold in all
    trace = _raw_trace(files["dir"] / "edge.npz", np.full((32, 1, 8, 16), 2**40, np.int64))
    argv = plan_args(files, policy)
    argv[argv.index("--trace") + 1] = str(trace)
    assert main([*argv, "--quiet"]) == 0
    capsys.readouterr()
    assert main(["plan", "inspect", str(files["dir"] / "p.npz"), "--trace", str(trace)]) == 0
