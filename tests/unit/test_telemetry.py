import re

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from expertmesh.controller.core import ControllerCore, ControllerSettings
from expertmesh.controller.telemetry import Telemetry, TelemetrySettings
from expertmesh.planner import ModelSpec, Topology

NAME = re.compile(r"^expertmesh_[a-z_]+$")
UNIT_SUFFIXES = ("_seconds", "_bytes", "_ratio", "_total", "_version", "_tokens", "_up", "_loss")


def _core() -> ControllerCore:
    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    model = ModelSpec(num_layers=2, num_experts=8, top_k=2, hidden=16, ffn_hidden=8)
    return ControllerCore(topo, model, ControllerSettings(trigger={"mode": "every_step"}))


def _fill(core: ControllerCore, step: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed + step)
    for layer in range(core.model.num_layers):
        core.report_layer(step, layer, rng.integers(0, 50, (4, 8)))


def _samples(tel: Telemetry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(tel.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metric_names_follow_prometheus_conventions():
    core = _core()
    tel = Telemetry(core)
    _fill(core, 0)
    core.commit(core.plan(0).version)
    tel.record_step(
        0,
        0.5,
        2.0,
        np.array([10, 20, 30, 40]),
        cross_dc_token_bytes=np.ones((2, 2)),
        cross_dc_weight_bytes=np.ones((2, 2)),
    )
    tel.set_worker_state(1, True)
    families = list(text_string_to_metric_families(tel.render().decode()))
    names = {f.name for f in families}
    for f in families:
        assert NAME.match(f.name), f.name
        if f.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in f.samples), f.name
        if f.type in ("gauge", "histogram") and not f.name.endswith("_created"):
            assert f.name.endswith(UNIT_SUFFIXES) or f.name == "expertmesh_step", f.name
    for want in (
        "expertmesh_layer_imbalance_ratio",
        "expertmesh_layer_balancedness_ratio",
        "expertmesh_planner_solve_seconds",
        "expertmesh_plan_version",
        "expertmesh_plan_commits",
        "expertmesh_migrations",
        "expertmesh_migration_bytes",
        "expertmesh_cross_dc_bytes",
        "expertmesh_step_seconds",
        "expertmesh_rank_tokens",
        "expertmesh_worker_up",
        "expertmesh_load_reports_received",
        "expertmesh_load_reports_rejected",
    ):
        assert want in names, want


def test_registry_is_per_instance():
    a, b = Telemetry(_core()), Telemetry(_core())
    a.record_step(0, 0.1, None, np.ones(4))
    assert _samples(a)[("expertmesh_tokens_total", ())] == 4
    assert _samples(b)[("expertmesh_tokens_total", ())] == 0


def test_plan_events_update_version_commits_and_solve_histogram():
    core = _core()
    tel = Telemetry(core)
    _fill(core, 0)
    pv = core.plan(0)
    s = _samples(tel)
    assert s[("expertmesh_plan_prepared_version", ())] == 1
    assert s[("expertmesh_plan_version", ())] == 0
    assert s[("expertmesh_planner_solve_seconds_count", ())] == 2  # one per layer
    core.commit(pv.version)
    _fill(core, 1)
    core.rollback(core.plan(1).version)
    s = _samples(tel)
    assert s[("expertmesh_plan_version", ())] == 1
    assert s[("expertmesh_plan_commits_total", ())] == 1
    assert s[("expertmesh_plan_rollbacks_total", ())] == 1
    assert [e.event for e in tel.plan_events()] == [
        "prepared",
        "committed",
        "prepared",
        "rolled_back",
    ]
    key = ("expertmesh_plan_imbalance_ratio", (("layer", "0"), ("when", "after")))
    assert s[key] == pytest.approx(pv.imbalance_after[0])


def test_layer_imbalance_and_balancedness_match_the_core():
    core = _core()
    tel = Telemetry(core)
    _fill(core, 0)
    s = _samples(tel)
    for layer in range(2):
        want = core.layer_stats(layer).imbalance
        imb = s[("expertmesh_layer_imbalance_ratio", (("layer", str(layer)),))]
        bal = s[("expertmesh_layer_balancedness_ratio", (("layer", str(layer)),))]
        assert imb == pytest.approx(want) and bal == pytest.approx(1 / want)


def test_report_counters_come_from_the_core():
    core = _core()
    tel = Telemetry(core)
    core.report_load(0, 0, 0, np.ones(8, int))
    with pytest.raises(ValueError):
        core.report_load(0, 0, 0, -np.ones(8, int))
    core.reject_report()
    s = _samples(tel)
    assert s[("expertmesh_load_reports_received_total", ())] == 3
    assert s[("expertmesh_load_reports_rejected_total", ())] == 2


def test_step_cross_dc_and_workers():
    core = _core()
    tel = Telemetry(core)
    tok = np.array([[0, 100], [50, 0]])
    wts = np.array([[0, 0], [7, 0]])
    tel.record_step(
        3, 0.25, 1.5, np.array([1, 2, 3, 6]), cross_dc_token_bytes=tok, cross_dc_weight_bytes=wts
    )
    tel.record_step(4, 0.25, float("nan"), np.array([3, 3, 3, 3]), cross_dc_token_bytes=tok)
    tel.set_worker_state(2, False)
    s = _samples(tel)

    def cross(src, dst, kind):
        labels = (("dst_dc", dst), ("kind", kind), ("src_dc", src))
        return s.get(("expertmesh_cross_dc_bytes_total", labels))

    assert cross("dc0000", "dc0001", "tokens") == 200
    assert cross("dc0001", "dc0000", "weights") == 7
    assert cross("dc0000", "dc0001", "weights") is None
    assert s[("expertmesh_step_seconds_count", ())] == 2
    assert s[("expertmesh_step_loss", ())] == 1.5  # the NaN loss did not overwrite it
    assert s[("expertmesh_rank_tokens", (("rank", "3"),))] == 3
    assert s[("expertmesh_worker_up", (("rank", "2"),))] == 0
    assert [r.imbalance for r in tel.steps()] == [2.0, 1.0]
    assert tel.cross_dc_totals()[0, 0, 1] == 200
    assert tel.workers()[2][0] is False


@pytest.mark.parametrize(
    ("args", "cross", "message"),
    [
        ((0, 0.1, None, np.ones(3)), None, r"tokens_per_rank must be \[4\]"),
        ((0, 0.1, None, -np.ones(4)), None, ">= 0"),
        ((0, float("nan"), None, np.ones(4)), None, "seconds"),
        ((0, 0.1, None, np.ones(4)), np.ones((3, 3)), r"\[2, 2\]"),
        ((0, 0.1, None, np.ones(4)), np.full((2, 2), np.inf), "finite"),
        ((-1, 0.1, None, np.ones(4)), None, "step"),
    ],
)
def test_bad_step_records_raise_and_change_nothing(args, cross, message):
    tel = Telemetry(_core())
    with pytest.raises(ValueError, match=message):
        tel.record_step(*args, cross_dc_token_bytes=cross)
    assert tel.steps() == []
    assert _samples(tel)[("expertmesh_tokens_total", ())] == 0


def test_label_sets_are_bounded():
    topo = Topology.generate(dcs=4, ranks_per_dc=2, masters=1, spare=0)
    core = ControllerCore(topo, ModelSpec(num_layers=1, num_experts=8))
    tel = Telemetry(core, TelemetrySettings(max_rank_series=2, max_dc_pair_series=2))
    tel.record_step(0, 0.1, None, np.arange(8), cross_dc_token_bytes=np.ones((4, 4)))
    with pytest.raises(ValueError, match="unknown rank"):
        tel.set_worker_state(8, True)
    s = _samples(tel)
    ranks = {dict(k[1])["rank"] for k in s if k[0] == "expertmesh_rank_tokens"}
    assert ranks == {"0", "1"}
    pairs = {
        (dict(k[1])["src_dc"], dict(k[1])["dst_dc"]): v
        for k, v in s.items()
        if k[0] == "expertmesh_cross_dc_bytes_total"
    }
    assert len(pairs) == 3 and pairs[("other", "other")] == 10  # 12 off-diagonal pairs


def test_close_stops_following_plan_events():
    core = _core()
    tel = Telemetry(core)
    tel.close()
    tel.close()
    _fill(core, 0)
    core.plan(0)
    assert tel.plan_events() == [] and core.listeners == []


def test_balancedness_summary_is_vllms():
    """Per layer mean/max tokens over ranks, then min, median, 10th percentile and mean over
    layers, computed here the way vLLM does (torch over a [layers, ranks] token tensor)."""
    import torch

    topo = Topology.generate(dcs=2, ranks_per_dc=2, masters=2, spare=1)
    model = ModelSpec(num_layers=5, num_experts=8, top_k=2, hidden=16, ffn_hidden=8)
    core = ControllerCore(topo, model, ControllerSettings(trigger={"mode": "every_step"}))
    tel = Telemetry(core)
    rng = np.random.default_rng(3)
    for layer in range(5):
        core.report_layer(0, layer, rng.integers(0, 50, (4, 8)) * (1 + 3 * (layer == 2)))
    tokens = torch.tensor(np.stack([core.newest_rank_tokens(layer) for layer in range(5)]))
    tokens = tokens.float()  # [L, R]
    per_layer = tokens.mean(dim=-1) / tokens.max(dim=-1).values
    want = {
        "min": per_layer.min().item(),
        "p50": torch.quantile(per_layer, 0.5).item(),
        "p90": torch.quantile(per_layer, 0.1).item(),
        "avg": per_layer.mean().item(),
    }
    s = _samples(tel)
    for stat, v in want.items():
        assert s[("expertmesh_eplb_balancedness_ratio", (("stat", stat),))] == pytest.approx(
            v, rel=1e-6
        )
    assert want["min"] < want["p90"] < want["p50"] <= 1.0  # the statistics differ on this load
