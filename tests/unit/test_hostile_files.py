"""Hostile files through the CLI: every command that reads a trace, plan, topology or config
exits 2 with one line on stderr (no traceback) and never allocates much (tracemalloc peak),
whatever the file holds: truncated, wrong dtype, huge declared shapes, pickled objects,
alias bombs, deep nesting, non-UTF-8, binary garbage, Python tags."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from expertmesh import formats
from expertmesh.cli.main import main
from expertmesh.formats import read_topology, read_trace, read_yaml, write_topology, write_trace
from expertmesh.planner import Topology

PEAK_LIMIT = 96 << 20  # bytes any of these may allocate
R, E = 4, 8


def _npy(header_shape: tuple[int, ...], dtype: str, payload: bytes = b"") -> bytes:
    """An .npy member whose header declares ``header_shape`` but holds ``payload``."""
    buf = io.BytesIO()
    header = {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": header_shape}
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + payload


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _pickled(path: Path) -> Path:
    buf = io.BytesIO()
    np.save(buf, np.array([{"x": 1}, None], dtype=object), allow_pickle=True)
    return _zip(path, {"load.npy": buf.getvalue()})


def _alias_bomb() -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):  # 10**9 nodes once expanded
        refs = ", ".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i} [{refs}]")
    lines.append("dcs: *a8")
    return "\n".join(lines) + "\n"


def _lying_zip(path: Path, declared: tuple[int, ...] = (1, 1, 2**14, 2**13)) -> Path:
    """A trace whose ``load`` member declares a 1 GiB int64 array, holds 64 bytes of it, and
    whose zip headers (local and central) claim the member is the full size: only counting
    what the member really holds tells it apart from an honest 1 GiB array."""
    data = _npy(declared, "<i8", b"\0" * 64)
    _zip(path, {"load.npy": data})
    claimed = len(data) - 64 + 8 * int(np.prod(declared))
    raw = bytearray(path.read_bytes())
    struct.pack_into("<I", raw, raw.index(b"PK\x03\x04") + 22, claimed)  # local header
    struct.pack_into("<I", raw, raw.index(b"PK\x01\x02") + 24, claimed)  # central directory
    path.write_bytes(bytes(raw))
    with zipfile.ZipFile(path) as zf:
        assert zf.getinfo("load.npy").file_size == claimed  # the lie is what zipfile reads
    return path


BAD_NPZ = {
    "truncated": lambda p, good: p.write_bytes(good.read_bytes()[: good.stat().st_size // 2]),
    "garbage": lambda p, good: p.write_bytes(bytes(range(256)) * 40),
    "empty": lambda p, good: p.write_bytes(b""),
    "float_load": lambda p, good: write_trace_raw(p, np.ones((1, 1, R, E), np.float64)),
    "huge_declared_shape": lambda p, good: _zip(
        p, {"load.npy": _npy((2**20, 2**20, 2**10, 8), "<i8")}
    ),
    "declared_1gb_tiny_data": lambda p, good: _zip(
        p, {"load.npy": _npy((1, 1, 2**14, 2**13), "<i8", b"\0" * 64)}
    ),
    "zip_header_lies_about_size": lambda p, good: _lying_zip(p),
    "pickled_objects": lambda p, good: _pickled(p),
    "meta_pickled": lambda p, good: _zip(
        p,
        {
            "load.npy": _npy((1, 1, R, E), "<i8", b"\0" * (R * E * 8)),
            "meta.npy": _npy((2,), "|O"),
        },
    ),
    "meta_deep_json": lambda p, good: write_trace_raw(
        p, np.ones((1, 1, R, E), np.int64), meta="[" * 100_000 + "]" * 100_000
    ),
    "meta_not_utf8": lambda p, good: write_trace_raw(
        p, np.ones((1, 1, R, E), np.int64), meta=b'{"top_k": "\xff\xfe"}'
    ),
    "unknown_member": lambda p, good: _zip(p, {"evil.pkl": b"cos\nsystem\n(S'echo'\ntR."}),
}

BAD_YAML = {
    "alias_bomb": _alias_bomb(),
    "deep_nesting": "dcs: " + "[" * 200 + "]" * 200,
    "python_tag": "dcs: !!python/object/apply:os.system ['echo pwned']\n",
    "not_utf8": b"dcs: [{name: \xff\xfe, nodes: 1, ranks_per_node: 1}]\n",
    "garbage": bytes(range(256)) * 8,
    "not_a_mapping": "- 1\n- 2\n",
    "huge_counts": "dcs: [{name: a, nodes: 100000000, ranks_per_node: 100000000}]\n"
    "slots_per_rank: {masters: 1, spare: 0}\n",
    "nan_bandwidth": "dcs: [{name: a, nodes: 1, ranks_per_node: 4}]\n"
    "slots_per_rank: {masters: 2, spare: 0}\n"
    "links: {inter_dc: {gbps: .nan, latency_ms: 1}}\n",
}


def write_trace_raw(path: Path, load: np.ndarray, meta: str | bytes | None = None) -> Path:
    arrays = {"load": load}
    if meta is not None:
        arrays["meta"] = np.array(meta)
    np.savez(path, **arrays)
    return path


@pytest.fixture
def good(tmp_path):
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    write_topology(tmp_path / "topo.yaml", topo)
    load = np.random.default_rng(0).integers(0, 20, (2, 1, R, E))
    write_trace(tmp_path / "trace.npz", load, {"top_k": 2, "hidden": 16})
    assert main(["plan", "--quiet", "--trace", str(tmp_path / "trace.npz"), "--topology",
                 str(tmp_path / "topo.yaml"), "--policy", "static", "--out",
                 str(tmp_path / "plan.npz")]) == 0  # fmt: skip
    return tmp_path


def _run_refused(argv: list[str], capsys) -> str:
    capsys.readouterr()
    tracemalloc.start()
    try:
        code = main(argv)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    out = capsys.readouterr()
    err = out.err.strip()
    assert code == 2, (argv, out.out[-500:], err[-2000:])
    assert len(err.splitlines()) == 1 and err.startswith("expertmesh "), err[-2000:]
    assert "Traceback" not in err and len(err) < 2000
    assert peak < PEAK_LIMIT, f"{argv}: peak {peak >> 20} MiB"
    return err


def _trace_commands(bad: Path, g: Path) -> list[list[str]]:
    t, y, p = str(g / "trace.npz"), str(g / "topo.yaml"), str(g / "plan.npz")
    o = str(g / "out")
    return [
        ["trace", "inspect", str(bad)],
        ["plan", "--quiet", "--trace", str(bad), "--topology", y, "--policy", "static",
         "--out", o + ".npz"],
        ["plan", "inspect", p, "--trace", str(bad)],
        ["plan", "inspect", str(bad), "--trace", t],
        ["plan", "compare", "--trace", t, p, str(bad)],
        ["sim", "--trace", str(bad), "--topology", y, "--policies", "static", "--out", o,
         "--no-progress"],
    ]  # fmt: skip


@pytest.mark.parametrize("kind", sorted(BAD_NPZ))
def test_hostile_npz_files_exit_2_with_one_line(good, capsys, kind):
    bad = good / f"bad-{kind}.npz"
    BAD_NPZ[kind](bad, good / "trace.npz")
    for argv in _trace_commands(bad, good):
        _run_refused(argv, capsys)


def _yaml_commands(bad: Path, g: Path) -> list[list[str]]:
    t, o = str(g / "trace.npz"), str(g / "out")
    return [
        ["plan", "--quiet", "--trace", t, "--topology", str(bad), "--policy", "static",
         "--out", o + ".npz"],
        ["trace", "generate", "--out", o + ".npz", "--topology", str(bad), "--experts", "8"],
        ["sim", "--topology", str(bad), "--trace", t, "--out", o, "--no-progress"],
        ["sim", "--trace", t, "--topology", str(g / "topo.yaml"), "--policies", "static",
         "--policy-settings", str(bad), "--out", o, "--no-progress"],
        ["sim", "sweep", "--config", str(bad), "--out", o, "--no-progress"],
        ["serve", "--topology", str(bad), "--rest-port", "0", "--grpc-port", "0",
         "--seconds", "0"],
        ["demo", "--topology", str(bad), "--steps", "1", "--exit"],
    ]  # fmt: skip


@pytest.mark.parametrize("kind", sorted(BAD_YAML))
def test_hostile_yaml_files_exit_2_with_one_line(good, capsys, kind):
    bad = good / f"bad-{kind}.yaml"
    data = BAD_YAML[kind]
    bad.write_bytes(data if isinstance(data, bytes) else data.encode())
    for argv in _yaml_commands(bad, good):
        if kind in ("huge_counts", "nan_bandwidth") and argv[0] == "sim" and "sweep" in argv:
            continue  # a valid sweep config shape-wise is another schema; covered below
        _run_refused(argv, capsys)


def test_alias_bomb_is_refused_before_it_is_walked(tmp_path):
    p = tmp_path / "bomb.yaml"
    p.write_text(_alias_bomb())
    with pytest.raises(ValueError, match="alias"):
        read_yaml(p)
    # a few honest aliases are fine
    p.write_text("base: &b {gbps: 10, latency_ms: 1}\nlinks: {inter_dc: *b, intra_dc: *b}\n")
    assert read_yaml(p)["links"]["inter_dc"] == {"gbps": 10, "latency_ms": 1}


def test_readers_raise_value_error_on_hostile_files(good):
    bad = good / "bad.npz"
    for kind, make in BAD_NPZ.items():
        make(bad, good / "trace.npz")
        with pytest.raises(ValueError) as err:
            read_trace(bad)
        assert str(bad) in str(err.value) and "\n" not in str(err.value), kind
    for kind, data in BAD_YAML.items():
        y = good / "bad.yaml"
        y.write_bytes(data if isinstance(data, bytes) else data.encode())
        with pytest.raises(ValueError):
            read_topology(y)
        assert kind


def test_meta_json_round_trip_still_works(good):
    meta = read_trace(good / "trace.npz").meta
    assert meta == {"top_k": 2, "hidden": 16}
    assert json.loads(json.dumps(meta)) == meta
    assert yaml.safe_load(Path(good / "topo.yaml").read_text())["dcs"]


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--policy-settings", "[" * 5000 + "]" * 5000, "--seconds", "0"],
        ["demo", "--policy-settings", "[" * 5000 + "]" * 5000, "--steps", "1", "--exit"],
        ["demo", "--policy", "hybrid", "--policy-settings", '{"period": 0}', "--exit"],
        ["demo", "--policy-settings", '{"period": 4', "--exit"],
        ["plan", "--trace", "t.npz", "--topology", "t.yaml", "--policy", "static", "--out",
         "o.npz", "--set", "period=" + "[" * 5000 + "]" * 5000],
    ],
)  # fmt: skip
def test_deep_json_on_the_command_line_is_one_line(good, capsys, argv, monkeypatch):
    monkeypatch.chdir(good)
    (good / "t.npz").write_bytes((good / "trace.npz").read_bytes())
    (good / "t.yaml").write_bytes((good / "topo.yaml").read_bytes())
    _run_refused(argv, capsys)


def test_a_zip_member_whose_header_lies_is_measured_before_numpy_allocates(tmp_path):
    """The zip header says the member holds 1 GiB; it holds 64 bytes. The reader counts the
    member's real bytes (above VERIFY_ABOVE_BYTES) and refuses it as truncated before numpy
    allocates the declared array; without that count numpy allocates 1 GiB first."""
    bad = _lying_zip(tmp_path / "lies.npz")
    assert formats.VERIFY_ABOVE_BYTES < 2**30
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"'load' is truncated \(64 of 1073741824 bytes\)"):
            read_trace(bad)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_LIMIT, f"peak {peak >> 20} MiB"


def _load_of_bytes(nbytes: int) -> np.ndarray:
    return np.zeros((1, 1, 1, nbytes // 8), np.int64)  # zeros: deflates to a few bytes


@pytest.mark.parametrize("limit", [4096, 1 << 20])
def test_the_array_size_limit_refuses_an_array_just_over_it(tmp_path, monkeypatch, limit):
    """With a small MAX_ARRAY_BYTES, an array of exactly the limit is read and one of 8 bytes
    more is refused by its header, although both files are tiny on disk."""
    monkeypatch.setattr(formats, "MAX_ARRAY_BYTES", limit)
    at, over = tmp_path / "at.npz", tmp_path / "over.npz"
    write_trace(at, _load_of_bytes(limit))
    write_trace(over, _load_of_bytes(limit + 8))
    assert over.stat().st_size < limit  # the header, not the file size, is over
    assert read_trace(at).load.nbytes == limit
    with pytest.raises(
        ValueError, match=f"needs {limit + 8} bytes, more than the limit of {limit}"
    ):
        read_trace(over)


def test_the_size_limit_set_in_the_environment_holds_in_a_new_process(tmp_path):
    """EXPERTMESH_MAX_ARRAY_BYTES, read at import in a fresh CLI process: a deflated array
    just over it exits 2 with one line naming the limit; one at the limit is inspected."""
    at, over = tmp_path / "at.npz", tmp_path / "over.npz"
    write_trace(at, _load_of_bytes(4096))
    write_trace(over, _load_of_bytes(4096 + 8))
    env = {**os.environ, "EXPERTMESH_MAX_ARRAY_BYTES": "4096"}

    def inspect(path: Path) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "expertmesh.cli.main", "trace", "inspect", str(path)]
        return subprocess.run(
            argv, check=False, env=env, capture_output=True, text=True, timeout=120
        )

    ok = inspect(at)
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = inspect(over)
    err = bad.stderr.strip()
    assert bad.returncode == 2 and len(err.splitlines()) == 1, err[-2000:]
    assert "needs 4104 bytes, more than the limit of 4096" in err
