"""The SPMD data plane on a real multi-node local Ray cluster (one labeled node per DC):
workers run their own loops over gloo, the driver only starts them and reads results,
and every policy trains exactly the single-process reference model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from expertmesh.controller.core import Trigger
from expertmesh.planner import Topology
from expertmesh.runtime.settings import RuntimeSettings
from expertmesh.runtime.spmd import SpmdRuntime
from expertmesh.workers.model import Corpus, LMConfig
from expertmesh.workers.reference import ReferenceLM

pytestmark = pytest.mark.integration

LM = LMConfig(num_layers=2, num_experts=8, top_k=2, hidden=16, ffn_hidden=16, batch=4, seq_len=32)
STEPS = 6
BF16 = {"encoding": {"weight_bytes": 2, "grad_bytes": 2}}
POLICIES = ("static", "eplb", "hybrid", "hybrid-bf16")


def _settings(policy: str, dcs: int) -> RuntimeSettings:
    topo = Topology.generate(dcs, 2, masters=2, spare=2).with_inter_dc(0.5, 2.0)
    return RuntimeSettings(
        topology=topo.to_dict(),
        lm=LM,
        policy=policy.removesuffix("-bf16"),
        policy_settings=BF16 if policy.endswith("-bf16") else {},
        trigger=Trigger(mode="every_step"),
        corpus_bytes=200_000,
    )


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, Any]]:
    out: dict[str, Any] = {}
    for policy, dcs in [(p, 2) for p in POLICIES] + [("hybrid", 3)]:
        with SpmdRuntime(_settings(policy, dcs)) as rt:
            steps = rt.train(STEPS)
            weights = {
                (layer, e): [rt.expert_weights(r, layer, e) for r in range(rt.topology.num_ranks)]
                for layer in range(LM.num_layers)
                for e in (0, LM.num_experts - 1)
            }
            out[f"{policy}/{dcs}"] = {
                "steps": steps,
                "dcs": rt.node_dcs(),
                "status": rt.status(),
                "weights": weights,
                "metrics": rt.metrics(),
            }
    yield out


def _reference(dcs: int) -> tuple[list[float], ReferenceLM]:
    ref = ReferenceLM(LM)
    corpus = Corpus.load(None, 200_000)
    return [ref.train_step(corpus, s, list(range(2 * dcs))) for s in range(STEPS)], ref


def test_workers_train_on_their_dc_nodes_over_gloo(runs: dict[str, Any]) -> None:
    run = runs["static/2"]
    topo = Topology.generate(2, 2, masters=2, spare=2)
    assert run["dcs"] == [topo.dcs[int(d)].name for d in topo.rank_dc]
    assert run["status"]["backend"] == "gloo"
    assert all(s.backend == "gloo" for s in run["steps"])
    assert [s.step for s in run["steps"]] == list(range(STEPS))


@pytest.mark.parametrize("key", ["static/2", "eplb/2", "hybrid/2", "hybrid/3"])
def test_every_policy_trains_the_reference_model(runs: dict[str, Any], key: str) -> None:
    want, ref = _reference(int(key.split("/")[1]))
    got = [s.loss for s in runs[key]["steps"]]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for (layer, e), copies in runs[key]["weights"].items():
        expect = [t.detach().numpy() for t in ref.expert(layer, e)]
        held = [w for w in copies if w is not None]
        assert held, (layer, e)
        for w in held:  # masters and replicas alike
            for a, b in zip(w, expect, strict=True):
                np.testing.assert_allclose(a, b, atol=5e-6)


def test_plans_are_committed_while_training_goes_on(runs: dict[str, Any]) -> None:
    for key in ("eplb/2", "hybrid/2", "hybrid/3"):
        steps = runs[key]["steps"]
        assert steps[-1].plan_version >= 1, key
        assert runs[key]["status"]["version"] >= 1
        assert runs[key]["status"]["errors"] == 0
    # hybrid replicates every expert into every DC: no token crosses once its plan is in
    hy = [s for s in runs["hybrid/2"]["steps"] if s.plan_version >= 1]
    assert hy and all(s.cross_dc_token_bytes == 0 for s in hy)
    st = runs["static/2"]["steps"]
    assert all(s.cross_dc_token_bytes > 0 for s in st)
    assert "expertmesh_step_seconds" in runs["static/2"]["metrics"]


def test_bfloat16_copies_train_close_with_fewer_weight_bytes(runs: dict[str, Any]) -> None:
    a, b = runs["hybrid/2"]["steps"], runs["hybrid-bf16/2"]["steps"]
    np.testing.assert_allclose([s.loss for s in b], [s.loss for s in a], rtol=2e-3)
    both = [
        (x, y) for x, y in zip(a, b, strict=True) if x.plan_version >= 1 and y.plan_version >= 1
    ]
    assert both
    assert all(y.cross_dc_weight_bytes < x.cross_dc_weight_bytes for x, y in both)


def test_measured_balance_of_every_step_reaches_metrics(runs: dict[str, Any]) -> None:
    """The controller records each SPMD step's measured balance in telemetry: /metrics shows
    the newest step's values and the fast loop's totals over every step."""
    for key in ("static/2", "hybrid/2"):
        steps, text = runs[key]["steps"], runs[key]["metrics"]
        got = {
            (x.name, tuple(sorted(x.labels.items()))): x.value
            for f in text_string_to_metric_families(text)
            for x in f.samples
        }
        last = steps[-1]
        assert got[("expertmesh_measured_imbalance_ratio", ())] == last.imbalance, key
        assert got[("expertmesh_static_imbalance_ratio", ())] == last.imbalance_static, key
        assert last.balancedness is not None
        for layer, b in enumerate(last.balancedness):
            assert got[("expertmesh_measured_balancedness_ratio", (("layer", str(layer)),))] == b
        assert got[("expertmesh_fast_loop_replicas_total", ())] == sum(s.replicas for s in steps)
        fanout = sum(s.fanout_bytes for s in steps)
        assert got[("expertmesh_fast_loop_fanout_bytes_total", ())] == fanout, key
        assert got[("expertmesh_fast_loop_seconds_count", ())] == len(steps), key
        total = sum(s.balance_seconds for s in steps)
        assert got[("expertmesh_fast_loop_seconds_sum", ())] == pytest.approx(total), key
        assert runs[key]["status"]["errors"] == 0, key
