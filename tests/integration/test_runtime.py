"""The runtime on a real multi-node local Ray cluster (one labeled node per DC)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import ray

from expertmesh.controller.core import Trigger
from expertmesh.planner import Topology, available_policies
from expertmesh.runtime.cluster import NAMESPACE, Runtime, RuntimeSettings
from expertmesh.workers.model import LMConfig

POLICIES = [p for p in ("static", "eplb", "quota", "hybrid") if p in available_policies()]
LM = LMConfig(num_layers=2, num_experts=8, top_k=2, hidden=16, ffn_hidden=16, batch=4, seq_len=32)
STEPS = 4
BF16 = {"encoding": {"weight_bytes": 2, "grad_bytes": 2}}  # hybrid's copies in bfloat16


def _settings(policy: str) -> RuntimeSettings:
    topo = Topology.generate(2, 2, masters=2, spare=2).with_inter_dc(0.5, 2.0)
    return RuntimeSettings(
        topology=topo.to_dict(),
        lm=LM,
        policy=policy.removesuffix("-bf16"),
        policy_settings=BF16 if policy.endswith("-bf16") else {},
        trigger=Trigger(mode="every_step"),
        corpus_bytes=200_000,
    )


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, list]]:
    out: dict[str, list] = {}
    for policy in [*POLICIES, *(["hybrid-bf16"] if "hybrid" in POLICIES else [])]:
        rt = Runtime(_settings(policy))
        try:
            rt.start()
            steps = [rt.run_step() for _ in range(STEPS)]
            out[policy] = [steps, rt.node_dcs(), rt.status()]
            if policy == "static":
                ctl = ray.get_actor("controller", namespace=NAMESPACE)
                out[policy].append(ray.get(ctl.status.remote())["policy"])
        finally:
            rt.shutdown()
    yield out


def test_workers_run_on_their_dc_nodes(runs: dict[str, list]) -> None:
    _, dcs, _, name = runs["static"]
    assert dcs == ["dc0000", "dc0000", "dc0001", "dc0001"]
    assert name == "static"


@pytest.mark.parametrize("policy", POLICIES)
def test_policies_train_to_the_same_losses(runs: dict[str, list], policy: str) -> None:
    steps, _, status = runs[policy][:3]
    base = [s.loss for s in runs["static"][0]]
    assert all(s.error is None for s in steps), [s.error for s in steps]
    assert status["errors"] == 0
    np.testing.assert_allclose([s.loss for s in steps], base, rtol=1e-4)
    assert steps[-1].loss < steps[0].loss
    assert steps[-1].plan_version >= 1
    assert steps[0].cross_dc_token_bytes > 0  # step 0 runs on static EP for every policy
    # migrations are reported apart from the step's own traffic
    for s in steps:
        pairs = np.asarray(s.bytes_by_pair)
        assert pairs.shape == (3, 2, 2)
        assert pairs[2].sum() == s.cross_dc_migration_bytes
    if policy == "static":
        assert all(s.cross_dc_migration_bytes == 0 for s in steps)


@pytest.mark.skipif("hybrid" not in POLICIES, reason="no hybrid policy")
def test_bfloat16_copies_train_close_to_float32_with_fewer_weight_bytes(
    runs: dict[str, list],
) -> None:
    steps, _, status = runs["hybrid-bf16"][:3]
    fp32 = runs["hybrid"][0]
    assert all(s.error is None for s in steps) and status["errors"] == 0
    base = [s.loss for s in runs["static"][0]]
    assert steps[0].loss == base[0]  # step 0: nothing sent in bfloat16 yet
    np.testing.assert_allclose([s.loss for s in steps], base, rtol=1e-3)
    # replicas from step 1 on: their gradients and refreshes cross in 2 bytes, not 4
    assert steps[-1].plan_version >= 1 and fp32[-1].cross_dc_weight_bytes > 0
    assert steps[-1].cross_dc_weight_bytes < 0.75 * fp32[-1].cross_dc_weight_bytes
