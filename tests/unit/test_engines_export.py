"""``plan export`` and ``GET /plans/{version}/export``: import -> plan -> export -> read back
equal, for every engine; each file checked against the engine's documented layout, and SGLang's
file against SGLang's own loader; plans an engine cannot express are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from engine_fixtures import LAYERS, R, write_trtllm
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file
from sglang_peer import SGLANG_VERSION, load_module, load_placement, module_path

from expertmesh.cli.main import main
from expertmesh.controller.api import create_app
from expertmesh.controller.core import ControllerCore, ControllerSettings
from expertmesh.controller.store import SqlitePlanStore
from expertmesh.controller.telemetry import Telemetry
from expertmesh.engines.files import read_export
from expertmesh.engines.placement import EngineLayout, ExportError, sglang_map, vllm_maps
from expertmesh.formats import read_plan
from expertmesh.planner import ModelSpec, Topology

E = 12
TOPOLOGY = """\
dcs:
  - {name: a, nodes: 1, ranks_per_node: 2}
  - {name: b, nodes: 1, ranks_per_node: 2}
slots_per_rank: {masters: 3, spare: 1}
links:
  intra_node: {gbps: 3200, latency_ms: 0.005}
  intra_dc: {gbps: 400, latency_ms: 0.01}
  inter_dc: {gbps: 10, latency_ms: 20}
"""
S = 4
FILES = [("sglang", "json"), ("sglang", "pt"), ("trtllm", "yaml"), ("vllm", "safetensors"),
         ("vllm", "json")]  # fmt: skip


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TensorRT-LLM statistics -> trace -> an eplb plan (every slot filled)."""
    d = tmp_path_factory.mktemp("engines")
    write_trtllm(d / "stats")
    (d / "topo.yaml").write_text(TOPOLOGY)
    assert (
        main(["trace", "import", str(d / "stats"), "--format", "trtllm", "--out", str(d / "t.npz")])
        == 0
    )
    assert main(["plan", "--trace", str(d / "t.npz"), "--topology", str(d / "topo.yaml"), "--policy",
                 "eplb", "--set", "period=2", "--set", "window=2", "--out", str(d / "p.npz"),
                 "--quiet"]) == 0  # fmt: skip
    return d


@pytest.mark.parametrize(("fmt", "suffix"), FILES)
def test_round_trip_through_the_cli(planned: Path, fmt: str, suffix: str) -> None:
    out = planned / f"{fmt}.{suffix}"
    args = [
        "plan",
        "export",
        str(planned / "p.npz"),
        "--format",
        fmt,
        "--out",
        str(out),
        "--step",
        "2",
    ]
    assert main([*args, "--num-model-layers", "7"]) == 0
    plan = read_plan(planned / "p.npz")
    assert plan.meta["engine"]["layers"] == list(LAYERS)  # carried from the imported trace
    layout = EngineLayout.make(3, layer_ids=LAYERS, num_model_layers=7)
    back = read_export(out, fmt, num_ranks=R, num_experts=E, layout=layout)
    np.testing.assert_array_equal(back, plan.phy2log[2])


def test_files_follow_the_documented_layouts(planned: Path) -> None:
    """Read with plain json / yaml / safetensors, as the engines' docs describe them.

    TensorRT-LLM's own loader (``MoeLoadBalancerConfig`` in ``tensorrt_llm.llmapi``) cannot be
    imported on a CPU machine (the package needs CUDA libraries) and vLLM has no placement
    loader at all, so for those two this checks the documented schema, not the engine's code;
    SGLang's own loader is run in ``test_sglang_own_loader_reads_the_map``."""
    plan = read_plan(planned / "p.npz")
    phy = plan.phy2log[-1].reshape(3, -1)  # [L, P], p = r * S + s
    for fmt, suffix in (("sglang", "json"), ("trtllm", "yaml"), ("vllm", "safetensors")):
        assert main(["plan", "export", str(planned / "p.npz"), "--format", fmt, "--out",
                     str(planned / f"last.{suffix}"), "--num-model-layers", "7"]) == 0  # fmt: skip
    sg = json.loads((planned / "last.json").read_text())
    assert list(sg) == ["physical_to_logical_map"]  # SGLang passes every key on as an argument
    p2l = np.array(sg["physical_to_logical_map"])
    assert p2l.shape == (7, R * S)
    np.testing.assert_array_equal(p2l[3:6], phy)
    np.testing.assert_array_equal(p2l[:3], np.tile(np.arange(R * S) % E, (3, 1)))  # dense: trivial
    trt = yaml.safe_load((planned / "last.yaml").read_text())
    assert set(trt) == {"num_slots", "layer_updates_per_iter", "initial_global_assignments"}
    assert (
        trt["num_slots"] == R * S
        and trt["num_slots"] % R == 0
        and trt["layer_updates_per_iter"] == 0
    )
    assert sorted(trt["initial_global_assignments"]) == list(LAYERS)  # model layer ids, as ints
    for j, lid in enumerate(LAYERS):
        row = trt["initial_global_assignments"][lid]
        assert len(row) == trt["num_slots"] and set(row) == set(range(E))
        for r in range(R):  # each rank's slots contiguous
            assert row[r * S : (r + 1) * S] == plan.phy2log[-1, j, r].tolist()
    vl = load_file(str(planned / "last.safetensors"))
    assert vl["physical_to_logical_map"].shape == (3, R * S)
    assert vl["logical_to_physical_map"].shape == (3, E, R * S - E + 1)
    for layer in range(3):
        for e in range(E):
            slots = vl["logical_to_physical_map"][layer, e]
            n = vl["logical_replica_count"][layer, e]
            assert list(slots[:n]) == sorted(np.flatnonzero(phy[layer] == e).tolist())
            assert (slots[n:] == -1).all()


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sglang_loader():
    path, why = module_path(REPO / ".cache" / "peers")
    if path is None:
        pytest.skip(f"SGLang {SGLANG_VERSION}'s loader unavailable: {why}")
    return load_module(path)


@pytest.mark.parametrize("suffix", ["json", "pt"])
def test_sglang_own_loader_reads_the_map(planned: Path, sglang_loader, suffix: str) -> None:
    """SGLang's compute_initial_expert_location_metadata (from its wheel) on our file."""
    out = planned / f"peer.{suffix}"
    assert main(["plan", "export", str(planned / "p.npz"), "--format", "sglang", "--out", str(out),
                 "--num-model-layers", "7"]) == 0  # fmt: skip
    meta = load_placement(
        sglang_loader, out, ep_size=R, num_experts=E, num_layers=7, num_physical=R * S
    )
    phy = read_plan(planned / "p.npz").phy2log[-1].reshape(3, -1)
    np.testing.assert_array_equal(meta.physical_to_logical_map.numpy()[3:6], phy)
    l2p = meta.logical_to_all_physical_map.numpy()  # [N, E, P], -1 padded
    ours = vllm_maps(phy.reshape(3, R, S), E)["logical_to_physical_map"]
    width = ours.shape[2]
    np.testing.assert_array_equal(l2p[3:6, :, :width], ours)
    assert (l2p[3:6, :, width:] == -1).all()
    dispatch = meta.logical_to_rank_dispatch_physical_map.numpy()  # static dispatch, rank 0
    assert (phy[np.arange(3)[:, None], dispatch[3:6]] == np.arange(E)).all()


def test_sglang_loader_refuses_a_file_with_extra_keys(planned: Path, sglang_loader) -> None:
    """Why the exporter writes one key: SGLang's loader passes every key to init_by_mapping."""
    p2l = sglang_map(
        read_plan(planned / "p.npz").phy2log[-1],
        E,
        EngineLayout.make(3, layer_offset=3, num_model_layers=7),
    )
    (planned / "extra.json").write_text(
        json.dumps({"physical_to_logical_map": p2l.tolist(), "version": 1})
    )
    with pytest.raises(TypeError):
        load_placement(sglang_loader, planned / "extra.json", ep_size=R, num_experts=E, num_layers=7,
                       num_physical=R * S)  # fmt: skip


def _empty_slot_plan(tmp: Path) -> Path:
    (tmp / "topo.yaml").write_text(TOPOLOGY)
    assert main(["trace", "generate", "--out", str(tmp / "t.npz"), "--topology", str(tmp / "topo.yaml"),
                 "--experts", "10", "--layers", "2", "--steps", "2", "--top-k", "2",
                 "--tokens-per-rank", "64"]) == 0  # fmt: skip
    assert main(["plan", "--trace", str(tmp / "t.npz"), "--topology", str(tmp / "topo.yaml"),
                 "--policy", "static", "--out", str(tmp / "p.npz"), "--quiet"]) == 0  # fmt: skip
    return tmp / "p.npz"


@pytest.mark.parametrize("fmt", ["sglang", "trtllm", "vllm"])
def test_unexpressible_plan_refused(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _empty_slot_plan(tmp_path)
    capsys.readouterr()
    out = tmp_path / ("x.yaml" if fmt == "trtllm" else "x.json")
    assert main(["plan", "export", str(plan), "--format", fmt, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "empty" in err, err
    assert not out.exists()


@pytest.mark.parametrize("args", [
    ["--format", "sglang", "--out", "x.yaml"],  # wrong suffix
    ["--format", "sglang", "--out", "x.json", "--step", "99"],
    ["--format", "sglang", "--out", "x.json", "--num-model-layers", "4"],  # layers 3..5 do not fit
    ["--format", "trtllm", "--out", "x.yaml", "--layer-ids", "1,1,2"],
    ["--format", "trtllm", "--out", "x.yaml", "--layer-ids", "1,2"],
    ["--format", "trtllm", "--out", "x.yaml", "--layer-ids", "a,b,c"],
    ["--format", "trtllm", "--out", "x.yaml", "--layer-updates-per-iter", "-1"],
    ["--format", "vllm", "--out", "x.pt"],
])  # fmt: skip
def test_bad_export_options_exit_2(
    planned: Path, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a if not a.startswith("x.") else str(planned / "bad" / a) for a in args]
    assert main(["plan", "export", str(planned / "p.npz"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err, err
    assert not (planned / "bad").exists()


@pytest.mark.parametrize(("fmt", "suffix", "edit"), [
    ("sglang", "json", lambda d: {**d, "extra": 1}),
    ("sglang", "json", lambda d: {"physical_to_logical_map": d["physical_to_logical_map"][:-1]}),
    ("trtllm", "yaml", lambda d: {**d, "num_slots": d["num_slots"] + 1}),
    ("trtllm", "yaml", lambda d: {**d, "unknown": 1}),
    ("vllm", "json", lambda d: {**d, "logical_replica_count": [[1] * E] * 3}),
])  # fmt: skip
def test_read_back_refuses_a_changed_file(planned: Path, fmt: str, suffix: str, edit) -> None:
    out = planned / f"edit-{fmt}.{suffix}"
    assert main(["plan", "export", str(planned / "p.npz"), "--format", fmt, "--out", str(out),
                 "--num-model-layers", "7"]) == 0  # fmt: skip
    text = out.read_text()
    data = yaml.safe_load(text) if suffix == "yaml" else json.loads(text)
    out.write_text(yaml.safe_dump(edit(data)) if suffix == "yaml" else json.dumps(edit(data)))
    layout = EngineLayout.make(3, layer_ids=LAYERS, num_model_layers=7)
    with pytest.raises(ValueError, match=str(out)):
        read_export(out, fmt, num_ranks=R, num_experts=E, layout=layout)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), st.integers(1, 6), st.data())
def test_vllm_maps_invert_each_other(
    layers: int, ranks: int, slots: int, experts: int, data
) -> None:
    if ranks * slots < experts:
        experts = ranks * slots
    rows = []
    for _ in range(layers):
        extra = data.draw(st.lists(st.integers(0, experts - 1), min_size=ranks * slots - experts,
                                   max_size=ranks * slots - experts))  # fmt: skip
        rows.append(np.array(data.draw(st.permutations(list(range(experts)) + extra))))
    phy = np.array(rows, np.int32).reshape(layers, ranks, slots)
    maps = vllm_maps(phy, experts)
    p2l, l2p, cnt = (
        maps[k]
        for k in ("physical_to_logical_map", "logical_to_physical_map", "logical_replica_count")
    )
    for layer in range(layers):
        for e in range(experts):
            held = l2p[layer, e, : cnt[layer, e]]
            assert (p2l[layer, held] == e).all() and (np.diff(held) > 0).all()
        assert cnt[layer].sum() == ranks * slots
    assert (l2p >= 0).sum() == phy.size


def test_planner_refuses_nothing_valid_and_everything_invalid() -> None:
    phy = np.array([[[0, 1], [2, 0]]], np.int32)
    vllm_maps(phy, 3)
    for bad, n in ((np.array([[[0, -1], [2, 1]]]), 3), (np.array([[[0, 0], [2, 2]]]), 3),
                   (np.array([[[0, 5], [2, 1]]]), 3)):  # fmt: skip
        with pytest.raises(ExportError):
            vllm_maps(bad.astype(np.int32), n)


# ---- REST ----


def _rest(spare: int) -> tuple[ControllerCore, TestClient]:
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=spare)
    model = ModelSpec(num_layers=2, num_experts=8, top_k=2, hidden=16, ffn_hidden=8)
    store = SqlitePlanStore(":memory:")
    core = ControllerCore(
        topo, model, ControllerSettings(trigger={"mode": "every_step"}), store=store
    )
    rng = np.random.default_rng(0)
    for layer in range(2):
        core.report_layer(0, layer, rng.integers(0, 50, (4, 8)))
    core.commit(core.plan(0).version)
    return core, TestClient(create_app(core, Telemetry(core), store))


def test_rest_export_matches_the_cli_files() -> None:
    core, c = _rest(spare=0)  # 4 ranks x 2 masters = 8 experts: every slot filled
    pv = core.committed
    phy = np.stack([lp.phy2log for lp in pv.layers])
    r = c.get(f"/api/v1/plans/{pv.version}/export", params={"format": "sglang", "layer_offset": 1})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    p2l = np.array(r.json()["physical_to_logical_map"])
    np.testing.assert_array_equal(p2l[1:], phy.reshape(2, -1))
    r = c.get(f"/api/v1/plans/{pv.version}/export", params={"format": "trtllm", "layer_offset": 3})
    assert r.headers["content-type"].startswith("application/yaml")
    cfg = yaml.safe_load(r.text)
    assert cfg["initial_global_assignments"][4] == phy[1].ravel().tolist()
    r = c.get(f"/api/v1/plans/{pv.version}/export", params={"format": "vllm"})
    np.testing.assert_array_equal(
        r.json()["logical_replica_count"], vllm_maps(phy, 8)["logical_replica_count"]
    )


def test_rest_export_refusals_change_nothing() -> None:
    core, c = _rest(spare=1)  # spare slots stay empty under the default policy
    v = core.committed.version
    before = (core.committed.version, len(core.versions()))
    r = c.get(f"/api/v1/plans/{v}/export", params={"format": "sglang"})
    assert r.status_code == 422 and "empty" in r.json()["error"]
    assert c.get(f"/api/v1/plans/{v}/export", params={"format": "nope"}).status_code == 422
    assert c.get(f"/api/v1/plans/{v + 7}/export", params={"format": "vllm"}).status_code == 404
    assert (
        c.get(
            f"/api/v1/plans/{v}/export", params={"format": "vllm", "layer_offset": -1}
        ).status_code
        == 422
    )
    assert (core.committed.version, len(core.versions())) == before
    schema = c.get("/openapi.json").json()["paths"]["/api/v1/plans/{version}/export"]["get"]
    assert "application/yaml" in schema["responses"]["200"]["content"]


def _write_source(d: Path, fmt: str) -> tuple[Path, list[str]]:
    """Load statistics in ``fmt``'s layout for R ranks, E experts and the layers of LAYERS."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    rng = np.random.default_rng(7)
    if fmt == "trtllm":
        write_trtllm(d / "stats")
        return d / "stats", []
    if fmt == "sglang":  # [buckets, model layers, E]: dense layers 0..2 and two unused buckets zero
        counts = np.zeros((5, 6, E), np.int32)
        counts[:3, 3:] = rng.integers(0, 60, (3, 3, E))
        torch.save({"rank": 0, "logical_count": torch.from_numpy(counts)}, d / "dump.pt")
        return d / "dump.pt", ["--ranks", str(R)]
    n = 96  # routing: one row per (token, MoE layer)
    topk = rng.integers(0, E, (n, 3, 2))
    table = pa.table({
        "token": np.repeat(np.arange(n), 3), "layer": np.tile(np.array(LAYERS), n),
        "experts": pa.array(topk.reshape(-1, 2).tolist(), pa.list_(pa.int64())),
    })  # fmt: skip
    pq.write_table(table, d / "routes.parquet")
    return d / "routes.parquet", ["--ranks", str(R), "--tokens-per-step", "32", "--experts", str(E)]


@pytest.mark.parametrize("source", ["trtllm", "sglang", "routing"])
def test_every_import_plans_and_exports_every_engine(tmp_path: Path, source: str) -> None:
    """The issue's round trip: each engine's load file -> trace -> plan -> each engine's
    placement -> read back equal, with the engine layer ids carried all the way."""
    src, extra = _write_source(tmp_path, source)
    (tmp_path / "topo.yaml").write_text(TOPOLOGY)
    trace, plan = tmp_path / "t.npz", tmp_path / "p.npz"
    assert main(["trace", "import", str(src), "--format", source, "--out", str(trace), *extra]) == 0
    assert main(["plan", "--trace", str(trace), "--topology", str(tmp_path / "topo.yaml"),
                 "--policy", "eplb", "--set", "period=1", "--set", "window=1", "--out", str(plan),
                 "--quiet"]) == 0  # fmt: skip
    phy = read_plan(plan).phy2log[-1]
    layout = EngineLayout.make(3, layer_ids=LAYERS, num_model_layers=7)
    for fmt, suffix in FILES:
        out = tmp_path / f"placement-{fmt}.{suffix}"
        assert main(["plan", "export", str(plan), "--format", fmt, "--out", str(out),
                     "--num-model-layers", "7"]) == 0  # fmt: skip
        np.testing.assert_array_equal(
            read_export(out, fmt, num_ranks=R, num_experts=E, layout=layout), phy
        )
