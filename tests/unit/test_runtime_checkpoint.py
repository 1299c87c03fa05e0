"""The expert checkpoint on disk (expertmesh.runtime.checkpoint): round trip bit for bit,
newest K kept, atomic writes, truncated / corrupt / hostile checkpoints refused and the
previous one used."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.runtime.checkpoint import CheckpointDir, CheckpointError


def _experts(seed: int, layers: int = 2, experts: int = 3, d: int = 4, f: int = 6) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(layers):
        for e in range(experts):
            shapes = [(d, f), (d, f), (f, d)]
            out[(layer, e)] = tuple(
                [rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)
            )
    return out


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(
        x.dtype == y.dtype and np.array_equal(x, y)
        for k in a
        for pa, pb in zip(a[k], b[k], strict=True)
        for x, y in zip(pa, pb, strict=True)
    )


def test_round_trip_is_bitwise_and_keeps_metadata(tmp_path: Path) -> None:
    ck = CheckpointDir(tmp_path / "ckpt")
    ex = _experts(0)
    written = ck.write(ex, step=4, plan_version=7, run="r1")
    got = ck.load_latest()
    assert got.path == written.path and got.seq == 1 and got.nbytes == written.nbytes > 0
    assert (got.step, got.plan_version, got.run) == (4, 7, "r1")
    assert _same(got.experts, ex)


def test_torch_tensors_are_written_as_their_values(tmp_path: Path) -> None:
    ex = _experts(1)
    as_torch = {k: tuple([torch.from_numpy(a) for a in part] for part in v) for k, v in ex.items()}
    ck = CheckpointDir(tmp_path)
    ck.write(as_torch, step=0, plan_version=0, run="r")
    assert _same(ck.load_latest().experts, ex)


def test_only_the_newest_k_are_kept(tmp_path: Path) -> None:
    ck = CheckpointDir(tmp_path, keep=2)
    for step in range(5):
        ck.write(_experts(step), step=step, plan_version=step, run="r")
    assert [p.name for p in ck.paths()] == ["ckpt-000005", "ckpt-000004"]
    assert ck.load_latest().step == 4
    with pytest.raises(ValueError, match="keep"):
        CheckpointDir(tmp_path, keep=0)


def _two(tmp_path: Path) -> tuple[CheckpointDir, Path]:
    ck = CheckpointDir(tmp_path)
    ck.write(_experts(0), step=1, plan_version=1, run="r")
    newest = ck.write(_experts(1), step=3, plan_version=2, run="r").path
    return ck, newest


def test_truncated_checkpoint_is_refused_and_the_previous_used(tmp_path: Path) -> None:
    ck, newest = _two(tmp_path)
    data = newest / "experts.npz"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        ck.load(newest)
    got = ck.load_latest()
    assert got.step == 1 and _same(got.experts, _experts(0))


def test_corrupt_bytes_are_refused(tmp_path: Path) -> None:
    ck, newest = _two(tmp_path)
    data = newest / "experts.npz"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one byte flipped
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="sha256"):
        ck.load(newest)
    assert ck.load_latest().step == 1


@pytest.mark.parametrize(
    "manifest",
    [b"", b"{not json", b"[]", b'{"format": "other"}', "\u00e9".encode("latin-1")],
)
def test_bad_manifests_are_refused(tmp_path: Path, manifest: bytes) -> None:
    ck, newest = _two(tmp_path)
    (newest / "manifest.json").write_bytes(manifest)
    with pytest.raises(CheckpointError, match="manifest"):
        ck.load(newest)
    assert ck.load_latest().step == 1


def test_missing_files_are_refused(tmp_path: Path) -> None:
    ck, newest = _two(tmp_path)
    (newest / "experts.npz").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        ck.load(newest)
    (newest / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        ck.load(newest)


def test_a_pickled_array_is_never_loaded(tmp_path: Path) -> None:
    """A hostile checkpoint whose manifest matches its data: an object array (pickle)."""
    ck, newest = _two(tmp_path)
    buf = io.BytesIO()
    np.savez(buf, **{"0.0.w0": np.array([{"x": 1}], dtype=object)})
    data = newest / "experts.npz"
    data.write_bytes(buf.getvalue())
    man = json.loads((newest / "manifest.json").read_text())
    import hashlib

    man["data"].update(bytes=len(buf.getvalue()), sha256=hashlib.sha256(buf.getvalue()).hexdigest())
    man["experts"], man["arrays_per_part"] = [[0, 0]], 1
    (newest / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CheckpointError, match="cannot be read"):
        ck.load(newest)


def test_no_usable_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    ck = CheckpointDir(tmp_path)
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        ck.load_latest()
    only = ck.write(_experts(0), step=0, plan_version=0, run="r").path
    (only / "experts.npz").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"no usable checkpoint.*truncated"):
        ck.load_latest()
    with pytest.raises(CheckpointError):
        ck.load(tmp_path / "not-a-checkpoint")


def test_a_crashed_writers_leftovers_are_ignored(tmp_path: Path) -> None:
    ck = CheckpointDir(tmp_path)
    ck.write(_experts(0), step=1, plan_version=1, run="r")
    (tmp_path / ".tmp-ckpt-000002-999").mkdir()  # a writer died before its rename
    (tmp_path / ".tmp-ckpt-000002-999" / "experts.npz").write_bytes(b"half")
    assert [p.name for p in ck.paths()] == ["ckpt-000001"]
    assert ck.load_latest().step == 1
    assert ck.write(_experts(1), step=3, plan_version=1, run="r").path.name == "ckpt-000002"


def test_other_runs_are_skipped_when_asked(tmp_path: Path) -> None:
    ck = CheckpointDir(tmp_path)
    ck.write(_experts(0), step=1, plan_version=1, run="mine")
    ck.write(_experts(1), step=9, plan_version=1, run="other")
    assert ck.load_latest().run == "other"
    assert ck.load_latest(run="mine").step == 1


def test_a_failed_write_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = CheckpointDir(tmp_path)
    ck.write(_experts(0), step=1, plan_version=1, run="r")

    def boom(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(OSError, match="No space"):
        ck.write(_experts(1), step=2, plan_version=1, run="r")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000001"]  # no half checkpoint
    assert ck.load_latest().step == 1


@settings(max_examples=15, deadline=None)
@given(
    layers=st.integers(1, 3),
    experts=st.integers(1, 4),
    d=st.integers(1, 5),
    f=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_round_trip_any_shapes(
    tmp_path_factory: pytest.TempPathFactory, layers: int, experts: int, d: int, f: int, seed: int
) -> None:
    ck = CheckpointDir(tmp_path_factory.mktemp("ck"), keep=1)
    ex = _experts(seed, layers, experts, d, f)
    ck.write(ex, step=seed, plan_version=0, run="r")
    assert _same(ck.load_latest().experts, ex)
