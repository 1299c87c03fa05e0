import io
import json
import os
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from expertmesh.formats import (
    read_plan,
    read_topology,
    read_trace,
    validate_plan,
    write_plan,
    write_topology,
    write_trace,
)
from expertmesh.planner import ModelSpec, Topology, make_policy, plan_trace


def npy_bytes(arr: np.ndarray, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return buf.getvalue()


def write_members(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def small_load(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 40, size=(3, 2, 8, 16)).astype(np.int64)


def small_plan():
    topo = Topology.generate(dcs=2, ranks_per_dc=4, masters=2, spare=1)
    model = ModelSpec(num_experts=16, num_layers=2)
    load = small_load()
    return load, topo, plan_trace(load, topo, model, make_policy("static"))


# ---- round trips ----


def test_trace_round_trip(tmp_path):
    load = small_load().astype(np.int32)
    meta = {"top_k": 4, "ranks_per_dc": [4, 4], "note": "x"}
    write_trace(tmp_path / "t.npz", load, meta)
    tr = read_trace(tmp_path / "t.npz")
    assert tr.load.dtype == np.int64 and np.array_equal(tr.load, load)
    assert tr.meta == meta
    write_trace(tmp_path / "bare.npz", load)
    assert read_trace(tmp_path / "bare.npz").meta == {}
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporary file
    assert (tmp_path / "t.npz").stat().st_mode & 0o777 == 0o666 & ~_umask()


def test_plan_round_trip_and_validation(tmp_path):
    load, _, plan = small_plan()
    arrays = plan.to_arrays()
    write_plan(tmp_path / "p.npz", arrays, {"policy": "static", "settings": {}})
    pf = read_plan(tmp_path / "p.npz")
    for key, arr in arrays.items():
        got = pf.arrays()[key]
        assert got.dtype == arr.dtype and np.array_equal(got, arr), key
    assert pf.policy == "static" and pf.shape == (3, 2, 8, 3)
    validate_plan(pf, load, "p.npz", "t.npz")
    other = load.copy()
    other[1, 1, 2, 3] += 1
    with pytest.raises(ValueError, match=r"p.npz does not route t.npz: step 1, layer 1, rank 2"):
        validate_plan(pf, other, "p.npz", "t.npz")
    with pytest.raises(ValueError, match="is a plan for 3 steps"):
        validate_plan(pf, load[:2], "p.npz", "t.npz")


def test_plan_route_to_a_rank_without_the_expert_is_refused(tmp_path):
    load, _, plan = small_plan()
    arrays = plan.to_arrays()
    route = arrays["route"].copy()
    row = route[0]
    holders = {int(r) for r in np.nonzero((arrays["phy2log"][row[0], row[1]] == row[3]).any(1))[0]}
    route[0, 4] = next(r for r in range(8) if r not in holders)
    write_plan(tmp_path / "p.npz", {**arrays, "route": route})
    with pytest.raises(ValueError, match="which does not hold it"):
        validate_plan(read_plan(tmp_path / "p.npz"), load, "p.npz", "t.npz")


def test_topology_round_trip(tmp_path, repo):
    topo = read_topology(repo / "deploy/topologies/two-dc.yaml")
    assert topo.num_ranks == 128 and topo.num_dcs == 2
    write_topology(tmp_path / "t.yaml", topo)
    assert read_topology(tmp_path / "t.yaml").to_dict() == topo.to_dict()


# ---- bad trace files: one line naming the file and the problem ----


def _bad_trace_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    load = small_load()
    ok = npy_bytes(load)
    files: dict[str, tuple[Path, str]] = {}

    def add(name: str, members: dict[str, bytes], match: str) -> None:
        files[name] = (write_members(tmp / f"{name}.npz", members), match)

    (tmp / "text.npz").write_text("load = 1\n")
    files["not a zip"] = (tmp / "text.npz", "not a trace .npz file")
    whole = tmp / "whole.npz"
    write_trace(whole, load)
    data = whole.read_bytes()
    (tmp / "cut.npz").write_bytes(data[: len(data) // 2])
    files["truncated file"] = (tmp / "cut.npz", "not a trace .npz file")
    add("missing load", {"loads.npy": ok}, "missing array 'load'")
    add("extra key", {"load.npy": ok, "extra.npy": ok}, "unexpected array 'extra'")
    add("not npy", {"load.npy": ok, "readme.txt": b"hi"}, "not an .npy array")
    add("float load", {"load.npy": npy_bytes(load.astype(float))}, "integer token counts")
    add("bool load", {"load.npy": npy_bytes(load > 3)}, "integer token counts")
    add("3-d load", {"load.npy": npy_bytes(load[0])}, r"\[T, L, R, E\]")
    add("empty load", {"load.npy": npy_bytes(load[:0])}, "empty")
    neg = load.copy()
    neg[2, 1, 5, 7] = -1
    add("negative", {"load.npy": npy_bytes(neg)}, "negative token counts .*step 2, layer 1")
    obj = np.empty(2, dtype=object)
    obj[:] = [1, "x"]
    add("pickle", {"load.npy": npy_bytes(obj, allow_pickle=True)}, "Python objects")
    # a header that claims 2**40 counts: refused before any allocation
    huge = bytearray(npy_bytes(np.zeros((1, 1, 1, 1), np.int64))[:-8])
    hdr = huge.decode("latin1").replace("(1, 1, 1, 1)", "(1024, 1024, 1024, 1024)")
    add("hostile size", {"load.npy": hdr.encode("latin1")}, "more than the limit")
    add("truncated member", {"load.npy": ok[:-40]}, "truncated")
    add("garbage header", {"load.npy": b"\x93NUMPY\x01\x00garbage"}, "bad .npy header")
    meta = {"load.npy": ok}
    add("meta not json", {**meta, "meta.npy": npy_bytes(np.array("{nope"))}, "not valid JSON")
    add("meta not object", {**meta, "meta.npy": npy_bytes(np.array("[1]"))}, "JSON object")
    add("meta numeric", {**meta, "meta.npy": npy_bytes(np.arange(3))}, "one JSON string")
    add(
        "meta disagrees",
        {**meta, "meta.npy": npy_bytes(np.array(json.dumps({"num_ranks": 9})))},
        "num_ranks = 9 but 'load' has 8",
    )
    add(
        "ranks_per_dc",
        {**meta, "meta.npy": npy_bytes(np.array(json.dumps({"ranks_per_dc": [3, 3]})))},
        "does not add up",
    )
    add(
        "bad top_k",
        {**meta, "meta.npy": npy_bytes(np.array(json.dumps({"top_k": "8"})))},
        "top_k must be a positive integer",
    )
    return files


def test_bad_trace_files_raise_one_clear_line(tmp_path):
    for name, (path, match) in _bad_trace_files(tmp_path).items():
        with pytest.raises(ValueError) as info:
            read_trace(path)
        msg = str(info.value)
        assert msg.startswith(f"{path}: "), (name, msg)
        assert "\n" not in msg, (name, msg)
        assert re.search(match, msg), (name, msg)


def test_missing_and_directory_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="trace file not found") as info:
        read_trace(tmp_path / "nope.npz")
    assert info.value.filename == str(tmp_path / "nope.npz")
    with pytest.raises(IsADirectoryError):
        read_trace(tmp_path)
    with pytest.raises(FileNotFoundError, match="topology file not found"):
        read_topology(tmp_path / "nope.yaml")
    with pytest.raises(FileNotFoundError, match="plan file not found"):
        read_plan(tmp_path / "nope.npz")


# ---- bad topology and plan files ----


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("dcs: [\n", "not valid YAML"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("", "expected a mapping"),
        ("dcs: [{name: a, nodes: 1, ranks_per_node: 2}]\n", "slots_per_rank"),
        (
            "dcs: [{name: a, nodes: 1, ranks_per_node: 2}]\nslots_per_rank: {masters: 1, spare: 0}\n"
            "colour: blue\n",
            "colour",
        ),
        (
            "dcs: [{name: a, nodes: 100000, ranks_per_node: 1024}]\n"
            "slots_per_rank: {masters: 1, spare: 0}\n",
            "more than the limit",
        ),
        ("!!python/object:os.system {}\n", "not valid YAML"),
    ],
)
def test_bad_topology_files(tmp_path, text, match):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        read_topology(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)


def test_binary_topology_file(tmp_path):
    (tmp_path / "t.yaml").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="not a UTF-8 text file"):
        read_topology(tmp_path / "t.yaml")


def _plan_with(tmp_path: Path, **changes: np.ndarray) -> Path:
    _, _, plan = small_plan()
    arrays = {**plan.to_arrays(), **changes}
    path = tmp_path / "p.npz"
    write_plan(path, arrays)
    return path


def test_bad_plan_files(tmp_path):
    _, _, plan = small_plan()
    a = plan.to_arrays()
    route = a["route"].copy()
    route[0, 2] = 99
    master = a["master"].copy()
    master[0, 0, 0] = master[0, 0, 1]
    cases = {
        "phy2log float": ({"phy2log": a["phy2log"].astype(float)}, "'phy2log' must hold integers"),
        "route shape": ({"route": a["route"][:, :4]}, r"'route' must be \[N, 6\]"),
        "route rank": ({"route": route}, "src_rank outside"),
        "negative tokens": (
            {"route": np.concatenate([a["route"], [[0, 0, 0, 0, 0, -1]]])},
            "negative token counts",
        ),
        "solve shape": ({"solve_seconds": np.zeros(3)}, "'solve_seconds' must have shape"),
        "solve nan": ({"solve_seconds": np.full((3, 2), np.nan)}, "non-finite"),
        "master": ({"master": master}, "does not hold its expert"),
        "migration cols": ({"migration": np.zeros((1, 5), np.int64)}, "'migration' must be"),
    }
    for name, (changes, match) in cases.items():
        path = _plan_with(tmp_path, **changes)
        with pytest.raises(ValueError, match=match) as info:
            read_plan(path)
        assert str(info.value).startswith(f"{path}: "), name
    write_members(tmp_path / "q.npz", {"phy2log.npy": npy_bytes(a["phy2log"])})
    with pytest.raises(ValueError, match="missing array 'route'"):
        read_plan(tmp_path / "q.npz")
