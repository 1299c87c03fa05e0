"""``trace import``: fixtures written in each engine's documented layout, read back exactly;
hostile files refused with one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from engine_fixtures import ITERS, LAYERS, E, K, R, write_trtllm
from engine_fixtures import topk as _topk
from safetensors.torch import save_file

from expertmesh.cli.main import main
from expertmesh.engines.load import import_trace
from expertmesh.formats import read_trace


def test_trtllm_statistics_read_exactly(tmp_path: Path) -> None:
    want = write_trtllm(tmp_path / "stats")
    got = import_trace(tmp_path / "stats", "trtllm")
    np.testing.assert_array_equal(got.load, want)
    assert got.meta["top_k"] == K
    assert got.meta["engine"]["layers"] == list(LAYERS)
    assert got.meta["engine"]["iterations"] == [ITERS[0], ITERS[-1]]


def test_sglang_logical_count_split_over_ranks(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    counts = np.zeros((6, 5, E), np.int32)  # [buckets, L, E]: layers 0-1 dense, 2 ring slots unused
    counts[:4, 2:] = rng.integers(0, 40, (4, 3, E))
    torch.save(
        {
            "rank": 0,
            "logical_count": torch.from_numpy(counts),
            "average_utilization_rate_over_window": None,
        },
        tmp_path / "expert_distribution_recorder_1.pt",
    )
    got = import_trace(tmp_path / "expert_distribution_recorder_1.pt", "sglang", num_ranks=R)
    assert got.load.shape == (4, 3, R, E)
    np.testing.assert_array_equal(got.load.sum(axis=2), counts[:4, 2:])
    spread = got.load.max(axis=2) - got.load.min(axis=2)
    assert spread.max() <= 1  # largest remainder: as even as integers allow
    eng = got.meta["engine"]
    assert eng["layers"] == [2, 3, 4] and eng["empty_buckets_dropped"] == 2
    # the [L, E] form, as JSON
    (tmp_path / "lc.json").write_text(json.dumps({"logical_count": counts[0].tolist()}))
    one = import_trace(tmp_path / "lc.json", "sglang", num_ranks=R)
    np.testing.assert_array_equal(one.load[0].sum(axis=1), counts[0, 2:])


def _routing_rows(rng: np.random.Generator, n: int, layers: int) -> np.ndarray:
    return np.stack([_topk(rng, n) for _ in range(layers)], axis=1)  # [N, L, K]


def _brute(topk: np.ndarray, step: np.ndarray, rank: np.ndarray, steps: int) -> np.ndarray:
    n, layers, _ = topk.shape
    out = np.zeros((steps, layers, R, E), np.int64)
    for i in range(n):
        for layer in range(layers):
            for e in topk[i, layer]:
                if e >= 0:
                    out[step[i], layer, rank[i], e] += 1
    return out


def test_routing_tables_npy_npz_parquet(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    n, tps = 48, 16
    topk = _routing_rows(rng, n, 2)
    topk[5, 1, 1] = -1  # a dropped assignment
    np.save(tmp_path / "r.npy", topk)
    got = import_trace(
        tmp_path / "r.npy", "routing", num_ranks=R, tokens_per_step=tps, num_experts=E
    )
    tok = np.arange(n)
    np.testing.assert_array_equal(got.load, _brute(topk, tok // tps, (tok % tps) * R // tps, 3))

    step, rank = rng.integers(0, 2, n), rng.integers(0, R, n)
    np.savez(tmp_path / "r.npz", topk_ids=topk, step=step, rank=rank)
    got = import_trace(tmp_path / "r.npz", "routing", num_experts=E)
    np.testing.assert_array_equal(got.load, _brute(topk, step, rank, 2))

    rows = [(i, 7 + layer, topk[i, layer].tolist(), int(step[i]), int(rank[i]))
            for i in range(n) for layer in range(2)]  # fmt: skip
    table = pa.table({
        "token": [x[0] for x in rows], "layer": [x[1] for x in rows],
        "experts": pa.array([x[2] for x in rows], pa.list_(pa.int32())),
        "step": [x[3] for x in rows], "rank": [x[4] for x in rows],
    })  # fmt: skip
    pq.write_table(table, tmp_path / "r.parquet")
    got = import_trace(tmp_path / "r.parquet", "routing", num_ranks=R, num_experts=E)
    np.testing.assert_array_equal(got.load, _brute(topk, step, rank, 2))
    assert got.meta["engine"]["layers"] == [7, 8] and got.meta["top_k"] == K


def test_cli_import_writes_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want = write_trtllm(tmp_path / "stats")
    assert main(["trace", "import", str(tmp_path / "stats"), "--format", "trtllm",
                 "--out", str(tmp_path / "t.npz")]) == 0  # fmt: skip
    trace = read_trace(tmp_path / "t.npz")
    np.testing.assert_array_equal(trace.load, want)
    assert trace.meta["engine"]["format"] == "trtllm" and "3..5" in capsys.readouterr().out
    assert main(["trace", "inspect", str(tmp_path / "t.npz")]) == 0
    assert "imported from" in capsys.readouterr().out


def _bad_trtllm(d: Path, case: str) -> None:
    write_trtllm(d)
    if case == "no meta":
        (d / "meta_info.json").unlink()
    elif case == "meta not json":
        (d / "meta_info.json").write_text("{num_experts: 3")
    elif case == "meta experts":
        (d / "meta_info.json").write_text(
            json.dumps({"num_experts": -2, "num_experts_per_token": 2})
        )
    elif case == "truncated":
        data = (d / "rank1.safetensors").read_bytes()
        (d / "rank1.safetensors").write_bytes(data[: len(data) // 2])
    elif case == "huge header":
        (d / "rank1.safetensors").write_bytes((1 << 60).to_bytes(8, "little") + b"{}")
    elif case == "bad key":
        save_file({"layer3": torch.zeros(E, dtype=torch.int32)}, str(d / "rank1.safetensors"))
    elif case == "wrong shape":
        save_file({"100_3": torch.zeros(E + 1, dtype=torch.int32)}, str(d / "rank1.safetensors"))
    elif case == "float counts":
        save_file({"100_3": torch.zeros(E)}, str(d / "rank1.safetensors"))
    elif case == "negative":
        save_file({"100_3": -torch.ones(E, dtype=torch.int32)}, str(d / "rank1.safetensors"))
    elif case == "rank gap":
        (d / "rank1.safetensors").rename(d / "rank7.safetensors")
    elif case == "ep_size":
        (d / "meta_info.json").write_text(
            json.dumps({"num_experts": E, "num_experts_per_token": K, "ep_size": 8})
        )
    elif case == "missing keys":
        save_file({"100_3": torch.zeros(E, dtype=torch.int32), "999_9": torch.zeros(E, dtype=torch.int32)},
                  str(d / "rank1.safetensors"))  # fmt: skip


TRT_CASES = ["no meta", "meta not json", "meta experts", "truncated", "huge header", "bad key",
             "wrong shape", "float counts", "negative", "rank gap", "ep_size", "missing keys"]  # fmt: skip


@pytest.mark.parametrize("case", TRT_CASES)
def test_bad_trtllm_statistics_exit_2(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _bad_trtllm(tmp_path / "s", case)
    out = tmp_path / "t.npz"
    assert (
        main(["trace", "import", str(tmp_path / "s"), "--format", "trtllm", "--out", str(out)]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err, err
    assert not out.exists()


class _Evil:
    def __reduce__(self):  # what a malicious pickle does: run code on load
        return (Path.write_text, (Path("/tmp/expertmesh-pwned"), "x"))


def _bad_file(tmp_path: Path, case: str) -> tuple[str, Path, list[str]]:
    p = tmp_path / "x"
    if case == "pickle with code":
        p = p.with_suffix(".pt")
        torch.save({"logical_count": _Evil()}, p)
        return "sglang", p, ["--ranks", "2"]
    if case == "sglang no key":
        p = p.with_suffix(".pt")
        torch.save({"records": []}, p)
        return "sglang", p, ["--ranks", "2"]
    if case == "sglang negative":
        p = p.with_suffix(".json")
        p.write_text(json.dumps({"logical_count": [[1, -2], [3, 4]]}))
        return "sglang", p, ["--ranks", "2"]
    if case == "sglang ragged":
        p = p.with_suffix(".json")
        p.write_text(json.dumps({"logical_count": [[1, 2], [3]]}))
        return "sglang", p, ["--ranks", "2"]
    if case == "sglang no ranks":
        p = p.with_suffix(".json")
        p.write_text(json.dumps({"logical_count": [[1, 2]]}))
        return "sglang", p, []
    if case == "sglang deep json":
        p = p.with_suffix(".json")
        p.write_text("[" * 100_000 + "]" * 100_000)
        return "sglang", p, ["--ranks", "2"]
    if case == "npy objects":
        p = p.with_suffix(".npy")
        np.save(p, np.array([[["a"]]], dtype=object), allow_pickle=True)
        return "routing", p, ["--ranks", "2"]
    if case == "npy truncated":
        p = p.with_suffix(".npy")
        np.save(p, np.zeros((50, 2, 2), np.int64))
        p.write_bytes(p.read_bytes()[:300])
        return "routing", p, ["--ranks", "2"]
    if case == "npy 2-d":
        p = p.with_suffix(".npy")
        np.save(p, np.zeros((5, 2), np.int64))
        return "routing", p, ["--ranks", "2"]
    if case == "expert out of range":
        p = p.with_suffix(".npy")
        np.save(p, np.full((5, 1, 2), 9, np.int64))
        return "routing", p, ["--ranks", "2", "--experts", "4"]
    if case == "parquet float layer":
        p = p.with_suffix(".parquet")
        pq.write_table(pa.table({"token": [0], "layer": [0.5], "experts": [[1, 2]]}), p)
        return "routing", p, ["--ranks", "2"]
    if case == "parquet ragged":
        p = p.with_suffix(".parquet")
        pq.write_table(pa.table({"token": [0, 1], "layer": [0, 0], "experts": [[1, 2], [1]]}), p)
        return "routing", p, ["--ranks", "2"]
    if case == "parquet garbage":
        p = p.with_suffix(".parquet")
        p.write_bytes(b"PAR1" + b"\x00" * 64 + b"PAR1")
        return "routing", p, ["--ranks", "2"]
    if case == "parquet bomb":  # run-length encoding: 20M values in about a kilobyte
        p = p.with_suffix(".parquet")
        experts = pa.array([np.zeros(20_000_000, np.int64)], pa.list_(pa.int64()))
        pq.write_table(
            pa.table({"token": [0], "layer": [0], "experts": experts}), p, compression="zstd"
        )
        return "routing", p, ["--ranks", "2"]
    if case == "missing file":
        return "routing", tmp_path / "nope.npy", ["--ranks", "2"]
    raise AssertionError(case)


FILE_CASES = ["pickle with code", "sglang no key", "sglang negative", "sglang ragged",
              "sglang no ranks", "sglang deep json", "npy objects", "npy truncated", "npy 2-d",
              "expert out of range", "parquet float layer", "parquet ragged", "parquet garbage",
              "parquet bomb", "missing file"]  # fmt: skip


@pytest.mark.parametrize("case", FILE_CASES)
def test_bad_load_files_exit_2(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    Path("/tmp/expertmesh-pwned").unlink(missing_ok=True)
    fmt, path, extra = _bad_file(tmp_path, case)
    out = tmp_path / "t.npz"
    code = main(["trace", "import", str(path), "--format", fmt, "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "error:" in err, err
    assert not out.exists()
    assert not Path("/tmp/expertmesh-pwned").exists()
